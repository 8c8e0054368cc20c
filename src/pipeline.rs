//! The FLUX.2-klein pipeline, stage by stage as diffusers' `Flux2KleinPipeline.__call__`:
//! 1. check inputs, 2. encode the prompt, 3. encode the references, 4. prepare latents,
//! 5. schedule, 6. denoise, 7. decode.
//!
//! Every stage is public, so an app can cache prompt embeddings or inject its own latents. Graphs
//! are loaded on first use; the text encoder is released before the transformer is loaded unless
//! [`PipelineOptions::keep_text_encoder`] is set.
//!
//! Thread safety: a `Pipeline` is `Send` but its stages take `&mut self` (ONNX Runtime sessions are
//! run through `&mut`): use one pipeline per thread, or a mutex around a shared one.
//! Pipelines in separate threads give exactly the images of one running the same requests in turn.
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ndarray::{concatenate, s, Array2, Array3, Array4, ArrayView3, Axis, Ix3, Ix4};

use crate::buckets::PER_BUCKET;
use crate::error::{KleinError, Result};
use crate::latents::{
    pack_latents, prepare_image_ids, prepare_latent_ids, prepare_text_ids, unpack_latents,
};
use crate::manifest::{default_cache_dir, Manifest, Verification};
use crate::noise::randn;
use crate::output::{to_rgb_images, RgbImage};
use crate::prompt_cache::PromptCache;
use crate::reference::{load_reference, preprocess_reference, ReferenceImage};
use crate::runtime::{
    self, load_graph, CoreMlOptions, CudaOptions, Device, Graph, RuntimeOptions, SessionConfig,
    TensorInput,
};
use crate::schedule::{compute_empirical_mu, schedule, Schedule};
use crate::support;
use crate::tokenize::PromptTokenizer;

/// Largest output side in pixels. The transformer's attention is quadratic in the token count;
/// 4096x4096 is already 65,536 image tokens.
pub const MAX_SIDE: u32 = 4096;
/// Largest number of image tokens (output + references) one transformer call may see: the output
/// at 1 megapixel (4096 tokens) plus four 1-megapixel references.
pub const MAX_IMAGE_TOKENS: usize = 5 * 4096;
/// Largest batch (`num_images`) in one call.
pub const MAX_BATCH: usize = 16;

/// How to load a bundle.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct PipelineOptions {
    /// Where to run the graphs.
    pub device: Device,
    /// Threads inside one operator (`None`: ONNX Runtime's default).
    pub threads: Option<usize>,
    /// Where the ONNX Runtime library comes from.
    pub runtime: RuntimeOptions,
    /// Keep the text-encoder session loaded after encoding (for many prompts in one process).
    pub keep_text_encoder: bool,
    /// Check the sha256 of every bundle file against the manifest before loading any graph
    /// (default: on). A stamp in the cache directory skips the hashing while no file changes
    /// ([`Manifest::verify_hashes_cached`]).
    pub verify_hashes: bool,
    /// Directory for verification stamps (`None`: [`default_cache_dir`]).
    pub cache_dir: Option<PathBuf>,
    /// Directory of the on-disk prompt-embedding cache (`None`: no cache).
    pub prompt_cache_dir: Option<PathBuf>,
    /// CUDA provider settings (with a CUDA device, or auto).
    pub cuda: CudaOptions,
    /// CoreML provider settings (with the CoreML device, or auto).
    pub coreml: CoreMlOptions,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            device: Device::default(),
            threads: None,
            runtime: RuntimeOptions::default(),
            keep_text_encoder: false,
            verify_hashes: true,
            cache_dir: None,
            prompt_cache_dir: None,
            cuda: CudaOptions::default(),
            coreml: CoreMlOptions::default(),
        }
    }
}

impl PipelineOptions {
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }
    pub fn with_threads(mut self, threads: usize) -> Self {
        self.threads = Some(threads);
        self
    }
    pub fn with_runtime(mut self, runtime: RuntimeOptions) -> Self {
        self.runtime = runtime;
        self
    }
    pub fn with_keep_text_encoder(mut self, keep: bool) -> Self {
        self.keep_text_encoder = keep;
        self
    }
    pub fn with_verify_hashes(mut self, verify: bool) -> Self {
        self.verify_hashes = verify;
        self
    }
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }
    pub fn with_prompt_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.prompt_cache_dir = Some(dir.into());
        self
    }
    pub fn with_cuda(mut self, cuda: CudaOptions) -> Self {
        self.cuda = cuda;
        self
    }
    pub fn with_coreml(mut self, coreml: CoreMlOptions) -> Self {
        self.coreml = coreml;
        self
    }
}

