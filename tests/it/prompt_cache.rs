//! The on-disk prompt-embedding cache: a hit equals a fresh encoding, entries are keyed by prompt,
//! and an unreadable entry is a miss, not an error.
use klein::pipeline::{Pipeline, PipelineOptions};
use klein::runtime::{Device, RuntimeOptions};

use crate::util::{ort_library, repo, temp_dir};

fn pipeline(cache: &std::path::Path) -> Pipeline {
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_prompt_cache_dir(cache);
    Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap()
}

#[test]
fn cached_embeddings_equal_fresh_ones() {
    let cache = temp_dir("prompt-cache");
    let fresh = pipeline(&cache)
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    let entries: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(entries.len(), 1, "one entry per prompt: {entries:?}");

    // A new pipeline reads the entry: swap in another prompt's entry and it is what comes back.
    let other = pipeline(&cache)
        .encode_prompt("another prompt", None)
        .unwrap()
        .embeds;
    assert_ne!(fresh, other);
    let other_entry = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| *p != entries[0])
        .unwrap();
    std::fs::copy(&other_entry, &entries[0]).unwrap();
    let hit = pipeline(&cache)
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    assert_eq!(
        hit, other,
        "the embeddings came from the cache entry, bit for bit"
    );

    // A corrupt entry is a miss: the prompt is encoded again and the entry rewritten.
    std::fs::write(&entries[0], b"not safetensors").unwrap();
    let again = pipeline(&cache)
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    assert_eq!(again, fresh);
    assert_ne!(std::fs::read(&entries[0]).unwrap(), b"not safetensors");
}
