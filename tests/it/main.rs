//! Integration tests of the klein library, one module per stage (one test binary, as ripgrep does).
//!
//! The ONNX Runtime tests need the library: run `scripts/setup-ort.sh` once (it fills `.ort/`), or
//! set `ORT_DYLIB_PATH`.

mod bundle;
mod diffusers;
mod manifest;
mod runtime;
mod tokenize;
mod util;