/// What to generate.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct Request {
    pub prompt: String,
    /// Preprocessed reference images ([`Pipeline::load_reference`], [`Pipeline::prepare_reference`]).
    pub references: Vec<ReferenceImage>,
    /// Output size; default: the first reference's size, else the bundle's default.
    pub width: Option<u32>,
    pub height: Option<u32>,
    /// Denoising steps; default: the manifest's.
    pub steps: Option<usize>,
    /// Classifier-free guidance scale (base models only); default: the manifest's.
    pub guidance: Option<f64>,
    pub seed: u64,
    /// Images per prompt (one batch); at least 1.
    pub num_images: usize,
    /// Initial latents `[num_images, 128, h, w]` instead of the seed's noise.
    pub initial_latents: Option<Array4<f32>>,
    /// Embeddings of `prompt` from [`Pipeline::encode_prompt`], reused instead of running the
    /// text encoder again (one prompt, many seeds). `[1, max_sequence_length, embed_dim]`.
    pub prompt_embeds: Option<PromptEmbeds>,
}

impl Request {
    pub fn new(prompt: impl Into<String>) -> Self {
        Request {
            prompt: prompt.into(),
            num_images: 1,
            ..Default::default()
        }
    }
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }
    pub fn with_size(mut self, width: u32, height: u32) -> Self {
        self.width = Some(width);
        self.height = Some(height);
        self
    }
    pub fn with_steps(mut self, steps: usize) -> Self {
        self.steps = Some(steps);
        self
    }
    pub fn with_guidance(mut self, guidance: f64) -> Self {
        self.guidance = Some(guidance);
        self
    }
    pub fn with_reference(mut self, reference: ReferenceImage) -> Self {
        self.references.push(reference);
        self
    }
    pub fn with_num_images(mut self, n: usize) -> Self {
        self.num_images = n;
        self
    }
    pub fn with_initial_latents(mut self, latents: Array4<f32>) -> Self {
        self.initial_latents = Some(latents);
        self
    }
    pub fn with_prompt_embeds(mut self, embeds: PromptEmbeds) -> Self {
        self.prompt_embeds = Some(embeds);
        self
    }
}

/// The pipeline stages, as reported to the progress callback and in [`Timings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    LoadTextEncoder,
    EncodePrompt,
    LoadVaeEncoder,
    EncodeReferences,
    LoadTransformer,
    Denoise,
    LoadVaeDecoder,
    Decode,
}

impl Stage {
    pub fn label(self) -> &'static str {
        match self {
            Stage::LoadTextEncoder => "load text encoder",
            Stage::EncodePrompt => "encode prompt",
            Stage::LoadVaeEncoder => "load VAE encoder",
            Stage::EncodeReferences => "encode references",
            Stage::LoadTransformer => "load transformer",
            Stage::Denoise => "denoise",
            Stage::LoadVaeDecoder => "load VAE decoder",
            Stage::Decode => "decode",
        }
    }
}

/// Progress events. The callback returns `ControlFlow::Break(())` to cancel (checked between steps
/// and stages); the generation then ends with [`KleinError::Cancelled`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    StageStarted(Stage),
    StageFinished(Stage, Duration),
    /// Denoising step `step` (1-based) of `total` finished.
    Step {
        step: usize,
        total: usize,
    },
}

/// Seconds spent per stage, in the order they ran.
pub type Timings = Vec<(Stage, Duration)>;

/// Prompt embeddings `[1, L, D]` and whether the prompt was truncated to the maximum length.
#[derive(Debug, Clone)]
pub struct PromptEmbeds {
    pub embeds: Array3<f32>,
    pub truncated: bool,
}

/// Reference tokens `[1, N, 128]` (all references packed, in order) and their ids `[N, 4]`.
#[derive(Debug, Clone)]
pub struct ReferenceTokens {
    pub tokens: Array3<f32>,
    pub ids: Array2<i64>,
    /// How many reference images the tokens come from.
    pub count: usize,
}

/// What the transformer sees at every step besides the latents ([`Pipeline::denoise_context`]).
#[derive(Debug, Clone)]
pub struct DenoiseContext {
    /// Identifies this context's constant inputs to [`Graph::run_with_constants`] (clones share
    /// it: they hold the same data).
    id: u64,
    /// `[B, L, D]` prompt embeddings, and the negative ones with the guidance scale.
    text: Array3<f32>,
    negative: Option<(Array3<f32>, f32)>,
    /// `[L, 4]` and `[h*w + N, 4]` position ids.
    txt_ids: Array2<i64>,
    img_ids: Array2<i64>,
    /// `[B, N, 128]` reference tokens, appended after the latents at every step.
    ref_tokens: Array3<f32>,
    /// The output's latent grid, `image_tokens = lat_h * lat_w`.
    lat_h: usize,
    lat_w: usize,
    image_tokens: usize,
    schedule: Schedule,
}

