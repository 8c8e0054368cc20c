//! LoRAs on a bundle: the files a pipeline applies ([`LoraSpec`]), read and checked against the
//! bundle's `lora_targets` (`LoraSet::load`: every module must be a linear layer of this
//! transformer, of the same shape), and merged into the transformer's weights when its session is
//! created (`LoraSet::initializers`): `W + sum(scale * delta)` per touched layer, handed to ONNX
//! Runtime in place of the graph's initializer. Untouched layers are read from the bundle as usual,
//! and no other graph is reloaded when the LoRAs change.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::lora_merge::{self, Contribution, MergedGraph};
use crate::bundle::lora_targets::LoraTarget;
use crate::bundle::manifest::Precision;
use crate::bundle::support::DYNAMIC;
use crate::bundle::Manifest;
use crate::error::{KleinError, Result};
use crate::limits::{MAX_LORAS, MAX_LORA_SCALE};
use crate::stages::lora::{first_names, read_lora, LoraFamily, LoraFile, LoraFormat};

/// A LoRA file and the scale it is applied with (`delta * scale`; negative or above 1 allowed).
#[derive(Debug, Clone, PartialEq)]
pub struct LoraSpec {
    path: PathBuf,
    scale: f32,
}

impl LoraSpec {
    pub fn new(path: impl Into<PathBuf>, scale: f32) -> LoraSpec {
        LoraSpec {
            path: path.into(),
            scale,
        }
    }

    /// `FILE` (scale 1) or `FILE:SCALE`, as the CLI's `--lora` takes it. A path that itself ends
    /// in `:<number>` can be given as `FILE:<number>:1`.
    pub fn parse(text: &str) -> LoraSpec {
        if let Some((path, scale)) = text.rsplit_once(':') {
            if let Ok(scale) = scale.parse::<f32>() {
                if !path.is_empty() {
                    return LoraSpec::new(path, scale);
                }
            }
        }
        LoraSpec::new(text, 1.0)
    }

    /// [`LoraSpec::parse`] for a command line's argument, whose file name may not be UTF-8:
    /// split on its bytes at the last `:` when what follows is a number.
    pub fn parse_os(text: &std::ffi::OsStr) -> LoraSpec {
        if let Some(text) = text.to_str() {
            return LoraSpec::parse(text);
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let bytes = text.as_bytes();
            if let Some(colon) = bytes.iter().rposition(|&b| b == b':').filter(|&i| i > 0) {
                let scale = std::str::from_utf8(&bytes[colon + 1..]).ok();
                if let Some(scale) = scale.and_then(|s| s.parse::<f32>().ok()) {
                    return LoraSpec::new(std::ffi::OsStr::from_bytes(&bytes[..colon]), scale);
                }
            }
        }
        LoraSpec::new(text, 1.0)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The scale is finite and within [`MAX_LORA_SCALE`] (checked before the file is read).
    pub fn check(&self) -> Result<()> {
        if !self.scale.is_finite() || self.scale.abs() > MAX_LORA_SCALE {
            return Err(KleinError::request_about(
                "loras",
                format!(
                    "LoRA {}: scale {} must be between -{MAX_LORA_SCALE} and {MAX_LORA_SCALE}",
                    self.path.display(),
                    self.scale
                ),
            ));
        }
        Ok(())
    }
}

/// Checks a list of LoRAs without reading them: how many, and their scales.
pub fn check_specs(specs: &[LoraSpec]) -> Result<()> {
    if specs.len() > MAX_LORAS {
        return Err(KleinError::request_about(
            "loras",
            format!(
                "{} LoRAs; at most {MAX_LORAS} can be applied at once",
                specs.len()
            ),
        ));
    }
    specs.iter().try_for_each(LoraSpec::check)
}

/// What `specs` would change in the bundle at `dir` (read and checked as
/// [`crate::pipeline::Pipeline::set_loras`] does), without loading any graph.
pub fn inspect(specs: &[LoraSpec], manifest: &Manifest, dir: &Path) -> Result<Vec<LoraSummary>> {
    Ok(LoraSet::load(specs, manifest, dir)?.summaries())
}

/// What one LoRA changes, as `klein info --lora` lists it.
#[derive(Debug, Clone)]
pub struct LoraSummary {
    pub path: PathBuf,
    pub format: LoraFormat,
    pub scale: f32,
    pub modules: Vec<ModuleSummary>,
}

/// One layer a LoRA changes.
#[derive(Debug, Clone)]
pub struct ModuleSummary {
    /// diffusers' module name (`transformer_blocks.0.attn.to_q`).
    pub module: String,
    /// The key prefix in the file it comes from.
    pub source: String,
    /// LoRA rank (`None`: LoKr).
    pub rank: Option<usize>,
    /// The file's own scaling (alpha / rank, metadata); the LoRA's scale multiplies it.
    pub file_scale: f32,
    /// `[out, in]`.
    pub shape: (usize, usize),
}

/// LoRAs read and checked against one bundle.
#[derive(Debug, Clone, Default)]
pub(crate) struct LoraSet {
    adapters: Vec<(LoraSpec, LoraFile)>,
}

impl LoraSet {
    /// Reads `specs` and checks each against the bundle: a transformer it can merge into (not
    /// quantized, not static-shape, with a LoRA map), every module one of its linear layers,
    /// every delta of that layer's shape.
    pub fn load(specs: &[LoraSpec], manifest: &Manifest, dir: &Path) -> Result<LoraSet> {
        check_specs(specs)?;
        let mut adapters = Vec::with_capacity(specs.len());
        for spec in specs {
            let targets = targets(manifest, dir, spec.path())?;
            let file = read_lora(spec.path(), lora_family(manifest))?;
            check_fit(&file, targets)?;
            check_range(&file, spec.scale, targets)?;
            adapters.push((spec.clone(), file));
        }
        Ok(LoraSet { adapters })
    }

