//! The checks [`Manifest::load`] and [`Manifest::from_json_bytes`] make: the format version first,
//! then the fields, the numbers against each other, and the files against the bundle directory.
use super::*;

/// Only the version field, read first so that a manifest from a newer format gets a version error
/// rather than a confusing one about a field that format renamed.
#[derive(Deserialize)]
struct VersionProbe {
    format_version: Option<serde_json::Value>,
}

impl Manifest {
    /// Reads and checks `<bundle_dir>/manifest.json`, then checks that every file it lists exists
    /// with the listed size. Hashes are not checked here: see [`Manifest::verify_hashes`].
    pub fn load(bundle_dir: &Path) -> Result<Manifest> {
        let bundle_error = |path: &Path, reason: String| KleinError::Bundle {
            path: path.to_path_buf(),
            reason,
        };
        if !bundle_dir.is_dir() {
            let reason = if bundle_dir.exists() {
                "is not a directory; pass the bundle directory (the one holding manifest.json)"
                    .to_string()
            } else {
                crate::bundle::installed::missing_hint(bundle_dir)
            };
            return Err(bundle_error(bundle_dir, reason));
        }
        let manifest_path = bundle_dir.join(MANIFEST_FILE);
        let reading = |source| KleinError::Io {
            path: manifest_path.clone(),
            action: "reading the manifest",
            source,
        };
        match std::fs::metadata(&manifest_path) {
            Ok(meta) if meta.is_file() => {}
            Ok(_) => {
                return Err(bundle_error(
                    &manifest_path,
                    "is not a file; a bundle's manifest.json is the JSON file `klein-export convert` writes"
                        .to_string(),
                ))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(bundle_error(
                    bundle_dir,
                    format!("has no {MANIFEST_FILE}; is this a klein bundle written by `klein-export convert`?"),
                ))
            }
            // Permission denied and the like: the system's reason, not "no manifest".
            Err(e) => return Err(reading(e)),
        }
        let bytes = std::fs::read(&manifest_path).map_err(reading)?;
        let manifest = Manifest::from_json_bytes(&bytes, &manifest_path)?;
        manifest.check_files(bundle_dir, &manifest_path)?;
        Ok(manifest)
    }

    /// Parses and checks the text of a `manifest.json` without looking at the bundle's files:
    /// the format version, the schema and the consistency of its numbers. `manifest_path` only
    /// names the manifest in errors. [`Manifest::load`] is this plus the file checks.
    pub fn from_json_bytes(bytes: &[u8], manifest_path: &Path) -> Result<Manifest> {
        let bundle_error = |reason: String| KleinError::Bundle {
            path: manifest_path.to_path_buf(),
            reason,
        };
        // Not an object at all (`[]`): said so, not as serde names the probe's type.
        let value: serde_json::Value = serde_json::from_slice(bytes)
            .map_err(|e| bundle_error(format!("not valid JSON: {e}")))?;
        if !value.is_object() {
            return Err(bundle_error(
                "is not a JSON object; a manifest.json is the object `klein-export convert` writes"
                    .to_string(),
            ));
        }
        let probe: VersionProbe = serde_json::from_value(value)
            .map_err(|e| bundle_error(format!("not valid JSON: {e}")))?;
        let supported = supported_versions();
        match probe.format_version {
            None => {
                return Err(bundle_error(format!(
                    "has no `format_version`; this runtime reads format version {supported}"
                )))
            }
            Some(v)
                if v.as_u64().is_some_and(|v| {
                    SUPPORTED_FORMAT_VERSIONS
                        .iter()
                        .any(|&s| u64::from(s) == v)
                }) => {}
            Some(v) => {
                return Err(bundle_error(format!(
                    "format_version {v} is not supported; this runtime reads format version {supported}. \
                     Use a klein release that reads it, or re-export the bundle with a matching klein-export"
                )))
            }
        }

        let manifest: Manifest = serde_json::from_slice(bytes).map_err(|e| {
            bundle_error(format!("does not match the format version 1 schema: {e}"))
        })?;
        manifest.check_consistency().map_err(bundle_error)?;
        Ok(manifest)
    }

    /// Refuses an ONNX Runtime library older than the bundle's `min_onnxruntime_version` (its
    /// graphs may use operators or attributes that release lacks; it would fail later, or worse,
    /// run them differently). `bundle_dir` names the bundle in the error.
    pub fn check_runtime(&self, runtime: &RuntimeInfo, bundle_dir: &Path) -> Result<()> {
        let needed = self.min_onnxruntime_version;
        let Some(version) = runtime.version.filter(|&version| version < needed) else {
            return Ok(()); // new enough, or a build that reports no release (not checked)
        };
        Err(KleinError::Bundle {
            path: bundle_dir.join(MANIFEST_FILE),
            reason: format!(
                "needs ONNX Runtime {needed} or newer (min_onnxruntime_version), but the library in \
                 use is {version} ({}, {}); use ONNX Runtime {needed} or newer (ORT_DYLIB_PATH, the \
                 CLI's --ort-lib, Python's ort_lib, the C API's ort_library)",
                runtime.library.display(),
                runtime.source
            ),
        })
    }

