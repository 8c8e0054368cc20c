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
    assert_warned(&mut p, "another bundle, device setting or prompt");
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
    assert_warned(&mut p, "the prompt cache could not be updated");
}

/// The cache's entries (files named `<64 hex digits>.safetensors`).
fn cache_entries(cache: &Path) -> std::collections::BTreeSet<std::path::PathBuf> {
    std::fs::read_dir(cache)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_str().unwrap();
            name.strip_suffix(".safetensors")
                .is_some_and(|hash| hash.len() == 64 && hash.bytes().all(|b| b.is_ascii_hexdigit()))
        })
        .collect()
}

/// Past its size limit the cache removes its least recently used entries when it writes one (a
/// hit renews an entry), down to the limit; files that are not entries are neither counted nor
/// removed. Without it a server's cache grew by 15.7 MB per new prompt (the 4B) until the disk
/// was full.
#[test]
fn the_least_recently_used_entries_go_past_the_limit() {
    let cache = temp_dir("prompt-cache-limit");
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_prompt_cache_dir(&cache)
        .with_prompt_cache_limit_mib(1);
    let mut p = Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap();
    let mut paths = Vec::new();
    let mut fit = 1;
    while paths.len() < fit {
        let before = cache_entries(&cache);
        p.encode_prompt(&format!("prompt {}", paths.len()), None)
            .unwrap();
        let new: Vec<_> = cache_entries(&cache).difference(&before).cloned().collect();
        assert_eq!(new.len(), 1, "one entry per prompt");
        // As many entries as 1 MiB holds.
        fit = (1 << 20) / std::fs::metadata(&new[0]).unwrap().len() as usize;
        assert!((2..64).contains(&fit), "{fit} entries fit");
        paths.push(new[0].clone());
    }
    // Prompt 0 the oldest, then 1, ...; a file that is not an entry, larger than the limit.
    let now = std::time::SystemTime::now();
    for (i, path) in paths.iter().enumerate() {
        let age = std::time::Duration::from_secs(1000 - i as u64);
        let file = std::fs::File::options().write(true).open(path).unwrap();
        file.set_modified(now - age).unwrap();
    }
    let notes = cache.join("notes.safetensors");
    std::fs::write(&notes, vec![0u8; 2 << 20]).unwrap();
    // Someone's sha256-named safetensors file (a LoRA, say), older than every entry: not klein's.
    let foreign = cache.join(format!("{}.safetensors", "ab".repeat(32)));
    let data = vec![0u8; 3 << 20];
    let view = TensorView::new(Dtype::F32, vec![data.len() / 4], &data).unwrap();
    std::fs::write(
        &foreign,
        safetensors::serialize([("w", view)], None).unwrap(),
    )
    .unwrap();
    let file = std::fs::File::options().write(true).open(&foreign).unwrap();
    file.set_modified(now - std::time::Duration::from_secs(5000))
        .unwrap();

    // A hit renews prompt 0; a new prompt then pushes out prompt 1, the least recently used.
    let cache_entries = |cache: &Path| {
        let mut entries = cache_entries(cache);
        entries.remove(&foreign);
        entries
    };
    let before = cache_entries(&cache);
    p.encode_prompt("prompt 0", None).unwrap();
    assert_eq!(cache_entries(&cache), before, "a hit writes nothing");
    let renewed = std::fs::metadata(&paths[0]).unwrap().modified().unwrap();
    assert!(renewed > now - std::time::Duration::from_secs(100));
    p.encode_prompt("a new prompt", None).unwrap();
    let after = cache_entries(&cache);
    assert_eq!(after.len(), fit, "at most the limit");
    assert!(!after.contains(&paths[1]), "the least recently used went");
    assert!(after.contains(&paths[0]), "the renewed one stayed");
    assert!(paths[2..].iter().all(|path| after.contains(path)));
    assert!(
        notes.exists() && foreign.exists(),
        "not entries: left alone"
    );
    assert!(p.take_warnings().is_empty());
}
