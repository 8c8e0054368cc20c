//! klein: a portable runtime for the FLUX.2-klein image models on ONNX Runtime.
//!
//! The pipeline follows diffusers' `Flux2KleinPipeline` stage by stage; each stage lives in its own
//! module. Only [`runtime`] talks to ONNX Runtime.
#![warn(clippy::unwrap_used)]
// `unsafe` lives in `capi` only (the C API), which allows it for itself.
#![deny(unsafe_code)]

pub mod batch;
pub mod buckets;
pub mod capi;
pub mod error;
pub mod latents;
pub mod manifest;
pub mod noise;
pub mod output;
pub mod pipeline;
pub mod prompt_cache;
pub mod reference;
pub mod runtime;
pub mod schedule;
pub mod support;
pub mod tokenize;

pub use error::{KleinError, Result};
