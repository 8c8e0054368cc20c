//! Stage 6: the transformer's inputs besides the latents ([`DenoiseContext`]), one Euler step, and
//! the flow-matching loop.
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use ndarray::{concatenate, s, Array1, Array2, Array3, ArrayD, Axis, Ix3};

use super::inpaint::Blend;
use super::progress::{notify, timed, Progress, ProgressFn, Stage, StepPreview};
use super::prompts::PromptEmbeds;
use super::request::{check_token_budget, no_preview_map};
use super::{internal, Pipeline};
use crate::bundle::kv::{self, kv_shape};
use crate::bundle::Component;
use crate::error::{KleinError, Result};
use crate::runtime::{Outputs, TensorInput};
use crate::stages::latents::{prepare_latent_ids, prepare_text_ids};
use crate::stages::output::RgbImage;
use crate::stages::preview::preview_image;
use crate::stages::schedule::Schedule;

/// Reference tokens `[1, N, 128]` (all references packed, in order) and their ids `[N, 4]`.
#[derive(Debug, Clone)]
pub struct ReferenceTokens {
    pub tokens: Array3<f32>,
    pub ids: Array2<i64>,
    /// How many reference images the tokens come from.
    pub count: usize,
}

impl ReferenceTokens {
    /// No reference: `[1, 0, channels]` tokens and `[0, 4]` ids.
    pub fn none(channels: usize) -> ReferenceTokens {
        ReferenceTokens {
            tokens: Array3::zeros((1, 0, channels)),
            ids: Array2::zeros((0, 4)),
            count: 0,
        }
    }
}

/// What the transformer sees at every step besides the latents ([`Pipeline::denoise_context`]).
#[derive(Debug, Clone)]
pub struct DenoiseContext {
    /// Identifies this context's constant inputs to `Graph::run_with_constants` (clones share
    /// it: they hold the same data).
    id: u64,
    /// `[B, L, D]` prompt embeddings, and the negative ones with the guidance scale.
    text: Array3<f32>,
    negative: Option<(Array3<f32>, f32)>,
    /// `[L, 4]` and `[h*w + N, 4]` position ids (KV bundles: `[h*w, 4]`, the references' in
    /// `ref_ids`).
    txt_ids: Array2<i64>,
    img_ids: Array2<i64>,
    /// `[B, N, 128]` reference tokens, appended after the latents at every step (KV bundles: given
    /// to the first step only, which extracts their K/V).
    ref_tokens: Array3<f32>,
    /// KV bundles: `[N, 4]` the references' position ids.
    ref_ids: Option<Array2<i64>>,
    /// The output's latent grid `(lat_h, lat_w)`, and `image_tokens = lat_h * lat_w`.
    grid: (usize, usize),
    image_tokens: usize,
    /// Static-shape bundles: the bucket of the output's size.
    bucket: Option<usize>,
    schedule: Schedule,
    /// Inpainting: the mask's blend after every step.
    blend: Option<Blend>,
    /// A preview every this many steps (and after the last), of the images from this index of
    /// the batch on.
    previews: Option<(usize, usize)>,
}

impl DenoiseContext {
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    pub(crate) fn with_blend(mut self, blend: Blend) -> Self {
        self.blend = Some(blend);
        self
    }

    /// Previews every `every` steps (and after the last) of the images from `first_image` of
    /// the request's batch on ([`Progress::Preview`]).
    pub fn with_previews(mut self, every: usize, first_image: usize) -> Self {
        self.previews = Some((every.max(1), first_image));
        self
    }
}

