//! `graphs.transformer.lora_targets`: where each linear layer's weight lives in the bundle, so that
//! the runtime can merge a LoRA into it (written by the exporter's `lora_map.py`, which finds each
//! `nn.Linear` weight among the graph's initializers by content: the exporter renames and
//! transposes them).
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where the weight of one linear layer (diffusers' `[out, in]`) is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LoraTarget {
    /// The graph initializer ONNX Runtime is given the merged weight under.
    pub initializer: String,
    /// How the initializer stores the weight.
    pub layout: WeightLayout,
    /// `[out, in]` of the linear layer.
    pub shape: [usize; 2],
    pub dtype: WeightDtype,
    /// The bundle file holding the initializer's raw little-endian data, at `offset`, `bytes` long.
    pub file: String,
    pub offset: u64,
    pub bytes: u64,
}

/// `lora_targets.*.layout`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightLayout {
    /// `[out, in]`, as torch stores it (Gemm with transB, or MatMul with the weight first).
    OutIn,
    /// `[in, out]`, transposed for MatMul.
    InOut,
}

/// `lora_targets.*.dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    Float32,
    Float16,
    Bfloat16,
}

impl WeightDtype {
    pub fn size(self) -> u64 {
        match self {
            WeightDtype::Float32 => 4,
            WeightDtype::Float16 | WeightDtype::Bfloat16 => 2,
        }
    }

    /// The largest finite value of the type.
    pub fn max_value(self) -> f64 {
        match self {
            WeightDtype::Float32 => f64::from(f32::MAX),
            WeightDtype::Float16 => f64::from(half::f16::MAX),
            WeightDtype::Bfloat16 => f64::from(half::bf16::MAX),
        }
    }

    /// As the manifest spells it.
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::Float32 => "float32",
            WeightDtype::Float16 => "float16",
            WeightDtype::Bfloat16 => "bfloat16",
        }
    }
}

/// What is wrong with `targets`, given the size of each bundle file the manifest lists (empty:
/// nothing).
pub fn problems(
    targets: &BTreeMap<String, LoraTarget>,
    file_size: impl Fn(&str) -> Option<u64>,
) -> Vec<String> {
    let mut problems = Vec::new();
    // A file missing from `files` is said once, with how many targets name it.
    let mut unlisted: BTreeMap<&str, usize> = BTreeMap::new();
    for (module, t) in targets {
        let [out, inp] = t.shape;
        let want = (out as u64)
            .checked_mul(inp as u64)
            .and_then(|n| n.checked_mul(t.dtype.size()));
        if out == 0 || inp == 0 || want != Some(t.bytes) {
            problems.push(format!(
                "lora_targets.{module}: {} bytes for a {out}x{inp} {:?} weight",
                t.bytes, t.dtype
            ));
        }
        match file_size(&t.file) {
            Some(size) if t.offset.checked_add(t.bytes).is_some_and(|end| end <= size) => {}
            Some(size) => problems.push(format!(
                "lora_targets.{module}: bytes {}+{} past the end of {} ({size} bytes)",
                t.offset, t.bytes, t.file
            )),
            None => *unlisted.entry(t.file.as_str()).or_default() += 1,
        }
    }
    for (file, count) in unlisted {
        problems.push(format!(
            "lora_targets: file {file} ({count} target(s)) is not in the bundle's files"
        ));
    }
    problems
}
