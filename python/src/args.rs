//! The arguments the Python side passes for LoRAs and images, turned into the library's values.
use std::path::PathBuf;

use klein::pipeline::{ImageInput, LoraSpec};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A LoRA as Python gives it: `(path, scale)`, `"FILE"` or `"FILE:SCALE"`, or an `os.PathLike`.
#[derive(FromPyObject)]
pub(crate) enum LoraArg {
    Pair(PathBuf, f32),
    Text(String),
    Path(PathBuf),
}

impl LoraArg {
    pub(crate) fn spec(self) -> LoraSpec {
        match self {
            LoraArg::Pair(path, scale) => LoraSpec::new(path, scale),
            LoraArg::Text(text) => LoraSpec::parse(&text),
            LoraArg::Path(path) => LoraSpec::new(path, 1.0),
        }
    }
}

/// A reference image as the Python side passes it: a path (read by klein, labelled by the string
/// as given) or the bytes of an image file with its label. Paths and labels are the OS's: a file
/// name that is not UTF-8 (`os.fsdecode`'s surrogates) is read as it is.
#[derive(FromPyObject)]
pub(crate) enum ReferenceArg<'py> {
    Encoded(Bound<'py, PyBytes>, PathBuf),
    Path(PathBuf),
}

/// A [`ReferenceArg`] copied out of Python's objects, for use without the GIL.
pub(crate) fn image_input(arg: ReferenceArg<'_>) -> ImageInput {
    match arg {
        ReferenceArg::Encoded(bytes, label) => ImageInput::encoded(bytes.as_bytes(), label),
        ReferenceArg::Path(path) => ImageInput::File(path),
    }
}
