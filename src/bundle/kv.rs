//! The KV variant's transformer contract (`model.kv_cache`, `Flux2KleinKVPipeline`): besides the
//! plain inputs, the graph takes the reference tokens whose attention K/V it extracts, and the K/V
//! an earlier step extracted; it returns the extracted K/V (export/klein_export/kv_cache.py).
use super::manifest::{Manifest, TransformerSpec};

/// `[B, R, 128]` reference tokens to extract (R = 0 on the steps that use the cache).
pub const REF_LATENTS: &str = "ref_latents";
/// `[R, 4]` their position ids.
pub const REF_IDS: &str = "ref_ids";
/// `[layers, 2, B, K, heads * head_dim]` K/V of an earlier step (K = 0 on the first).
pub const CACHED_KV: &str = "cached_kv";
/// `[layers, 2, B, R, heads * head_dim]` output: the K/V of `ref_latents`.
pub const REF_KV: &str = "ref_kv";

/// The blocks whose K/V are cached (every double and single block), and the width of one token's
/// K or V.
pub fn kv_shape(tr: &TransformerSpec) -> (usize, usize) {
    (
        tr.num_layers + tr.num_single_layers,
        tr.num_attention_heads * tr.attention_head_dim,
    )
}

impl Manifest {
    /// What is wrong with the manifest's KV contract: a KV bundle's transformer must have the KV
    /// tensors with the architecture's sizes (and no static shapes); another bundle's must not.
    pub(super) fn kv_problems(&self) -> Vec<String> {
        let spec = &self.graphs.transformer;
        let has = |name: &str| {
            spec.inputs
                .iter()
                .chain(&spec.outputs)
                .any(|t| t.name == name)
        };
        let names = [REF_LATENTS, REF_IDS, CACHED_KV, REF_KV];
        if !self.model.kv_cache {
            return names
                .iter()
                .find(|n| has(n))
                .map(|name| {
                    format!(
                        "graphs.transformer has `{name}`, a KV transformer's tensor, but \
                         model.kv_cache is not set"
                    )
                })
                .into_iter()
                .collect();
        }
        let mut problems: Vec<String> = names
            .iter()
            .filter(|n| !has(n))
            .map(|name| {
                format!(
                    "model.kv_cache is set but graphs.transformer has no `{name}` (a KV \
                     transformer takes ref_latents, ref_ids and cached_kv and returns ref_kv)"
                )
            })
            .collect();
        if self.static_shapes.is_some() {
            problems
                .push("model.kv_cache and static_shapes together: KV bundles are dynamic".into());
        }
        let (layers, width) = kv_shape(&self.transformer);
        let sizes = [
            (0, layers, "layers (num_layers + num_single_layers)"),
            (4, width, "num_attention_heads x attention_head_dim"),
        ];
        for name in [CACHED_KV, REF_KV].into_iter().filter(|n| has(n)) {
            for (axis, want, what) in sizes {
                let found = spec.fixed_dim(name, axis);
                if found != Some(want as u64) {
                    problems.push(format!(
                        "graphs.transformer `{name}` axis {axis} is {} but the transformer's \
                         {what} is {want}",
                        found.map_or("not a fixed size".to_string(), |n| n.to_string())
                    ));
                }
            }
        }
        problems
    }
}
