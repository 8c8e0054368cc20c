//! Tensors in and out of a graph: element types, the inputs klein gives (converted to what the
//! graph takes) and the outputs it reads back as `f32`.
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use half::{bf16, f16};
use ndarray::{ArrayD, ArrayView, ArrayViewD, CowArray, Dimension, IxDyn};
use ort::session::SessionOutputs;
use ort::value::{DynValue, DynValueRef, Outlet, Tensor, TensorElementType, TensorRef, ValueType};
use serde::{Deserialize, Serialize};

use super::library::error_chain;
use crate::error::{KleinError, Result};

/// Element type of a graph input or output, with the names the manifest uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dtype {
    /// 32-bit float.
    Float32,
    /// IEEE half precision.
    Float16,
    /// bfloat16.
    Bfloat16,
    /// 64-bit float.
    Float64,
    /// 64-bit signed integer.
    Int64,
    /// 32-bit signed integer.
    Int32,
    /// 8-bit signed integer.
    Int8,
    /// 8-bit unsigned integer.
    Uint8,
    /// Boolean.
    Bool,
}

impl Dtype {
    /// The name used in the manifest (`float32`, `int64`...).
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Float32 => "float32",
            Dtype::Float16 => "float16",
            Dtype::Bfloat16 => "bfloat16",
            Dtype::Float64 => "float64",
            Dtype::Int64 => "int64",
            Dtype::Int32 => "int32",
            Dtype::Int8 => "int8",
            Dtype::Uint8 => "uint8",
            Dtype::Bool => "bool",
        }
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Name, element type and shape of one graph input or output, as ONNX Runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Element type, `None` for a type the bundle contract never uses (or a non-tensor).
    pub dtype: Option<Dtype>,
    /// Human-readable type, e.g. `float32` or `Sequence<Tensor<f32>>`.
    pub type_name: String,
    /// Dimensions; `None` for a dynamic one.
    pub shape: Vec<Option<u64>>,
}

impl TensorInfo {
    pub(super) fn from_outlet(outlet: &Outlet) -> Self {
        let name = outlet.name().to_string();
        match outlet.dtype() {
            ValueType::Tensor { ty, shape, .. } => {
                let dtype = dtype_of(*ty);
                TensorInfo {
                    name,
                    dtype,
                    type_name: dtype
                        .map_or_else(|| format!("tensor({ty})"), |d| d.as_str().to_string()),
                    shape: shape.iter().map(|&d| u64::try_from(d).ok()).collect(),
                }
            }
            other => TensorInfo {
                name,
                dtype: None,
                type_name: other.to_string(),
                shape: Vec::new(),
            },
        }
    }

    /// The shape as `[a, ?, c]` (`?` for a dynamic dimension).
    pub fn shape_string(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .map(|d| d.map_or("?".to_string(), |d| d.to_string()))
            .collect();
        format!("[{}]", dims.join(", "))
    }
}

fn dtype_of(ty: TensorElementType) -> Option<Dtype> {
    Some(match ty {
        TensorElementType::Float32 => Dtype::Float32,
        TensorElementType::Float16 => Dtype::Float16,
        TensorElementType::Bfloat16 => Dtype::Bfloat16,
        TensorElementType::Float64 => Dtype::Float64,
        TensorElementType::Int64 => Dtype::Int64,
        TensorElementType::Int32 => Dtype::Int32,
        TensorElementType::Int8 => Dtype::Int8,
        TensorElementType::Uint8 => Dtype::Uint8,
        TensorElementType::Bool => Dtype::Bool,
        _ => return None,
    })
}

/// One input of [`super::Graph::run`]: a borrowed `f32` or `i64` array of any shape. An `f32` input is
/// converted when the graph takes `float16` or `bfloat16`.
#[derive(Debug, Clone)]
pub enum TensorInput<'a> {
    /// Floating-point data.
    F32(ArrayViewD<'a, f32>),
    /// Integer data (token ids, masks, position ids).
    I64(ArrayViewD<'a, i64>),
}

impl TensorInput<'_> {
    pub(super) fn dtype(&self) -> Dtype {
        match self {
            TensorInput::F32(_) => Dtype::Float32,
            TensorInput::I64(_) => Dtype::Int64,
        }
    }
}

