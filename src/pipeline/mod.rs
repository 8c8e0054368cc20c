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
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use ndarray::{s, Array4, ArrayD, Ix4};

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
mod prompt_encoding;
pub mod prompts;
mod references;
pub mod request;
mod spec;
mod vae;
mod warnings;

pub use denoise::{DenoiseContext, ReferenceTokens};
pub use options::{PipelineOptions, VaeTiling};
pub use progress::{Progress, ProgressFn, Stage, StepPreview, Timings};
pub use prompt_cache::{CacheLookup, PromptCache, DEFAULT_PROMPT_CACHE_MIB};
pub use prompts::{PromptEmbeds, PromptMemo};
pub use request::{random_seed, Inpaint, MaskCrop, Request, RANDOM_SEED_LIMIT};
pub use spec::{ImageInput, Input, MaskKind, RequestSpec, Rule, SpecError};

pub use graphs::Placement;
use graphs::{GraphSource, LoadedGraphs};
use inpaint::Blend;
use lora::LoraSet;
pub use lora::{LoraSpec, LoraSummary, ModuleSummary};
use request::Plan;
use vae::check_vae_tile;
use warnings::Warnings;

use crate::bundle::support;
use crate::bundle::{default_cache_dir, Component, Manifest, Verification};
use crate::error::{KleinError, Result};
use crate::runtime::{self, Device, Graph, SessionConfig};
use crate::stages::latents::pack_latents;
use crate::stages::noise::randn;
use crate::stages::output::RgbImage;
use crate::stages::reference::ReferenceImage;
use crate::stages::schedule::{compute_empirical_mu, schedule, Schedule};
use crate::stages::tokenize::ParsedTokenizer;

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
        // A name or Hub id of an installed model (`klein-export pull`) is its bundle directory; a
        // Hub id of a bundle repository not yet installed is fetched (the `hub` feature).
        let dir = &crate::bundle::installed::locate(dir)?;
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

    /// A FLUX.3 Image Klein bundle (`model.family`).
    pub(crate) fn is_flux3(&self) -> bool {
        self.manifest.model.family == crate::bundle::ModelFamily::Flux3
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

    /// Output size in pixels for a request: explicit, else the first reference's, else the
    /// bundle's default; floored to the latent multiple (16), as the reference pipeline does.
    /// With a mask crop ([`MaskCrop`]): the whole source's size, which the result is pasted into.
    pub fn output_size(&self, request: &Request) -> Result<(u32, u32)> {
        // Every check `generate` makes before its work: a size given is one it would make.
        let plan = Plan::new(&self.manifest, request)?;
        if let Some([left, top, right, bottom]) = self.crop_back(request) {
            return Ok((right - left, bottom - top));
        }
        match request.inpaint.as_ref().and_then(|i| i.crop.as_ref()) {
            Some(crop) => Ok(crop.size()),
            None => Ok((plan.width, plan.height)),
        }
    }

    /// FLUX.3, one reference and no size given: the box of the padded canvas the output is
    /// cropped back to, as `Flux3DecodeStep` does.
    fn crop_back(&self, request: &Request) -> Option<[u32; 4]> {
        match (request.width, request.height, &request.references[..]) {
            (None, None, [only]) if self.is_flux3() => only.crop_box,
            _ => None,
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
        // 1. Check inputs before anything is loaded; the request's LoRAs.
        let plan = Plan::new(&self.manifest, request)?;
        if let Some(loras) = &request.loras {
            self.set_loras(loras)?;
        }
        let model = &self.manifest.model;
        if let Some(given) = request.guidance.filter(|&g| model.is_distilled && g > 1.0) {
            self.warnings.push(format!(
                "guidance {given} is ignored: {} is a distilled model (it runs without guidance)",
                model.name
            ));
        }
        if let Some(warning) = floored_size(request, &plan, self.manifest.latents.pixel_multiple) {
            self.warnings.push(warning);
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
        let (width, height) = match self.crop_back(request) {
            Some(crop) => {
                images = images.iter().map(|image| image.crop(crop)).collect();
                (crop[2] - crop[0], crop[3] - crop[1])
            }
            None => (width, height),
        };
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

/// An error of the pipeline's own arithmetic (a shape that cannot happen with a valid bundle).
fn internal(what: &str, error: impl std::fmt::Display) -> KleinError {
    KleinError::Inference {
        stage: "pipeline",
        message: format!("{what}: {error}"),
    }
}

/// The warning for a size given that is not a multiple of the latent grid's `multiple` (16): it is
/// floored, as diffusers floors it (and warns). With a source image (inpainting, img2img), a size
/// other than the source's: it is ignored, as diffusers ignores it there.
fn floored_size(request: &Request, plan: &Plan, multiple: u32) -> Option<String> {
    if let Some(inpaint) = &request.inpaint {
        let source = &inpaint.image;
        let ignored: Vec<String> = [
            ("width", request.width, source.width),
            ("height", request.height, source.height),
        ]
        .into_iter()
        .filter_map(|(name, given, side)| {
            given
                .filter(|&g| g / multiple * multiple != side / multiple * multiple)
                .map(|g| format!("{name} {g}"))
        })
        .collect();
        return (!ignored.is_empty()).then(|| {
            format!(
                "{} {} ignored: inpainting and img2img make an image of the source image's size \
                 ({}x{}), as diffusers does; resize the source for another size",
                ignored.join(" and "),
                if ignored.len() > 1 { "are" } else { "is" },
                plan.width,
                plan.height
            )
        });
    }
    let floored: Vec<String> = [
        ("width", request.width, plan.width),
        ("height", request.height, plan.height),
    ]
    .into_iter()
    .filter_map(|(name, given, used)| {
        given
            .filter(|&g| g != used)
            .map(|g| format!("{name} {g} is floored to {used}"))
    })
    .collect();
    (!floored.is_empty()).then(|| {
        format!(
            "{}: image sides are multiples of {multiple}, as in diffusers",
            floored.join(", ")
        )
    })
}
