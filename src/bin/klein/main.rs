//! The `klein` command line: parses flags, reports progress on stderr, writes PNG files.
//! All the work is done by the library.
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{ArgGroup, Args, Parser, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use klein::manifest::Manifest;
use klein::output::{encode_png, write_atomic};
use klein::pipeline::{Generation, Pipeline, PipelineOptions, Progress, Request, MAX_BATCH};
use klein::runtime::{
    ComputeUnits, ConvSearch, CoreMlOptions, CudaOptions, Device, RuntimeOptions,
};
use klein::KleinError;

mod batch;

/// The bundled tiny model, used when neither `--model` nor `KLEIN_MODEL` is given.
const BUNDLED_MODEL: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/onnx/klein-tiny");
/// The batch summary's file name in `--out-dir`.

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
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompts"])))]
struct GenerateArgs {
    /// The prompt (may be empty); or --prompts for many
    prompt: Option<String>,
    /// JSON Lines file, one image per line: {"prompt": "...", "seed": 7, "width": 512, "height": 512, "steps": 4, "guidance": 1.0, "refs": ["a.png"], "name": "fox"} (only "prompt" is required; refs are relative to the file). Other options apply to every line that does not set them
    #[arg(
        long,
        value_name = "FILE",
        requires = "out_dir",
        conflicts_with_all = ["output", "seed", "refs", "num_images"]
    )]
    prompts: Option<PathBuf>,
    /// Output directory of --prompts: NAME.png per line (default name: the line number, 0001) and
    /// summary.json. Lines whose output exists are skipped, so an interrupted run can be restarted
    #[arg(
        long,
        value_name = "DIR",
        requires = "prompts",
        conflicts_with = "prompt"
    )]
    out_dir: Option<PathBuf>,
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
    /// CUDA: largest size of ONNX Runtime's GPU memory arena, in GiB [default: no limit]
    #[arg(
        long,
        value_name = "GIB",
        help_heading = "CUDA (--device cuda or auto)"
    )]
    cuda_mem_limit: Option<f64>,
    /// CUDA: grow the memory arena by what each allocation needs, not by powers of two
    #[arg(long, help_heading = "CUDA (--device cuda or auto)")]
    cuda_arena_exact: bool,
    /// CUDA: cuDNN convolution algorithm search: heuristic, exhaustive or default
    #[arg(
        long,
        value_name = "SEARCH",
        default_value = "heuristic",
        help_heading = "CUDA (--device cuda or auto)"
    )]
    cuda_conv_search: ConvSearch,
    /// CUDA: TF32 tensor cores for float32 products (Ampere and newer) [default: ONNX Runtime's]
    #[arg(long, value_name = "on|off", value_parser = on_off, help_heading = "CUDA (--device cuda or auto)")]
    cuda_tf32: Option<bool>,
    /// CoreML: where graphs may run: all, cpu-gpu, cpu-ane (Neural Engine) or cpu
    #[arg(
        long,
        value_name = "UNITS",
        default_value = "all",
        help_heading = "CoreML (--device coreml or auto)"
    )]
    coreml_units: ComputeUnits,
    /// CoreML: keep compiled models in DIR between runs (created if missing)
    #[arg(
        long,
        value_name = "DIR",
        help_heading = "CoreML (--device coreml or auto)"
    )]
    coreml_cache: Option<PathBuf>,
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
    /// Do not check the sha256 of the bundle's files before loading. By default they are checked,
    /// and a stamp in $KLEIN_CACHE_DIR (else $XDG_CACHE_HOME/klein, else ~/.cache/klein) skips
    /// the check while no file changes
    #[arg(long)]
    no_verify_hashes: bool,
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
        Command::Info(args) => info(args).map(|()| ExitCode::SUCCESS),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("klein: error: {error:#}");
            ExitCode::from(if is_user_error(&error) { 2 } else { 1 })
        }
    }
}

