//! LoRA files, read as diffusers 0.42.1's `Flux2LoraLoaderMixin.lora_state_dict` reads them, for
//! the transformer (diffusers' Flux2 loader has no text-encoder LoRA); for FLUX.3 Image Klein as
//! `Flux3LoraLoaderMixin.lora_state_dict` does (diffusers/PEFT and BFL names only, `keys/flux3.rs`):
//! - PEFT / diffusers: `transformer.<module>.lora_A.weight` and `lora_B`, optional adapter metadata
//!   (`lora_adapter_metadata`: rank, alpha, rank and alpha patterns, rsLoRA); PEFT's own
//!   `base_model.model.` prefix;
//! - BFL / ai-toolkit: `diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight` (fused QKV split
//!   into Q, K and V), or `diffusion_model.` + diffusers module names;
//! - kohya: `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, `lora_up`, `.alpha`;
//! - LoKr (`lokr_w1`, `lokr_w1_a/b`, `lokr_w2`, `lokr_w2_a/b`, `.alpha`) in the BFL, LyCORIS
//!   (`lycoris_transformer_blocks_0_attn_to_q.lokr_w1`), bare (`<module>.lokr_w1`) and diffusers
//!   (`transformer.<module>.lokr_w1`) layouts.
//!
//! A file becomes [`Update`]s in diffusers' module names; `Update::delta_rows` gives the weight
//! delta `scale * B A` (LoRA) or `scale * kron(w1, w2)` (LoKr). What diffusers ignores with a warning
//! (keys it cannot place, text-encoder keys, DoRA magnitudes) is refused here: a LoRA that loads
//! "successfully" and changes nothing, or changes less than it should, is worse than an error.
use std::io::Read;
use std::ops::Range;
use std::path::{Path, PathBuf};

use ndarray::linalg::general_mat_mul;
use ndarray::{s, Array2, ArrayViewMut2};
use safetensors::{Dtype, SafeTensors};

use crate::error::{KleinError, Result, READING_LORA};
use crate::limits::MAX_LORA_FILE_BYTES;

mod config;
mod keys;

pub(crate) use keys::first_names;
pub use keys::LoraFormat;

/// The model a LoRA is read for: diffusers' loaders differ (`Flux2LoraLoaderMixin`,
/// `Flux3LoraLoaderMixin`), and so do the layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFamily {
    /// FLUX.2-klein.
    Flux2,
    /// FLUX.3 Image Klein.
    Flux3,
}

/// A LoRA file, converted to diffusers' module names.
#[derive(Debug, Clone)]
pub struct LoraFile {
    pub path: PathBuf,
    pub format: LoraFormat,
    pub updates: Vec<Update>,
}

/// The change of one linear layer.
#[derive(Debug, Clone)]
pub struct Update {
    /// The target module (diffusers' name under the transformer, `transformer_blocks.0.attn.to_q`).
    pub module: String,
    /// The key prefix in the file, for messages.
    pub source: String,
    pub factors: Factors,
    /// The rows of the factors' delta that are this module's: all of them, or one block of a fused
    /// projection (LoKr on a fused QKV, which cannot be split into factors per block).
    pub rows: Range<usize>,
    /// The file's own scaling (alpha / rank, adapter metadata); the user's scale multiplies it.
    pub scale: f32,
}

/// The low-rank factors of an update.
#[derive(Debug, Clone)]
pub enum Factors {
    /// `delta = up . down`: up `[out, r]`, down `[r, in]`.
    Lora { up: Array2<f32>, down: Array2<f32> },
    /// `delta = kron(w1, w2)`: w1 `[a, b]`, w2 `[c, d]`, delta `[a*c, b*d]` (factors stored as
    /// products `w_a . w_b` are multiplied out when read).
    Lokr { w1: Array2<f32>, w2: Array2<f32> },
}

impl Factors {
    /// `[out, in]` of the delta.
    pub fn shape(&self) -> (usize, usize) {
        match self {
            Factors::Lora { up, down } => (up.nrows(), down.ncols()),
            Factors::Lokr { w1, w2 } => (w1.nrows() * w2.nrows(), w1.ncols() * w2.ncols()),
        }
    }

