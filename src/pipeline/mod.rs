//! The FLUX.2-klein pipeline, stage by stage as diffusers' `Flux2KleinPipeline.__call__`: check
//! inputs ([`request`]), encode the prompt, encode the references, prepare the latents, schedule,
//! denoise (`denoise.rs`), decode; numbered 1 to 7 in [`Pipeline::generate`].
//!
//! Every stage is public and takes the progress callback (`None`: no reports), so an app can cache
//! prompt embeddings or inject its own latents. Graphs are loaded on first use (`graphs`); the
//! text encoder is released after the prompt unless [`PipelineOptions::with_keep_text_encoder`] is
//! set. On the CPU, when both graphs' files fit in half the memory available, the transformer
//! loads on a thread of its own while the prompt is encoded; otherwise it loads after the text
//! encoder is released.
//!
//! Thread safety: a `Pipeline` is `Send` but its stages take `&mut self` (ONNX Runtime sessions are
//! run through `&mut`): use one pipeline per thread, or a mutex around a shared one.
//! Pipelines in separate threads give exactly the images of one running the same requests in turn.
use std::borrow::Cow;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use ndarray::{
    concatenate, s, Array2, Array3, Array4, ArrayD, ArrayView3, ArrayView4, Axis, Ix3, Ix4,
};

/// The [`GraphSource`] of a pipeline's fields (a macro, not a method: it borrows the fields, not
/// the whole pipeline, so that `self.graphs` can be borrowed mutably beside it).
macro_rules! graph_source {
    ($pipeline:expr) => {
        GraphSource {
            dir: &$pipeline.dir,
            manifest: &$pipeline.manifest,
            session: &$pipeline.session,
            loras: &$pipeline.loras,
            scratch: &$pipeline.scratch,
            keeps_text_encoder: $pipeline.keep_text_encoder,
        }
    };
}

mod denoise;
mod graphs;
mod inpaint;
pub mod lora;
mod lora_merge;
pub mod metadata;
pub mod options;
pub mod progress;
pub mod prompt_cache;
pub mod prompts;
pub mod request;
mod warnings;

pub use denoise::{DenoiseContext, ReferenceTokens};
pub use options::{PipelineOptions, VaeTiling};
pub use progress::{Progress, ProgressFn, Stage, StepPreview, Timings};
pub use prompt_cache::{CacheLookup, PromptCache, DEFAULT_PROMPT_CACHE_MIB};
pub use prompts::{PromptEmbeds, PromptMemo};
pub use request::{Inpaint, MaskCrop, ReferenceSource, Request};

pub use graphs::Placement;
use graphs::{GraphSource, LoadedGraphs};
use inpaint::Blend;
use lora::LoraSet;
pub use lora::{LoraSpec, LoraSummary, ModuleSummary};
use progress::timed;
use request::Plan;
use warnings::Warnings;

use crate::bundle::manifest::LatentsSpec;
use crate::bundle::support;
use crate::bundle::{default_cache_dir, Component, Manifest, Verification};
use crate::error::{KleinError, Result};
use crate::runtime::{self, give_back_freed_memory, Device, Graph, SessionConfig, TensorInput};
use crate::stages::latents::{pack_latents, prepare_image_ids, unpack_latents};
use crate::stages::noise::randn;
use crate::stages::output::{to_rgb_images, RgbImage};
use crate::stages::reference::{
    decode_reference_bytes, load_reference, preprocess_reference, processed_size, read_file,
    read_header_bytes, ImageHeader, ReferenceImage,
};
use crate::stages::schedule::{compute_empirical_mu, schedule, Schedule};
use crate::stages::tokenize::ParsedTokenizer;
use crate::stages::vae_tiling::{patchify, stitch, unpatchify, TileLayout};

/// The result of [`Pipeline::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub images: Vec<RgbImage>,
    pub width: u32,
    pub height: u32,
    pub steps: usize,
    pub guidance: f64,
    pub seed: u64,
    /// The negative prompt guidance ran with, when the request gave one (not empty).
    pub negative_prompt: Option<String>,
    /// Whether the VAE decoded in tiles ([`VaeTiling`]).
    pub vae_tiled: bool,
    /// The tile side in pixels when it is not the bundle's
    /// ([`PipelineOptions::with_vae_tile_size`]) and the VAE decoded in tiles.
    pub vae_tile_size: Option<u32>,
    /// Inpainting and img2img: the strength, and whether a mask limited the repaint.
    pub strength: Option<f64>,
    pub masked: bool,
    /// `padding_mask_crop`: the padding of the region that was inpainted and pasted back.
    pub mask_crop: Option<u32>,
    pub prompt_truncated: bool,
    pub timings: Timings,
}

