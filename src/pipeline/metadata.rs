//! What an image records of how it was made (PNG text chunks, the JPEG comment): the same for the
//! CLI, `klein serve` and the Python bindings, so that the same request gives the same file.
use std::path::Path;

use super::{Generation, Pipeline};
use crate::bundle::manifest::ModelVariant;
use crate::bundle::MANIFEST_FILE;
use crate::error::{KleinError, Result};

/// sha256 of the manifest.json of the bundle at `bundle_dir` ([`Pipeline::bundle_sha256`], for
/// callers that hold no pipeline).
pub fn manifest_sha256(bundle_dir: &Path) -> Result<String> {
    let path = bundle_dir.join(MANIFEST_FILE);
    let bytes = std::fs::read(&path).map_err(|source| KleinError::Io {
        path,
        action: "reading",
        source,
    })?;
    Ok(crate::fsutil::sha256_hex(&bytes))
}

impl Pipeline {
    /// sha256 of the bundle's manifest.json, stored in every image.
    pub fn bundle_sha256(&self) -> Result<String> {
        manifest_sha256(self.bundle_dir())
    }

    /// Where the graphs ran: one device (`cpu`), or each graph's (`text_encoder cuda:0, ...`).
    pub fn device_name(&self) -> String {
        let placements = self.placements();
        let Some(first) = placements.first() else {
            return "none".to_string();
        };
        if placements.iter().all(|p| p.device == first.device) {
            return first.device.to_string();
        }
        placements
            .iter()
            .map(|p| format!("{} {}", p.component, p.device))
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The text stored with the images of `generation`: everything needed to make them again.
    /// `references` names the reference images as the caller gave them (paths, upload names).
    pub fn image_metadata(
        &self,
        generation: &Generation,
        prompt: &str,
        references: &[String],
        bundle_hash: &str,
    ) -> Vec<(String, String)> {
        let manifest = self.manifest();
        let loras: Vec<String> = self
            .loras
            .specs()
            .iter()
            .map(|l| format!("{}:{}", l.path().display(), l.scale()))
            .collect();
        let g = generation;
        let mut text: Vec<(String, String)> = vec![("prompt".into(), prompt.into())];
        if let Some(negative) = &g.negative_prompt {
            text.push(("negative_prompt".into(), negative.clone()));
        }
        if let Some(strength) = g.strength {
            text.push(("strength".into(), strength.to_string()));
            text.push(("mask".into(), if g.masked { "yes" } else { "no" }.into()));
            if let Some(padding) = g.mask_crop {
                text.push(("mask_crop".into(), padding.to_string()));
            }
        }
        if g.vae_tiled {
            text.push(("vae_tiling".into(), "on".into()));
        }
        if let Some(pixels) = g.vae_tile_size {
            text.push(("vae_tile_size".into(), pixels.to_string()));
        }
        text.extend([
            ("seed".into(), g.seed.to_string()),
            ("steps".into(), g.steps.to_string()),
            ("guidance".into(), g.guidance.to_string()),
            ("size".into(), format!("{}x{}", g.width, g.height)),
            ("model".into(), manifest.model.name.clone()),
            (
                "model_variant".into(),
                variant_name(manifest.model.variant).into(),
            ),
            ("bundle_sha256".into(), bundle_hash.to_string()),
            ("device".into(), self.device_name()),
            ("references".into(), json_list(references)),
            ("loras".into(), json_list(&loras)),
            (
                "Software".into(),
                format!("klein {}", env!("CARGO_PKG_VERSION")),
            ),
        ]);
        text
    }
}

/// The manifest's name of a model variant (`4b`, `9b`, `tiny`, `custom`).
pub fn variant_name(variant: ModelVariant) -> &'static str {
    match variant {
        ModelVariant::Klein4B => "4b",
        ModelVariant::Klein9B => "9b",
        ModelVariant::Tiny => "tiny",
        ModelVariant::Custom => "custom",
    }
}

/// A JSON array of strings.
fn json_list(items: &[String]) -> String {
    serde_json::Value::from(items.to_vec()).to_string()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn variant_names_are_the_manifest_names() {
        for variant in [
            ModelVariant::Klein4B,
            ModelVariant::Klein9B,
            ModelVariant::Tiny,
            ModelVariant::Custom,
        ] {
            let json = serde_json::to_value(variant).unwrap();
            assert_eq!(json.as_str(), Some(variant_name(variant)));
        }
    }

    #[test]
    fn lists_are_json_arrays_with_escapes() {
        let items = vec!["a \"b\".png".to_string(), "c".to_string()];
        assert_eq!(json_list(&items), r#"["a \"b\".png","c"]"#);
        assert_eq!(json_list(&[]), "[]");
    }
}
