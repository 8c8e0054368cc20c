//! Every bound on a number a user, a file or a manifest gives, in one place. Each is checked
//! before anything is allocated or loaded for it ([`crate::pipeline::request`] for requests,
//! [`crate::stages::reference`] for image headers, [`crate::bundle::manifest`] for manifests),
//! and each error names the bound.

/// Largest output side in pixels. The transformer's attention is quadratic in the token count;
/// 4096x4096 is already 65,536 image tokens.
pub const MAX_SIDE: u32 = 4096;
/// Largest number of image tokens (output + references) one transformer call may see: the output
/// at 1 megapixel (4096 tokens) plus four 1-megapixel references.
pub const MAX_IMAGE_TOKENS: usize = 5 * 4096;
/// Largest batch (`num_images`) in one call.
pub const MAX_BATCH: usize = 16;

/// Largest width or height of a reference file this runtime decodes, to refuse decompression
/// bombs before allocating.
pub const MAX_DECODE_SIDE: u32 = 16384;
/// Largest decoded reference pixel buffer, in bytes (512 MiB, the image crate's default); also
/// libjpeg's working memory (the coefficients of a progressive JPEG).
pub const MAX_DECODE_BYTES: u64 = 512 * 1024 * 1024;
/// Largest reference file read into memory: no file klein decodes within [`MAX_DECODE_BYTES`] of
/// pixels needs more.
pub const MAX_DECODE_FILE_BYTES: u64 = MAX_DECODE_BYTES;

/// Largest `references.time_offset_scale` (in size) a manifest may give: reference `i` gets time
/// coordinate `scale * (i + 1)`, and there are at most `MAX_IMAGE_TOKENS` references (one token
/// each), so the coordinates fit in the int64 position ids.
pub const MAX_TIME_OFFSET_SCALE: u64 = i64::MAX as u64 / (MAX_IMAGE_TOKENS as u64 + 1);