/// Whether an error comes from what the user gave (exit code 2) rather than from the runtime (1).
fn is_user_error(error: &anyhow::Error) -> bool {
    error.chain().any(|e| {
        e.downcast_ref::<KleinError>()
            .is_some_and(KleinError::is_user_error)
            || e.downcast_ref::<UsageError>().is_some()
    })
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

/// A seed for a generation that names none (printed and stored, so the image can be remade).
fn random_seed() -> u64 {
    RandomState::new().hash_one(std::process::id())
}

fn pipeline_options(args: &GenerateArgs) -> PipelineOptions {
    let mut runtime = RuntimeOptions::default();
    if let Some(lib) = &args.ort_lib {
        runtime = runtime.with_library(lib);
    }
    let mut options = PipelineOptions::default()
        .with_device(args.device)
        .with_runtime(runtime)
        .with_verify_hashes(!args.no_verify_hashes);
    if let Some(threads) = args.threads {
        options = options.with_threads(threads);
    }
    if let Some(dir) = &args.prompt_cache {
        options = options.with_prompt_cache_dir(dir);
    }
    let mut cuda = CudaOptions::default();
    cuda.memory_limit = args
        .cuda_mem_limit
        .map(|gib| (gib * (1u64 << 30) as f64) as usize);
    cuda.arena_same_as_requested = args.cuda_arena_exact;
    cuda.conv_search = args.cuda_conv_search;
    cuda.tf32 = args.cuda_tf32;
    let mut coreml = CoreMlOptions::default();
    coreml.compute_units = args.coreml_units;
    coreml.cache_dir = args.coreml_cache.clone();
    options.with_cuda(cuda).with_coreml(coreml)
}

/// `on`/`off` (also true/false, yes/no, 1/0).
fn on_off(s: &str) -> Result<bool, String> {
    match s.to_ascii_lowercase().as_str() {
        "on" | "true" | "yes" | "1" => Ok(true),
        "off" | "false" | "no" | "0" => Ok(false),
        _ => Err(format!("`{s}` is not on or off")),
    }
}

/// Device-specific flags given for a device they do not apply to: a mistake worth stopping for
/// (`--coreml-cache` with `--device cuda` would otherwise be silently ignored).
fn check_device_flags(args: &GenerateArgs) -> Result<(), String> {
    let cuda_flags = [
        ("--cuda-mem-limit", args.cuda_mem_limit.is_some()),
        ("--cuda-arena-exact", args.cuda_arena_exact),
        (
            "--cuda-conv-search",
            args.cuda_conv_search != ConvSearch::default(),
        ),
        ("--cuda-tf32", args.cuda_tf32.is_some()),
    ];
    let coreml_flags = [
        (
            "--coreml-units",
            args.coreml_units != ComputeUnits::default(),
        ),
        ("--coreml-cache", args.coreml_cache.is_some()),
    ];
    let (cuda_ok, coreml_ok) = match args.device {
        Device::Cuda(_) => (true, false),
        Device::CoreMl => (false, true),
        Device::Auto => (true, true),
        Device::Cpu => (false, false),
    };
    for (flags, ok) in [(&cuda_flags[..], cuda_ok), (&coreml_flags[..], coreml_ok)] {
        if let Some((flag, _)) = flags.iter().find(|(_, given)| *given && !ok) {
            return Err(format!(
                "{flag} does not apply to --device {}; it applies with --device {} or auto",
                args.device,
                if flag.starts_with("--cuda") {
                    "cuda"
                } else {
                    "coreml"
                }
            ));
        }
    }
    if let Some(gib) = args.cuda_mem_limit {
        if !(gib.is_finite() && gib > 0.0 && gib < 1e6) {
            return Err(format!(
                "--cuda-mem-limit {gib}: give a positive number of GiB"
            ));
        }
    }
    Ok(())
}

/// Progress on stderr: a bar when stderr is a terminal and --quiet is not given.
struct Reporter {
    bar: ProgressBar,
    quiet: bool,
}

impl Reporter {
    fn new(quiet: bool) -> Reporter {
        let bar = ProgressBar::hidden();
        if !quiet && std::io::stderr().is_terminal() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{msg:28} [{bar:30}] {pos}/{len} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
        }
        Reporter { bar, quiet }
    }

    /// A line on stderr, unless --quiet.
    fn say(&self, line: impl std::fmt::Display) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    /// The progress callback for one generation; `prefix` goes before each stage's name.
    fn callback<'a>(&'a self, prefix: &'a str) -> impl FnMut(Progress) -> ControlFlow<()> + 'a {
        move |event: Progress| {
            let bar = &self.bar;
            match event {
                Progress::StageStarted(stage) => {
                    bar.set_message(format!("{prefix}{}", stage.label()));
                    bar.set_length(1);
                    bar.set_position(0);
                }
                Progress::Step { step, total } => {
                    bar.set_message(format!("{prefix}denoise"));
                    bar.set_length(total as u64);
                    bar.set_position(step as u64);
                }
                Progress::StageFinished(..) => bar.set_position(bar.length().unwrap_or(1)),
            }
            ControlFlow::Continue(())
        }
    }

    fn clear(&self) {
        self.bar.finish_and_clear();
        self.bar.reset();
    }

    /// The warnings and, with --timings, the stage times of a finished generation.
    fn report(&self, pipeline: &Pipeline, generation: &Generation, timings: bool, label: &str) {
        if generation.prompt_truncated {
            eprintln!(
                "klein: warning: {label}the prompt is longer than {} tokens and was truncated, as the reference pipeline does",
                pipeline.manifest().tokenizer.max_sequence_length
            );
        }
        if timings {
            for (stage, elapsed) in &generation.timings {
                eprintln!("{:>20}: {:8.3} s", stage.label(), elapsed.as_secs_f64());
            }
        }
    }
}

