//! The I/O contract: a loaded graph is checked against its [`GraphSpec`] in the manifest (tensor
//! names, element types, ranks and fixed sizes) and its `klein.*` metadata (component, format
//! version, precision, quantization), before it runs.
use std::collections::BTreeMap;
use std::path::Path;

use super::component::Component;
use super::manifest::{
    supported_versions, DimSpec, GraphSpec, TensorSpec, SUPPORTED_FORMAT_VERSIONS,
};
use crate::error::{KleinError, Result};
use crate::runtime::{tensor_names, Graph, TensorInfo};

/// Metadata key naming the component a graph implements (`text_encoder`, `transformer`, ...).
pub const META_COMPONENT: &str = "klein.component";
/// Metadata key holding the graph's weight precision (`fp32`, `fp16`, `bf16`).
pub const META_PRECISION: &str = "klein.precision";
/// Metadata key holding the quantization scheme (`none`, or the scheme as JSON).
pub const META_QUANTIZATION: &str = "klein.quantization";
/// Metadata key holding the bundle format version the graph was exported for.
pub const META_FORMAT_VERSION: &str = "klein.format_version";

/// Checks a loaded graph of `component` against its spec: I/O first, then metadata.
pub fn check_graph(component: Component, spec: &GraphSpec, graph: &Graph) -> Result<()> {
    check_io(spec, graph)?;
    spec.check_metadata(component.as_str(), graph.metadata(), graph.path())
}

/// Checks the graph's inputs and outputs against the manifest's I/O contract: the same names,
/// element types and ranks, and equal sizes where both sides fix a dimension. Every mismatch is
/// reported, naming the graph, the tensor, what was expected and what was found.
pub fn check_io(declared: &GraphSpec, graph: &Graph) -> Result<()> {
    let mut problems = Vec::new();
    compare_tensors("input", &declared.inputs, graph.inputs(), &mut problems);
    compare_tensors("output", &declared.outputs, graph.outputs(), &mut problems);
    if problems.is_empty() {
        Ok(())
    } else {
        Err(KleinError::Bundle {
            path: graph.path().to_path_buf(),
            reason: format!(
                "the {} graph does not match manifest.json: {}",
                graph.name(),
                problems.join("; ")
            ),
        })
    }
}

impl GraphSpec {
    /// Checks the `klein.*` metadata of the loaded graph file `path` against this spec:
    /// `klein.component` must be `component`, `klein.format_version` a supported version, and
    /// `klein.precision` / `klein.quantization` must agree with the manifest.
    pub fn check_metadata(
        &self,
        component: &str,
        metadata: &BTreeMap<String, String>,
        path: &Path,
    ) -> Result<()> {
        let bundle_error = |reason: String| KleinError::Bundle {
            path: path.to_path_buf(),
            reason,
        };
        let get = |key: &str| {
            metadata.get(key).ok_or_else(|| {
                bundle_error(format!(
                    "graph has no `{key}` metadata; it was not written by klein-export (expected the `{component}` graph)"
                ))
            })
        };
        let found = get(META_COMPONENT)?;
        if found != component {
            return Err(bundle_error(format!(
                "{META_COMPONENT} is `{found}`, expected `{component}` (graph files swapped?)"
            )));
        }
        let version = get(META_FORMAT_VERSION)?;
        if !SUPPORTED_FORMAT_VERSIONS
            .iter()
            .any(|v| v.to_string() == *version)
        {
            return Err(bundle_error(format!(
                "{META_FORMAT_VERSION} is `{version}`; this runtime reads format version {}",
                supported_versions()
            )));
        }
        let precision = get(META_PRECISION)?;
        if precision != self.precision.as_str() {
            return Err(bundle_error(format!(
                "{META_PRECISION} is `{precision}`, manifest.json says `{}`",
                self.precision
            )));
        }
        let quantization = get(META_QUANTIZATION)?;
        let graph_quantized = quantization != "none";
        if graph_quantized != self.quantization.is_some() {
            let declared = self
                .quantization
                .as_ref()
                .map_or("none".to_string(), |q| q.method.clone());
            return Err(bundle_error(format!(
                "{META_QUANTIZATION} is `{quantization}`, manifest.json says `{declared}`"
            )));
        }
        Ok(())
    }
}

/// Appends to `problems` every difference between the declared and the actual tensors of a graph.
fn compare_tensors(
    kind: &str,
    declared: &[TensorSpec],
    actual: &[TensorInfo],
    problems: &mut Vec<String>,
) {
    for spec in declared {
        let Some(found) = actual.iter().find(|t| t.name == spec.name) else {
            problems.push(format!(
                "{kind} `{}` is in manifest.json but not in the graph (graph {kind}s: {})",
                spec.name,
                tensor_names(actual)
            ));
            continue;
        };
        if found.dtype != Some(spec.dtype) {
            problems.push(format!(
                "{kind} `{}`: expected {}, found {}",
                spec.name, spec.dtype, found.type_name
            ));
        }
        let expected_shape = format!(
            "[{}]",
            spec.shape
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        if found.shape.len() != spec.shape.len() {
            problems.push(format!(
                "{kind} `{}`: expected shape {expected_shape} (rank {}), found {} (rank {})",
                spec.name,
                spec.shape.len(),
                found.shape_string(),
                found.shape.len()
            ));
            continue;
        }
        for (axis, (want, got)) in spec.shape.iter().zip(&found.shape).enumerate() {
            if let (DimSpec::Fixed(want), Some(got)) = (want, got) {
                if want != got {
                    problems.push(format!(
                        "{kind} `{}` dimension {axis}: expected {want} (shape {expected_shape}), found {got} (shape {})",
                        spec.name,
                        found.shape_string()
                    ));
                }
            }
        }
    }
    for tensor in actual {
        if !declared.iter().any(|spec| spec.name == tensor.name) {
            problems.push(format!(
                "{kind} `{}` ({}) is in the graph but not in manifest.json",
                tensor.name, tensor.type_name
            ));
        }
    }
}
