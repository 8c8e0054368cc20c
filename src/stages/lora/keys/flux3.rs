//! FLUX.3 Image Klein LoRAs, as diffusers 0.42.1's `Flux3LoraLoaderMixin.lora_state_dict` reads
//! them: diffusers/PEFT names (`transformer.<module>.lora_A.weight`), or BFL names
//! (`diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight`) renamed by
//! `_convert_non_diffusers_flux3_lora_to_diffusers`. That loader converts no kohya and no LoKr file:
//! those are refused, as is a FLUX.2-klein LoRA, by name.
use super::{lora_pairs, Fail, Keys, LoraFormat, Store, Update};
use crate::stages::lora::config::AdapterConfig;

/// `_convert_non_diffusers_flux3_lora_to_diffusers`'s block renames, applied in this order.
const BFL_BLOCKS: &[(&str, &str)] = &[
    (".q_proj.", ".attn.to_q."),
    (".k_proj.", ".attn.to_k."),
    (".v_proj.", ".attn.to_v."),
    (".attn_out.", ".attn.to_out.0."),
    (".mlp_in.", ".ff.linear_in."),
    (".mlp_out.", ".ff.linear_out."),
];

/// A key of a FLUX.3 Image Klein LoRA, in any of its layouts (on a FLUX.2-klein bundle: refused).
pub(super) fn is_flux3_key(key: &str) -> bool {
    [
        "mode_blocks.",
        ".x_embedders.",
        "early_stream_modulations",
        "single_stream_modulations",
    ]
    .iter()
    .any(|part| key.contains(part))
}

/// A key of a FLUX.2-klein LoRA, in any of its layouts (on a FLUX.3 bundle: refused).
fn is_flux2_key(key: &str) -> bool {
    key.starts_with("transformer_blocks.")
        || [
            "double_blocks",
            ".transformer_blocks.",
            "to_qkv_mlp_proj",
            "img_attn",
            "txt_attn",
        ]
        .iter()
        .any(|part| key.contains(part))
}

/// `key` as `_convert_non_diffusers_flux3_lora_to_diffusers` writes it: `transformer.` + diffusers'
/// module names.
fn bfl_to_diffusers(key: &str) -> String {
    let mut key = key
        .strip_prefix("diffusion_model.")
        .unwrap_or(key)
        .replace("content_mode_blocks.", "mode_blocks.")
        .replace("single_blocks.", "single_transformer_blocks.");
    for (bfl, diffusers) in BFL_BLOCKS {
        key = key.replace(bfl, diffusers);
    }
    format!("transformer.{key}")
}

/// The format of a FLUX.3 LoRA file and its updates.
pub(super) fn convert(
    store: &Store<'_>,
    config: Option<&AdapterConfig>,
) -> Result<(LoraFormat, Vec<Update>), Fail> {
    let names = store.names();
    if let Some(key) = names.iter().find(|k| is_flux2_key(k)) {
        return Err(format!(
            "a FLUX.2-klein LoRA (`{key}`): this bundle is FLUX.3 Image Klein, whose layers are others; \
             use a LoRA trained for FLUX.3 Image Klein, or run this one on a FLUX.2-klein bundle"
        ));
    }
    let loader =
        "diffusers' FLUX.3 loader (Flux3LoraLoaderMixin) converts diffusers/PEFT and BFL LoRAs \
                  only, and so does klein for FLUX.3";
    if let Some(key) = names.iter().find(|k| k.contains(".lora_down.weight")) {
        return Err(format!("a kohya LoRA (`{key}`): {loader}"));
    }
    if let Some(key) = names.iter().find(|k| k.contains(".lokr_")) {
        return Err(format!("a LoKr adapter (`{key}`): {loader}"));
    }
    let (format, mut keys) = if names.iter().any(|k| k.starts_with("diffusion_model.")) {
        (LoraFormat::Bfl, Keys::new(store, bfl_to_diffusers))
    } else {
        (LoraFormat::Diffusers, Keys::new(store, str::to_string))
    };
    keys.model = "FLUX.3 Image Klein";
    Ok((format, lora_pairs(keys, LoraFormat::Diffusers, config)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bfl_names_become_diffusers_module_names() {
        let cases = [
            (
                "diffusion_model.content_mode_blocks.image.0.q_proj.lora_A.weight",
                "transformer.mode_blocks.image.0.attn.to_q.lora_A.weight",
            ),
            (
                "diffusion_model.txt_mode_blocks.1.attn_out.lora_B.weight",
                "transformer.txt_mode_blocks.1.attn.to_out.0.lora_B.weight",
            ),
            (
                "diffusion_model.single_blocks.3.mlp_in.lora_A.weight",
                "transformer.single_transformer_blocks.3.ff.linear_in.lora_A.weight",
            ),
            (
                "diffusion_model.single_blocks.0.mlp_out.lora_B.weight",
                "transformer.single_transformer_blocks.0.ff.linear_out.lora_B.weight",
            ),
        ];
        for (bfl, diffusers) in cases {
            assert_eq!(bfl_to_diffusers(bfl), diffusers);
        }
    }

    #[test]
    fn each_family_knows_the_other_by_its_layers() {
        for key in [
            "transformer.mode_blocks.image.0.attn.to_q.lora_A.weight",
            "diffusion_model.content_mode_blocks.image_cond.0.q_proj.lora_A.weight",
            "transformer.txt_mode_blocks.0.ff.linear_in.lora_A.weight",
        ] {
            assert!(is_flux3_key(key) && !is_flux2_key(key), "{key}");
        }
        for key in [
            "transformer.transformer_blocks.0.attn.to_q.lora_A.weight",
            "transformer.single_transformer_blocks.0.attn.to_qkv_mlp_proj.lora_A.weight",
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_A.weight",
            "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight",
        ] {
            assert!(is_flux2_key(key) && !is_flux3_key(key), "{key}");
        }
        // Both have single_transformer_blocks.N.attn.to_q: neither alone.
        let shared = "transformer.single_transformer_blocks.0.attn.to_q.lora_A.weight";
        assert!(!is_flux2_key(shared) && !is_flux3_key(shared));
    }
}