impl DenoiseContext {
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
}

/// The result of [`Pipeline::generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub images: Vec<RgbImage>,
    pub width: u32,
    pub height: u32,
    pub steps: usize,
    pub guidance: f64,
    pub seed: u64,
    pub prompt_truncated: bool,
    pub timings: Timings,
}

/// A loaded bundle.
pub struct Pipeline {
    dir: PathBuf,
    manifest: Manifest,
    tokenizer: PromptTokenizer,
    session: SessionConfig,
    keep_text_encoder: bool,
    prompt_cache: Option<PromptCache>,
    verification: Option<Verification>,
    text_encoder: Option<Graph>,
    transformer: Option<Graph>,
    vae_encoder: Option<Graph>,
    vae_decoder: Option<Graph>,
    /// Static-shape bundles: the bucket whose graphs the transformer and VAE slots hold.
    bucket: Option<usize>,
    device_used: Option<Device>,
}

type Callback<'a> = &'a mut dyn FnMut(Progress) -> ControlFlow<()>;

fn notify(progress: &mut Option<Callback<'_>>, event: Progress) -> Result<()> {
    match progress {
        Some(callback) => match callback(event) {
            ControlFlow::Continue(()) => Ok(()),
            ControlFlow::Break(()) => Err(KleinError::Cancelled),
        },
        None => Ok(()),
    }
}

fn request_error(reason: String) -> KleinError {
    KleinError::Request(reason)
}