    /// Numbers that must agree with each other for the pipeline's arithmetic to be right.
    fn check_consistency(&self) -> std::result::Result<(), String> {
        let te = &self.text_encoder;
        let tr = &self.transformer;
        let vae = &self.vae;
        let mut problems = Vec::new();
        let length = self.tokenizer.max_sequence_length;
        if length == 0 || length > MAX_SEQUENCE_LENGTH {
            problems.push(format!(
                "tokenizer.max_sequence_length {length} is outside 1..={MAX_SEQUENCE_LENGTH} \
                 (FLUX.2-klein uses 512)"
            ));
        }
        if self.scheduler.class_name != SCHEDULER_CLASS {
            problems.push(format!(
                "scheduler.class {:?} is not {SCHEDULER_CLASS:?}, the only scheduler this runtime implements",
                self.scheduler.class_name
            ));
        }
        if tr.num_attention_heads == 0 || tr.attention_head_dim == 0 {
            problems.push(format!(
                "transformer.num_attention_heads {} and attention_head_dim {} must be non-zero",
                tr.num_attention_heads, tr.attention_head_dim
            ));
        }
        if vae.sample_size == 0 {
            problems.push(
                "vae.sample_size is 0 (the VAE's tile side in pixels, 1024 in FLUX.2)".to_string(),
            );
        }
        let model = &self.model;
        if model.default_steps == 0 || model.default_steps as usize > MAX_STEPS {
            problems.push(format!(
                "model.default_steps {} is outside 1..={MAX_STEPS}",
                model.default_steps
            ));
        }
        if !(model.default_guidance.is_finite()
            && (0.0..=MAX_GUIDANCE).contains(&model.default_guidance))
        {
            problems.push(format!(
                "model.default_guidance {} is outside 0..={MAX_GUIDANCE}",
                model.default_guidance
            ));
        }
        for (name, side) in [
            ("default_width", model.default_width),
            ("default_height", model.default_height),
        ] {
            if !(MIN_SIDE..=MAX_SIDE).contains(&side) {
                problems.push(format!(
                    "model.{name} {side} is outside {MIN_SIDE}..={MAX_SIDE} pixels"
                ));
            }
        }
        // Found here, in the file (the schedule refuses it too, without naming the file).
        if self.scheduler.shift.num_train_timesteps == 0 {
            problems.push("scheduler.num_train_timesteps is 0 (FLUX.2 trains on 1000)".to_string());
        }
        if te.hidden_layers.is_empty() {
            problems.push("text_encoder.hidden_layers is empty".to_string());
        }
        if let Some(bad) = te
            .hidden_layers
            .iter()
            .find(|&&k| k == 0 || k > te.layers_in_graph)
        {
            problems.push(format!(
                "text_encoder.hidden_layers has layer {bad}, outside 1..={} (layers_in_graph)",
                te.layers_in_graph
            ));
        }
        if te.layers_in_graph > te.num_hidden_layers {
            problems.push(format!(
                "text_encoder.layers_in_graph {} exceeds num_hidden_layers {}",
                te.layers_in_graph, te.num_hidden_layers
            ));
        }
        // Products and sums of manifest numbers are checked: a hostile manifest must not
        // overflow them (a panic in debug builds, a wrong but accepted value in release builds).
        match te.hidden_size.checked_mul(te.hidden_layers.len()) {
            Some(dim) if dim == te.embed_dim => {}
            product => problems.push(format!(
                "text_encoder.embed_dim {} != hidden_size {} x {} hidden layers{}",
                te.embed_dim,
                te.hidden_size,
                te.hidden_layers.len(),
                if product.is_none() {
                    " (overflows)"
                } else {
                    ""
                }
            )),
        }
        if tr.joint_attention_dim != te.embed_dim {
            problems.push(format!(
                "transformer.joint_attention_dim {} != text_encoder.embed_dim {}",
                tr.joint_attention_dim, te.embed_dim
            ));
        }
        let rope_sum = tr
            .axes_dims_rope
            .iter()
            .try_fold(0usize, |sum, &d| sum.checked_add(d));
        if rope_sum != Some(tr.attention_head_dim) {
            problems.push(format!(
                "transformer.axes_dims_rope {:?} sums to {}, not attention_head_dim {}",
                tr.axes_dims_rope,
                rope_sum.map_or("more than the largest integer".to_string(), |s| s
                    .to_string()),
                tr.attention_head_dim
            ));
        }
        let packed = vae
            .patch_size
            .checked_mul(vae.patch_size)
            .and_then(|p| p.checked_mul(vae.latent_channels));
        if self.latents.channels == 0
            || self.latents.channels != tr.in_channels
            || Some(self.latents.channels) != packed
        {
            problems.push(format!(
                "latents.channels {} must be non-zero and equal transformer.in_channels {} and \
                 vae.latent_channels x patch_size^2 = {}",
                self.latents.channels,
                tr.in_channels,
                packed.map_or("(overflows)".to_string(), |p| p.to_string())
            ));
        }
        let multiple = vae.spatial_factor.checked_mul(vae.patch_size);
        if self.latents.pixel_multiple == 0
            || Some(self.latents.pixel_multiple as usize) != multiple
        {
            problems.push(format!(
                "latents.pixel_multiple {} must be non-zero and equal vae.spatial_factor x patch_size = {}",
                self.latents.pixel_multiple,
                multiple.map_or("(overflows)".to_string(), |m| m.to_string())
            ));
        }
        let limits = &self.references.limits;
        if limits.max_aspect_ratio < 1.0 || limits.max_area == 0 || limits.min_side == 0 {
            problems.push(format!(
                "references.max_aspect_ratio {}, max_area {} and min_side {} must be at least 1 \
                 (diffusers uses 8, 1048576 and 64): no reference would fit",
                limits.max_aspect_ratio, limits.max_area, limits.min_side
            ));
        }
        // Reference i gets time coordinate `scale * (i + 1)`; the token budget bounds i.
        let scale = self.references.time_offset_scale;
        if scale.unsigned_abs() > MAX_TIME_OFFSET_SCALE {
            problems.push(format!(
                "references.time_offset_scale {scale} is out of range: at most {MAX_TIME_OFFSET_SCALE} \
                 in size (diffusers uses 10)"
            ));
        }
        if let Some(targets) = &self.graphs.transformer.lora_targets {
            let size = |file: &str| self.files.get(file).map(|entry| entry.bytes);
            problems.extend(lora_targets::problems(targets, size));
        }
        problems.extend(self.graph_width_problems());
        problems.extend(self.kv_problems()); // bundle/kv.rs
        if let Some(preview) = &self.preview {
            let cells = vae.patch_size.saturating_mul(vae.patch_size);
            problems.extend(preview.problems(self.latents.channels, cells));
        }
        if let Some(shapes) = &self.static_shapes {
            problems.extend(shapes.problems(
                self.latents.pixel_multiple,
                self.tokenizer.max_sequence_length,
                MAX_SIDE,
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("inconsistent numbers: {}", problems.join("; ")))
        }
    }

    /// Every listed file exists with its listed size; every file the pipeline reads is listed.
    fn check_files(&self, bundle_dir: &Path, manifest_path: &Path) -> Result<()> {
        let bundle_error = |path: PathBuf, reason: String| KleinError::Bundle { path, reason };
        let needed = std::iter::once(("tokenizer", &self.tokenizer.file))
            .chain(self.graphs.iter().map(|(c, g)| (c.as_str(), &g.file)))
            .chain(self.static_shapes.iter().flat_map(StaticShapes::files));
        for (what, file) in needed {
            if !self.files.contains_key(file) {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!(
                        "{what} file `{file}` is not listed in `files`, so it cannot be checked"
                    ),
                ));
            }
        }
        for (name, entry) in &self.files {
            let relative = Path::new(name);
            if name.is_empty()
                || !relative
                    .components()
                    .all(|c| matches!(c, PathComponent::Normal(_)))
            {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!("`files` entry `{name}` is not a plain path inside the bundle"),
                ));
            }
            if entry.sha256.len() != 64 || !entry.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(bundle_error(
                    manifest_path.to_path_buf(),
                    format!(
                        "files.{name}.sha256 `{}` is not 64 hex digits",
                        entry.sha256
                    ),
                ));
            }
            let path = bundle_dir.join(relative);
            let meta = match std::fs::metadata(&path) {
                Ok(meta) => meta,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(bundle_error(
                        path,
                        "is listed in manifest.json but missing; copy or export the bundle again"
                            .to_string(),
                    ))
                }
                Err(source) => {
                    return Err(KleinError::Io {
                        path,
                        action: "reading file metadata",
                        source,
                    })
                }
            };
            if !meta.is_file() {
                return Err(bundle_error(
                    path,
                    "is listed in manifest.json but is not a file".to_string(),
                ));
            }
            if meta.len() != entry.bytes {
                let hint = if meta.len() < entry.bytes {
                    "truncated: an interrupted copy or download?"
                } else {
                    "larger than exported: modified or replaced?"
                };
                return Err(bundle_error(
                    path,
                    format!(
                        "is {} bytes, manifest.json says {} ({hint})",
                        meta.len(),
                        entry.bytes
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `"1"`, or `"1, 2"` when several versions are readable.
pub(crate) fn supported_versions() -> String {
    SUPPORTED_FORMAT_VERSIONS
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