    /// The LoRA rank (`None` for LoKr).
    pub fn rank(&self) -> Option<usize> {
        match self {
            Factors::Lora { down, .. } => Some(down.nrows()),
            Factors::Lokr { .. } => None,
        }
    }
}

impl Update {
    /// `[out, in]` of this module's delta.
    pub fn shape(&self) -> (usize, usize) {
        (self.rows.len(), self.factors.shape().1)
    }

    /// Adds `scale * delta` to `weight` in place: `weight` is `[out, in]`, or `[in, out]` when
    /// `transposed` (a MatMul weight). LoRA factors are multiplied straight into the weight
    /// (`W += s * up . down`, or `W += s * down^T . up^T`), with no delta matrix in between.
    pub fn add_to(&self, mut weight: ArrayViewMut2<'_, f32>, scale: f32, transposed: bool) {
        match &self.factors {
            Factors::Lora { up, down } => {
                let scale = scale * self.scale;
                let up = up.slice(s![self.rows.clone(), ..]);
                if transposed {
                    // [in, r] . [r, rows] into [in, rows]
                    general_mat_mul(scale, &down.t(), &up.t(), 1.0, &mut weight);
                } else {
                    // [rows, r] . [r, in] into [rows, in]
                    general_mat_mul(scale, &up, down, 1.0, &mut weight);
                }
            }
            Factors::Lokr { .. } => {
                let delta = self.delta(scale);
                if transposed {
                    weight += &delta.t();
                } else {
                    weight += &delta;
                }
            }
        }
    }

    /// An upper bound of `|scale * delta|`'s entries, from the factors alone (no weight read):
    /// `rank x max|up| x max|down|` (LoRA) or `max|w1| x max|w2|` (LoKr), times the scales.
    pub fn delta_bound(&self, scale: f32) -> f64 {
        let max = |a: &Array2<f32>| a.iter().fold(0f64, |m, &v| m.max(f64::from(v.abs())));
        let factors = match &self.factors {
            Factors::Lora { up, down } => down.nrows() as f64 * max(up) * max(down),
            Factors::Lokr { w1, w2 } => max(w1) * max(w2),
        };
        factors * f64::from(self.scale).abs() * f64::from(scale).abs()
    }

    /// `scale * delta` of this module: `[out, in]`.
    pub fn delta(&self, scale: f32) -> Array2<f32> {
        let scale = scale * self.scale;
        match &self.factors {
            // [rows, r] . [r, in] -> [rows, in]
            Factors::Lora { up, down } => {
                let up = up.slice(s![self.rows.clone(), ..]).mapv(|v| v * scale);
                up.dot(down)
            }
            Factors::Lokr { w1, w2 } => {
                let (c, d) = w2.dim();
                let mut out = Array2::<f32>::zeros((self.rows.len(), w1.ncols() * d));
                // kron row i = w1[i / c, :] (x) w2[i % c, :], at column j1 * d + j2
                for (r, i) in self.rows.clone().enumerate() {
                    let (a_row, b_row) = (w1.row(i / c), w2.row(i % c));
                    let mut row = out.row_mut(r);
                    for (j1, &a) in a_row.iter().enumerate() {
                        for (j2, &b) in b_row.iter().enumerate() {
                            row[j1 * d + j2] = a * b * scale;
                        }
                    }
                }
                out
            }
        }
    }
}

/// Where `path` is missing but is `FILE:TEXT` with an existing `FILE` (`--lora x.safetensors:O.8`,
/// a scale that is no number), what to say instead of "no such file".
fn mistyped_scale(path: &Path, error: &std::io::Error) -> Option<String> {
    let (file, scale) = path.to_str()?.rsplit_once(':')?;
    // A LoRA directory ([`lora_in_directory`]) takes a scale as a file does.
    let (what, given) = match Path::new(file) {
        f if f.is_file() => ("one", "FILE:SCALE"),
        f if f.is_dir() => ("a LoRA directory", "DIR:SCALE"),
        _ => return None,
    };
    (error.kind() == std::io::ErrorKind::NotFound && !file.is_empty()).then(|| {
        format!(
            "no such file, and {file} is {what}: \"{scale}\" is not a scale; give {given} \
             with a number, such as {file}:0.8"
        )
    })
}