    pub fn is_empty(&self) -> bool {
        self.adapters.is_empty()
    }

    pub fn specs(&self) -> Vec<LoraSpec> {
        self.adapters.iter().map(|(spec, _)| spec.clone()).collect()
    }

    pub fn summaries(&self) -> Vec<LoraSummary> {
        self.adapters
            .iter()
            .map(|(spec, file)| LoraSummary {
                path: spec.path.clone(),
                format: file.format,
                scale: spec.scale,
                modules: file
                    .updates
                    .iter()
                    .map(|u| ModuleSummary {
                        module: u.module.clone(),
                        source: u.source.clone(),
                        rank: u.factors.rank(),
                        file_scale: u.scale,
                        shape: u.shape(),
                    })
                    .collect(),
            })
            .collect()
    }

    /// The transformer graph with every LoRA of non-zero scale merged ([`lora_merge`]); `None`
    /// when there is none (the bundle's graph loads as it is). `scratch_root` holds merged
    /// external weights while the session is created.
    pub fn merged_graph(
        &self,
        manifest: &Manifest,
        dir: &Path,
        scratch_root: &Path,
    ) -> Result<Option<MergedGraph>> {
        let mut by_module: BTreeMap<&str, Vec<Contribution<'_>>> = BTreeMap::new();
        for (spec, file) in &self.adapters {
            if spec.scale == 0.0 {
                continue;
            }
            for update in &file.updates {
                by_module
                    .entry(update.module.as_str())
                    .or_default()
                    .push((update, spec.scale, &file.path));
            }
        }
        if by_module.is_empty() {
            return Ok(None);
        }
        let empty = BTreeMap::new();
        let targets = manifest
            .graphs
            .transformer
            .lora_targets
            .as_ref()
            .unwrap_or(&empty);
        lora_merge::merge(
            by_module,
            targets,
            dir,
            &manifest.graphs.transformer.file,
            scratch_root,
        )
        .map(Some)
    }
}

/// The model family LoRA files are read for.
fn lora_family(manifest: &Manifest) -> LoraFamily {
    match manifest.model.family {
        crate::bundle::ModelFamily::Flux2 => LoraFamily::Flux2,
        crate::bundle::ModelFamily::Flux3 => LoraFamily::Flux3,
    }
}

/// The bundle's LoRA map, or why LoRAs cannot be merged into it at load time.
fn targets<'m>(
    manifest: &'m Manifest,
    dir: &Path,
    lora: &Path,
) -> Result<&'m BTreeMap<String, LoraTarget>> {
    let export = format!(
        "merge the LoRA when exporting: klein-export convert --checkpoint CKPT --lora {}:SCALE{} ...",
        lora.display(),
        export_flags(manifest)
    );
    let refuse = |why: String| KleinError::Lora {
        path: lora.to_path_buf(),
        reason: format!("bundle {}: {why}", dir.display()),
    };
    let spec = &manifest.graphs.transformer;
    if let Some(q) = &spec.quantization {
        return Err(refuse(format!(
            "its transformer is quantized ({} bits) and klein merges LoRAs into float weights only; {export}",
            q.bits
        )));
    }
    if manifest.static_shapes.is_some() {
        return Err(refuse(format!(
            "a static-shape bundle (for CoreML) takes no LoRA at load time; {export}"
        )));
    }
    spec.lora_targets.as_ref().ok_or_else(|| {
        refuse(format!(
            "it has no LoRA map (exported before klein read LoRAs): add one with `klein-export lora-map \
             --checkpoint CKPT --bundle {}` (no re-export), or {export}",
            dir.display()
        ))
    })
}