/// A loaded bundle.
pub struct Pipeline {
    dir: PathBuf,
    manifest: Manifest,
    tokenizer: ParsedTokenizer,
    session: SessionConfig,
    keep_text_encoder: bool,
    /// Release the transformer before the decode ([`PipelineOptions::with_release_transformer`]).
    release_transformer: bool,
    prompt_cache: Option<PromptCache>,
    verification: Option<Verification>,
    graphs: LoadedGraphs,
    /// LoRAs merged into the transformer when it loads.
    loras: LoraSet,
    /// The cache directory (else the system's temporary one): merged LoRA weights are written
    /// there while the transformer's session is created.
    scratch: PathBuf,
    /// Problems that did not stop a stage ([`Pipeline::take_warnings`]).
    warnings: Warnings,
    vae_tiling: VaeTiling,
    /// The VAE's tile side in pixels ([`PipelineOptions::with_vae_tile_size`], else the bundle's).
    vae_tile: usize,
    /// KV bundles: the references' K/V `[layers, 2, B, R, width]` extracted by the first step of
    /// the denoise context with this id ([`DenoiseContext`]).
    kv_cache: Option<(u64, ArrayD<f32>)>,
}

impl Pipeline {
    /// Opens the bundle at `dir`: reads and checks the manifest (file sizes; hashes unless
    /// [`PipelineOptions::with_verify_hashes`] is off, skipped while a stamp vouches for the files),
    /// starts parsing the tokenizer on a thread of its own (a tokenizer that does not fit the
    /// manifest is reported by the first prompt, or by [`Pipeline::load_all_graphs`]), and
    /// initialises ONNX Runtime (refused, before any hashing, when its release is older than the
    /// manifest's `min_onnxruntime_version`). A bundle whose files do not match its manifest is
    /// refused before any graph is loaded. Graphs are loaded on first use.
    pub fn load(dir: &Path, options: PipelineOptions) -> Result<Pipeline> {
        let PipelineOptions {
            session,
            runtime: runtime_options,
            keep_text_encoder,
            release_transformer,
            verify_hashes,
            cache_dir,
            prompt_cache_dir,
            prompt_cache_mib,
            loras,
            vae_tiling,
            vae_tile_size,
        } = options;
        request::check_session(&session)?;
        request::check_cache_limit(
            "prompt_cache_max_mib",
            prompt_cache_mib,
            crate::limits::MAX_PROMPT_CACHE_MIB,
            "MiB",
            prompt_cache_dir.is_some(),
            "--prompt-cache, prompt_cache, prompt_cache_dir",
        )?;
        lora::check_specs(&loras)?;
        let manifest = Manifest::load(dir)?;
        // Before hashing or loading anything: can this device run the bundle at all?
        support::check_bundle(session.device, &manifest.graphs, dir)?;
        let vae_tile = check_vae_tile(&manifest, vae_tile_size)?;
        let caches = [
            (
                &session.coreml.cache_dir,
                "creating the CoreML model cache directory",
            ),
            (&session.cpu_cache_dir, crate::error::CREATING_CPU_CACHE),
            (&prompt_cache_dir, crate::error::CREATING_PROMPT_CACHE),
        ];
        for (cache, action) in caches {
            if let Some(cache) = cache {
                std::fs::create_dir_all(cache).map_err(|source| KleinError::Io {
                    path: cache.clone(),
                    action,
                    // Not "File exists": a directory is wanted where a file is.
                    source: match cache.exists() && !cache.is_dir() {
                        true => std::io::Error::other("a file is there; give a directory"),
                        false => source,
                    },
                })?;
            }
        }
        // After the checks that hold for every build (a bundle the device cannot run is named
        // so on a Mac too), before the hashing and loading a device this build lacks would waste.
        session.device.check_compiled()?;
        // Before hashing: a library older than the bundle needs is refused at once.
        let runtime = runtime::init(runtime_options)?;
        manifest.check_runtime(runtime, dir)?;
        let cache_dir = cache_dir.or_else(default_cache_dir);
        let verification = if verify_hashes {
            Some(manifest.verify_hashes_cached(dir, cache_dir.as_deref())?)
        } else {
            None
        };
        let scratch = cache_dir.unwrap_or_else(std::env::temp_dir);
        let tokenizer = ParsedTokenizer::start(
            dir.join(&manifest.tokenizer.file),
            manifest.tokenizer.clone(),
        );
        let prompt_cache = prompt_cache_dir.map(|cache_dir| {
            let mib = prompt_cache_mib.unwrap_or(DEFAULT_PROMPT_CACHE_MIB);
            PromptCache::new(cache_dir, &manifest, mib)
        });
        let loras = LoraSet::load(&loras, &manifest, dir)?;
        Ok(Pipeline {
            dir: dir.to_path_buf(),
            manifest,
            tokenizer,
            session,
            keep_text_encoder,
            release_transformer,
            prompt_cache,
            verification,
            graphs: LoadedGraphs::default(),
            kv_cache: None,
            loras,
            scratch,
            warnings: Warnings::default(),
            vae_tiling,
            vae_tile,
        })
    }