impl Pipeline {
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
        check_token_budget(
            self.manifest.model.family.max_image_tokens(),
            image_tokens,
            references.ids.nrows(),
            references.count,
        )?;
        if let Some(shapes) = &self.manifest.static_shapes {
            if batch != shapes.batch || references.count != shapes.refs {
                return Err(KleinError::request(format!(
                    "this bundle has static shapes (for CoreML): {} image(s) per call with {} reference(s), \
                     not {batch} with {}",
                    shapes.batch, shapes.refs, references.count
                )));
            }
        }
        let m = self.manifest.latents.pixel_multiple;
        let bucket = self.bucket_of_size(lat_w as u32 * m, lat_h as u32 * m)?;
        // [1, L, D] -> [B, L, D]: every image of a prompt shares its embeddings.
        let repeat = |e: &PromptEmbeds| -> Result<Array3<f32>> {
            concatenate(Axis(0), &vec![e.embeds.view(); batch])
                .map_err(|err| internal("prompt embeddings", err))
        };
        let text = repeat(embeds)?;
        let negative = negative
            .map(|(n, g)| repeat(n).map(|t| (t, g as f32)))
            .transpose()?;
        // [h*w + N, 4]: output tokens then reference tokens (KV bundles: [h*w, 4] and [N, 4])
        let latent_ids = prepare_latent_ids(lat_h, lat_w);
        // FLUX.3 (and KV bundles) take the references' tokens and ids apart from the output's.
        let apart = self.manifest.model.kv_cache || self.is_flux3();
        let (img_ids, ref_ids) = if apart {
            (latent_ids, Some(references.ids.clone()))
        } else {
            let ids = concatenate(Axis(0), &[latent_ids.view(), references.ids.view()])
                .map_err(|e| internal("image ids", e))?;
            (ids, None)
        };
        // [1, N, 128] -> [B, N, 128]
        let ref_tokens = concatenate(Axis(0), &vec![references.tokens.view(); batch])
            .map_err(|e| internal("reference tokens", e))?;
        static CONTEXTS: AtomicU64 = AtomicU64::new(0);
        Ok(DenoiseContext {
            id: CONTEXTS.fetch_add(1, Ordering::Relaxed),
            txt_ids: prepare_text_ids(text.dim().1),
            text,
            negative,
            img_ids,
            ref_tokens,
            ref_ids,
            grid: (lat_h, lat_w),
            image_tokens,
            bucket,
            schedule,
            blend: None,
            previews: None,
        })
    }

    /// Stage 6, one Euler step `step` (0-based) on packed latents `[B, h*w, 128]`, in place (then,
    /// when inpainting, the mask's blend).
    pub fn denoise_step(
        &mut self,
        latents: &mut Array3<f32>,
        step: usize,
        ctx: &DenoiseContext,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<()> {
        let (batch, image_tokens, _) = latents.dim();
        if image_tokens != ctx.image_tokens
            || batch != ctx.text.dim().0
            || step >= ctx.schedule.num_steps()
        {
            return Err(KleinError::request(format!(
                "step {step} on latents {:?}: the context is for {} images of {} tokens and {} steps",
                latents.dim(),
                ctx.text.dim().0,
                ctx.image_tokens,
                ctx.schedule.num_steps()
            )));
        }
        let mut velocity = self.velocity(latents, step, ctx, &ctx.text, 0, &mut progress)?;
        if let Some((negative, g)) = &ctx.negative {
            let uncond = self.velocity(latents, step, ctx, negative, 1, &mut progress)?;
            // v = v_neg + g * (v - v_neg)
            velocity.zip_mut_with(&uncond, |v, &n| *v = n + g * (*v - n));
        }
        let dt = ctx.schedule.dt(step);
        latents.zip_mut_with(&velocity, |x, &v| *x += dt * v);
        if let Some(blend) = &ctx.blend {
            blend.after_step(latents, step, &ctx.schedule);
        }
        Ok(())
    }

    /// The transformer's velocity `[B, h*w, 128]` at `step` for `prompt` (`branch` 0, or 1 for
    /// the negative prompt). The prompt embeddings and ids are bound once per context, branch and
    /// form (key below): on CUDA they stay on the GPU across the steps.
    ///
    /// KV bundles: the context's first run extracts the references' K/V (kept in
    /// `Pipeline::kv_cache`), every later run takes them instead of the reference tokens; the
    /// references' K/V do not depend on the prompt or the step (they attend to themselves only, at
    /// a fixed timestep), so the negative branch takes the same, and a run that finds no cache
    /// of its context (steps of two contexts interleaved) extracts again with the same result.
    fn velocity(
        &mut self,
        latents: &Array3<f32>,
        step: usize,
        ctx: &DenoiseContext,
        prompt: &Array3<f32>,
        branch: u64,
        progress: &mut Option<&mut ProgressFn<'_>>,
    ) -> Result<Array3<f32>> {
        let (batch, image_tokens, _) = latents.dim();
        let timestep = Array1::from_elem(batch, ctx.schedule.transformer_timestep(step)); // [B]
        if self.is_flux3() {
            return self.flux3_velocity(latents, timestep, step, ctx, prompt, branch, progress);
        }
        let constants = [
            ("prompt_embeds", TensorInput::from(prompt.view())),
            ("img_ids", TensorInput::from(ctx.img_ids.view())),
            ("txt_ids", TensorInput::from(ctx.txt_ids.view())),
        ];
        let Some(ref_ids) = &ctx.ref_ids else {
            let graph = self.graph(Component::Transformer, ctx.bucket, progress)?;
            // [B, h*w, 128] ; [B, N, 128] -> [B, h*w + N, 128]
            let input = concatenate(Axis(1), &[latents.view(), ctx.ref_tokens.view()])
                .map_err(|e| internal("latents", e))?;
            let mut out = graph.run_with_constants(
                4 * ctx.id + branch,
                &constants,
                &[
                    ("latents", TensorInput::from(input.view())),
                    ("timestep", TensorInput::from(timestep.view())),
                ],
            )?;
            // [B, h*w + N, 128] -> [B, h*w, 128]: reference tokens are inputs only
            return Ok(take_velocity(&mut out)?.slice_move(s![.., ..image_tokens, ..]));
        };
        let cache = self.kv_cache.take().filter(|(id, _)| *id == ctx.id);
        let extract = cache.is_none() && ref_ids.nrows() > 0;
        let (layers, width) = kv_shape(&self.manifest.transformer);
        let no_cache = ArrayD::<f32>::zeros(vec![layers, 2, batch, 0, width]);
        // First run: [B, N, 128] tokens, [N, 4] ids and an empty [layers, 2, B, 0, width] cache;
        // later ones: no tokens ([B, 0, 128], [0, 4]) and the cache.
        let (tokens, ids, cached) = if extract {
            (ctx.ref_tokens.view(), ref_ids.view(), no_cache.view())
        } else {
            let cached = cache.as_ref().map_or(no_cache.view(), |(_, kv)| kv.view());
            (
                ctx.ref_tokens.slice(s![.., ..0, ..]),
                ref_ids.slice(s![..0, ..]),
                cached,
            )
        };
        let key = 4 * ctx.id + 2 * u64::from(!extract) + branch;
        let graph = self.graph(Component::Transformer, ctx.bucket, progress)?;
        let mut out = graph.run_with_constants(
            key,
            &[
                &constants[..],
                &[
                    (kv::REF_LATENTS, TensorInput::from(tokens)),
                    (kv::REF_IDS, TensorInput::from(ids)),
                    (kv::CACHED_KV, TensorInput::from(cached)),
                ],
            ]
            .concat(),
            &[
                ("latents", TensorInput::from(latents.view())),
                ("timestep", TensorInput::from(timestep.view())),
            ],
        )?;
        self.kv_cache = if extract {
            Some((ctx.id, out.take(kv::REF_KV)?))
        } else {
            cache
        };
        take_velocity(&mut out)
    }

    /// FLUX.3's transformer: the references as tokens of their own (none: `[B, 0, 128]`), the
    /// text ids of this prompt's window (the negative prompt's may be longer), and for a flow-map
    /// model the timestep this step jumps to (the next one, 0 after the last), as
    /// `Flux3DistilledLoopDenoiser` passes them.
    #[allow(clippy::too_many_arguments)]
    fn flux3_velocity(
        &mut self,
        latents: &Array3<f32>,
        timestep: Array1<f32>,
        step: usize,
        ctx: &DenoiseContext,
        prompt: &Array3<f32>,
        branch: u64,
        progress: &mut Option<&mut ProgressFn<'_>>,
    ) -> Result<Array3<f32>> {
        let txt_ids = prepare_text_ids(prompt.dim().1);
        let no_ids = Array2::<i64>::zeros((0, 4));
        let cond_ids = ctx.ref_ids.as_ref().unwrap_or(&no_ids);
        let constants = [
            ("prompt_embeds", TensorInput::from(prompt.view())),
            ("img_ids", TensorInput::from(ctx.img_ids.view())),
            ("txt_ids", TensorInput::from(txt_ids.view())),
            ("cond_latents", TensorInput::from(ctx.ref_tokens.view())),
            ("cond_ids", TensorInput::from(cond_ids.view())),
        ];
        let next = if step + 1 < ctx.schedule.num_steps() {
            ctx.schedule.transformer_timestep(step + 1)
        } else {
            0.0
        };
        let target = Array1::from_elem(timestep.len(), next);
        let mut feeds = vec![
            ("latents", TensorInput::from(latents.view())),
            ("timestep", TensorInput::from(timestep.view())),
        ];
        if self.manifest.transformer.flow_map {
            feeds.push(("target_timestep", TensorInput::from(target.view())));
        }
        let graph = self.graph(Component::Transformer, ctx.bucket, progress)?;
        let mut out = graph.run_with_constants(4 * ctx.id + branch, &constants, &feeds)?;
        take_velocity(&mut out)
    }

    /// The preview of each image after step `step`, from the latents before (`x_t`) and after it:
    /// the clean-image estimate `x0 = x_t - sigma_t * v`, with `v = (after - x_t) / dt` (which
    /// also holds for inpainting's kept tokens, whose estimate is the source itself).
    fn previews(
        &self,
        mut before: Array3<f32>,
        after: &Array3<f32>,
        step: usize,
        ctx: &DenoiseContext,
    ) -> Result<Vec<RgbImage>> {
        let spec = self
            .manifest
            .preview
            .as_ref()
            .ok_or_else(|| no_preview_map(&self.manifest))?;
        let sigma = ctx.schedule.sigma(step);
        let scale = -sigma / ctx.schedule.dt(step);
        // [B, h*w, 128]: x0 = x_t + (x_next - x_t) * (-sigma / dt)
        before.zip_mut_with(after, |x, &next| *x += (next - *x) * scale);
        let (lat_h, lat_w) = ctx.grid;
        Ok(before
            .outer_iter()
            .map(|tokens| preview_image(tokens, lat_h, lat_w, spec))
            .collect())
    }

    /// Stage 6: the Euler flow-matching loop over every step of the context's schedule.
    pub fn denoise(
        &mut self,
        mut latents: Array3<f32>,
        ctx: &DenoiseContext,
        mut progress: Option<&mut ProgressFn<'_>>,
    ) -> Result<Array3<f32>> {
        self.graph(Component::Transformer, ctx.bucket, &mut progress)?;
        let denoised = timed(&mut progress, Stage::Denoise, |progress| {
            let total = ctx.schedule.num_steps();
            for step in 0..total {
                let preview = ctx
                    .previews
                    .filter(|&(every, _)| (step + 1) % every == 0 || step + 1 == total);
                let before = preview.map(|_| latents.clone());
                self.denoise_step(&mut latents, step, ctx, progress.as_deref_mut())?;
                notify(
                    progress,
                    Progress::Step {
                        step: step + 1,
                        total,
                    },
                )?;
                if let (Some(before), Some((_, first_image))) = (before, preview) {
                    let images = self.previews(before, &latents, step, ctx)?;
                    let event = StepPreview {
                        step: step + 1,
                        total,
                        images,
                        first_image,
                    };
                    notify(progress, Progress::Preview(Arc::new(event)))?;
                }
            }
            Ok(latents)
        });
        if ctx.ref_ids.is_some() && self.manifest.model.kv_cache {
            // The references' K/V are this context's only: the host copy and the bound one go.
            self.kv_cache = None;
            if let Some(graph) = self.graphs.loaded(Component::Transformer) {
                graph.forget_constants();
            }
        }
        denoised
    }
}

/// The transformer's `velocity` output, `[B, tokens, 128]`.
fn take_velocity(out: &mut Outputs) -> Result<Array3<f32>> {
    out.take("velocity")?
        .into_dimensionality::<Ix3>()
        .map_err(|e| internal("velocity", e))
}
