//! The on-disk prompt-embedding cache: a hit equals a fresh encoding, entries are keyed by prompt,
//! and an entry that cannot be used (another prompt's, wrong shape, NaN, corrupt) is a miss with a
//! warning, not an error; an unwritable cache is a warning too.
use klein::pipeline::{Pipeline, PipelineOptions};
use klein::runtime::{Device, RuntimeOptions};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use std::path::Path;

use crate::util::{ort_library, repo, temp_dir};

/// The pipeline's warnings mention `needle`.
fn assert_warned(pipeline: &mut Pipeline, needle: &str) {
    let warnings = pipeline.take_warnings();
    assert!(
        warnings.iter().any(|w| w.contains(needle)),
        "no warning with `{needle}`: {warnings:?}"
    );
}

/// The raw data of an entry's tensor (its header's metadata order is not fixed).
fn tensor_bytes(entry: &[u8]) -> Vec<u8> {
    let tensors = SafeTensors::deserialize(entry).unwrap();
    tensors.tensor("prompt_embeds").unwrap().data().to_vec()
}

/// Replaces the tensor of a cache entry, keeping its metadata (bundle and prompt).
fn rewrite(entry: &Path, values: &[f32], shape: &[usize]) {
    let bytes = std::fs::read(entry).unwrap();
    let (_, metadata) = SafeTensors::read_metadata(&bytes).unwrap();
    let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let view = TensorView::new(Dtype::F32, shape.to_vec(), &data).unwrap();
    let out =
        safetensors::serialize([("prompt_embeds", view)], metadata.metadata().clone()).unwrap();
    std::fs::write(entry, out).unwrap();
}

fn pipeline(cache: &Path) -> Pipeline {
    pipeline_of(&repo().join("onnx/klein-tiny"), cache)
}

fn pipeline_of(bundle: &Path, cache: &Path) -> Pipeline {
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_prompt_cache_dir(cache);
    Pipeline::load(bundle, options).unwrap()
}

/// Two bundles with the same text encoder and tokenizer files but another chat template (as a
/// checkpoint whose template alone changed exports) do not share entries: each prompt's
/// embeddings are those of its own bundle's template.
#[test]
fn bundles_with_another_prompt_template_do_not_share_entries() {
    let cache = temp_dir("prompt-cache-template");
    let prompt = "a lighthouse at dusk";
    let bundle = crate::cli::BundleCopy::new("prompt-cache-template-bundle");
    let manifest = bundle.file("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let changed = text.replace("<think>\\n\\n</think>", "<think>\\n</think>");
    assert_ne!(text, changed, "the template was changed");
    std::fs::write(&manifest, changed).unwrap();
    let own = pipeline_of(bundle.path(), &temp_dir("prompt-cache-template-own"))
        .encode_prompt(prompt, None)
        .unwrap()
        .embeds;
    let original = pipeline(&cache).encode_prompt(prompt, None).unwrap().embeds;
    assert_ne!(own, original, "the templates give other embeddings");
    let from_cache = pipeline_of(bundle.path(), &cache)
        .encode_prompt(prompt, None)
        .unwrap()
        .embeds;
    assert_eq!(from_cache, own, "not the other bundle's entry");
    assert_eq!(
        std::fs::read_dir(&cache).unwrap().count(),
        2,
        "one entry each"
    );
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

    // Another prompt's entry in this prompt's place is rejected (with a warning), not used.
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
    let original = std::fs::read(&entries[0]).unwrap();
    std::fs::copy(&other_entry, &entries[0]).unwrap();
    let mut p = pipeline(&cache);
    let again = p
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    assert_eq!(again, fresh, "encoded again");
    assert_warned(&mut p, "another bundle or prompt");
    assert!(
        tensor_bytes(&std::fs::read(&entries[0]).unwrap()) == tensor_bytes(&original),
        "the entry is rewritten with this prompt's embeddings"
    );

    // A valid entry is what comes back, bit for bit.
    let doubled: Vec<f32> = fresh.iter().map(|v| v * 2.0).collect();
    rewrite(&entries[0], &doubled, fresh.shape());
    let hit = pipeline(&cache)
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    assert_eq!(hit.iter().copied().collect::<Vec<f32>>(), doubled);

    // Wrong shape and non-finite values: rejected, encoded again.
    for (values, shape, needle) in [
        (vec![0.5f32; 6], vec![1usize, 2, 3], "holds F32 [1, 2, 3]"),
        (
            vec![f32::NAN; fresh.len()],
            fresh.shape().to_vec(),
            "non-finite",
        ),
    ] {
        rewrite(&entries[0], &values, &shape);
        let mut p = pipeline(&cache);
        let again = p
            .encode_prompt("a lighthouse at dusk", None)
            .unwrap()
            .embeds;
        assert_eq!(again, fresh, "{needle}");
        assert_warned(&mut p, needle);
    }

    // A corrupt entry is a miss: the prompt is encoded again and the entry rewritten.
    std::fs::write(&entries[0], b"not safetensors").unwrap();
    let again = pipeline(&cache)
        .encode_prompt("a lighthouse at dusk", None)
        .unwrap()
        .embeds;
    assert_eq!(again, fresh);
    assert_ne!(std::fs::read(&entries[0]).unwrap(), b"not safetensors");
}

/// A cache directory that cannot be created (under a file) is refused when the pipeline loads, as
/// the CPU cache's is: the path is mistyped, and a server would otherwise run without the cache it
/// was given. One that fails later (replaced by a file here) warns; the prompt is still encoded.
#[test]
fn a_cache_that_cannot_be_made_is_refused_and_one_that_fails_later_warns() {
    let dir = temp_dir("prompt-cache-unwritable");
    std::fs::write(dir.join("file"), b"x").unwrap();
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_prompt_cache_dir(dir.join("file").join("cache"));
    let error = Pipeline::load(&repo().join("onnx/klein-tiny"), options)
        .err()
        .unwrap();
    assert!(error.is_user_error(), "{error}");
    assert!(
        error.to_string().contains("prompt cache directory"),
        "{error}"
    );

    let cache = dir.join("cache");
    let mut p = pipeline(&cache);
    std::fs::remove_dir(&cache).unwrap();
    std::fs::write(&cache, b"x").unwrap();
    let embeds = p.encode_prompt("a cat", None).unwrap().embeds;
    assert!(embeds.iter().all(|v| v.is_finite()));
    assert_warned(&mut p, "the prompt cache could not be written");
}
