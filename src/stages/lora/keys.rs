//! Which format a LoRA file is in, and its keys in diffusers' module names: the dispatch of
//! `Flux2LoraLoaderMixin.lora_state_dict` and the converters of diffusers 0.42.1's
//! `loaders/lora_conversion_utils.py` (`_convert_kohya_flux2_lora_to_diffusers`,
//! `_convert_non_diffusers_flux2_lora_to_diffusers`, `_convert_non_diffusers_flux2_lokr_to_diffusers`,
//! `_convert_lycoris_flux2_lokr_to_diffusers`, `_convert_non_diffusers_lokr_to_diffusers`). Where
//! diffusers drops a key with a warning, the file is refused.
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use ndarray::{s, Array2};

use super::config::AdapterConfig;
use super::{Factors, LoraFamily, Store, Update};

mod flux3;

/// The layout a LoRA file was written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// `transformer.<module>.lora_A.weight` (diffusers' `save_lora_weights`, PEFT).
    Diffusers,
    /// `diffusion_model.double_blocks.N...lora_A.weight` (BFL / ai-toolkit; also PEFT's
    /// `base_model.model.` prefix and `diffusion_model.` + diffusers names).
    Bfl,
    /// `lora_unet_double_blocks_N_..._lora_down.weight` with `.alpha` (kohya sd-scripts).
    Kohya,
    /// LoKr with BFL names (`diffusion_model.double_blocks.N.img_attn.qkv.lokr_w1`).
    LokrBfl,
    /// LoKr from LyCORIS (`lycoris_transformer_blocks_N_attn_to_q.lokr_w1`).
    LokrLycoris,
    /// LoKr with bare diffusers module names (`transformer_blocks.N.attn.to_q.lokr_w1`).
    LokrBare,
    /// LoKr with `transformer.` + diffusers module names.
    LokrDiffusers,
}

impl fmt::Display for LoraFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LoraFormat::Diffusers => "diffusers/PEFT LoRA",
            LoraFormat::Bfl => "BFL/ai-toolkit LoRA",
            LoraFormat::Kohya => "kohya LoRA",
            LoraFormat::LokrBfl => "BFL/ai-toolkit LoKr",
            LoraFormat::LokrLycoris => "LyCORIS LoKr",
            LoraFormat::LokrBare => "LoKr (diffusers module names)",
            LoraFormat::LokrDiffusers => "diffusers/PEFT LoKr",
        })
    }
}

type Fail = String;

/// Key prefixes of text-encoder weights in the formats above.
const TEXT_ENCODER_PREFIXES: &[&str] = &["text_encoder", "lora_te", "te_", "te1_", "te2_"];

