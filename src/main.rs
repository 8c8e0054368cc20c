//! The `klein` command line: parses flags, reports progress on stderr, writes PNG files.
//! All the work is done by the library.
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use klein::manifest::Manifest;
use klein::output::{encode_png, write_atomic};
use klein::pipeline::{Generation, Pipeline, PipelineOptions, Progress, Request, MAX_BATCH};
use klein::runtime::{Device, RuntimeOptions};
use klein::KleinError;

/// The bundled tiny model, used when neither `--model` nor `KLEIN_MODEL` is given.
const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/onnx/klein-tiny");

#[derive(Parser)]
#[command(
    name = "klein",
    version,
    about = "Run FLUX.2-klein image models on ONNX Runtime"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate images: text-to-image, or edit/compose with --ref.
    Generate(Box<GenerateArgs>),
    /// Show what is in a bundle.
    Info(InfoArgs),
}

#[derive(Args)]
struct GenerateArgs {
    /// The prompt (may be empty).
    prompt: String,
    /// Bundle directory [default: $KLEIN_MODEL, else the bundled tiny model]
    #[arg(long, short = 'm')]
    model: Option<PathBuf>,
    /// Output width in pixels, floored to a multiple of 16 [default: first reference's width, else the bundle's]
    #[arg(long)]
    width: Option<u32>,
    /// Output height in pixels, floored to a multiple of 16 [default: first reference's height, else the bundle's]
    #[arg(long)]
    height: Option<u32>,
    /// Denoising steps [default: the bundle's, 4 for distilled models]
    #[arg(long)]
    steps: Option<usize>,
    /// Classifier-free guidance scale, base (non-distilled) models only [default: the bundle's]
    #[arg(long)]
    guidance: Option<f64>,
    /// Seed of the initial noise (same seed, same image as diffusers) [default: random, printed]
    #[arg(long)]
    seed: Option<u64>,
    /// Reference image (repeatable): one to edit, several to compose
    #[arg(long = "ref", value_name = "IMAGE")]
    refs: Vec<PathBuf>,
    /// Images to generate for the prompt (one batch)
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=MAX_BATCH as i64))]
    num_images: u16,
    /// Execution provider: cpu, cuda, cuda:N, coreml or auto
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Threads per operator [default: ONNX Runtime's choice]
    #[arg(long)]
    threads: Option<usize>,
    /// Output PNG file; with --num-images N, files NAME-1.png ... NAME-N.png
    #[arg(short, long, default_value = "klein.png")]
    output: PathBuf,
    /// Print nothing on stderr but errors and warnings
    #[arg(long, short)]
    quiet: bool,
    /// Print the time spent in each stage
    #[arg(long)]
    timings: bool,
    /// Directory of an on-disk prompt-embedding cache
    #[arg(long)]
    prompt_cache: Option<PathBuf>,
    /// Check the sha256 of every bundle file before loading
    #[arg(long)]
    verify_hashes: bool,
    /// ONNX Runtime shared library [default: $ORT_DYLIB_PATH, else the one set up at build time]
    #[arg(long)]
    ort_lib: Option<PathBuf>,
}

#[derive(Args)]
struct InfoArgs {
    /// Bundle directory [default: $KLEIN_MODEL, else the bundled tiny model]
    model: Option<PathBuf>,
    /// Also check the sha256 of every file
    #[arg(long)]
    verify: bool,
}

fn default_model(model: Option<PathBuf>) -> PathBuf {
    model
        .or_else(|| std::env::var_os("KLEIN_MODEL").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(BUNDLED_MODEL))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(*args),
        Command::Info(args) => info(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("klein: error: {error:#}");
            let user_error = error.chain().any(|e| {
                e.downcast_ref::<KleinError>()
                    .is_some_and(KleinError::is_user_error)
                    || e.downcast_ref::<UsageError>().is_some()
            });
            ExitCode::from(if user_error { 2 } else { 1 })
        }
    }
}

/// A command-line mistake only the binary can see (the library's checks return [`KleinError`]s).
/// Exits with code 2, as every user error does.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageError(String);