impl Pipeline {
    /// Opens the bundle at `dir`: reads and checks the manifest (file sizes; hashes unless
    /// [`PipelineOptions::verify_hashes`] is off, skipped while a stamp vouches for the files) and
    /// the tokenizer, and initialises ONNX Runtime. A bundle whose files do not match its manifest
    /// is refused before any graph is loaded. Graphs are loaded on first use.
    pub fn load(dir: &Path, options: PipelineOptions) -> Result<Pipeline> {
        let PipelineOptions {
            device,
            threads,
            runtime: runtime_options,
            keep_text_encoder,
            verify_hashes,
            cache_dir,
            prompt_cache_dir,
            cuda,
            coreml,
        } = options;
        let manifest = Manifest::load(dir)?;
        // Before hashing or loading anything: can this device run the bundle at all?
        support::check_bundle(device, &manifest.graphs, dir)?;
        if let Some(cache) = &coreml.cache_dir {
            std::fs::create_dir_all(cache).map_err(|source| KleinError::Io {
                path: cache.clone(),
                action: "creating the CoreML model cache directory",
                source,
            })?;
        }
        let verification = if verify_hashes {
            let cache_dir = cache_dir.or_else(default_cache_dir);
            Some(manifest.verify_hashes_cached(dir, cache_dir.as_deref())?)
        } else {
            None
        };
        let tokenizer =
            PromptTokenizer::load(&dir.join(&manifest.tokenizer.file), &manifest.tokenizer)?;
        runtime::init(runtime_options)?;
        let mut session = SessionConfig::default()
            .with_device(device)
            .with_cuda(cuda)
            .with_coreml(coreml);
        if let Some(threads) = threads {
            session = session.with_intra_threads(threads);
        }
        let prompt_cache = prompt_cache_dir.map(|cache_dir| PromptCache::new(cache_dir, &manifest));
        Ok(Pipeline {
            dir: dir.to_path_buf(),
            manifest,
            tokenizer,
            session,
            keep_text_encoder,
            prompt_cache,
            verification,
            text_encoder: None,
            transformer: None,
            vae_encoder: None,
            vae_decoder: None,
            bucket: None,
            device_used: None,
        })
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

    /// The execution provider the graphs run on (known once a graph is loaded).
    pub fn device_used(&self) -> Option<Device> {
        self.device_used
    }

    /// Loads every graph now (instead of on first use) and checks each against the manifest.
    pub fn load_all_graphs(&mut self) -> Result<()> {
        for name in ["text_encoder", "transformer", "vae_encoder", "vae_decoder"] {
            self.graph(name, &mut None)?;
        }
        Ok(())
    }

    /// The graph `name`, loaded (and checked against the manifest) on first use.
    fn graph(
        &mut self,
        name: &'static str,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<&mut Graph> {
        let file = self.graph_file(name)?;
        let (slot, spec, stage) = match name {
            "text_encoder" => (
                &mut self.text_encoder,
                &self.manifest.graphs.text_encoder,
                Stage::LoadTextEncoder,
            ),
            "transformer" => (
                &mut self.transformer,
                &self.manifest.graphs.transformer,
                Stage::LoadTransformer,
            ),
            "vae_encoder" => (
                &mut self.vae_encoder,
                &self.manifest.graphs.vae_encoder,
                Stage::LoadVaeEncoder,
            ),
            "vae_decoder" => (
                &mut self.vae_decoder,
                &self.manifest.graphs.vae_decoder,
                Stage::LoadVaeDecoder,
            ),
            other => return Err(internal("graph", format!("no graph named `{other}`"))),
        };
        if slot.is_none() {
            notify(progress, Progress::StageStarted(stage))?;
            let start = Instant::now();
            let path = self.dir.join(file);
            let graph = load_graph(name, &path, &self.session)?;
            graph.check_io(spec)?;
            spec.check_metadata(name, graph.metadata(), &path)?;
            self.device_used = Some(graph.device());
            *slot = Some(graph);
            notify(progress, Progress::StageFinished(stage, start.elapsed()))?;
        }
        slot.as_mut()
            .ok_or_else(|| unreachable!("the slot was filled above"))
    }

    /// The file of graph `name`: the current bucket's for the per-bucket graphs of a static-shape
    /// bundle, else the manifest's.
    fn graph_file(&self, name: &str) -> Result<String> {
        let (_, spec) = self
            .manifest
            .graphs
            .iter()
            .find(|(component, _)| *component == name)
            .ok_or_else(|| internal("graph", format!("no graph named `{name}`")))?;
        let Some(shapes) = &self.manifest.static_shapes else {
            return Ok(spec.file.clone());
        };
        if !PER_BUCKET.contains(&name) {
            return Ok(spec.file.clone());
        }
        let bucket = self
            .bucket
            .and_then(|b| shapes.buckets.get(b))
            .ok_or_else(|| internal("graph", format!("no bucket chosen for the {name} graph")))?;
        // A bundle without references keeps its dynamic VAE encoder.
        Ok(bucket.files.get(name).unwrap_or(&spec.file).clone())
    }

    /// Static-shape bundles: makes `index` the current bucket, releasing the graphs of another.
    fn switch_bucket(&mut self, index: usize) {
        if self.bucket != Some(index) {
            self.transformer = None;
            self.vae_encoder = None;
            self.vae_decoder = None;
            self.bucket = Some(index);
        }
    }

    /// Static-shape bundles: switches to the bucket of a `width` x `height` output (a request
    /// error when there is none); no-op for dynamic bundles.
    fn use_bucket_of_size(&mut self, width: u32, height: u32) -> Result<()> {
        if let Some(shapes) = &self.manifest.static_shapes {
            let index = shapes
                .bucket_for_size(width, height)
                .map_err(request_error)?;
            self.switch_bucket(index);
        }
        Ok(())
    }

    /// Stage 2: the prompt's embeddings `[1, L, 3*hidden]` (from the cache when enabled).
    pub fn encode_prompt(&mut self, prompt: &str) -> Result<PromptEmbeds> {
        self.encode_prompt_with(prompt, &mut None)
    }

    fn encode_prompt_with(
        &mut self,
        prompt: &str,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<PromptEmbeds> {
        let encoded = self.tokenizer.encode(prompt)?;
        if let Some(embeds) = self.prompt_cache.as_ref().and_then(|c| c.get(prompt)) {
            return Ok(PromptEmbeds {
                embeds,
                truncated: encoded.truncated,
            });
        }
        let seq = encoded.input_ids.len();
        // [L] -> [1, L]
        let ids = Array2::from_shape_vec((1, seq), encoded.input_ids)
            .map_err(|e| internal("token ids", e))?;
        let mask = Array2::from_shape_vec((1, seq), encoded.attention_mask)
            .map_err(|e| internal("attention mask", e))?;
        let graph = self.graph("text_encoder", progress)?;
        notify(progress, Progress::StageStarted(Stage::EncodePrompt))?;
        let start = Instant::now();
        let mut out = graph.run(&[
            ("input_ids", TensorInput::from(ids.view())),
            ("attention_mask", TensorInput::from(mask.view())),
        ])?;
        let embeds = out
            .take("prompt_embeds")?
            .into_dimensionality::<Ix3>()
            .map_err(|e| internal("prompt_embeds", e))?;
        notify(
            progress,
            Progress::StageFinished(Stage::EncodePrompt, start.elapsed()),
        )?;
        if let Some(cache) = &self.prompt_cache {
            cache.put(prompt, &embeds)?;
        }
        Ok(PromptEmbeds {
            embeds,
            truncated: encoded.truncated,
        })
    }

    /// Releases the text-encoder session (its memory goes back before the transformer loads).
    pub fn release_text_encoder(&mut self) {
        self.text_encoder = None;
    }

    /// Reads and preprocesses a reference image file (EXIF orientation, alpha, area, crop).
    pub fn load_reference(&self, path: &Path) -> Result<ReferenceImage> {
        load_reference(
            path,
            &self.manifest.references.limits,
            self.manifest.latents.pixel_multiple,
        )
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
    pub fn encode_references(&mut self, references: &[ReferenceImage]) -> Result<ReferenceTokens> {
        self.encode_references_with(references, &mut None)
    }

    fn encode_references_with(
        &mut self,
        references: &[ReferenceImage],
        progress: &mut Option<Callback<'_>>,
    ) -> Result<ReferenceTokens> {
        let channels = self.manifest.latents.channels;
        let scale = self.manifest.references.time_offset_scale;
        if let Some(first) = references.first() {
            self.use_bucket_of_size(first.width, first.height)?;
        }
        let graph = self.graph("vae_encoder", progress)?;
        notify(progress, Progress::StageStarted(Stage::EncodeReferences))?;
        let start = Instant::now();
        let mut packed = Vec::with_capacity(references.len());
        let mut grids = Vec::with_capacity(references.len());
        for reference in references {
            let mut out = graph.run(&[("image", TensorInput::from(reference.pixels.view()))])?;
            // [1, 128, h, w]
            let latents = out
                .take("latents")?
                .into_dimensionality::<Ix4>()
                .map_err(|e| internal("vae latents", e))?;
            grids.push((latents.dim().2, latents.dim().3));
            packed.push(pack_latents(latents.view())); // -> [1, h*w, 128]
        }
        let views: Vec<ArrayView3<f32>> = packed.iter().map(|p| p.view()).collect();
        let tokens = if views.is_empty() {
            Array3::zeros((1, 0, channels))
        } else {
            concatenate(Axis(1), &views).map_err(|e| internal("reference tokens", e))?
            // [1, N, 128]
        };
        notify(
            progress,
            Progress::StageFinished(Stage::EncodeReferences, start.elapsed()),
        )?;
        Ok(ReferenceTokens {
            tokens,
            ids: prepare_image_ids(&grids, scale),
            count: grids.len(),
        })
    }

    /// Output size in pixels for a request: explicit, else the first reference's, else the
    /// bundle's default; floored to the latent multiple (16), as the reference pipeline does.
    pub fn output_size(&self, request: &Request) -> Result<(u32, u32)> {
        let first = request.references.first();
        let width = request
            .width
            .or(first.map(|r| r.width))
            .unwrap_or(self.manifest.model.default_width);
        let height = request
            .height
            .or(first.map(|r| r.height))
            .unwrap_or(self.manifest.model.default_height);
        let multiple = self.manifest.latents.pixel_multiple;
        for (what, value) in [("width", width), ("height", height)] {
            if value < multiple || value > MAX_SIDE {
                return Err(request_error(format!(
                    "{what} {value} is out of range: it must be between {multiple} and {MAX_SIDE} pixels"
                )));
            }
        }
        Ok((width / multiple * multiple, height / multiple * multiple))
    }

    /// Stage 4: the seed's initial noise `[batch, 128, h, w]`, drawn as
    /// `torch.randn(generator=torch.Generator("cpu").manual_seed(seed))`.
    pub fn prepare_latents(&self, seed: u64, batch: usize, width: u32, height: u32) -> Array4<f32> {
        let m = self.manifest.latents.pixel_multiple as usize;
        let shape = [
            batch,
            self.manifest.latents.channels,
            height as usize / m,
            width as usize / m,
        ];
        randn(seed, &shape)
            .into_dimensionality::<Ix4>()
            .unwrap_or_else(|_| unreachable!("randn returns the shape it is given"))
    }

    /// Stage 5: the flow-matching schedule for an `h x w` latent grid.
    pub fn schedule(&self, steps: usize, lat_h: usize, lat_w: usize) -> Result<Schedule> {
        let mu = compute_empirical_mu(&self.manifest.scheduler.empirical_mu, lat_h * lat_w, steps);
        schedule(steps, mu, &self.manifest.scheduler.shift)
    }

    /// Stage 6 set-up: everything the transformer sees besides the latents, built once per
    /// generation. `batch` images share the prompt; `negative` embeddings and `guidance > 1` turn on
    /// classifier-free guidance (base models).
    #[allow(clippy::too_many_arguments)] // each is a stage input, as in diffusers' __call__
    pub fn denoise_context(
        &self,
        batch: usize,
        lat_h: usize,
        lat_w: usize,
        embeds: &PromptEmbeds,
        negative: Option<(&PromptEmbeds, f64)>,
        references: &ReferenceTokens,
        schedule: Schedule,
    ) -> Result<DenoiseContext> {
        let image_tokens = lat_h * lat_w;
        check_token_budget(image_tokens, references.ids.nrows(), references.count)?;
        if let Some(shapes) = &self.manifest.static_shapes {
            if batch != shapes.batch || references.count != shapes.refs {
                return Err(request_error(format!(
                    "this bundle has static shapes (for CoreML): {} image(s) per call with {} reference(s), \
                     not {batch} with {}",
                    shapes.batch, shapes.refs, references.count
                )));
            }
        }
        // [1, L, D] -> [B, L, D]: every image of a prompt shares its embeddings.
        let repeat = |e: &PromptEmbeds| -> Result<Array3<f32>> {
            concatenate(Axis(0), &vec![e.embeds.view(); batch])
                .map_err(|err| internal("prompt embeddings", err))
        };
        let text = repeat(embeds)?;
        let negative = negative
            .map(|(n, g)| repeat(n).map(|t| (t, g as f32)))
            .transpose()?;
        // [h*w + N, 4]: output tokens then reference tokens
        let img_ids = concatenate(
            Axis(0),
            &[
                prepare_latent_ids(lat_h, lat_w).view(),
                references.ids.view(),
            ],
        )
        .map_err(|e| internal("image ids", e))?;
        // [1, N, 128] -> [B, N, 128]
        let ref_tokens = concatenate(Axis(0), &vec![references.tokens.view(); batch])
            .map_err(|e| internal("reference tokens", e))?;
        static CONTEXTS: AtomicU64 = AtomicU64::new(0);
        Ok(DenoiseContext {
            id: CONTEXTS.fetch_add(1, Ordering::Relaxed),
            lat_h,
            lat_w,
            txt_ids: prepare_text_ids(text.dim().1),
            text,
            negative,
            img_ids,
            ref_tokens,
            image_tokens,
            schedule,
        })
    }

    /// Stage 6, one Euler step `step` (0-based) on packed latents `[B, h*w, 128]`, in place.
    pub fn denoise_step(
        &mut self,
        latents: &mut Array3<f32>,
        step: usize,
        ctx: &DenoiseContext,
    ) -> Result<()> {
        self.denoise_step_with(latents, step, ctx, &mut None)
    }

    fn denoise_step_with(
        &mut self,
        latents: &mut Array3<f32>,
        step: usize,
        ctx: &DenoiseContext,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<()> {
        let (batch, image_tokens, _) = latents.dim();
        if image_tokens != ctx.image_tokens
            || batch != ctx.text.dim().0
            || step >= ctx.schedule.num_steps()
        {
            return Err(request_error(format!(
                "step {step} on latents {:?}: the context is for {} images of {} tokens and {} steps",
                latents.dim(),
                ctx.text.dim().0,
                ctx.image_tokens,
                ctx.schedule.num_steps()
            )));
        }
        let m = self.manifest.latents.pixel_multiple as usize;
        self.use_bucket_of_size((ctx.lat_w * m) as u32, (ctx.lat_h * m) as u32)?;
        let graph = self.graph("transformer", progress)?;
        // [B, h*w, 128] ; [B, N, 128] -> [B, h*w + N, 128]
        let input = concatenate(Axis(1), &[latents.view(), ctx.ref_tokens.view()])
            .map_err(|e| internal("latents", e))?;
        let timestep = ndarray::Array1::from_elem(batch, ctx.schedule.transformer_timestep(step)); // [B]
                                                                                                   // The prompt embeddings and ids are bound once per context and prompt (key: context id
                                                                                                   // x 2, + 1 for the negative prompt): on CUDA they stay on the GPU across the steps.
        let mut run = |prompt: &Array3<f32>, key: u64| -> Result<Array3<f32>> {
            let mut out = graph.run_with_constants(
                key,
                &[
                    ("prompt_embeds", TensorInput::from(prompt.view())),
                    ("img_ids", TensorInput::from(ctx.img_ids.view())),
                    ("txt_ids", TensorInput::from(ctx.txt_ids.view())),
                ],
                &[
                    ("latents", TensorInput::from(input.view())),
                    ("timestep", TensorInput::from(timestep.view())),
                ],
            )?;
            let velocity = out
                .take("velocity")?
                .into_dimensionality::<Ix3>()
                .map_err(|e| internal("velocity", e))?;
            // [B, h*w + N, 128] -> [B, h*w, 128]: reference tokens are inputs only
            Ok(velocity.slice_move(s![.., ..image_tokens, ..]))
        };
        let mut velocity = run(&ctx.text, 2 * ctx.id)?;
        if let Some((negative, g)) = &ctx.negative {
            let uncond = run(negative, 2 * ctx.id + 1)?;
            // v = v_neg + g * (v - v_neg)
            velocity.zip_mut_with(&uncond, |v, &n| *v = n + g * (*v - n));
        }
        let dt = ctx.schedule.dt(step);
        latents.zip_mut_with(&velocity, |x, &v| *x += dt * v);
        Ok(())
    }

    /// Stage 6: the Euler flow-matching loop over every step of the context's schedule.
    pub fn denoise(&mut self, latents: Array3<f32>, ctx: &DenoiseContext) -> Result<Array3<f32>> {
        self.denoise_with(latents, ctx, &mut None)
    }

    fn denoise_with(
        &mut self,
        mut latents: Array3<f32>,
        ctx: &DenoiseContext,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<Array3<f32>> {
        let m = self.manifest.latents.pixel_multiple as usize;
        self.use_bucket_of_size((ctx.lat_w * m) as u32, (ctx.lat_h * m) as u32)?;
        self.graph("transformer", progress)?;
        notify(progress, Progress::StageStarted(Stage::Denoise))?;
        let start = Instant::now();
        let total = ctx.schedule.num_steps();
        for step in 0..total {
            self.denoise_step_with(&mut latents, step, ctx, progress)?;
            notify(
                progress,
                Progress::Step {
                    step: step + 1,
                    total,
                },
            )?;
        }
        notify(
            progress,
            Progress::StageFinished(Stage::Denoise, start.elapsed()),
        )?;
        Ok(latents)
    }

    /// Stage 7: packed latents `[B, h*w, 128]` to images.
    pub fn decode(
        &mut self,
        latents: ArrayView3<f32>,
        lat_h: usize,
        lat_w: usize,
    ) -> Result<Vec<RgbImage>> {
        self.decode_with(latents, lat_h, lat_w, &mut None)
    }

    fn decode_with(
        &mut self,
        latents: ArrayView3<f32>,
        lat_h: usize,
        lat_w: usize,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<Vec<RgbImage>> {
        let grid = unpack_latents(latents, lat_h, lat_w)?; // [B, h*w, 128] -> [B, 128, h, w]
        let m = self.manifest.latents.pixel_multiple;
        self.use_bucket_of_size(lat_w as u32 * m, lat_h as u32 * m)?;
        let graph = self.graph("vae_decoder", progress)?;
        notify(progress, Progress::StageStarted(Stage::Decode))?;
        let start = Instant::now();
        let mut out = graph.run(&[("latents", TensorInput::from(grid.view()))])?;
        // [B, 3, 16h, 16w]
        let decoded = out
            .take("image")?
            .into_dimensionality::<Ix4>()
            .map_err(|e| internal("decoded image", e))?;
        let images = to_rgb_images(decoded.view());
        notify(
            progress,
            Progress::StageFinished(Stage::Decode, start.elapsed()),
        )?;
        Ok(images)
    }

    /// Runs every stage for `request`. `progress` may cancel between steps and stages.
    pub fn generate(
        &mut self,
        request: &Request,
        mut progress: Option<&mut dyn FnMut(Progress) -> ControlFlow<()>>,
    ) -> Result<Generation> {
        let mut timings = Timings::new();
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
            let mut callback: Option<Callback<'_>> = Some(&mut on_event);
            self.run_stages(request, &mut callback)?
        };
        Ok(Generation {
            timings,
            ..generation
        })
    }

    fn run_stages(
        &mut self,
        request: &Request,
        progress: &mut Option<Callback<'_>>,
    ) -> Result<Generation> {
        // 1. Check inputs before anything is loaded.
        let model = &self.manifest.model;
        let batch = request.num_images;
        if batch == 0 || batch > MAX_BATCH {
            return Err(request_error(format!(
                "num_images is {batch}: it must be between 1 and {MAX_BATCH}"
            )));
        }
        let steps = request.steps.unwrap_or(model.default_steps as usize);
        if steps == 0 {
            return Err(request_error(
                "steps is 0: at least 1 denoising step is needed".to_string(),
            ));
        }
        let guidance = request.guidance.unwrap_or(model.default_guidance);
        if !guidance.is_finite() || guidance < 0.0 {
            return Err(request_error(format!(
                "guidance {guidance} must be a finite number >= 0"
            )));
        }
        // As diffusers: guidance applies to base (non-distilled) models only, when above 1.
        let cfg = !model.is_distilled && guidance > 1.0;
        let (width, height) = self.output_size(request)?;
        let m = self.manifest.latents.pixel_multiple;
        let (lat_h, lat_w) = ((height / m) as usize, (width / m) as usize);
        let ref_tokens: usize = request
            .references
            .iter()
            .map(|r| (r.width / m * (r.height / m)) as usize)
            .sum();
        check_token_budget(lat_h * lat_w, ref_tokens, request.references.len())?;
        if let Some(shapes) = &self.manifest.static_shapes {
            let sizes: Vec<(u32, u32)> = request
                .references
                .iter()
                .map(|r| (r.width, r.height))
                .collect();
            let index = shapes
                .bucket_for_request(width, height, &sizes)
                .map_err(request_error)?;
            self.switch_bucket(index);
        }
        let noise = match &request.initial_latents {
            Some(latents) => {
                let want = (batch, self.manifest.latents.channels, lat_h, lat_w);
                if latents.dim() != want {
                    return Err(request_error(format!(
                        "initial latents have shape {:?}, expected {want:?}",
                        latents.dim()
                    )));
                }
                latents.clone()
            }
            None => self.prepare_latents(request.seed, batch, width, height),
        };
        if let Some(given) = &request.prompt_embeds {
            let want = (
                1,
                self.manifest.tokenizer.max_sequence_length,
                self.manifest.text_encoder.embed_dim,
            );
            if given.embeds.dim() != want {
                return Err(request_error(format!(
                    "prompt embeddings have shape {:?}, expected {want:?} (from Pipeline::encode_prompt of this bundle)",
                    given.embeds.dim()
                )));
            }
        }

        // 2. Prompt (and the empty negative prompt for guidance), then free the text encoder.
        let encoded;
        let embeds = match &request.prompt_embeds {
            Some(given) => given,
            None => {
                encoded = self.encode_prompt_with(&request.prompt, progress)?;
                &encoded
            }
        };
        let negative = if cfg {
            Some(self.encode_prompt_with("", progress)?)
        } else {
            None
        };
        if !self.keep_text_encoder {
            self.release_text_encoder();
        }

        // 3. References.
        let references = if request.references.is_empty() {
            ReferenceTokens {
                tokens: Array3::zeros((1, 0, self.manifest.latents.channels)),
                ids: Array2::zeros((0, 4)),
                count: 0,
            }
        } else {
            self.encode_references_with(&request.references, progress)?
        };

        // 4-6. Latents, schedule, denoising.
        let schedule = self.schedule(steps, lat_h, lat_w)?;
        let negative = negative.as_ref().map(|n| (n, guidance));
        // Static graphs take one image per call: image i denoises row i of the batch's noise,
        // as it would in one batched call.
        let chunk = match &self.manifest.static_shapes {
            Some(shapes) => shapes.batch,
            None => batch,
        };
        let mut images = Vec::with_capacity(batch);
        for first in (0..batch).step_by(chunk) {
            let rows = s![first..(first + chunk).min(batch), .., .., ..];
            let ctx = self.denoise_context(
                noise.slice(rows).dim().0,
                lat_h,
                lat_w,
                embeds,
                negative,
                &references,
                schedule.clone(),
            )?;
            let packed = pack_latents(noise.slice(rows)); // [B, 128, h, w] -> [B, h*w, 128]
            let latents = self.denoise_with(packed, &ctx, progress)?;

            // 7. Decode.
            images.extend(self.decode_with(latents.view(), lat_h, lat_w, progress)?);
        }
        Ok(Generation {
            images,
            width,
            height,
            steps,
            guidance,
            seed: request.seed,
            prompt_truncated: embeds.truncated,
            timings: Timings::new(),
        })
    }
}

/// Output plus reference tokens must fit in one transformer call ([`MAX_IMAGE_TOKENS`]).
fn check_token_budget(
    output_tokens: usize,
    reference_tokens: usize,
    references: usize,
) -> Result<()> {
    let total = output_tokens + reference_tokens;
    if total > MAX_IMAGE_TOKENS {
        return Err(request_error(format!(
            "{total} image tokens ({output_tokens} for the output + {reference_tokens} for {references} reference(s)): \
             at most {MAX_IMAGE_TOKENS} fit; use fewer or smaller references or a smaller output"
        )));
    }
    Ok(())
}

fn internal(what: &str, error: impl std::fmt::Display) -> KleinError {
    KleinError::Inference {
        stage: "pipeline",
        message: format!("{what}: {error}"),
    }
}
