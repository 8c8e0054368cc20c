//! Integration tests of the klein library, one module per stage (one test binary, as ripgrep does).
//!
//! The ONNX Runtime tests need the library: run `scripts/setup-ort.sh` once (it fills `.ort/`), or
//! set `ORT_DYLIB_PATH`.

mod avx2_host;
mod batch;
mod bundle;
mod cancel;
mod capi;
mod cli;
mod cpu_cache;
mod decode;
mod devices;
mod diffusers;
mod fuzz_regressions;
mod fuzz_targets;
mod heap_tunables;
mod layers;
mod limits;
mod lora;
mod manifest;
mod outputs;
mod previews;
mod prompt_cache;
mod runtime;
mod sessions;
mod setup;
mod spec;
mod threads;
mod tokenize;
mod util;