    /// Applies `loras` (in place of those applied so far; empty: none) from the next transformer
    /// load on. Each file is read and checked against the bundle now: a LoRA for another model or
    /// size, keys that match no layer, a quantized or static-shape bundle are errors, and the
    /// pipeline keeps its LoRAs. When they change, only the transformer's session is released;
    /// the text encoder and the VAE stay loaded.
    pub fn set_loras(&mut self, loras: &[LoraSpec]) -> Result<()> {
        if self.loras.specs() == loras {
            return Ok(());
        }
        self.loras = LoraSet::load(loras, &self.manifest, &self.dir)?;
        self.graphs.release(Component::Transformer);
        Ok(())
    }

    /// What each applied LoRA changes: its format and the layers it touches.
    pub fn loras(&self) -> Vec<LoraSummary> {
        self.loras.summaries()
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn bundle_dir(&self) -> &Path {
        &self.dir
    }

    /// How the bundle's hashes were checked at load time (`None`: not checked).
    pub fn verification(&self) -> Option<&Verification> {
        self.verification.as_ref()
    }

    /// Problems met since the last call that did not stop the work (a prompt-cache entry that was
    /// rejected, a cache that could not be written, guidance given to a distilled model), oldest
    /// first. The library never prints: an app shows or logs them. At most 64 are kept between
    /// two calls: older ones are dropped, and a first warning says how many. A generation that
    /// fails leaves none of its own (they would read as the next generation's): its error says
    /// what went wrong.
    pub fn take_warnings(&mut self) -> Vec<String> {
        let taken = self.graphs.take_warnings();
        self.warnings.extend(taken);
        self.warnings.take()
    }

    /// The execution provider of the graph loaded last (known once a graph is loaded); see
    /// [`Pipeline::placements`] for every graph's.
    pub fn device_used(&self) -> Option<Device> {
        self.graphs.device_used()
    }

    /// Where each graph loaded so far runs, and which devices auto skipped for it and why.
    pub fn placements(&self) -> &[Placement] {
        self.graphs.placements()
    }

    /// Loads every graph now (instead of on first use) and checks each against the manifest, and
    /// the tokenizer.
    pub fn load_all_graphs(&mut self) -> Result<()> {
        for component in Component::ALL {
            self.graph(component, None, &mut None)?;
        }
        self.tokenizer.get()?;
        Ok(())
    }

    /// The graph of `component` (of `bucket` in a static-shape bundle), loaded on first use.
    fn graph(
        &mut self,
        component: Component,
        bucket: Option<usize>,
        progress: &mut Option<&mut ProgressFn<'_>>,
    ) -> Result<&mut Graph> {
        self.graphs
            .get(component, bucket, &graph_source!(self), progress)
    }

    /// The files loading `component`'s graph will read: the CPU cache's saved copy when there is
    /// one, else the bundle's graph file and its external data; empty when not known before a
    /// request (a static-shape bundle's per-bucket graphs, a transformer with LoRAs merged). The
    /// pipeline reads the text encoder's (on the CPU), then the transformer's into the page cache
    /// as the prompt is encoded ([`runtime::prefetch_in_turn`]); an app can warm them the same way.
    pub fn graph_files(&self, component: Component) -> Vec<PathBuf> {
        LoadedGraphs::files(component, None, &graph_source!(self))
    }

    /// Static-shape bundles: the bucket of a `width` x `height` output (a request error when there
    /// is none); `None` for dynamic bundles.
    fn bucket_of_size(&self, width: u32, height: u32) -> Result<Option<usize>> {
        self.manifest
            .static_shapes
            .as_ref()
            .map(|shapes| shapes.bucket_for_size(width, height))
            .transpose()
            .map_err(KleinError::request)
    }

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
    fn loads_transformer_early(&mut self) -> bool {
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

    /// Reads and preprocesses a reference image file (EXIF orientation, alpha, area, crop).
    pub fn load_reference(&self, path: &Path) -> Result<ReferenceImage> {
        load_reference(
            path,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
        )
    }

    /// Decodes and preprocesses the bytes of a PNG, JPEG or WebP file as [`Self::load_reference`]
    /// does for a file (an upload, an image held in memory); `label` names it in errors.
    pub fn decode_reference(&self, bytes: &[u8], label: &Path) -> Result<ReferenceImage> {
        decode_reference_bytes(
            bytes,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// Reads each reference file once, checks them all as [`Self::load_references`] does before
    /// any is decoded, then decodes and preprocesses them in order. Files that can be read only
    /// once (a pipe, a shell's `<(...)`) work here.
    pub fn load_reference_files(
        &self,
        paths: &[&Path],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<Vec<ReferenceImage>> {
        let sources: Vec<_> = paths.iter().map(|&p| ReferenceSource::File(p)).collect();
        self.load_references(&sources, width, height)
    }

    /// Reference images from files (each read once) or from files' bytes, checked from their
    /// headers before any is decoded: each readable and of a size the pipeline takes, at most
    /// [`crate::limits::MAX_REFERENCES`] of them, and the output (`width` x `height`, else the
    /// first reference's size, else the bundle's default) plus all of them within the token
    /// budget; then decoded and preprocessed in order.
    pub fn load_references(
        &self,
        sources: &[ReferenceSource<'_>],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<Vec<ReferenceImage>> {
        request::check_reference_count(sources.len())?;
        let files = sources
            .iter()
            .map(|source| match *source {
                ReferenceSource::File(path) => Ok((Cow::Owned(read_file(path)?), path)),
                ReferenceSource::Encoded(bytes, label) => Ok((Cow::Borrowed(bytes), label)),
            })
            .collect::<Result<Vec<_>>>()?;
        let headers = files
            .iter()
            .map(|(bytes, path)| Ok((read_header_bytes(bytes, path)?, *path)))
            .collect::<Result<Vec<_>>>()?;
        self.check_reference_sizes(&headers, width, height)?;
        files
            .iter()
            .map(|(bytes, path)| self.decode_reference(bytes, path))
            .collect()
    }

    /// The size checks of [`Self::load_references`], on headers already read.
    fn check_reference_sizes(
        &self,
        headers: &[(ImageHeader, &Path)],
        width: Option<u32>,
        height: Option<u32>,
    ) -> Result<()> {
        let m = self.manifest.latents.pixel_multiple;
        let mut sizes = Vec::with_capacity(headers.len());
        for &(ref header, path) in headers {
            sizes.push(processed_size(
                header.width,
                header.height,
                &self.manifest.references.limits,
                m,
                path,
            )?);
        }
        let first = sizes.first().copied();
        let width = width
            .or(first.map(|s| s.0))
            .unwrap_or(self.manifest.model.default_width);
        let height = height
            .or(first.map(|s| s.1))
            .unwrap_or(self.manifest.model.default_height);
        let tokens: usize = sizes.iter().map(|&(w, h)| (w / m * (h / m)) as usize).sum();
        request::check_token_budget((width / m * (height / m)) as usize, tokens, sizes.len())
    }

    /// Preprocesses an already decoded reference image; `label` names it in errors.
    pub fn prepare_reference(
        &self,
        image: &image::DynamicImage,
        label: &Path,
    ) -> Result<ReferenceImage> {
        preprocess_reference(
            image,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
            label,
        )
    }

    /// Stage 3: VAE-encodes each reference (one at a time, as diffusers) and packs them in order.
    pub fn encode_references(
        &mut self,
        references: &[ReferenceImage],
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<ReferenceTokens> {
        let channels = self.manifest.latents.channels;
        let scale = self.manifest.references.time_offset_scale;
        let bucket = match references.first() {
            Some(first) => self.bucket_of_size(first.width, first.height)?,
            None => None,
        };
        let tiled = references
            .iter()
            .map(|r| self.vae_tiles(r.width as usize, r.height as usize))
            .collect::<Result<Vec<bool>>>()?;
        let layout = tiled
            .iter()
            .any(|&t| t)
            .then(|| self.vae_layout(false))
            .transpose()?;
        let _heap = layout.is_some().then(give_back_freed_memory);
        let packing = self.manifest.latents;
        let graph = self.graph(Component::VaeEncoder, bucket, &mut progress)?;
        let (tokens, grids) = timed(&mut progress, Stage::EncodeReferences, |_| {
            let mut packed = Vec::with_capacity(references.len());
            let mut grids = Vec::with_capacity(references.len());
            for (index, (reference, &tiled)) in references.iter().zip(&tiled).enumerate() {
                // The last one frees the encoder's arena. [1, 128, h, w]:
                let last = (index + 1 == references.len()).then_some(&packing);
                let latents = match layout.filter(|_| tiled) {
                    Some(layout) => encode_tiles(graph, reference.pixels.view(), layout, last)?,
                    None => encode_image(graph, reference.pixels.view(), last)?,
                };
                grids.push((latents.dim().2, latents.dim().3));
                packed.push(pack_latents(latents.view())); // -> [1, h*w, 128]
            }
            let views: Vec<ArrayView3<f32>> = packed.iter().map(|p| p.view()).collect();
            let tokens = if views.is_empty() {
                Array3::zeros((1, 0, channels))
            } else {
                // [1, N, 128]
                concatenate(Axis(1), &views).map_err(|e| internal("reference tokens", e))?
            };
            Ok((tokens, grids))
        })?;
        Ok(ReferenceTokens {
            tokens,
            ids: prepare_image_ids(&grids, scale),
            count: grids.len(),
        })
    }

    /// Output size in pixels for a request: explicit, else the first reference's, else the
    /// bundle's default; floored to the latent multiple (16), as the reference pipeline does.
    /// With a mask crop ([`MaskCrop`]): the whole source's size, which the result is pasted into.
    pub fn output_size(&self, request: &Request) -> Result<(u32, u32)> {
        // Every check `generate` makes before its work: a size given is one it would make.
        let plan = Plan::new(&self.manifest, request)?;
        match request.inpaint.as_ref().and_then(|i| i.crop.as_ref()) {
            Some(crop) => Ok(crop.size()),
            None => Ok((plan.width, plan.height)),
        }
    }

    /// Stage 4: the seed's initial noise `[batch, 128, h, w]`, drawn as
    /// `torch.randn(generator=torch.Generator("cpu").manual_seed(seed))`.
    pub fn prepare_latents(&self, seed: u64, batch: usize, width: u32, height: u32) -> Array4<f32> {
        let shape = self
            .manifest
            .latents
            .latents_shape(batch, height as usize, width as usize);
        randn(seed, &shape)
            .into_dimensionality::<Ix4>()
            .unwrap_or_else(|_| unreachable!("randn returns the shape it is given"))
    }

    /// Stage 5: the flow-matching schedule for an `h x w` latent grid.
    pub fn schedule(&self, steps: usize, lat_h: usize, lat_w: usize) -> Result<Schedule> {
        let mu = compute_empirical_mu(&self.manifest.scheduler.empirical_mu, lat_h * lat_w, steps);
        schedule(steps, mu, &self.manifest.scheduler.shift)
    }

    /// Stage 7: packed latents `[B, h*w, 128]` to images.
    pub fn decode(
        &mut self,
        latents: ArrayView3<f32>,
        lat_h: usize,
        lat_w: usize,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<Vec<RgbImage>> {
        let grid = unpack_latents(latents, lat_h, lat_w)?; // [B, h*w, 128] -> [B, 128, h, w]
        let m = self.manifest.latents.pixel_multiple;
        let bucket = self.bucket_of_size(lat_w as u32 * m, lat_h as u32 * m)?;
        let tiled = self.vae_tiles(lat_w * m as usize, lat_h * m as usize)?;
        let layout = tiled.then(|| self.vae_layout(true)).transpose()?;
        // The decoder on glibc's usual heap, whose kept memory goes back first (runtime's heap):
        // the steps' freed activations would otherwise stay under the decoder's own.
        let _heap = give_back_freed_memory();
        let packing = self.manifest.latents;
        let graph = self.graph(Component::VaeDecoder, bucket, &mut progress)?;
        timed(&mut progress, Stage::Decode, |_| {
            // [B, 3, 16h, 16w]
            let decoded = match layout {
                Some(layout) => decode_tiles(graph, grid.view(), layout, &packing)?,
                None => decode_latents(graph, grid.view(), Some(&packing))?,
            };
            Ok(to_rgb_images(decoded.view()))
        })
    }

    /// Whether an image (or reference) of `width` x `height` pixels goes through the VAE in
    /// tiles. Static-shape graphs take their sizes only: `On` is refused there, `Auto` is off.
    fn vae_tiles(&self, width: usize, height: usize) -> Result<bool> {
        let tiles = self.vae_tiling.applies(width, height, self.vae_tile);
        if tiles && self.manifest.static_shapes.is_some() {
            if self.vae_tiling == VaeTiling::On {
                return Err(KleinError::request(
                    "VAE tiling needs graphs that take any size; this is a static-shape bundle",
                ));
            }
            return Ok(false);
        }
        Ok(tiles)
    }

    /// The VAE's tiles for the decoder or the encoder ([`vae_layout`]).
    fn vae_layout(&self, decoder: bool) -> Result<TileLayout> {
        vae_layout(&self.manifest, self.vae_tile, decoder)
    }

    /// Runs every stage for `request`. `progress` may cancel between steps and stages. On the
    /// CPU the transformer may load while the prompt is encoded (see the module docs); its load
    /// stage then reports the time generation waited for it.
    pub fn generate(
        &mut self,
        request: &Request,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<Generation> {
        let mut timings = Timings::new();
        let mark = self.warnings.mark();
        let generation = {
            let mut on_event = |event: Progress| {
                if let Progress::StageFinished(stage, elapsed) = event {
                    timings.push((stage, elapsed));
                }
                match progress.as_mut() {
                    Some(callback) => callback(event),
                    None => ControlFlow::Continue(()),
                }
            };
            let run = self.run_stages(request, &mut on_event);
            if run.is_err() {
                self.warnings.forget_since(mark);
            }
            run?
        };
        Ok(Generation {
            timings,
            ..generation
        })
    }

    fn run_stages(
        &mut self,
        request: &Request,
        progress: &mut ProgressFn<'_>,
    ) -> Result<Generation> {
        // 1. Check inputs before anything is loaded.
        let plan = Plan::new(&self.manifest, request)?;
        let model = &self.manifest.model;
        if let Some(given) = request.guidance.filter(|&g| model.is_distilled && g > 1.0) {
            self.warnings.push(format!(
                "guidance {given} is ignored: {} is a distilled model (it runs without guidance)",
                model.name
            ));
        }
        let Plan {
            batch,
            steps,
            guidance,
            cfg,
            width,
            height,
            lat_h,
            lat_w,
            first_step,
        } = plan;
        let noise = match &request.initial_latents {
            Some(latents) => latents.clone(),
            None => self.prepare_latents(request.seed, batch, width, height),
        };

        // 2. Prompt (and the negative prompt for guidance: empty unless given), then free the
        //    text encoder. On the CPU the transformer loads meanwhile.
        if self.loads_transformer_early() {
            self.graphs
                .start_loading(Component::Transformer, &graph_source!(self))?;
        }
        let encoded;
        let embeds = match &request.prompt_embeds {
            Some(given) => given,
            None => {
                encoded = self.encode_prompt(&request.prompt, Some(&mut *progress))?;
                &encoded
            }
        };
        let negative = if cfg {
            let negative = request.negative_prompt.as_deref().unwrap_or("");
            Some(self.encode_prompt(negative, Some(&mut *progress))?)
        } else {
            None
        };
        if !self.keep_text_encoder {
            self.release_text_encoder();
        }

        // 3. References: the inpainting source first, then the references.
        let conditioning: Vec<ReferenceImage> = request.conditioning_images().cloned().collect();
        let references = if conditioning.is_empty() {
            ReferenceTokens::none(self.manifest.latents.channels)
        } else {
            self.encode_references(&conditioning, Some(&mut *progress))?
        };
        drop(conditioning);

        // 4-6. Latents, schedule (from the strength's first step when inpainting), denoising.
        let schedule = self.schedule(steps, lat_h, lat_w)?;
        let schedule = match first_step {
            Some(first) => schedule.starting_at(first),
            None => schedule,
        };
        let negative = negative.as_ref().map(|n| (n, guidance));
        // Static graphs take one image per call: image i denoises row i of the batch's noise,
        // as it would in one batched call.
        let chunk = match &self.manifest.static_shapes {
            Some(shapes) => shapes.batch,
            None => batch,
        };
        let mut images = Vec::with_capacity(batch);
        // Non-finite denoised latent values, and all of them, over the chunks: one warning.
        let (mut broken, mut total) = (0, 0);
        for first in (0..batch).step_by(chunk) {
            let rows = s![first..(first + chunk).min(batch), .., .., ..];
            let mut ctx = self.denoise_context(
                noise.slice(rows).dim().0,
                lat_h,
                lat_w,
                embeds,
                negative,
                &references,
                schedule.clone(),
            )?;
            let mut packed = pack_latents(noise.slice(rows)); // [B, 128, h, w] -> [B, h*w, 128]
            if let Some(inpaint) = &request.inpaint {
                let blend = Blend::new(
                    references.tokens.view(),
                    packed.clone(),
                    inpaint.mask.as_ref(),
                    lat_h,
                    lat_w,
                );
                // As diffusers: given latents are the start itself, the seed's noise is mixed.
                if request.initial_latents.is_none() {
                    packed = blend.initial_latents(&schedule);
                }
                ctx = ctx.with_blend(blend);
            }
            if let Some(every) = request.preview_every {
                ctx = ctx.with_previews(every, first);
            }
            let latents = self.denoise(packed, &ctx, Some(&mut *progress))?;
            broken += latents.iter().filter(|v| !v.is_finite()).count();
            total += latents.len();
            if self.release_transformer && first + chunk >= batch {
                self.graphs.release(Component::Transformer);
            }

            // 7. Decode.
            images.extend(self.decode(latents.view(), lat_h, lat_w, Some(&mut *progress))?);
        }
        if broken > 0 {
            self.warnings.push(format!(
                "{broken} of {total} denoised latent values are not finite (NaN or infinity): the \
                 image(s) are black or broken where they are. The values overflowed: lower the LoRAs' \
                 scales if any (a float16 bundle overflows sooner than a float32 one)"
            ));
        }
        let vae_tiled = self.vae_tiles(width as usize, height as usize)?;
        // 8. `padding_mask_crop`: the region's images pasted back into the whole source.
        let crop = request.inpaint.as_ref().and_then(|i| i.crop.as_ref());
        let (width, height) = match crop {
            Some(crop) => {
                images = images.iter().map(|image| crop.paste_back(image)).collect();
                crop.size()
            }
            None => (width, height),
        };
        Ok(Generation {
            images,
            width,
            height,
            steps,
            guidance,
            seed: request.seed,
            negative_prompt: request.negative_prompt.clone().filter(|n| !n.is_empty()),
            strength: request.inpaint.as_ref().map(|i| i.strength),
            masked: request.inpaint.as_ref().is_some_and(|i| i.mask.is_some()),
            mask_crop: crop.map(|c| c.padding),
            vae_tiled,
            vae_tile_size: (vae_tiled && self.vae_tile != self.manifest.vae.sample_size)
                .then_some(self.vae_tile as u32),
            prompt_truncated: embeds.truncated,
            timings: Timings::new(),
        })
    }
}

/// The tiles of `tile` pixels for the decoder or the encoder, checked to be slices of what the
/// graph takes: even latent cells (the decoder takes 2x2 patches), multiples of the pixel
/// multiple (the encoder's images).
fn vae_layout(manifest: &Manifest, tile: usize, decoder: bool) -> Result<TileLayout> {
    let vae = &manifest.vae;
    if decoder {
        let layout = TileLayout::decoder(tile, vae.spatial_factor);
        layout.check_aligned(vae.patch_size, "decoder")?;
        Ok(layout)
    } else {
        let layout = TileLayout::encoder(tile, vae.spatial_factor);
        layout.check_aligned(manifest.latents.pixel_multiple as usize, "encoder")?;
        Ok(layout)
    }
}

/// The VAE tile side: `requested`, checked to give aligned tiles for both graphs, else the
/// bundle's `vae.sample_size`.
fn check_vae_tile(manifest: &Manifest, requested: Option<u32>) -> Result<usize> {
    let Some(pixels) = requested else {
        return Ok(manifest.vae.sample_size);
    };
    crate::stages::vae_tiling::check_tile_size(pixels)?;
    let tile = pixels as usize;
    if vae_layout(manifest, tile, true).is_err() || vae_layout(manifest, tile, false).is_err() {
        return Err(KleinError::request_about(
            "vae_tile_size",
            format!(
            "VAE tile size {pixels}: tiles and their strides must fall on whole 2x2 latent patches \
             and 16-pixel blocks of bundle {}",
            manifest.model.name
        ),
        ));
    }
    Ok(tile)
}

/// The whole image through the VAE encoder: `[1, 3, H, W]` -> `[1, 128, H/16, W/16]`.
/// `last`: given for the pass's last run (with the manifest's latent packing, which gives the
/// output's shape), after which the encoder's arena is freed ([`Graph::run_then_free_arena`]).
fn encode_image(
    graph: &mut Graph,
    pixels: ArrayView4<f32>,
    last: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (batch, _, height, width) = pixels.dim();
    let shape = last.map(|packing| packing.latents_shape(batch, height, width));
    run_vae(graph, ("image", pixels), "latents", shape)
}

/// One run of a VAE graph, `input` (its name and value) to the output named `output`; with
/// `last_shape` (that output's shape) the pass's last, after which the graph's arena is freed.
fn run_vae(
    graph: &mut Graph,
    (input, value): (&str, ArrayView4<f32>),
    output: &str,
    last_shape: Option<[usize; 4]>,
) -> Result<Array4<f32>> {
    let inputs = [(input, TensorInput::from(value))];
    let mut out = match last_shape {
        Some(shape) => graph.run_then_free_arena(&inputs, &[(output, &shape)])?,
        None => graph.run(&inputs)?,
    };
    out.take(output)?
        .into_dimensionality::<Ix4>()
        .map_err(|e| internal(output, e))
}

/// The image through the encoder in tiles ([`crate::stages::vae_tiling`]): each tile's latents,
/// unpatchified, are blended and joined as diffusers' `_tiled_encode` joins its tiles' moments,
/// then patchified again. `[1, 3, H, W]` -> `[1, 128, H/16, W/16]`. `last_image`: given for the
/// pass's last image, whose last tile frees the encoder's arena (as [`encode_image`]).
fn encode_tiles(
    graph: &mut Graph,
    pixels: ArrayView4<f32>,
    layout: TileLayout,
    last_image: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (_, _, height, width) = pixels.dim();
    let (rows, columns) = (layout.starts(height), layout.starts(width));
    let mut grid = Vec::new();
    for &i in &rows {
        let mut row = Vec::new();
        for &j in &columns {
            let tile = pixels.slice(s![
                ..,
                ..,
                i..(i + layout.tile).min(height),
                j..(j + layout.tile).min(width)
            ]);
            let last_tile = rows.last() == Some(&i) && columns.last() == Some(&j);
            let last = last_image.filter(|_| last_tile);
            row.push(unpatchify(encode_image(graph, tile, last)?.view())); // [1, 32, th/8, tw/8]
        }
        grid.push(row);
    }
    Ok(patchify(stitch(grid, layout.blend, layout.keep)?.view()))
}

/// The latents through the VAE decoder at once: `[B, 128, h, w]` -> `[B, 3, 16h, 16w]`.
/// `last`: given for the pass's last run (with the manifest's latent packing, which gives the
/// output's shape), after which the decoder's arena is freed ([`Graph::run_then_free_arena`]).
fn decode_latents(
    graph: &mut Graph,
    latents: ArrayView4<f32>,
    last: Option<&LatentsSpec>,
) -> Result<Array4<f32>> {
    let (batch, _, h, w) = latents.dim();
    let shape = last.map(|packing| packing.image_shape(batch, h, w));
    run_vae(graph, ("latents", latents), "image", shape)
}

/// The latents through the decoder in tiles, as diffusers' `tiled_decode` over `z` (whose tiles
/// of even cells are these latents' tiles of half as many): `[B, 128, h, w]` -> `[B, 3, 16h, 16w]`.
fn decode_tiles(
    graph: &mut Graph,
    latents: ArrayView4<f32>,
    layout: TileLayout,
    packing: &LatentsSpec,
) -> Result<Array4<f32>> {
    let (_, _, h, w) = latents.dim();
    let (zh, zw) = (2 * h, 2 * w); // cells of z
    let (rows, columns) = (layout.starts(zh), layout.starts(zw));
    let mut grid = Vec::new();
    for &i in &rows {
        let mut row = Vec::new();
        for &j in &columns {
            let (bottom, right) = ((i + layout.tile).min(zh), (j + layout.tile).min(zw));
            let tile = latents.slice(s![.., .., i / 2..bottom / 2, j / 2..right / 2]);
            let last = rows.last() == Some(&i) && columns.last() == Some(&j);
            // The last tile frees the arena.
            row.push(decode_latents(graph, tile, last.then_some(packing))?);
        }
        grid.push(row);
    }
    stitch(grid, layout.blend, layout.keep)
}

/// An error of the pipeline's own arithmetic (a shape that cannot happen with a valid bundle).
fn internal(what: &str, error: impl std::fmt::Display) -> KleinError {
    KleinError::Inference {
        stage: "pipeline",
        message: format!("{what}: {error}"),
    }
}
