//! The adapter configuration diffusers stores in a LoRA file's safetensors metadata
//! (`lora_adapter_metadata`: a JSON object of PEFT's `LoraConfig` / `LoKrConfig` fields, each key
//! prefixed with the component, `transformer.r`), and the scaling PEFT derives from it: per module
//! `alpha / r` (`alpha / sqrt(r)` with rsLoRA), the rank and alpha patterns matched as PEFT's
//! `get_pattern_key` matches them (`(.*\.)?PATTERN$`, first pattern in key order).
use std::collections::{BTreeMap, HashMap};

use serde_json::Value;

/// `LORA_ADAPTER_METADATA_KEY` in diffusers' `loaders/lora_base.py`.
const METADATA_KEY: &str = "lora_adapter_metadata";
/// Only the transformer's adapter is read (diffusers' Flux2 loader has no other component).
const PREFIX: &str = "transformer.";

/// The transformer's adapter configuration.
#[derive(Debug, Clone)]
pub struct AdapterConfig {
    r: f64,
    alpha: f64,
    rank_pattern: BTreeMap<String, f64>,
    alpha_pattern: BTreeMap<String, f64>,
    rslora: bool,
}

impl AdapterConfig {
    /// The configuration in a file's metadata (`None`: the file has none, PEFT's defaults apply:
    /// alpha equal to the rank, scaling 1).
    pub fn from_metadata(metadata: &HashMap<String, String>) -> Result<Option<Self>, String> {
        let Some(raw) = metadata.get(METADATA_KEY) else {
            return Ok(None);
        };
        let fields: BTreeMap<String, Value> = serde_json::from_str(raw)
            .map_err(|e| format!("its `{METADATA_KEY}` metadata is not a JSON object ({e})"))?;
        let field = |name: &str| fields.get(&format!("{PREFIX}{name}"));
        if fields.keys().all(|k| !k.starts_with(PREFIX)) {
            return Ok(None);
        }
        // PEFT writes these as JSON booleans; anything else would be read as false unseen.
        let flag = |name: &str| -> Result<bool, String> {
            match field(name) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(v) => Err(format!(
                    "adapter metadata `{PREFIX}{name}` is {v}; true or false"
                )),
            }
        };
        if flag("use_dora")? {
            return Err("a DoRA adapter (use_dora); klein applies LoRA and LoKr only".into());
        }
        let number = |name: &str| -> Result<Option<f64>, String> {
            match field(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => match v.as_f64() {
                    Some(x) if x.is_finite() && x > 0.0 => Ok(Some(x)),
                    _ => Err(format!(
                        "adapter metadata `{PREFIX}{name}` is {v}; a positive number"
                    )),
                },
            }
        };
        let pattern = |name: &str| -> Result<BTreeMap<String, f64>, String> {
            match field(name) {
                None | Some(Value::Null) => Ok(BTreeMap::new()),
                Some(Value::Object(map)) => map
                    .iter()
                    .map(|(k, v)| match v.as_f64() {
                        Some(x) if x.is_finite() && x > 0.0 => Ok((k.clone(), x)),
                        _ => Err(format!(
                            "adapter metadata `{PREFIX}{name}` gives {k} the value {v}"
                        )),
                    })
                    .collect(),
                Some(v) => Err(format!(
                    "adapter metadata `{PREFIX}{name}` is {v}; an object"
                )),
            }
        };
        let r = number("r")?.unwrap_or(8.0); // PEFT's LoraConfig default
        Ok(Some(AdapterConfig {
            r,
            // LoRA calls it lora_alpha, LoKr alpha; PEFT's default is 8
            alpha: number("lora_alpha")?.or(number("alpha")?).unwrap_or(8.0),
            rank_pattern: pattern("rank_pattern")?,
            alpha_pattern: pattern("alpha_pattern")?,
            rslora: flag("use_rslora")?,
        }))
    }

    /// The rank the configuration gives `module`.
    pub fn rank(&self, module: &str) -> f64 {
        matching(&self.rank_pattern, module).unwrap_or(self.r)
    }

    /// PEFT's scaling of `module`: `alpha / r`, or `alpha / sqrt(r)` with rsLoRA.
    pub fn scaling(&self, module: &str) -> f64 {
        let alpha = matching(&self.alpha_pattern, module).unwrap_or(self.alpha);
        let r = self.rank(module);
        if self.rslora {
            alpha / r.sqrt()
        } else {
            alpha / r
        }
    }
}

/// The value of the first pattern (in key order) that is `module` or a dotted suffix of it.
fn matching(patterns: &BTreeMap<String, f64>, module: &str) -> Option<f64> {
    patterns
        .iter()
        .find(|(pattern, _)| {
            module == pattern.as_str()
                || module
                    .strip_suffix(pattern.as_str())
                    .is_some_and(|head| head.ends_with('.'))
        })
        .map(|(_, v)| *v)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    fn config(json: &str) -> Option<AdapterConfig> {
        let metadata = HashMap::from([(METADATA_KEY.to_string(), json.to_string())]);
        AdapterConfig::from_metadata(&metadata).unwrap()
    }

    #[test]
    fn patterns_and_rslora_give_peft_scaling() {
        let c = config(
            r#"{"transformer.r": 4, "transformer.lora_alpha": 8,
                "transformer.rank_pattern": {"attn.to_q": 2},
                "transformer.alpha_pattern": {"transformer_blocks.0.attn.to_q": 1}}"#,
        )
        .unwrap();
        assert_eq!(c.scaling("transformer_blocks.1.attn.to_k"), 2.0);
        assert_eq!(c.rank("transformer_blocks.1.attn.to_q"), 2.0);
        assert_eq!(c.scaling("transformer_blocks.1.attn.to_q"), 4.0);
        assert_eq!(c.scaling("transformer_blocks.0.attn.to_q"), 0.5);
        // a pattern matches at a dot boundary only
        assert_eq!(c.rank("transformer_blocks.1.attn.xto_q"), 4.0);
        let rs = config(
            r#"{"transformer.r": 16, "transformer.lora_alpha": 8, "transformer.use_rslora": true}"#,
        )
        .unwrap();
        assert_eq!(rs.scaling("x"), 2.0);
    }

    #[test]
    fn dora_and_bad_numbers_are_refused() {
        let metadata = |json: &str| {
            AdapterConfig::from_metadata(&HashMap::from([(METADATA_KEY.into(), json.into())]))
        };
        assert!(metadata(r#"{"transformer.use_dora": true}"#)
            .unwrap_err()
            .contains("DoRA"));
        assert!(metadata(r#"{"transformer.r": -1}"#)
            .unwrap_err()
            .contains("positive"));
        assert!(metadata(r#"{"transformer.use_rslora": "yes"}"#)
            .unwrap_err()
            .contains("true or false"));
        assert!(metadata("[1]").is_err());
        assert!(metadata(r#"{"text_encoder.r": 4}"#).unwrap().is_none());
    }
}
