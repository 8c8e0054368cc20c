//! The CPU load cache (`PipelineOptions::with_cpu_cache_dir`): the first load saves each graph as
//! ONNX Runtime optimised it, with its prepacked weights; later loads use the saved copy and make
//! the same image, bit for bit; a damaged entry is replaced with a warning, never an error.
use std::path::{Path, PathBuf};

use klein::bundle::Component;
use klein::pipeline::{Pipeline, PipelineOptions, Request};
use klein::runtime::{Device, RuntimeOptions};

use crate::util::{ort_library, repo, temp_dir, test_cache_dir};

fn pipeline(cpu_cache: Option<&Path>) -> Pipeline {
    let mut options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_cache_dir(test_cache_dir());
    if let Some(dir) = cpu_cache {
        options = options.with_cpu_cache_dir(dir);
    }
    Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap()
}

/// One image's pixels, and the pipeline's warnings after it.
fn generate(cpu_cache: Option<&Path>) -> (Vec<u8>, Vec<String>) {
    let request = Request::new("a lighthouse at dusk")
        .with_seed(3)
        .with_size(64, 48)
        .with_steps(2);
    let mut pipeline = pipeline(cpu_cache);
    let generated = pipeline.generate(&request, None).unwrap();
    (generated.images[0].pixels.clone(), pipeline.take_warnings())
}

/// The saved graphs under `cache`: `<key>/<component>.onnx`, sorted.
fn saved_graphs(cache: &Path) -> Vec<PathBuf> {
    let mut graphs: Vec<PathBuf> = std::fs::read_dir(cache)
        .unwrap()
        .flat_map(|entry| std::fs::read_dir(entry.unwrap().path()).unwrap())
        .map(|file| file.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == "onnx"))
        .collect();
    graphs.sort();
    graphs
}

#[test]
fn saved_graphs_make_the_same_image() {
    let cache = temp_dir("cpu-cache");
    let (plain, warnings) = generate(None);
    assert!(warnings.is_empty(), "{warnings:?}");

    let (saving, warnings) = generate(Some(&cache));
    assert!(warnings.is_empty(), "{warnings:?}");
    let graphs = saved_graphs(&cache);
    let names: Vec<_> = graphs
        .iter()
        .map(|g| g.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    let mut expected = vec!["text_encoder.onnx", "transformer.onnx", "vae_decoder.onnx"];
    expected.sort();
    let mut sorted = names.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "one entry per graph loaded");
    for graph in &graphs {
        let data = graph.with_extension("onnx.data");
        assert!(data.is_file(), "{} has no weights file", graph.display());
    }
    // No partial folder is left behind.
    let partial = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("partial"))
        .count();
    assert_eq!(partial, 0);

    let modified: Vec<_> = graphs
        .iter()
        .map(|g| std::fs::metadata(g).unwrap().modified().unwrap())
        .collect();
    let (cached, warnings) = generate(Some(&cache));
    assert!(warnings.is_empty(), "{warnings:?}");
    let again: Vec<_> = graphs
        .iter()
        .map(|g| std::fs::metadata(g).unwrap().modified().unwrap())
        .collect();
    assert_eq!(
        modified, again,
        "a later load reads the entries, never rewrites them"
    );
    assert!(
        plain == saving && plain == cached,
        "the cache changed the image"
    );
}

/// The transformer's saved graph under `cache`.
fn saved_transformer(cache: &Path) -> PathBuf {
    saved_graphs(cache)
        .into_iter()
        .find(|g| g.ends_with("transformer.onnx"))
        .unwrap()
}

/// After the transformer's entry was damaged: the next run makes `first`'s image with a warning
/// that mentions `needle` (the entry saved again), and the run after it uses the new entry quietly.
fn assert_saved_again(cache: &Path, first: &[u8], needle: &str) {
    let (second, warnings) = generate(Some(cache));
    assert_eq!(first, second, "the damaged entry was used");
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("transformer") && w.contains(needle)),
        "{warnings:?}"
    );
    let (third, warnings) = generate(Some(cache));
    assert_eq!(first, third);
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn a_damaged_entry_is_saved_again_with_a_warning() {
    let cache = temp_dir("cpu-cache-damaged");
    let (first, _) = generate(Some(&cache));
    let transformer = saved_transformer(&cache);
    std::fs::write(&transformer, b"not a graph").unwrap();
    assert_saved_again(&cache, &first, "saved again");
    assert!(
        std::fs::metadata(&transformer).unwrap().len() > 1000,
        "the entry was saved again"
    );
}