/// BFL block paths in a double block -> diffusers module paths in `transformer_blocks.N`.
const BFL_DOUBLE: &[(&str, &[&str])] = &[
    ("img_attn.qkv", &["attn.to_q", "attn.to_k", "attn.to_v"]),
    (
        "txt_attn.qkv",
        &["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    ),
    ("img_attn.proj", &["attn.to_out.0"]),
    ("txt_attn.proj", &["attn.to_add_out"]),
    ("img_mlp.0", &["ff.linear_in"]),
    ("img_mlp.2", &["ff.linear_out"]),
    ("txt_mlp.0", &["ff_context.linear_in"]),
    ("txt_mlp.2", &["ff_context.linear_out"]),
];
/// BFL single-block paths -> diffusers paths in `single_transformer_blocks.N`.
const BFL_SINGLE: &[(&str, &str)] = &[
    ("linear1", "attn.to_qkv_mlp_proj"),
    ("linear2", "attn.to_out"),
];
/// BFL top-level layers -> diffusers modules (`extra_mappings`).
const BFL_EXTRA: &[(&str, &str)] = &[
    ("img_in", "x_embedder"),
    ("txt_in", "context_embedder"),
    (
        "time_in.in_layer",
        "time_guidance_embed.timestep_embedder.linear_1",
    ),
    (
        "time_in.out_layer",
        "time_guidance_embed.timestep_embedder.linear_2",
    ),
    (
        "guidance_in.in_layer",
        "time_guidance_embed.guidance_embedder.linear_1",
    ),
    (
        "guidance_in.out_layer",
        "time_guidance_embed.guidance_embedder.linear_2",
    ),
    ("final_layer.linear", "proj_out"),
    ("final_layer.adaLN_modulation.1", "norm_out.linear"),
    (
        "single_stream_modulation.lin",
        "single_stream_modulation.linear",
    ),
    (
        "double_stream_modulation_img.lin",
        "double_stream_modulation_img.linear",
    ),
    (
        "double_stream_modulation_txt.lin",
        "double_stream_modulation_txt.linear",
    ),
];
/// Diffusers-named blocks a BFL LoRA may use directly (`possible_expanded_block_prefixes`).
const BFL_EXPANDED: &[(&str, &str)] = &[
    ("single_transformer_blocks.", "single_transformer_blocks."),
    ("transformer_blocks.", "transformer_blocks."),
    ("sformer_blocks.", "transformer_blocks."),
];
/// kohya names in `lora_unet_double_blocks_N_` -> diffusers paths in `transformer_blocks.N`.
const KOHYA_DOUBLE: &[(&str, &[&str])] = &[
    ("img_attn_proj", &["attn.to_out.0"]),
    ("img_attn_qkv", &["attn.to_q", "attn.to_k", "attn.to_v"]),
    ("txt_attn_proj", &["attn.to_add_out"]),
    (
        "txt_attn_qkv",
        &["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    ),
    ("img_mlp_0", &["ff.linear_in"]),
    ("img_mlp_2", &["ff.linear_out"]),
    ("txt_mlp_0", &["ff_context.linear_in"]),
    ("txt_mlp_2", &["ff_context.linear_out"]),
];
/// kohya names in `lora_unet_single_blocks_N_` -> diffusers paths in `single_transformer_blocks.N`.
const KOHYA_SINGLE: &[(&str, &str)] = &[
    ("linear1", "attn.to_qkv_mlp_proj"),
    ("linear2", "attn.to_out"),
];
/// kohya top-level names -> diffusers modules.
const KOHYA_EXTRA: &[(&str, &str)] = &[
    ("lora_unet_img_in", "x_embedder"),
    ("lora_unet_txt_in", "context_embedder"),
    (
        "lora_unet_time_in_in_layer",
        "time_guidance_embed.timestep_embedder.linear_1",
    ),
    (
        "lora_unet_time_in_out_layer",
        "time_guidance_embed.timestep_embedder.linear_2",
    ),
    ("lora_unet_final_layer_linear", "proj_out"),
];
/// LyCORIS sub-paths -> diffusers paths (`_LYCORIS_FLUX2_SUBPATH_MAP`).
const LYCORIS_SUBPATHS: &[(&str, &str)] = &[
    ("attn_to_q", "attn.to_q"),
    ("attn_to_k", "attn.to_k"),
    ("attn_to_v", "attn.to_v"),
    ("attn_to_out_0", "attn.to_out.0"),
    ("attn_to_add_out", "attn.to_add_out"),
    ("attn_add_q_proj", "attn.add_q_proj"),
    ("attn_add_k_proj", "attn.add_k_proj"),
    ("attn_add_v_proj", "attn.add_v_proj"),
    ("attn_to_qkv_mlp_proj", "attn.to_qkv_mlp_proj"),
    ("attn_to_out", "attn.to_out"),
    ("ff_linear_in", "ff.linear_in"),
    ("ff_linear_out", "ff.linear_out"),
    ("ff_context_linear_in", "ff_context.linear_in"),
    ("ff_context_linear_out", "ff_context.linear_out"),
];
/// Fused projections a LoKr may target (diffusers fuses the model for them), and their parts.
const FUSED_QKV: &[(&str, [&str; 3])] = &[
    ("attn.to_qkv", ["attn.to_q", "attn.to_k", "attn.to_v"]),
    (
        "attn.to_added_qkv",
        ["attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"],
    ),
];
const LOKR_SUFFIXES: &[&str] = &[
    "lokr_w1",
    "lokr_w1_a",
    "lokr_w1_b",
    "lokr_w2",
    "lokr_w2_a",
    "lokr_w2_b",
];

/// The keys of a file not yet used: canonical name (after diffusers' renames) -> name in the file.
struct Keys<'s, 'a> {
    store: &'s Store<'a>,
    left: BTreeMap<String, String>,
    /// The model named when keys are left over.
    model: &'static str,
}

impl<'s, 'a> Keys<'s, 'a> {
    fn new(store: &'s Store<'a>, rename: impl Fn(&str) -> String) -> Self {
        let left = store
            .names()
            .into_iter()
            .map(|k| (rename(k), k.to_string()))
            .collect();
        Keys {
            store,
            left,
            model: "FLUX.2-klein",
        }
    }

    /// Removes `key` and reads it as a matrix.
    fn matrix(&mut self, key: &str) -> Result<Option<Array2<f32>>, Fail> {
        match self.left.remove(key) {
            Some(original) => self.store.matrix(&original).map(Some),
            None => Ok(None),
        }
    }

    fn scalar(&mut self, key: &str) -> Result<Option<f32>, Fail> {
        match self.left.remove(key) {
            Some(original) => self.store.scalar(&original).map(Some),
            None => Ok(None),
        }
    }

    /// Canonical keys ending in `suffix`, with the suffix removed: the module bases.
    fn bases(&self, suffixes: &[&str]) -> Vec<String> {
        let bases: BTreeSet<String> = self
            .left
            .keys()
            .filter_map(|k| suffixes.iter().find_map(|s| k.strip_suffix(s)))
            .map(str::to_string)
            .collect();
        bases.into_iter().collect()
    }

    /// An error for the keys nothing used, or Ok.
    fn finish(self, format: LoraFormat) -> Result<(), Fail> {
        if self.left.is_empty() {
            return Ok(());
        }
        let originals: Vec<&str> = self.left.values().map(String::as_str).collect();
        let text: Vec<&str> = originals
            .iter()
            .copied()
            .filter(|k| TEXT_ENCODER_PREFIXES.iter().any(|p| k.starts_with(p)))
            .collect();
        if !text.is_empty() {
            return Err(format!(
                "{} text-encoder keys ({}): klein applies LoRAs to the transformer only, as diffusers' \
                 {} loader does (it ignores these keys); use a LoRA without text-encoder weights",
                text.len(),
                first_names(&text),
                self.model
            ));
        }
        Err(format!(
            "{} keys match no layer of a {} transformer in the {format} layout ({}): a LoRA for \
             another model (FLUX.1, another family) or a layout klein does not read",
            originals.len(),
            self.model,
            first_names(&originals)
        ))
    }
}

/// The first three names, and how many more.
pub(crate) fn first_names(names: &[&str]) -> String {
    let mut text = names.iter().take(3).copied().collect::<Vec<_>>().join(", ");
    if names.len() > 3 {
        text.push_str(&format!(", and {} more", names.len() - 3));
    }
    text
}

/// The format of the file in `store` and its updates, read for a bundle of `family`.
pub(super) fn convert(
    store: &Store<'_>,
    config: Option<&AdapterConfig>,
    family: LoraFamily,
) -> Result<(LoraFormat, Vec<Update>), Fail> {
    let names = store.names();
    let dora: Vec<&str> = names
        .iter()
        .copied()
        .filter(|k| k.contains("dora_scale") || k.contains("lora_magnitude_vector"))
        .collect();
    if !dora.is_empty() {
        return Err(format!(
            "a DoRA adapter ({}): klein applies LoRA and LoKr only (diffusers drops the DoRA magnitudes \
             and applies the rest, which is another adapter)",
            first_names(&dora)
        ));
    }
    if family == LoraFamily::Flux3 {
        return flux3::convert(store, config);
    }
    if let Some(key) = names.iter().find(|k| flux3::is_flux3_key(k)) {
        return Err(format!(
            "a FLUX.3 Image Klein LoRA (`{key}`): this bundle is FLUX.2-klein, whose layers are others; \
             use a LoRA trained for FLUX.2-klein, or run this one on a FLUX.3 Image Klein bundle"
        ));
    }
    // lora_state_dict: kohya first, then PEFT's prefix, then LoKr, then BFL.
    if names.iter().any(|k| k.contains(".lora_down.weight")) {
        let updates = kohya(Keys::new(store, str::to_string), config)?;
        return Ok((LoraFormat::Kohya, updates));
    }
    let peft = |k: &str| match k.strip_prefix("base_model.model.") {
        Some(rest) => format!("diffusion_model.{rest}"),
        None => k.to_string(),
    };
    let keys = Keys::new(store, peft);
    let is_lokr = keys.left.keys().any(|k| k.contains(".lokr_"));
    let is_bfl = keys.left.keys().any(|k| k.starts_with("diffusion_model."));
    if is_lokr {
        let (format, keys, baked): (LoraFormat, Keys<'_, '_>, bool) =
            if keys.left.keys().any(|k| k.starts_with("lycoris_")) {
                (LoraFormat::LokrLycoris, keys, true)
            } else if is_bfl {
                let strip = |k: &str| {
                    let k = peft(k);
                    k.strip_prefix("diffusion_model.").unwrap_or(&k).to_string()
                };
                (LoraFormat::LokrBfl, Keys::new(store, strip), true)
            } else if !keys.left.keys().any(|k| k.starts_with("transformer.")) {
                (LoraFormat::LokrBare, keys, true)
            } else {
                (LoraFormat::LokrDiffusers, keys, false)
            };
        let updates = lokr(keys, format, baked, config)?;
        return Ok((format, updates));
    }
    if is_bfl {
        let strip = |k: &str| {
            let k = peft(k);
            let k = k.strip_prefix("diffusion_model.").unwrap_or(&k);
            k.replace("lora_down", "lora_A")
                .replace("lora_up", "lora_B")
        };
        let updates = lora_pairs(Keys::new(store, strip), LoraFormat::Bfl, config)?;
        return Ok((LoraFormat::Bfl, updates));
    }
    let updates = lora_pairs(keys, LoraFormat::Diffusers, config)?;
    Ok((LoraFormat::Diffusers, updates))
}

/// The diffusers modules of a base name in `format`, or None when it names none.
fn modules_of(base: &str, format: LoraFormat) -> Option<Vec<String>> {
    match format {
        LoraFormat::Diffusers => base
            .strip_prefix("transformer.")
            .map(|m| vec![m.to_string()]),
        LoraFormat::LokrDiffusers | LoraFormat::LokrBare => {
            let module = match format {
                LoraFormat::LokrDiffusers => base.strip_prefix("transformer.")?,
                _ => base,
            };
            Some(unfused(module))
        }
        LoraFormat::Bfl | LoraFormat::LokrBfl => {
            if let Some(rest) = base.strip_prefix("single_blocks.") {
                let (i, tail) = block(rest, '.')?;
                let (_, path) = BFL_SINGLE.iter().find(|(k, _)| *k == tail)?;
                return Some(vec![format!("single_transformer_blocks.{i}.{path}")]);
            }
            if let Some(rest) = base.strip_prefix("double_blocks.") {
                let (i, tail) = block(rest, '.')?;
                let (_, paths) = BFL_DOUBLE.iter().find(|(k, _)| *k == tail)?;
                return Some(
                    paths
                        .iter()
                        .map(|p| format!("transformer_blocks.{i}.{p}"))
                        .collect(),
                );
            }
            if let Some((_, module)) = BFL_EXTRA.iter().find(|(k, _)| *k == base) {
                return Some(vec![module.to_string()]);
            }
            if format == LoraFormat::Bfl {
                for (from, to) in BFL_EXPANDED {
                    if let Some(rest) = base.strip_prefix(from) {
                        return Some(vec![format!("{to}{rest}")]);
                    }
                }
            }
            None
        }
        LoraFormat::Kohya => {
            if let Some(rest) = base.strip_prefix("lora_unet_double_blocks_") {
                let (i, tail) = block(rest, '_')?;
                let (_, paths) = KOHYA_DOUBLE.iter().find(|(k, _)| *k == tail)?;
                return Some(
                    paths
                        .iter()
                        .map(|p| format!("transformer_blocks.{i}.{p}"))
                        .collect(),
                );
            }
            if let Some(rest) = base.strip_prefix("lora_unet_single_blocks_") {
                let (i, tail) = block(rest, '_')?;
                let (_, path) = KOHYA_SINGLE.iter().find(|(k, _)| *k == tail)?;
                return Some(vec![format!("single_transformer_blocks.{i}.{path}")]);
            }
            KOHYA_EXTRA
                .iter()
                .find(|(k, _)| *k == base)
                .map(|(_, m)| vec![m.to_string()])
        }
        LoraFormat::LokrLycoris => {
            // ^lycoris_((?:single_)?transformer_blocks)_(\d+)_(.+)$
            let rest = base.strip_prefix("lycoris_")?;
            let (container, rest) = if let Some(r) = rest.strip_prefix("single_transformer_blocks_")
            {
                ("single_transformer_blocks", r)
            } else {
                (
                    "transformer_blocks",
                    rest.strip_prefix("transformer_blocks_")?,
                )
            };
            let (i, tail) = block(rest, '_')?;
            let (_, path) = LYCORIS_SUBPATHS.iter().find(|(k, _)| *k == tail)?;
            Some(vec![format!("{container}.{i}.{path}")])
        }
    }
}

/// `"3.rest"` -> `(3, "rest")` (split at `sep`; the block index must be a number).
fn block(text: &str, sep: char) -> Option<(usize, &str)> {
    let (i, tail) = text.split_once(sep)?;
    Some((i.parse().ok()?, tail))
}

/// A fused QKV module's parts, or the module itself.
fn unfused(module: &str) -> Vec<String> {
    for (fused, parts) in FUSED_QKV {
        if let Some(head) = module.strip_suffix(fused) {
            if head.is_empty() || head.ends_with('.') {
                return parts.iter().map(|p| format!("{head}{p}")).collect();
            }
        }
    }
    vec![module.to_string()]
}

/// `(lora_A, lora_B)` pairs (diffusers, BFL layouts) -> updates.
fn lora_pairs(
    mut keys: Keys<'_, '_>,
    format: LoraFormat,
    config: Option<&AdapterConfig>,
) -> Result<Vec<Update>, Fail> {
    let mut updates = Vec::new();
    for base in keys.bases(&[".lora_A.weight", ".lora_B.weight"]) {
        let Some(modules) = modules_of(&base, format) else {
            continue; // left in `keys`: reported by finish
        };
        let down = keys.matrix(&format!("{base}.lora_A.weight"))?;
        let up = keys.matrix(&format!("{base}.lora_B.weight"))?;
        let (Some(down), Some(up)) = (down, up) else {
            return Err(format!("`{base}` has only one of lora_A and lora_B"));
        };
        updates.extend(split_lora(&base, &modules, up, down, 1.0, config)?);
    }
    keys.finish(format)?;
    Ok(updates)
}

/// kohya `lora_down`, `lora_up` and `alpha` -> updates (scale alpha / rank).
fn kohya(mut keys: Keys<'_, '_>, config: Option<&AdapterConfig>) -> Result<Vec<Update>, Fail> {
    let mut updates = Vec::new();
    for base in keys.bases(&[".lora_down.weight", ".lora_up.weight", ".alpha"]) {
        let Some(modules) = modules_of(&base, LoraFormat::Kohya) else {
            continue;
        };
        let down = keys.matrix(&format!("{base}.lora_down.weight"))?;
        let up = keys.matrix(&format!("{base}.lora_up.weight"))?;
        let alpha = keys.scalar(&format!("{base}.alpha"))?;
        let (Some(down), Some(up)) = (down, up) else {
            return Err(format!("`{base}` has only one of lora_down and lora_up"));
        };
        check_rank(&base, down.nrows())?;
        let rank = down.nrows() as f32;
        let scale = alpha.unwrap_or(rank) / rank;
        updates.extend(split_lora(&base, &modules, up, down, scale, config)?);
    }
    keys.finish(LoraFormat::Kohya)?;
    Ok(updates)
}

/// A rank of 0 changes nothing (PEFT refuses `r=0`; kohya's alpha / rank is not a number).
fn check_rank(base: &str, rank: usize) -> Result<(), Fail> {
    if rank == 0 {
        return Err(format!(
            "`{base}` has rank 0 (lora_A/down has no rows): it changes nothing; a LoRA's rank is 1 or more"
        ));
    }
    Ok(())
}

/// One update per module, each with its block of `up`'s rows (`up` `[out, r]`, `down` `[r, in]`).
fn split_lora(
    base: &str,
    modules: &[String],
    up: Array2<f32>,
    down: Array2<f32>,
    scale: f32,
    config: Option<&AdapterConfig>,
) -> Result<Vec<Update>, Fail> {
    let rank = down.nrows();
    check_rank(base, rank)?;
    if up.ncols() != rank {
        return Err(format!(
            "`{base}`: lora_B/up is {:?} and lora_A/down {:?}; the rank (up's columns, down's rows) must agree",
            up.dim(),
            down.dim()
        ));
    }
    if !up.nrows().is_multiple_of(modules.len()) {
        return Err(format!(
            "`{base}`: {} output rows do not split into the {} projections it stands for",
            up.nrows(),
            modules.len()
        ));
    }
    let block = up.nrows() / modules.len();
    modules
        .iter()
        .enumerate()
        .map(|(i, module)| {
            let peft = match config {
                Some(c) => {
                    if c.rank(module) != rank as f64 {
                        return Err(format!(
                            "`{base}` has rank {rank}, its adapter metadata says {} for {module}",
                            c.rank(module)
                        ));
                    }
                    c.scaling(module) as f32
                }
                None => 1.0,
            };
            Ok(Update {
                module: module.clone(),
                source: base.to_string(),
                factors: Factors::Lora {
                    up: up.slice(s![i * block..(i + 1) * block, ..]).to_owned(),
                    down: down.clone(),
                },
                rows: 0..block,
                scale: scale * peft,
            })
        })
        .collect()
}

/// LoKr factors -> updates. `baked`: the layout's `.alpha` scales by alpha / rank when a factor is
/// rank-decomposed (`_bake_lokr_alpha_`); with two full factors it is dropped.
fn lokr(
    mut keys: Keys<'_, '_>,
    format: LoraFormat,
    baked: bool,
    config: Option<&AdapterConfig>,
) -> Result<Vec<Update>, Fail> {
    if let Some(t2) = keys.left.values().find(|k| k.contains("lokr_t2")) {
        return Err(format!(
            "`{t2}`: a Tucker-decomposed (convolution) LoKr factor; a linear layer's LoKr has none"
        ));
    }
    let suffixes: Vec<String> = LOKR_SUFFIXES.iter().map(|s| format!(".{s}")).collect();
    let suffixes: Vec<&str> = suffixes.iter().map(String::as_str).collect();
    let mut updates = Vec::new();
    for base in keys.bases(&suffixes) {
        let Some(modules) = modules_of(&base, format) else {
            continue;
        };
        let mut factor = |name: &str| -> Result<(Option<Array2<f32>>, usize), Fail> {
            let full = keys.matrix(&format!("{base}.{name}"))?;
            let a = keys.matrix(&format!("{base}.{name}_a"))?;
            let b = keys.matrix(&format!("{base}.{name}_b"))?;
            match (full, a, b) {
                (Some(w), None, None) => Ok((Some(w), 0)),
                (None, Some(a), Some(b)) if a.ncols() == b.nrows() => {
                    let rank = b.nrows();
                    Ok((Some(a.dot(&b)), rank))
                }
                (None, None, None) => Ok((None, 0)),
                _ => Err(format!(
                    "`{base}`: {name} must be given either whole or as {name}_a and {name}_b of a common rank"
                )),
            }
        };
        let (w1, rank1) = factor("lokr_w1")?;
        let (w2, rank2) = factor("lokr_w2")?;
        let (Some(w1), Some(w2)) = (w1, w2) else {
            return Err(format!("`{base}` needs both lokr_w1 and lokr_w2 factors"));
        };
        let mut scale = 1.0;
        if baked {
            if let Some(alpha) = keys.scalar(&format!("{base}.alpha"))? {
                // rank = w2_b's rows if w2 is decomposed, else w1_b's; none: alpha dropped
                let rank = if rank2 > 0 { rank2 } else { rank1 };
                if rank > 0 {
                    scale = alpha / rank as f32;
                }
            }
        }
        let factors = Factors::Lokr { w1, w2 };
        let out = factors.shape().0;
        if !out.is_multiple_of(modules.len()) {
            return Err(format!(
                "`{base}`: {out} output rows do not split into the {} projections it stands for",
                modules.len()
            ));
        }
        let block = out / modules.len();
        for (i, module) in modules.iter().enumerate() {
            let peft = config.map_or(1.0, |c| c.scaling(module) as f32);
            updates.push(Update {
                module: module.clone(),
                source: base.clone(),
                factors: factors.clone(),
                rows: i * block..(i + 1) * block,
                scale: scale * peft,
            });
        }
    }
    keys.finish(format)?;
    Ok(updates)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use safetensors::tensor::{Dtype, TensorView};
    use safetensors::SafeTensors;

    /// `tensors` (name, shape, value of every element) as a safetensors file's bytes.
    fn file(tensors: &[(&str, &[usize], f32)]) -> Vec<u8> {
        let data: Vec<Vec<u8>> = tensors
            .iter()
            .map(|(_, shape, v)| {
                let n: usize = shape.iter().product();
                (0..n).flat_map(|_| v.to_le_bytes()).collect()
            })
            .collect();
        let views: Vec<(&str, TensorView<'_>)> = tensors
            .iter()
            .zip(&data)
            .map(|((name, shape, _), d)| {
                (
                    *name,
                    TensorView::new(Dtype::F32, shape.to_vec(), d).unwrap(),
                )
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    fn convert_bytes(bytes: &[u8]) -> Result<(LoraFormat, Vec<Update>), Fail> {
        let store = Store {
            tensors: SafeTensors::deserialize(bytes).unwrap(),
        };
        convert(&store, None, LoraFamily::Flux2)
    }

    #[test]
    fn kohya_qkv_splits_into_three_layers_with_alpha_over_rank() {
        let bytes = file(&[
            (
                "lora_unet_double_blocks_1_img_attn_qkv.lora_down.weight",
                &[4, 8],
                1.0,
            ),
            (
                "lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight",
                &[24, 4],
                1.0,
            ),
            ("lora_unet_double_blocks_1_img_attn_qkv.alpha", &[], 2.0),
        ]);
        let (format, updates) = convert_bytes(&bytes).unwrap();
        assert_eq!(format, LoraFormat::Kohya);
        let modules: Vec<&str> = updates.iter().map(|u| u.module.as_str()).collect();
        assert_eq!(
            modules,
            [
                "transformer_blocks.1.attn.to_q",
                "transformer_blocks.1.attn.to_k",
                "transformer_blocks.1.attn.to_v"
            ]
        );
        for update in &updates {
            assert_eq!(update.shape(), (8, 8));
            assert_eq!(update.scale, 0.5);
        }
    }

    /// Rank 0 (no rows in down/A) changes nothing: refused as such, in both layouts (kohya's
    /// alpha / rank had read as "changes ... by up to NaN").
    #[test]
    fn rank_zero_is_refused() {
        for (down, up) in [
            (
                "lora_unet_double_blocks_1_img_attn_qkv.lora_down.weight",
                "lora_unet_double_blocks_1_img_attn_qkv.lora_up.weight",
            ),
            (
                "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
                "transformer.transformer_blocks.0.attn.to_q.lora_B.weight",
            ),
        ] {
            let bytes = file(&[(down, &[0, 64], 1.0), (up, &[64, 0], 1.0)]);
            let error = convert_bytes(&bytes).unwrap_err();
            assert!(error.contains("rank 0"), "{error}");
        }
    }

    #[test]
    fn lycoris_and_bfl_lokr_names() {
        let bytes = file(&[
            (
                "lycoris_single_transformer_blocks_3_attn_to_qkv_mlp_proj.lokr_w1",
                &[2, 2],
                1.0,
            ),
            (
                "lycoris_single_transformer_blocks_3_attn_to_qkv_mlp_proj.lokr_w2",
                &[6, 4],
                1.0,
            ),
        ]);
        let (format, updates) = convert_bytes(&bytes).unwrap();
        assert_eq!(format, LoraFormat::LokrLycoris);
        assert_eq!(
            updates[0].module,
            "single_transformer_blocks.3.attn.to_qkv_mlp_proj"
        );
        assert_eq!(updates[0].shape(), (12, 8));

        let bytes = file(&[
            (
                "diffusion_model.double_blocks.0.txt_attn.qkv.lokr_w1",
                &[3, 1],
                1.0,
            ),
            (
                "diffusion_model.double_blocks.0.txt_attn.qkv.lokr_w2_a",
                &[4, 2],
                1.0,
            ),
            (
                "diffusion_model.double_blocks.0.txt_attn.qkv.lokr_w2_b",
                &[2, 8],
                1.0,
            ),
            (
                "diffusion_model.double_blocks.0.txt_attn.qkv.alpha",
                &[],
                1.0,
            ),
        ]);
        let (format, updates) = convert_bytes(&bytes).unwrap();
        assert_eq!(format, LoraFormat::LokrBfl);
        // fused [12, 8] split by rows into add_q/k/v, alpha 1 over rank 2
        let rows: Vec<_> = updates
            .iter()
            .map(|u| (u.module.as_str(), u.rows.clone(), u.scale))
            .collect();
        assert_eq!(
            rows,
            [
                ("transformer_blocks.0.attn.add_q_proj", 0..4, 0.5),
                ("transformer_blocks.0.attn.add_k_proj", 4..8, 0.5),
                ("transformer_blocks.0.attn.add_v_proj", 8..12, 0.5)
            ]
        );
    }

    #[test]
    fn keys_of_no_layout_are_refused_by_name() {
        let bytes = file(&[
            ("transformer.x_embedder.lora_A.weight", &[2, 4], 1.0),
            ("transformer.x_embedder.lora_B.weight", &[4, 2], 1.0),
            ("unet.down_blocks.0.lora_A.weight", &[2, 4], 1.0),
        ]);
        let error = convert_bytes(&bytes).unwrap_err();
        assert!(
            error.contains("unet.down_blocks.0.lora_A.weight"),
            "{error}"
        );
        assert!(error.contains("diffusers/PEFT LoRA layout"), "{error}");
    }
}
