//! The four graphs of a bundle, by name: the only place their names are spelled.
use std::fmt;

/// One graph of a bundle; its name is the manifest's `graphs` key and the graph's
/// `klein.component` metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Component {
    /// Prompt tokens to `prompt_embeds` (Qwen3).
    TextEncoder,
    /// One velocity prediction (Flux2 MM-DiT).
    Transformer,
    /// Reference image to normalised, patchified latents.
    VaeEncoder,
    /// Normalised, patchified latents to image.
    VaeDecoder,
}

impl Component {
    /// Every component, in pipeline order.
    pub const ALL: [Component; 4] = [
        Component::TextEncoder,
        Component::Transformer,
        Component::VaeEncoder,
        Component::VaeDecoder,
    ];

    /// The components with one graph per output size in a static-shape bundle.
    pub const PER_BUCKET: [Component; 3] = [
        Component::Transformer,
        Component::VaeDecoder,
        Component::VaeEncoder,
    ];

    /// The name in `manifest.json` and in the graph's `klein.component` metadata.
    pub fn as_str(self) -> &'static str {
        match self {
            Component::TextEncoder => "text_encoder",
            Component::Transformer => "transformer",
            Component::VaeEncoder => "vae_encoder",
            Component::VaeDecoder => "vae_decoder",
        }
    }

    /// Position in [`Component::ALL`], for tables indexed by component.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Whether a static-shape bundle has one graph of this component per bucket.
    pub fn is_per_bucket(self) -> bool {
        Component::PER_BUCKET.contains(&self)
    }
}

impl fmt::Display for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_is_the_position_in_all() {
        for (i, c) in Component::ALL.into_iter().enumerate() {
            assert_eq!(c.index(), i, "{c}");
        }
    }
}
