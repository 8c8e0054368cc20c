//! A bundle on disk: its manifest (the schema and its consistency), the graphs' I/O contract, hash
//! verification with its stamps, static-shape buckets, and which devices can run it. Nothing here
//! runs a graph.
pub mod buckets;
#[cfg(feature = "tiny-model")]
pub mod bundled;
pub mod component;
pub mod contract;
#[cfg(feature = "hub")]
pub mod hub;
pub mod installed;
pub mod kv;
pub mod lora_targets;
pub mod manifest;
pub mod stamp;
pub mod support;

pub use component::Component;
pub use manifest::{Manifest, ModelFamily, MANIFEST_FILE};
pub use stamp::{default_cache_dir, Verification};