impl<'a, D: Dimension> From<ArrayView<'a, f32, D>> for TensorInput<'a> {
    fn from(view: ArrayView<'a, f32, D>) -> Self {
        TensorInput::F32(view.into_dyn())
    }
}

impl<'a, D: Dimension> From<ArrayView<'a, i64, D>> for TensorInput<'a> {
    fn from(view: ArrayView<'a, i64, D>) -> Self {
        TensorInput::I64(view.into_dyn())
    }
}

/// An input in the element type and memory layout ONNX Runtime needs.
pub(super) enum PreparedInput<'a> {
    F32(CowArray<'a, f32, IxDyn>),
    I64(CowArray<'a, i64, IxDyn>),
    F16(ArrayD<f16>),
    Bf16(ArrayD<bf16>),
}

impl PreparedInput<'_> {
    /// An ONNX Runtime tensor viewing this data.
    pub(super) fn tensor(&self, stage: &'static str, path: &Path) -> Result<DynValueRef<'_>> {
        let made = match self {
            PreparedInput::F32(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::I64(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::F16(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::Bf16(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
        };
        made.map_err(|e| run_error(stage, path, &e))
    }

    /// An ONNX Runtime tensor owning this data. `IoBinding::bind_input` clones a tensor that
    /// borrows its data, and in ort 2.0.0-rc.15 that clone deadlocks (it takes a lock it already
    /// holds); an owned tensor is bound as it is.
    pub(super) fn into_owned_tensor(self, stage: &'static str, path: &Path) -> Result<DynValue> {
        let made = match self {
            PreparedInput::F32(a) => Tensor::from_array(a.into_owned()).map(|t| t.into_dyn()),
            PreparedInput::I64(a) => Tensor::from_array(a.into_owned()).map(|t| t.into_dyn()),
            PreparedInput::F16(a) => Tensor::from_array(a).map(|t| t.into_dyn()),
            PreparedInput::Bf16(a) => Tensor::from_array(a).map(|t| t.into_dyn()),
        };
        made.map_err(|e| run_error(stage, path, &e))
    }
}

pub(super) fn run_error(stage: &'static str, path: &Path, e: &ort::Error) -> KleinError {
    KleinError::Inference {
        stage,
        message: format!("running {}: {}", path.display(), error_chain(e)),
    }
}

/// Every output of a run, converted to `f32`.
pub(super) fn extract_outputs(
    stage: &'static str,
    results: &SessionOutputs<'_>,
) -> Result<Outputs> {
    let fail = |message: String| KleinError::Inference { stage, message };
    let mut values = Vec::with_capacity(results.len());
    for (name, value) in results.iter() {
        let extract_error =
            |e: ort::Error| fail(format!("reading output `{name}`: {}", error_chain(&e)));
        let array = match value.dtype() {
            ValueType::Tensor {
                ty: TensorElementType::Float32,
                ..
            } => value
                .try_extract_array::<f32>()
                .map_err(extract_error)?
                .to_owned(),
            ValueType::Tensor {
                ty: TensorElementType::Float16,
                ..
            } => value
                .try_extract_array::<f16>()
                .map_err(extract_error)?
                .mapv(f32::from),
            ValueType::Tensor {
                ty: TensorElementType::Bfloat16,
                ..
            } => value
                .try_extract_array::<bf16>()
                .map_err(extract_error)?
                .mapv(f32::from),
            other => {
                return Err(fail(format!(
                    "output `{name}` is {other}; klein reads float32/float16/bfloat16 outputs only"
                )))
            }
        };
        values.push((name.to_string(), array));
    }
    Ok(Outputs { stage, values })
}

/// The outputs of one [`super::Graph::run`], converted to owned `f32` arrays.
#[derive(Debug)]
pub struct Outputs {
    stage: &'static str,
    values: Vec<(String, ArrayD<f32>)>,
}

impl Outputs {
    /// Removes and returns the output called `name`.
    pub fn take(&mut self, name: &str) -> Result<ArrayD<f32>> {
        match self.values.iter().position(|(n, _)| n == name) {
            Some(i) => Ok(self.values.swap_remove(i).1),
            None => Err(KleinError::Inference {
                stage: self.stage,
                message: format!(
                    "no output `{name}` (outputs left: {})",
                    self.values
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }
    }
}

/// The names of `tensors`, comma-separated, for messages.
pub fn tensor_names(tensors: &[TensorInfo]) -> String {
    tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A graph initializer replaced before ONNX Runtime optimises the graph (how LoRAs are merged
/// without rewriting the bundle). The replacement is made in the graph itself, not at session
/// state (ONNX Runtime's `AddInitializer`): its constant folding of the fp16 graphs' weight casts
/// reads the graph and would ignore a later replacement.
pub struct Initializer {
    name: String,
    kind: Replacement,
}

enum Replacement {
    /// New raw bytes at `offset` of the graph file: an initializer stored in the file itself.
    InFile { offset: u64, bytes: Vec<u8> },
    /// An initializer stored as external data (ONNX Runtime's `AddExternalInitializers`).
    External(Arc<DynValue>),
}

impl fmt::Debug for Initializer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Initializer")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// The element data of an [`Initializer`].
pub enum InitializerData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    Bf16(Vec<bf16>),
}

impl Initializer {
    /// The initializer `name` whose raw data is stored at `offset` of the graph file itself,
    /// replaced by `bytes` (exactly as many, little-endian).
    pub fn in_file(name: &str, offset: u64, bytes: Vec<u8>) -> Initializer {
        Initializer {
            name: name.to_string(),
            kind: Replacement::InFile { offset, bytes },
        }
    }

    /// The initializer `name`, stored as external data, replaced by `data` of `shape` (row-major).
    pub fn external(name: &str, shape: &[usize], data: InitializerData) -> Result<Initializer> {
        let shape: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
        let value = match data {
            InitializerData::F32(v) => Tensor::from_array((shape, v)).map(|t| t.into_dyn()),
            InitializerData::F16(v) => Tensor::from_array((shape, v)).map(|t| t.into_dyn()),
            InitializerData::Bf16(v) => Tensor::from_array((shape, v)).map(|t| t.into_dyn()),
        }
        .map_err(|e| KleinError::Inference {
            stage: "lora",
            message: format!("initializer {name}: {}", error_chain(&e)),
        })?;
        Ok(Initializer {
            name: name.to_string(),
            kind: Replacement::External(Arc::new(value)),
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The external-data value, for `AddExternalInitializers`.
    pub(super) fn external_value(&self) -> Option<Arc<DynValue>> {
        match &self.kind {
            Replacement::External(value) => Some(Arc::clone(value)),
            Replacement::InFile { .. } => None,
        }
    }

    /// Writes in-file replacements into `graph` (the graph file's bytes).
    pub(super) fn patch(&self, graph: &mut [u8]) -> std::result::Result<(), String> {
        let Replacement::InFile { offset, bytes } = &self.kind else {
            return Ok(());
        };
        let start = usize::try_from(*offset).map_err(|e| e.to_string())?;
        let end = start.checked_add(bytes.len()).filter(|&e| e <= graph.len());
        match end {
            Some(end) => {
                graph[start..end].copy_from_slice(bytes);
                Ok(())
            }
            None => Err(format!(
                "initializer {}: bytes {start}+{} are past the end of the graph ({} bytes)",
                self.name,
                bytes.len(),
                graph.len()
            )),
        }
    }

    pub(super) fn is_in_file(&self) -> bool {
        matches!(self.kind, Replacement::InFile { .. })
    }
}