/// The first `limit + 1` bytes of `path` at most: more than `limit` means the file is over it.
fn read_capped(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(limit + 1)
        .read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The file diffusers' `save_lora_weights` writes into its directory.
pub const DIFFUSERS_LORA_FILE: &str = "pytorch_lora_weights.safetensors";

/// The LoRA file of a directory, as diffusers' `load_lora_weights` picks it: the one
/// `save_lora_weights` writes ([`DIFFUSERS_LORA_FILE`]), else the directory's only `.safetensors`
/// file.
pub fn lora_in_directory(dir: &Path) -> Result<PathBuf> {
    let saved = dir.join(DIFFUSERS_LORA_FILE);
    if saved.is_file() {
        return Ok(saved);
    }
    let entries = std::fs::read_dir(dir).map_err(|source| KleinError::Io {
        path: dir.to_path_buf(),
        action: READING_LORA,
        source,
    })?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    found.sort();
    let fail = |reason: String| KleinError::Lora {
        path: dir.to_path_buf(),
        reason,
    };
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(fail(format!(
            "a directory without {DIFFUSERS_LORA_FILE} or another .safetensors file; give the LoRA file"
        ))),
        _ => {
            let names: Vec<String> = found
                .iter()
                .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
                .collect();
            Err(fail(format!(
                "a directory with several .safetensors files ({}) and no {DIFFUSERS_LORA_FILE}; give one of them",
                names.join(", ")
            )))
        }
    }
}

/// Reads and converts the LoRA file at `path` for a bundle of `family`; a directory gives its LoRA
/// file ([`lora_in_directory`]).
pub fn read_lora(path: &Path, family: LoraFamily) -> Result<LoraFile> {
    let in_directory;
    let path = if path.is_dir() {
        in_directory = lora_in_directory(path)?;
        in_directory.as_path()
    } else {
        path
    };
    let fail = |reason: String| KleinError::Lora {
        path: path.to_path_buf(),
        reason,
    };
    let size = std::fs::metadata(path)
        .map_err(|source| match mistyped_scale(path, &source) {
            Some(reason) => fail(reason),
            None => KleinError::Io {
                path: path.to_path_buf(),
                action: READING_LORA,
                source,
            },
        })?
        .len();
    if size > MAX_LORA_FILE_BYTES {
        return Err(fail(format!(
            "{size} bytes; a LoRA file may have at most {MAX_LORA_FILE_BYTES} bytes"
        )));
    }
    // The size above is 0 for a pipe or a device (`/dev/zero`): the read is bounded too.
    let bytes = read_capped(path, MAX_LORA_FILE_BYTES).map_err(|source| KleinError::Io {
        path: path.to_path_buf(),
        action: READING_LORA,
        source,
    })?;
    if bytes.len() as u64 > MAX_LORA_FILE_BYTES {
        return Err(fail(format!(
            "more than {MAX_LORA_FILE_BYTES} bytes; a LoRA file may have at most {MAX_LORA_FILE_BYTES} bytes"
        )));
    }
    let tensors = SafeTensors::deserialize(&bytes).map_err(|e| {
        fail(format!(
            "not a safetensors file ({e}); klein reads LoRAs saved as .safetensors"
        ))
    })?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| fail(format!("unreadable safetensors header ({e})")))?;
    let adapter_config = match header.metadata() {
        Some(map) => config::AdapterConfig::from_metadata(map).map_err(fail)?,
        None => None,
    };
    let store = Store { tensors };
    let (format, updates) = keys::convert(&store, adapter_config.as_ref(), family).map_err(fail)?;
    if updates.is_empty() {
        return Err(fail("the file holds no LoRA weights".into()));
    }
    Ok(LoraFile {
        path: path.to_path_buf(),
        format,
        updates,
    })
}