/// Warns that guidance does nothing on a distilled model.
fn warn_ignored_guidance(pipeline: &Pipeline, guidance: Option<f64>) -> bool {
    let model = &pipeline.manifest().model;
    let ignored = model.is_distilled && guidance.is_some_and(|g| g > 1.0);
    if ignored {
        eprintln!(
            "klein: warning: --guidance is ignored: {} is a distilled model",
            model.name
        );
    }
    ignored
}

fn generate(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    check_device_flags(&args).map_err(UsageError)?;
    match (&args.prompts, &args.out_dir, &args.prompt) {
        (Some(prompts), Some(out_dir), _) => batch::generate_batch(&args, prompts, out_dir),
        (_, _, Some(prompt)) => generate_one(&args, prompt).map(|()| ExitCode::SUCCESS),
        // clap requires a prompt or --prompts with --out-dir.
        _ => Err(UsageError("give a prompt, or --prompts FILE --out-dir DIR".to_string()).into()),
    }
}

/// `klein generate PROMPT -o FILE`: one prompt, `--num-images` images.
fn generate_one(args: &GenerateArgs, prompt: &str) -> anyhow::Result<()> {
    let model = default_model(args.model.clone());
    let paths = output_paths(&args.output, usize::from(args.num_images));
    check_output_paths(&paths)?;
    let seed = args.seed.unwrap_or_else(random_seed);
    let reporter = Reporter::new(args.quiet);

    // Every error of `Pipeline::load` names the bundle or the file in it.
    let mut pipeline = Pipeline::load(&model, pipeline_options(args))?;

    let mut request = Request::new(prompt)
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
    warn_ignored_guidance(&pipeline, args.guidance);
    reporter.say(format!("seed: {seed}"));
    reporter.say(format!(
        "model: {} ({}), {width}x{height}",
        pipeline.manifest().model.name,
        model.display()
    ));

    let generation = pipeline.generate(&request, Some(&mut reporter.callback("")))?;
    reporter.clear();
    let device = device_name(&pipeline);
    reporter.report(&pipeline, &generation, args.timings, "");
    reporter.say(format!("device: {device}"));
    let text = png_text(
        &pipeline,
        &generation,
        prompt,
        &args.refs,
        &device,
        &bundle_sha256(&pipeline)?,
    )?;
    for (image, path) in generation.images.iter().zip(&paths) {
        write_atomic(path, &encode_png(image, &text)?)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn device_name(pipeline: &Pipeline) -> String {
    pipeline
        .device_used()
        .map(|d| d.to_string())
        .unwrap_or_else(|| "none".to_string())
}

/// sha256 of the bundle's manifest.json, stored in every PNG.
fn bundle_sha256(pipeline: &Pipeline) -> anyhow::Result<String> {
    let path = pipeline.bundle_dir().join(klein::manifest::MANIFEST_FILE);
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    Ok(sha256_hex(&bytes))
}

/// The PNG's text metadata: everything needed to make the image again.
fn png_text(
    pipeline: &Pipeline,
    g: &Generation,
    prompt: &str,
    refs: &[PathBuf],
    device: &str,
    bundle_hash: &str,
) -> anyhow::Result<Vec<(String, String)>> {
    let manifest = pipeline.manifest();
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
        ("bundle_sha256".into(), bundle_hash.to_string()),
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
        // The graph, its external data and, in static-shape bundles, every bucket's graph and
        // the shared weights: the files named `<component>.*`.
        let bytes: u64 = manifest
            .files
            .iter()
            .filter(|(file, _)| file.starts_with(&format!("{name}.")))
            .map(|(_, f)| f.bytes)
            .sum();
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
    if let Some(shapes) = &manifest.static_shapes {
        println!(
            "static shapes: {} (batch {}, {} tokens, {} reference(s) of the output's size)",
            shapes.sizes(),
            shapes.batch,
            shapes.seq,
            shapes.refs
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
