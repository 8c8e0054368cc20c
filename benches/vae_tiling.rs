//! `cargo bench --bench vae_tiling -- BUNDLE SIZE on|off [THREADS [CPU_CACHE_DIR]]`: the VAE
//! decode stage alone,
//! on the seed-0 noise of a SIZE x SIZE image (the decoder's cost does not depend on the latents'
//! values), with or without tiling. Prints the decode's seconds and the process's peak resident
//! memory (VmHWM), which is the decoder's: nothing else is loaded but the tokenizer.
//!
//! Run each setting in its own process (the peak is the process's), with `ulimit -v` to turn an
//! allocation the machine cannot hold into an error rather than a swap storm.
use std::path::PathBuf;
use std::time::Instant;

use klein::pipeline::{Pipeline, PipelineOptions, VaeTiling};
use klein::runtime::Device;
use klein::stages::latents::pack_latents;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    if args.len() < 3 {
        eprintln!(
            "usage: cargo bench --bench vae_tiling -- BUNDLE SIZE on|off [THREADS [CPU_CACHE_DIR]]"
        );
        std::process::exit(2);
    }
    let bundle = PathBuf::from(&args[0]);
    let size: u32 = args[1].parse().expect("SIZE: pixels, a multiple of 16");
    let tiling: VaeTiling = args[2].parse().expect("on or off");
    let mut options = PipelineOptions::default()
        .with_device(Device::Cpu)
        .with_verify_hashes(false)
        .with_vae_tiling(tiling);
    if let Some(threads) = args.get(3) {
        options = options.with_threads(threads.parse().expect("THREADS: a number"));
    }
    if let Some(cache) = args.get(4) {
        options = options.with_cpu_cache_dir(cache);
    }
    let mut pipeline = match Pipeline::load(&bundle, options) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{}", klein::error::chain(&e));
            std::process::exit(1);
        }
    };
    let noise = pipeline.prepare_latents(0, 1, size, size); // [1, 128, h, w]
    let (h, w) = (noise.dim().2, noise.dim().3);
    let packed = pack_latents(noise.view()); // [1, h*w, 128]
    let start = Instant::now();
    let result = pipeline.decode(packed.view(), h, w, None);
    let seconds = start.elapsed().as_secs_f64();
    let peak = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .map(str::to_string)
        })
        .unwrap_or_else(|| "VmHWM: unknown".into());
    match result {
        Ok(images) => println!(
            "decode {size}x{size} tiling {}: {seconds:.2} s, {} image(s), peak {peak}",
            args[2],
            images.len()
        ),
        Err(e) => {
            println!(
                "decode {size}x{size} tiling {}: failed after {seconds:.2} s ({}), peak {peak}",
                args[2],
                klein::error::chain(&e)
            );
            std::process::exit(1);
        }
    }
}
