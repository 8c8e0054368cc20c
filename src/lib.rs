//! klein: a portable runtime for the FLUX.2-klein image models on ONNX Runtime.
//!
//! The pipeline follows diffusers' `Flux2KleinPipeline` stage by stage. The crate is layered, each
//! layer using only those above it in this list:
//! - [`error`], [`limits`], [`fsutil`]: errors, every bound on user-given numbers, file helpers;
//! - [`stages`]: the pure stages (tokenizer, noise, latents, schedule, references, output);
//! - [`runtime`]: ONNX Runtime (the only module that uses `ort`);
//! - [`bundle`]: the bundle on disk (manifest, graph contract, hashes, buckets, device support);
//! - [`pipeline`]: the stages run on a bundle's graphs;
//! - [`capi`]: the C API.
#![warn(clippy::unwrap_used)]
// `unsafe` is denied but where a module or function allows it for itself: the C API (`capi`),
// the libjpeg binding, and the system calls of `runtime` and `fsutil::touch`.
#![deny(unsafe_code)]

#[cfg(feature = "api")]
pub mod api;
pub mod bundle;
pub mod capi;
pub mod error;
pub mod fsutil;
pub mod limits;
pub mod pipeline;
pub mod runtime;
pub mod stages;

pub use error::{KleinError, Result};
/// The `image` crate whose `RgbImage` the decoding functions and [`pipeline::Pipeline::crop_to_mask`]
/// take and return, so that callers need not match its version.
pub use image;
