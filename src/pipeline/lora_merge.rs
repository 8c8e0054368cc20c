//! LoRAs merged into the transformer's weights, handed to ONNX Runtime so that it owns them as it
//! owns the bundle's own weights (and frees them once prepacked):
//! - weights stored in the `.onnx` itself are patched into the graph's bytes (the runtime then
//!   creates the session from memory);
//! - weights in external data are written, merged, to `lora.data` in a scratch directory, next to
//!   a copy of the graph whose moved initializers point there and hard links to the bundle's own
//!   external-data files (ONNX Runtime refuses external data outside the graph's directory, even
//!   through a symbolic link); the session is created from that copy and the directory removed.
//!   The scratch directory is in the cache directory, else inside the bundle (a hard link needs
//!   the bundle's file system).
//!
//! Where neither can be made, the merged external weights are given through ONNX Runtime's
//! `AddExternalInitializers`, which costs one more copy of them in memory for the session's life.
use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use half::{bf16, f16};
use ndarray::ArrayViewMut2;
use rayon::prelude::*;

use crate::bundle::lora_targets::{LoraTarget, WeightDtype, WeightLayout};
use crate::error::{KleinError, Result};
use crate::fsutil::{remove_stale, WorkDir};
use crate::runtime::onnx_proto::redirect_initializers;
use crate::runtime::{Initializer, InitializerData};
use crate::stages::lora::Update;

/// Offsets in `lora.data` are multiples of this, so that ONNX Runtime can map them (64 KiB: the
/// allocation granularity of Windows, a multiple of every page size).
const ALIGN: u64 = 64 * 1024;
/// The merged external weights' file in the scratch directory.
const LORA_DATA: &str = "lora.data";
/// Scratch directories are `.klein-lora-<pid>-<n>` (hidden: one may be inside a bundle).
const SCRATCH_PREFIX: &str = ".klein-lora-";

/// One LoRA's update of a weight: the update, the user's scale, and the LoRA file (for messages).
pub(crate) type Contribution<'a> = (&'a Update, f32, &'a Path);

/// The transformer graph to load with the LoRAs merged.
pub(crate) struct MergedGraph {
    /// The graph file to load: the bundle's, or the rewritten copy in the scratch directory.
    pub path: PathBuf,
    /// Initializers the runtime replaces (patched bytes; injected external weights).
    pub initializers: Vec<Initializer>,
    /// Removed when the graph is dropped, after the session is created.
    _scratch: Option<WorkDir>,
}

