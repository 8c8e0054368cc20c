//! Soak: many generations on one pipeline in one process (64x64, 2 steps, the bundled tiny model),
//! to catch leaks. Prints the resident memory (VmRSS) after the 5th and the last generation and
//! their ratio, and fails if any image differs from the first (same seed every time).
//!
//! `cargo bench --bench soak` runs 50; `cargo bench --bench soak -- 200` another count. ONNX
//! Runtime is found as by the library (`ORT_DYLIB_PATH`, or `KLEIN_ORT_DYLIB` at build time).
//! Under `cargo test --benches` it only says how to run it.
use std::process::ExitCode;
use std::time::Instant;

use klein::pipeline::{Pipeline, PipelineOptions, Request};
use klein::runtime::Device;

const DEFAULT_GENERATIONS: usize = 50;
/// Memory is compared with the level after this many generations (sessions and allocator arenas
/// have grown to their working size by then).
const WARM_UP: usize = 5;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("soak: skipped outside `cargo bench --bench soak`");
        return ExitCode::SUCCESS;
    }
    let generations = match args.iter().find(|a| !a.starts_with("--")) {
        None => DEFAULT_GENERATIONS,
        Some(n) => match n.parse::<usize>() {
            Ok(n) if n >= WARM_UP => n,
            _ => {
                eprintln!("soak: the count must be a number >= {WARM_UP}, got `{n}`");
                return ExitCode::from(2);
            }
        },
    };
    match soak(generations) {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("soak: {message}");
            ExitCode::FAILURE
        }
    }
}

fn soak(generations: usize) -> Result<(), String> {
    let bundle = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/klein-tiny");
    let options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_threads(1);
    let mut pipeline = Pipeline::load(&bundle, options).map_err(|e| format!("{e:#}"))?;
    let request = Request::new("a red fox in the snow")
        .with_seed(7)
        .with_size(64, 64)
        .with_steps(2);
    println!(
        "soak: {generations} generations, 64x64, 2 steps, {}",
        bundle.display()
    );

    let start = Instant::now();
    let mut first = None;
    let mut warm_rss = None;
    for i in 1..=generations {
        let generation = pipeline
            .generate(&request, None)
            .map_err(|e| format!("generation {i}: {e:#}"))?;
        let pixels = generation
            .images
            .into_iter()
            .next()
            .map(|image| image.pixels);
        match &first {
            None => first = pixels,
            Some(want) if pixels.as_ref() != Some(want) => {
                return Err(format!(
                    "generation {i} differs from the first (same request and seed)"
                ));
            }
            Some(_) => {}
        }
        if i == WARM_UP {
            warm_rss = resident_kib();
            println!("after generation {i:>3}: VmRSS {}", show(warm_rss));
        }
    }
    let elapsed = start.elapsed();
    let last_rss = resident_kib();
    println!(
        "after generation {generations:>3}: VmRSS {}",
        show(last_rss)
    );
    match (warm_rss, last_rss) {
        (Some(warm), Some(last)) if warm > 0 => println!(
            "ratio {generations}/{WARM_UP}: {:.3}",
            last as f64 / warm as f64
        ),
        _ => println!("ratio {generations}/{WARM_UP}: n/a"),
    }
    println!(
        "{:.1} ms per generation ({:.2} s in all), every image identical",
        elapsed.as_secs_f64() * 1000.0 / generations as f64,
        elapsed.as_secs_f64()
    );
    Ok(())
}

/// Resident set size in KiB from `/proc/self/status` (Linux); `None` elsewhere.
fn resident_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    // "VmRSS:	  123456 kB"
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn show(kib: Option<u64>) -> String {
    kib.map_or_else(
        || "n/a".to_string(),
        |k| format!("{:.1} MiB", k as f64 / 1024.0),
    )
}
