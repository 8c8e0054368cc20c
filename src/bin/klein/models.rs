//! `klein models`: the installed models (`klein-export pull`), by the names `--model` takes.
use klein::bundle::installed::{list_in, models_dir};
use klein::bundle::Manifest;

pub(crate) fn models() -> anyhow::Result<()> {
    let Some(dir) = models_dir() else {
        println!("no models folder: set KLEIN_MODELS_DIR (or HOME)");
        return Ok(());
    };
    let installed = list_in(&dir);
    if installed.is_empty() {
        println!(
            "no models in {}; install one with `klein-export pull ORG/NAME` (for example \
             black-forest-labs/FLUX.2-klein-4B)",
            dir.display()
        );
        return Ok(());
    }
    println!(
        "{:<28} {:<10} {:<24} {:>9}  folder",
        "name", "kind", "weights", "size"
    );
    for (name, path) in installed {
        match Manifest::load(&path) {
            Ok(manifest) => {
                let kind = if manifest.model.is_distilled {
                    "distilled"
                } else {
                    "base"
                };
                let gib = manifest.files.values().map(|f| f.bytes).sum::<u64>() as f64
                    / f64::from(1u32 << 30);
                println!(
                    "{name:<28} {kind:<10} {:<24} {:>5.1} GiB  {}",
                    weights(&manifest),
                    gib,
                    path.display()
                );
            }
            Err(error) => println!("{name:<28} unusable: {error}"),
        }
    }
    Ok(())
}

/// The transformer's weights: its precision, and its quantization if any (`fp32, int8 dynamic`).
fn weights(manifest: &Manifest) -> String {
    let graph = &manifest.graphs.transformer;
    match &graph.quantization {
        Some(q) => format!("{}, int{} {}", graph.precision, q.bits, q.method),
        None => graph.precision.to_string(),
    }
}