/// The `klein-export convert` flags that make a bundle like this one again (precision and the
/// transformer's quantization), each with a leading space; nothing for an fp32 float bundle.
fn export_flags(manifest: &Manifest) -> String {
    let spec = &manifest.graphs.transformer;
    let mut flags = String::new();
    if spec.precision != Precision::Fp32 {
        flags += &format!(" --precision {}", spec.precision);
    }
    if let Some(q) = &spec.quantization {
        flags += &format!(" --quantize int{}", q.bits);
        if q.method == DYNAMIC {
            flags += " --method dynamic";
        } else {
            if let Some(block) = q.block_size.filter(|&b| b != 32) {
                flags += &format!(" --block-size {block}");
            }
            if q.symmetric == Some(false) {
                flags += " --asymmetric";
            }
            if let Some(level) = q.accuracy_level.filter(|&l| l > 0) {
                flags += &format!(" --accuracy-level {level}");
            }
        }
        if q.reduce_range {
            flags += " --reduce-range";
        }
    }
    flags
}

/// Every update of `file`, at `scale`, changes its layer's weights by less than half of what their
/// precision holds (float16: 65504), from a bound on the factors: a delta past it would merge into
/// infinities (a black image). Checked when the LoRA is set; the merge checks the sums again.
fn check_range(file: &LoraFile, scale: f32, targets: &BTreeMap<String, LoraTarget>) -> Result<()> {
    for update in &file.updates {
        let dtype = targets[&update.module].dtype;
        let limit = dtype.max_value() / 2.0;
        let bound = update.delta_bound(scale);
        if bound.is_nan() || bound > limit {
            return Err(KleinError::Lora {
                path: file.path.clone(),
                reason: format!(
                    "`{}` at scale {scale} changes {} by up to {bound:.2e}, which the bundle's {} weights \
                     cannot hold (at most {limit:.2e} here): the factors or their alpha are too large for \
                     this model; lower the LoRA's scale or use another file",
                    update.source,
                    update.module,
                    dtype.name()
                ),
            });
        }
    }
    Ok(())
}

/// Every update of `file` names a layer of `targets`, with its shape.
fn check_fit(file: &LoraFile, targets: &BTreeMap<String, LoraTarget>) -> Result<()> {
    let fail = |reason: String| KleinError::Lora {
        path: file.path.clone(),
        reason,
    };
    let unknown: Vec<String> = file
        .updates
        .iter()
        .filter(|u| !targets.contains_key(&u.module))
        .map(|u| format!("{} (from `{}`)", u.module, u.source))
        .collect();
    if !unknown.is_empty() {
        let names: Vec<&str> = unknown.iter().map(String::as_str).collect();
        let example = targets
            .iter()
            .next()
            .map(|(m, t)| format!("{m} [{}, {}]", t.shape[0], t.shape[1]))
            .unwrap_or_default();
        return Err(fail(format!(
            "{} modules of this {} are not linear layers of the bundle's transformer: {}; the bundle has {} \
             (e.g. {example}): a LoRA for another model",
            unknown.len(),
            file.format,
            first_names(&names),
            targets.len()
        )));
    }
    let mismatched: Vec<String> = file
        .updates
        .iter()
        .filter_map(|u| {
            let [out, inp] = targets[&u.module].shape;
            (u.shape() != (out, inp)).then(|| {
                let (o, i) = u.shape();
                format!(
                    "{} is [{out}, {inp}], `{}` gives [{o}, {i}]",
                    u.module, u.source
                )
            })
        })
        .collect();
    if !mismatched.is_empty() {
        let names: Vec<&str> = mismatched.iter().map(String::as_str).collect();
        let layers = match mismatched.len() {
            1 => "1 layer does".to_string(),
            n => format!("{n} layers do"),
        };
        return Err(fail(format!(
            "{layers} not have the shape this {} was trained for: {}: a LoRA for another size of the \
             model (klein 4B has hidden size 3072, 9B 4096)",
            file.format,
            first_names(&names)
        )));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn file_and_scale_split_at_the_last_colon_whatever_the_name() {
        let spec = LoraSpec::parse("dir:x/style.safetensors:-0.5");
        assert_eq!(
            (spec.path(), spec.scale()),
            (Path::new("dir:x/style.safetensors"), -0.5)
        );
        let spec = LoraSpec::parse("style.safetensors:strong");
        assert_eq!(
            (spec.path(), spec.scale()),
            (Path::new("style.safetensors:strong"), 1.0)
        );
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let odd = std::ffi::OsStr::from_bytes(b"/tmp/\xfe.safetensors:0.25");
            let spec = LoraSpec::parse_os(odd);
            assert_eq!(spec.path().as_os_str().as_bytes(), b"/tmp/\xfe.safetensors");
            assert_eq!(spec.scale(), 0.25);
            let whole = std::ffi::OsStr::from_bytes(b"/tmp/\xfe.safetensors");
            assert_eq!(LoraSpec::parse_os(whole).path().as_os_str(), whole);
        }
    }
}
