//! Every bound on a number a user, a file or a manifest gives, in one place. Each is checked
//! before anything is allocated or loaded for it ([`crate::pipeline::request`] for requests and
//! load options, [`crate::stages::reference`] for image headers, [`crate::bundle::manifest`] for
//! manifests), and each error names the bound. The "Limits" table of docs/pipelines.md lists them.
//!
//! An output is bounded twice: each side by [`MAX_SIDE`], and its area by the token budget
//! ([`MAX_IMAGE_TOKENS`], one token per 16x16 pixels, shared with the references): 2288x2288,
//! 4096x1280 or 1024x1024 plus four 1024x1024 references fit; 2304x2304 does not.

/// Smallest output side in pixels: one 16x16 latent patch (a bundle's own multiple, 16 for
/// FLUX.2, is checked again once the manifest is read).
pub const MIN_SIDE: u32 = 16;
/// Largest output side in pixels. The transformer's attention is quadratic in the token count;
/// 4096x4096 is already 65,536 image tokens.
pub const MAX_SIDE: u32 = 4096;
/// Largest number of image tokens (output + references) one transformer call may see: the output
/// at 1 megapixel (4096 tokens) plus four 1-megapixel references.
pub const MAX_IMAGE_TOKENS: usize = 5 * 4096;
/// FLUX.3 Image Klein's: a single reference is kept up to a 4-megapixel canvas and the output
/// defaults to that canvas (32,768 tokens), and up to ten references of 1 megapixel each go with
/// a 1-megapixel output (45,056), as diffusers' FLUX.3 pipelines allow.
pub const FLUX3_MAX_IMAGE_TOKENS: usize = 11 * 4096;
/// FLUX.3's single-reference canvas (`reference_canvas`): at most 4 megapixels, each side 64 to
/// 4096 pixels.
pub const FLUX3_MAX_CANVAS_AREA: u64 = 4 * 1024 * 1024;
pub const FLUX3_MAX_CANVAS_SIDE: u32 = 4096;
pub const FLUX3_MIN_CANVAS_SIDE: u32 = 64;
/// FLUX.3's text window: prompts are padded to a multiple of this many tokens
/// (`Flux3TextEncoderStep`), up to [`MAX_SEQUENCE_LENGTH`].
pub const FLUX3_PAD_MULTIPLE: usize = 80;
/// Largest batch (`num_images`) in one call.
pub const MAX_BATCH: usize = 16;
/// Largest number of denoising steps. Base models use about 50; diffusers' scheduler is trained on
/// 1000 timesteps, and beyond that the empirical shift leaves its fitted range.
pub const MAX_STEPS: usize = 1000;
/// Largest guidance scale (base models use 3.5-5; diffusers puts no bound, but past this the
/// velocity only overflows).
pub const MAX_GUIDANCE: f64 = 100.0;
/// Largest number of reference images in one request (diffusers' FLUX.2 pipelines document up to
/// 10; the token budget bounds them too).
pub const MAX_REFERENCES: usize = 10;
/// Largest prompt, in bytes of UTF-8 (the tokenizer keeps 512 tokens, about 2 KB of English; a
/// longer prompt is truncated as diffusers does, but is tokenized whole first).
pub const MAX_PROMPT_BYTES: usize = 64 * 1024;
/// Most threads inside one operator. ONNX Runtime starts them all when a session is created.
pub const MAX_THREADS: usize = 1024;
/// Largest `--prompts` file, in bytes, and most lines in it.
pub const MAX_BATCH_FILE_BYTES: u64 = 64 * 1024 * 1024;
pub const MAX_BATCH_LINES: usize = 100_000;
/// Most LoRAs applied at once, and the largest scale of one (either sign). Merged LoRAs add up;
/// past this the weights are no longer the model's.
pub const MAX_LORAS: usize = 16;
pub const MAX_LORA_SCALE: f32 = 100.0;
/// Largest LoRA file read into memory: a rank-128 LoRA on every linear layer of the 9B is about
/// 1 GB in fp32; a full fine-tune's difference is not a LoRA.
pub const MAX_LORA_FILE_BYTES: u64 = 4 * 1024 * 1024 * 1024;

/// Largest size limit of a prompt cache directory, in MiB (16 TiB): more is no limit at all.
pub const MAX_PROMPT_CACHE_MIB: u64 = 16 * 1024 * 1024;
/// Largest size limit of a CPU cache directory, in GiB (16 TiB).
pub const MAX_CPU_CACHE_GIB: u64 = 16 * 1024;

/// Largest width or height of a reference file this runtime decodes, to refuse decompression
/// bombs before allocating.
pub const MAX_DECODE_SIDE: u32 = 16384;
/// Largest decoded reference pixel buffer, in bytes (512 MiB, the image crate's default); also
/// libjpeg's working memory (the coefficients of a progressive JPEG).
pub const MAX_DECODE_BYTES: u64 = 512 * 1024 * 1024;
/// Largest reference file read into memory: no file klein decodes within [`MAX_DECODE_BYTES`] of
/// pixels needs more.
pub const MAX_DECODE_FILE_BYTES: u64 = MAX_DECODE_BYTES;

/// Largest `tokenizer.max_sequence_length` a manifest may give (FLUX.2-klein uses 512): every
/// prompt is padded to it, the text encoder's attention mask is its square, and the transformer
/// attends over it beside the image tokens.
pub const MAX_SEQUENCE_LENGTH: usize = 8192;

/// Largest `references.time_offset_scale` (in size) a manifest may give: reference `i` gets time
/// coordinate `scale * (i + 1)`, and there are at most `MAX_IMAGE_TOKENS` references (one token
/// each), so the coordinates fit in the int64 position ids.
pub const MAX_TIME_OFFSET_SCALE: u64 = i64::MAX as u64 / (MAX_IMAGE_TOKENS as u64 + 1);