/// The transformer graph of the bundle at `dir` with `by_module` merged in; `scratch_root` holds
/// the scratch directory while the session is created.
pub(crate) fn merge(
    by_module: BTreeMap<&str, Vec<Contribution<'_>>>,
    targets: &BTreeMap<String, LoraTarget>,
    dir: &Path,
    graph_file: &str,
    scratch_root: &Path,
) -> Result<MergedGraph> {
    let graph_path = dir.join(graph_file);
    let touched: Vec<(&LoraTarget, Vec<Contribution<'_>>)> = by_module
        .into_iter()
        .map(|(module, updates)| {
            targets
                .get(module)
                .map(|t| (t, updates))
                .ok_or_else(|| KleinError::Inference {
                    stage: "lora",
                    message: format!("{module} is not in the bundle's LoRA map"),
                })
        })
        .collect::<Result<_>>()?;
    let (inline, external): (Vec<_>, Vec<_>) =
        touched.into_iter().partition(|(t, _)| t.file == graph_file);
    let mut initializers: Vec<Initializer> = inline
        .par_iter()
        .map(|(t, updates)| {
            merged(dir, t, updates)
                .map(|bytes| Initializer::in_file(&t.initializer, t.offset, bytes))
        })
        .collect::<Result<_>>()?;
    if external.is_empty() {
        return Ok(MergedGraph {
            path: graph_path,
            initializers,
            _scratch: None,
        });
    }
    match redirect(&external, dir, &graph_path, scratch_root)? {
        Some((path, scratch)) => Ok(MergedGraph {
            path,
            initializers,
            _scratch: Some(scratch),
        }),
        None => {
            let injected: Vec<Initializer> = external
                .par_iter()
                .map(|(t, updates)| inject(t, merged(dir, t, updates)?))
                .collect::<Result<_>>()?;
            initializers.extend(injected);
            Ok(MergedGraph {
                path: graph_path,
                initializers,
                _scratch: None,
            })
        }
    }
}

/// Writes the merged `external` weights to `lora.data` in a new scratch directory with a copy of
/// the graph that reads them there; `None` when the bundle's external-data files cannot be linked
/// into it.
fn redirect(
    external: &[(&LoraTarget, Vec<Contribution<'_>>)],
    dir: &Path,
    graph_path: &Path,
    scratch_root: &Path,
) -> Result<Option<(PathBuf, WorkDir)>> {
    let graph = std::fs::read(graph_path)
        .map_err(io(graph_path, "reading the graph to merge a LoRA into"))?;
    let mut moved = BTreeMap::new();
    let mut end = 0u64;
    for (t, _) in external {
        moved.insert(t.initializer.clone(), (end, t.bytes));
        end = (end + t.bytes).div_ceil(ALIGN) * ALIGN;
    }
    let (rewritten, others) =
        redirect_initializers(&graph, &moved, LORA_DATA).map_err(|reason| KleinError::Bundle {
            path: graph_path.to_path_buf(),
            reason,
        })?;
    // ONNX Runtime refuses external data outside the graph's directory (symbolic links are
    // resolved), so the bundle's files are hard-linked: in the cache directory when it is on the
    // bundle's file system, else in a hidden directory inside the bundle.
    let Some(scratch) = [scratch_root, dir]
        .into_iter()
        .find_map(|root| linked_scratch(root, dir, &others))
    else {
        return Ok(None);
    };
    let scratch_dir = scratch.path().to_path_buf();
    let data_path = scratch_dir.join(LORA_DATA);
    let data = File::create(&data_path).map_err(io(&data_path, "writing merged LoRA weights"))?;
    data.set_len(end)
        .map_err(io(&data_path, "writing merged LoRA weights"))?;
    // Each weight is merged and written at its offset, then dropped: two in memory at a time.
    external.par_iter().try_for_each(|(t, updates)| {
        let bytes = merged(dir, t, updates)?;
        let offset = moved[&t.initializer].0;
        write_at(&data_path, offset, &bytes).map_err(io(&data_path, "writing merged LoRA weights"))
    })?;
    let copy = scratch_dir.join(graph_path.file_name().unwrap_or_default());
    std::fs::write(&copy, rewritten)
        .map_err(io(&copy, "writing the graph with merged LoRA weights"))?;
    Ok(Some((copy, scratch)))
}

/// A new scratch directory in `root` holding hard links to `files` of the bundle at `dir`;
/// `None` when it cannot be made (read-only, or another file system than the bundle's).
fn linked_scratch(root: &Path, dir: &Path, files: &BTreeSet<String>) -> Option<WorkDir> {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    remove_stale(root, |name| name.starts_with(SCRATCH_PREFIX));
    let scratch = WorkDir::create(root.join(format!(
        "{SCRATCH_PREFIX}{}-{}",
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    )))
    .ok()?;
    for file in files {
        std::fs::hard_link(dir.join(file), scratch.path().join(file)).ok()?;
    }
    Some(scratch)
}

/// An I/O error on `path` while doing `action`.
fn io(path: &Path, action: &'static str) -> impl FnOnce(std::io::Error) -> KleinError {
    let path = path.to_path_buf();
    move |source| KleinError::Io {
        path,
        action,
        source,
    }
}

/// `bytes` written at `offset` of the file at `path` (its own handle: workers write in parallel).
fn write_at(path: &Path, offset: u64, bytes: &[u8]) -> std::io::Result<()> {
    let mut file = std::fs::OpenOptions::new().write(true).open(path)?;
    file.seek(SeekFrom::Start(offset))?;
    file.write_all(bytes)
}

/// A merged external weight for `AddExternalInitializers`.
fn inject(target: &LoraTarget, bytes: Vec<u8>) -> Result<Initializer> {
    let data = match target.dtype {
        WeightDtype::Float32 => InitializerData::F32(
            bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        ),
        WeightDtype::Float16 => InitializerData::F16(
            bytes
                .chunks_exact(2)
                .map(|b| f16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
        WeightDtype::Bfloat16 => InitializerData::Bf16(
            bytes
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]))
                .collect(),
        ),
    };
    Initializer::external(&target.initializer, &stored_shape(target), data)
}

/// The initializer's dimensions: `[out, in]` or `[in, out]`.
fn stored_shape(target: &LoraTarget) -> [usize; 2] {
    let [out, inp] = target.shape;
    match target.layout {
        WeightLayout::OutIn => [out, inp],
        WeightLayout::InOut => [inp, out],
    }
}

/// `target`'s weight from the bundle plus every update's delta, as the initializer's raw
/// little-endian bytes (its dtype and layout).
fn merged(dir: &Path, target: &LoraTarget, updates: &[Contribution<'_>]) -> Result<Vec<u8>> {
    let path = dir.join(&target.file);
    let io = |source| KleinError::Io {
        path: path.clone(),
        action: "reading a weight to merge a LoRA into",
        source,
    };
    let mut file = File::open(&path).map_err(io)?;
    file.seek(SeekFrom::Start(target.offset)).map_err(io)?;
    let shape = stored_shape(target);
    let count = shape[0] * shape[1];
    let mut values = vec![0f32; count];
    match target.dtype {
        WeightDtype::Float32 => {
            file.read_exact(bytemuck::cast_slice_mut(&mut values))
                .map_err(io)?;
            for v in &mut values {
                *v = f32::from_bits(u32::from_le(v.to_bits()));
            }
        }
        WeightDtype::Float16 | WeightDtype::Bfloat16 => {
            let mut halves = vec![0u16; count];
            file.read_exact(bytemuck::cast_slice_mut(&mut halves))
                .map_err(io)?;
            let bf = target.dtype == WeightDtype::Bfloat16;
            for (v, h) in values.iter_mut().zip(halves) {
                let h = u16::from_le(h);
                *v = if bf {
                    bf16::from_bits(h).to_f32()
                } else {
                    f16::from_bits(h).to_f32()
                };
            }
        }
    }
    let mut weight =
        ArrayViewMut2::from_shape(shape, &mut values).map_err(|e| KleinError::Inference {
            stage: "lora",
            message: format!("{}: {e}", target.initializer),
        })?;
    let transposed = target.layout == WeightLayout::InOut;
    for (update, scale, _) in updates {
        update.add_to(weight.view_mut(), *scale, transposed);
    }
    // A sum past the weights' type would run as infinities and NaNs (a black image, no error).
    let stored_finite = |v: f32| match target.dtype {
        WeightDtype::Float32 => v.is_finite(),
        WeightDtype::Float16 => f16::from_f32(v).is_finite(),
        WeightDtype::Bfloat16 => bf16::from_f32(v).is_finite(),
    };
    if let Some(v) = values.iter().find(|&&v| !stored_finite(v)) {
        return Err(overflow(target, updates, *v));
    }
    Ok(match target.dtype {
        WeightDtype::Float32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        WeightDtype::Float16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        WeightDtype::Bfloat16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
    })
}

/// The error for a merged weight that `value` (infinite, NaN, or past the weights' type) leaves
/// unusable: it names the LoRA files that changed it and what would help.
fn overflow(target: &LoraTarget, updates: &[Contribution<'_>], value: f32) -> KleinError {
    // The first update's file, whose key is named; the others that changed the weight after.
    let (update, _, first) = updates[0];
    let others: BTreeSet<&Path> = updates
        .iter()
        .map(|(_, _, file)| *file)
        .filter(|file| file != &first)
        .collect();
    let others: Vec<String> = others.iter().map(|f| f.display().to_string()).collect();
    let path = first.to_path_buf();
    KleinError::Lora {
        path,
        reason: format!(
            "merged into {} (`{}` in the file{}), the weight holds {value}, which the bundle's {} \
             weights cannot hold: the factors or their alpha are too large for this model; lower \
             the LoRA's scale or use another file",
            update.module,
            update.source,
            if others.is_empty() {
                String::new()
            } else {
                format!(", with {}", others.join(", "))
            },
            target.dtype.name(),
        ),
    }
}