/// The tensors of a file, by name.
pub(crate) struct Store<'a> {
    tensors: SafeTensors<'a>,
}

impl Store<'_> {
    pub fn names(&self) -> Vec<&str> {
        let mut names = self.tensors.names();
        names.sort_unstable();
        names
    }

    /// A 2-D tensor as f32 (`[N, M, 1, 1]` convolution-shaped weights taken as `[N, M]`).
    pub fn matrix(&self, name: &str) -> std::result::Result<Array2<f32>, String> {
        let view = self
            .tensors
            .tensor(name)
            .map_err(|_| format!("`{name}` is missing"))?;
        let shape = view.shape();
        let (rows, cols) = match shape {
            [r, c] => (*r, *c),
            [r, c, 1, 1] => (*r, *c),
            _ => {
                return Err(format!(
                    "`{name}` has shape {shape:?}; a linear layer's factor is 2-D"
                ))
            }
        };
        let values = to_f32(view.dtype(), view.data()).map_err(|e| format!("`{name}`: {e}"))?;
        if values.iter().any(|v| !v.is_finite()) {
            return Err(format!("`{name}` holds non-finite values"));
        }
        Array2::from_shape_vec((rows, cols), values).map_err(|e| format!("`{name}`: {e}"))
    }

    /// A one-element tensor (`.alpha`) as f32.
    pub fn scalar(&self, name: &str) -> std::result::Result<f32, String> {
        let view = self
            .tensors
            .tensor(name)
            .map_err(|_| format!("`{name}` is missing"))?;
        let values = to_f32(view.dtype(), view.data()).map_err(|e| format!("`{name}`: {e}"))?;
        match values.as_slice() {
            [v] if v.is_finite() => Ok(*v),
            _ => Err(format!(
                "`{name}` should hold one finite number, has {} values",
                values.len()
            )),
        }
    }
}

/// Little-endian float data as f32.
fn to_f32(dtype: Dtype, data: &[u8]) -> std::result::Result<Vec<f32>, String> {
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => {
            return Err(format!(
                "dtype {other:?}; LoRA weights are F32, F16 or BF16"
            ))
        }
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use ndarray::array;

    /// A device or a pipe has no size to check first: the read itself stops past the bound.
    #[cfg(unix)]
    #[test]
    fn reads_stop_past_the_bound() {
        let bytes = read_capped(Path::new("/dev/zero"), 1000).unwrap();
        assert_eq!(bytes.len(), 1001);
    }

    #[test]
    fn lokr_rows_are_the_kronecker_product() {
        let update = Update {
            module: "b".into(),
            source: "x".into(),
            factors: Factors::Lokr {
                w1: array![[1.0, 2.0], [3.0, 4.0]],
                w2: array![[0.0, 5.0], [6.0, 7.0]],
            },
            rows: 2..4,
            scale: 0.5,
        };
        // rows 2..4 of kron([[1,2],[3,4]], [[0,5],[6,7]]), times 0.5 * 2
        let want = array![[0.0, 15.0, 0.0, 20.0], [18.0, 21.0, 24.0, 28.0]];
        assert_eq!(update.shape(), (2, 4));
        assert_eq!(update.delta(2.0), want);
        let mut transposed = Array2::<f32>::ones((4, 2));
        update.add_to(transposed.view_mut(), 2.0, true);
        assert_eq!(transposed, want.t().mapv(|v| v + 1.0));
    }

    #[test]
    fn lora_delta_is_up_times_down() {
        let update = Update {
            module: "q".into(),
            source: "x".into(),
            factors: Factors::Lora {
                up: array![[1.0], [2.0], [3.0]],
                down: array![[1.0, -1.0]],
            },
            rows: 0..3,
            scale: 1.0,
        };
        assert_eq!(
            update.delta(-1.0),
            array![[-1.0, 1.0], [-2.0, 2.0], [-3.0, 3.0]]
        );
    }
}
