//! Stage 2 of [`Pipeline`]: the prompt through the text encoder, read from and written to the
//! prompt cache ([`super::PromptCache`]) when the pipeline has one, with the graphs' files read
//! ahead of their loads.
use ndarray::{Array2, Ix3};

use super::progress::timed;
use super::{internal, request, CacheLookup, Pipeline, ProgressFn, PromptEmbeds, Stage};
use crate::bundle::{support, Component};
use crate::error::Result;
use crate::runtime::{self, Device, TensorInput};

impl Pipeline {
    /// Stage 2: the prompt's embeddings `[1, L, 3*hidden]` (from the cache when enabled).
    pub fn encode_prompt(
        &mut self,
        prompt: &str,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<PromptEmbeds> {
        request::check_prompt(prompt)?;
        // The prompt cache is read before the encoder loads, keyed by the device it will likely
        // run on (auto's guess, or where it ran before), and again once it has loaded if auto
        // picked another device.
        let likely = self.encoder_numerics();
        if let Some(hit) = self.cached_prompt(prompt, &likely)? {
            return Ok(hit);
        }
        // The encoder's files are read ahead of its own page faults, then the transformer's while
        // the encoder computes ([`runtime::prefetch_in_turn`]).
        let running = if self.graphs.loaded(Component::TextEncoder).is_none() && self.on_cpu() {
            self.graph_files(Component::TextEncoder)
        } else {
            Vec::new()
        };
        let later = if self.graphs.loaded(Component::Transformer).is_none()
            && !self.graphs.is_loading(Component::Transformer)
        {
            self.graph_files(Component::Transformer)
        } else {
            Vec::new()
        };
        runtime::prefetch_in_turn(running, later);
        // The encoder loads while the tokenizer's parse ends ([`ParsedTokenizer`]).
        self.graph(Component::TextEncoder, None, &mut progress)?;
        let numerics = self.encoder_numerics();
        if numerics != likely {
            if let Some(hit) = self.cached_prompt(prompt, &numerics)? {
                return Ok(hit);
            }
        }
        let encoded = self.tokenizer.get()?.encode(prompt)?;
        let seq = encoded.input_ids.len();
        // [L] -> [1, L]
        let ids = Array2::from_shape_vec((1, seq), encoded.input_ids)
            .map_err(|e| internal("token ids", e))?;
        let mask = Array2::from_shape_vec((1, seq), encoded.attention_mask)
            .map_err(|e| internal("attention mask", e))?;
        let graph = self.graph(Component::TextEncoder, None, &mut progress)?;
        let embeds = timed(&mut progress, Stage::EncodePrompt, |_| {
            let mut out = graph.run(&[
                ("input_ids", TensorInput::from(ids.view())),
                ("attention_mask", TensorInput::from(mask.view())),
            ])?;
            out.take("prompt_embeds")?
                .into_dimensionality::<Ix3>()
                .map_err(|e| internal("prompt_embeds", e))
        })?;
        if let Some(cache) = &self.prompt_cache {
            // The cache only saves time: a failure to write it is a warning.
            if let Err(error) = cache.put(prompt, &numerics, &embeds) {
                self.warnings.push(format!(
                    "the prompt cache could not be updated: {}",
                    crate::error::chain(&error)
                ));
            }
        }
        Ok(PromptEmbeds {
            embeds,
            truncated: encoded.truncated,
        })
    }

    /// The text encoder's settings that change its outputs, for the prompt cache, on the device
    /// it runs on: loaded, or loaded before (its session since released), or for auto the
    /// device it will likely get ([`Device::likely`]).
    fn encoder_numerics(&mut self) -> String {
        let ran_on = match self.graphs.loaded(Component::TextEncoder) {
            Some(graph) => Some(graph.device()),
            None => self
                .graphs
                .placements()
                .iter()
                .find(|placement| placement.component == Component::TextEncoder)
                .map(|placement| placement.device),
        };
        let device = ran_on.unwrap_or_else(|| {
            let spec = &self.manifest.graphs.text_encoder;
            let skip = support::auto_skip(spec.precision, spec.quantization.as_ref());
            self.session.device.likely(&skip)
        });
        self.session.numerics(device)
    }

    /// The prompt cache's embeddings of `prompt` encoded with `numerics`, if it has them (`None`
    /// also without a cache); an entry it rejects is a warning.
    fn cached_prompt(&mut self, prompt: &str, numerics: &str) -> Result<Option<PromptEmbeds>> {
        let Some(cache) = &self.prompt_cache else {
            return Ok(None);
        };
        match cache.get(prompt, numerics) {
            CacheLookup::Hit(embeds) => Ok(Some(PromptEmbeds {
                embeds,
                truncated: self.tokenizer.get()?.encode(prompt)?.truncated,
            })),
            CacheLookup::Rejected(warning) => {
                self.warnings.push(warning);
                Ok(None)
            }
            CacheLookup::Miss => Ok(None),
        }
    }

    /// Whether the graphs run on the CPU: `--device cpu`, or `auto` in a build with no other
    /// execution provider.
    fn on_cpu(&self) -> bool {
        match self.session.device {
            Device::Cpu => true,
            Device::Auto => Device::auto_candidates() == [Device::Cpu],
            _ => false,
        }
    }

    /// Whether the transformer's session is created on a thread of its own while the prompt is
    /// encoded: on the CPU, for the bundle's own transformer (no LoRA, not a static-shape
    /// bundle's per-bucket graph), when it is not loaded yet and the files of both graphs are at
    /// most half of the memory available (Linux's `MemAvailable`; elsewhere never). Creating the
    /// session (reading, optimising or mapping its cached form, prepacking its weights) is mostly
    /// single-threaded work; meanwhile the text encoder runs, and both sessions are held at once.
    pub(super) fn loads_transformer_early(&mut self) -> bool {
        if !self.on_cpu()
            || !self.loras.is_empty()
            || self.manifest.static_shapes.is_some()
            || self.graphs.is_loading(Component::Transformer)
            || self.graphs.loaded(Component::Transformer).is_some()
        {
            return false;
        }
        let bytes = [Component::TextEncoder, Component::Transformer]
            .into_iter()
            .flat_map(|component| self.graph_files(component))
            .filter_map(|file| std::fs::metadata(file).ok())
            .map(|metadata| metadata.len())
            .sum();
        runtime::fits_in_memory(bytes)
    }

    /// Releases the text-encoder session (its memory goes back before the transformer loads).
    pub fn release_text_encoder(&mut self) {
        self.graphs.release(Component::TextEncoder);
    }
}