/// A file where an entry's folder should be (left by something else): removed and saved again,
/// once; it once stayed, and every run warned and saved a copy it then threw away.
#[test]
fn a_file_in_an_entrys_place_is_replaced_once() {
    let cache = temp_dir("cpu-cache-file");
    let (first, _) = generate(Some(&cache));
    let entry = saved_transformer(&cache).parent().unwrap().to_path_buf();
    std::fs::remove_dir_all(&entry).unwrap();
    std::fs::write(&entry, b"junk").unwrap();
    assert_saved_again(&cache, &first, "saved again");
    assert!(entry.is_dir());
}

/// Weights rewritten in place, same size (zeroed): ONNX Runtime would load them without a word and
/// make another image. The entry's list of its files' sizes and times no longer agrees, so it is
/// saved again, with a warning, and the image is the right one.
#[test]
fn an_entry_whose_weights_changed_is_saved_again() {
    let cache = temp_dir("cpu-cache-zeroed");
    let (first, _) = generate(Some(&cache));
    let weights = saved_transformer(&cache).with_extension("onnx.data");
    let size = std::fs::metadata(&weights).unwrap().len();
    std::fs::write(&weights, vec![0u8; usize::try_from(size).unwrap()]).unwrap();
    assert_saved_again(&cache, &first, "not as it was saved");
}

#[test]
fn graph_files_name_what_the_transformer_load_reads() {
    let cache = temp_dir("cpu-cache-files");
    let bundle_graph = repo().join("onnx/klein-tiny/transformer.onnx");
    // Nothing saved yet (and no cache at all): the bundle's graph, which has no external data.
    assert_eq!(
        pipeline(Some(&cache)).graph_files(Component::Transformer),
        vec![bundle_graph.clone()]
    );
    assert_eq!(
        pipeline(None).graph_files(Component::Transformer),
        vec![bundle_graph]
    );

    generate(Some(&cache));
    let files = pipeline(Some(&cache)).graph_files(Component::Transformer);
    let saved = saved_graphs(&cache)
        .into_iter()
        .find(|g| g.ends_with("transformer.onnx"))
        .unwrap();
    assert_eq!(
        files,
        vec![saved.clone(), saved.with_extension("onnx.data")],
        "the saved entry the next load maps, and its weights"
    );
}

/// With a limit, saving the bundle's graphs removes an old entry that puts the cache over it (a
/// 2 GiB sparse file here, against a 1 GiB limit), and leaves what is not an entry alone; the
/// saved graphs make the same image.
#[test]
fn a_limit_removes_old_entries_when_graphs_are_saved() {
    let cache = temp_dir("cpu-cache-limit");
    let old = cache.join("0123456789abcdef0123456789abcdef");
    std::fs::create_dir_all(&old).unwrap();
    let big = std::fs::File::create(old.join("transformer.onnx.data")).unwrap();
    big.set_len(2 << 30).unwrap();
    std::fs::write(old.join("transformer.onnx"), b"graph").unwrap();
    std::fs::write(old.join("files"), b"").unwrap();
    // Last used a day ago (an entry used in the last 10 minutes would warn: a limit too small).
    let day_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(86_400);
    let stamp = std::fs::File::options().write(true).open(old.join("files"));
    stamp.unwrap().set_modified(day_ago).unwrap();
    std::fs::create_dir_all(cache.join("mine")).unwrap();
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1)
        .with_runtime(RuntimeOptions::default().with_library(ort_library()))
        .with_cache_dir(test_cache_dir())
        .with_cpu_cache_dir(&cache)
        .with_cpu_cache_limit_gib(1);
    let mut pipeline = Pipeline::load(&repo().join("onnx/klein-tiny"), options).unwrap();
    let request = Request::new("a lighthouse at dusk")
        .with_seed(3)
        .with_size(64, 48)
        .with_steps(2);
    let pixels = pipeline.generate(&request, None).unwrap().images[0]
        .pixels
        .clone();
    assert!(pipeline.take_warnings().is_empty());
    assert!(!old.exists(), "the old entry went");
    assert!(cache.join("mine").exists(), "not an entry: left alone");
    assert_eq!(saved_graphs(&cache).len(), 3);
    assert_eq!(pixels, generate(None).0);
}