/// Refuses, before any work, output paths that could not be written once the images are made.
fn check_output_paths(paths: &[PathBuf]) -> anyhow::Result<()> {
    for path in paths {
        if path.is_dir() {
            return Err(UsageError(format!(
                "output {} is a directory; give a file name such as {}",
                path.display(),
                path.join("klein.png").display()
            ))
            .into());
        }
        let parent = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        if !parent.is_dir() {
            return Err(UsageError(format!(
                "output {}: the directory {} does not exist; create it first",
                path.display(),
                parent.display()
            ))
            .into());
        }
    }
    Ok(())
}

/// Output paths: `out.png`, or `out-1.png` ... `out-N.png` for a batch.
fn output_paths(output: &Path, n: usize) -> Vec<PathBuf> {
    if n == 1 {
        return vec![output.to_path_buf()];
    }
    let stem = output
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "klein".into());
    let ext = output
        .extension()
        .map(|e| e.to_string_lossy().into_owned())
        .unwrap_or_else(|| "png".into());
    (1..=n)
        .map(|i| output.with_file_name(format!("{stem}-{i}.{ext}")))
        .collect()
}

fn generate(args: GenerateArgs) -> anyhow::Result<()> {
    let model = default_model(args.model);
    let paths = output_paths(&args.output, usize::from(args.num_images));
    check_output_paths(&paths)?;
    let seed = args
        .seed
        .unwrap_or_else(|| RandomState::new().hash_one(std::process::id()));
    let attended = !args.quiet && std::io::stderr().is_terminal();
    let say = |line: String| {
        if !args.quiet {
            eprintln!("{line}");
        }
    };

    let mut runtime = RuntimeOptions::default();
    if let Some(lib) = &args.ort_lib {
        runtime = runtime.with_library(lib);
    }
    let mut options = PipelineOptions::default()
        .with_device(args.device)
        .with_runtime(runtime)
        .with_verify_hashes(args.verify_hashes);
    if let Some(threads) = args.threads {
        options = options.with_threads(threads);
    }
    if let Some(dir) = &args.prompt_cache {
        options = options.with_prompt_cache_dir(dir);
    }
    // Every error of `Pipeline::load` names the bundle or the file in it.
    let mut pipeline = Pipeline::load(&model, options)?;

    let mut request = Request::new(args.prompt.clone())
        .with_seed(seed)
        .with_num_images(args.num_images as usize);
    for path in &args.refs {
        request = request.with_reference(pipeline.load_reference(path)?);
    }
    request.width = args.width;
    request.height = args.height;
    request.steps = args.steps;
    request.guidance = args.guidance;
    let (width, height) = pipeline.output_size(&request)?;
    let manifest = pipeline.manifest();
    if manifest.model.is_distilled && args.guidance.is_some_and(|g| g > 1.0) {
        eprintln!(
            "klein: warning: --guidance is ignored: {} is a distilled model",
            manifest.model.name
        );
    }
    say(format!("seed: {seed}"));
    say(format!(
        "model: {} ({}), {width}x{height}",
        manifest.model.name,
        model.display()
    ));

    let bar = ProgressBar::hidden();
    if attended {
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template("{msg:20} [{bar:30}] {pos}/{len} {elapsed}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    }
    let mut on_progress = |event: Progress| {
        match event {
            Progress::StageStarted(stage) => {
                bar.set_message(stage.label());
                bar.set_length(1);
                bar.set_position(0);
            }
            Progress::Step { step, total } => {
                bar.set_message("denoise");
                bar.set_length(total as u64);
                bar.set_position(step as u64);
            }
            Progress::StageFinished(..) => bar.set_position(bar.length().unwrap_or(1)),
        }
        ControlFlow::Continue(())
    };
    let generation = pipeline.generate(&request, Some(&mut on_progress))?;
    bar.finish_and_clear();
    if generation.prompt_truncated {
        eprintln!(
            "klein: warning: the prompt is longer than {} tokens and was truncated, as the reference pipeline does",
            pipeline.manifest().tokenizer.max_sequence_length
        );
    }
    let device = pipeline
        .device_used()
        .map(|d| d.to_string())
        .unwrap_or_else(|| "none".to_string());
    say(format!("device: {device}"));
    if args.timings {
        for (stage, elapsed) in &generation.timings {
            eprintln!("{:>20}: {:8.3} s", stage.label(), elapsed.as_secs_f64());
        }
    }
    let text = png_text(&pipeline, &generation, &args.prompt, &args.refs, &device)?;
    for (image, path) in generation.images.iter().zip(&paths) {
        write_atomic(path, &encode_png(image, &text)?)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn png_text(
    pipeline: &Pipeline,
    g: &Generation,
    prompt: &str,
    refs: &[PathBuf],
    device: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let manifest = pipeline.manifest();
    let manifest_path = pipeline.bundle_dir().join(klein::manifest::MANIFEST_FILE);
    let bundle_hash = sha256_hex(
        &std::fs::read(&manifest_path)
            .with_context(|| format!("reading {}", manifest_path.display()))?,
    );
    let refs: Vec<String> = refs.iter().map(|r| r.display().to_string()).collect();
    Ok(vec![
        ("prompt".into(), prompt.into()),
        ("seed".into(), g.seed.to_string()),
        ("steps".into(), g.steps.to_string()),
        ("guidance".into(), g.guidance.to_string()),
        ("size".into(), format!("{}x{}", g.width, g.height)),
        ("model".into(), manifest.model.name.clone()),
        (
            "model_variant".into(),
            variant_name(manifest.model.variant)?,
        ),
        ("bundle_sha256".into(), bundle_hash),
        ("device".into(), device.into()),
        ("references".into(), serde_json::to_string(&refs)?),
        (
            "Software".into(),
            format!("klein {}", env!("CARGO_PKG_VERSION")),
        ),
    ])
}

/// The manifest's name of a model variant (`4b`, `9b`, `tiny`, `custom`).
fn variant_name(variant: klein::manifest::ModelVariant) -> anyhow::Result<String> {
    let value = serde_json::to_value(variant)?;
    value
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("model variant {value} is not a string"))
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn info(args: InfoArgs) -> anyhow::Result<()> {
    let model = default_model(args.model);
    let manifest = Manifest::load(&model)?;
    if args.verify {
        manifest.verify_hashes(&model)?;
    }
    let m = &manifest.model;
    println!("bundle:       {}", model.display());
    println!(
        "model:        {} (variant {}, {})",
        m.name,
        variant_name(m.variant)?,
        if m.is_distilled { "distilled" } else { "base" }
    );
    println!(
        "defaults:     {} steps, guidance {}, {}x{}",
        m.default_steps, m.default_guidance, m.default_width, m.default_height
    );
    let te = &manifest.text_encoder;
    println!(
        "text encoder: hidden {}, layers {:?} of {} ({} in the graph), embeddings {}",
        te.hidden_size, te.hidden_layers, te.num_hidden_layers, te.layers_in_graph, te.embed_dim
    );
    let tr = &manifest.transformer;
    println!(
        "transformer:  {} double + {} single blocks, {} heads x {}, joint dim {}",
        tr.num_layers,
        tr.num_single_layers,
        tr.num_attention_heads,
        tr.attention_head_dim,
        tr.joint_attention_dim
    );
    println!(
        "tokenizer:    pad {:?} ({}), max {} tokens",
        manifest.tokenizer.pad_token,
        manifest.tokenizer.pad_token_id,
        manifest.tokenizer.max_sequence_length
    );
    println!("graphs:");
    for (name, spec) in manifest.graphs.iter() {
        let bytes = manifest.files.get(&spec.file).map(|f| f.bytes).unwrap_or(0);
        let quant = spec
            .quantization
            .as_ref()
            .map(serde_json::to_string)
            .transpose()?
            .unwrap_or_else(|| "none".into());
        println!(
            "  {name:13} {:>10.1} MB  {}  quantization {quant}",
            bytes as f64 / 1e6,
            spec.precision
        );
    }
    let e = &manifest.exporter;
    println!(
        "exported by:  {} {} (torch {}, diffusers {}, opset {})",
        e.name, e.version, e.torch, e.diffusers, e.opset
    );
    println!(
        "needs:        ONNX Runtime >= {}",
        manifest.min_onnxruntime_version
    );
    if args.verify {
        println!(
            "hashes:       all {} files match the manifest",
            manifest.files.len()
        );
    }
    Ok(())
}
