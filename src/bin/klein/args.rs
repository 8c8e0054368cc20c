//! The command line's flags (clap) and what they turn into: [`PipelineOptions`].
use std::path::PathBuf;

use clap::{ArgGroup, Args, Parser, Subcommand};
use klein::limits::{MAX_BATCH, MAX_SIDE};
use klein::pipeline::{LoraSpec, PipelineOptions, VaeTiling};
use klein::runtime::{
    ComputeUnits, ConvSearch, CoreMlOptions, CudaOptions, Device, RuntimeOptions,
};

use klein::bundle::bundled::tiny_model_dir;

#[derive(Parser)]
#[command(
    name = "klein",
    version,
    about = "Run FLUX.2-klein image models on ONNX Runtime"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Generate images: text-to-image, or edit/compose with --ref.
    Generate(Box<GenerateArgs>),
    /// Show what is in a bundle.
    Info(InfoArgs),
    /// Serve the model over HTTP: the OpenAI images API and klein's own routes.
    Serve(Box<ServeArgs>),
    /// Install the official ONNX Runtime library into klein's cache, where klein finds it (for a klein installed with cargo install)
    Setup(SetupArgs),
    /// List the installed models (klein-export pull ORG/NAME installs one), by the names --model takes
    Models,
}

/// `klein setup`.
#[derive(Args)]
pub(crate) struct SetupArgs {
    /// Install it again, even when it is there
    #[arg(long)]
    pub(crate) force: bool,
}

/// `klein serve`: one pipeline per device, a bounded queue in front of them.
#[derive(Args)]
pub(crate) struct ServeArgs {
    /// Address to listen on: 127.0.0.1 (or localhost) accepts this machine only; 0.0.0.0 (or ::) every network
    #[arg(long, default_value = "127.0.0.1", value_parser = parse_host)]
    pub(crate) host: std::net::IpAddr,
    /// TCP port (0: any free port, printed)
    #[arg(long, default_value_t = 8080, allow_negative_numbers = true, value_parser = whole::<u16>("0 to 65535"))]
    pub(crate) port: u16,
    /// Device of a pipeline: cpu, cuda, cuda:N, coreml or auto; repeat for one pipeline per device (--device cuda:0 --device cuda:1)
    #[arg(long = "device", value_name = "DEVICE", default_value = "cpu")]
    pub(crate) devices: Vec<Device>,
    /// Requests that may wait for a pipeline, 1 to 1024; one more gets 429 with Retry-After
    #[arg(long, allow_negative_numbers = true, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) queue: u16,
    /// Seconds a request may take, waiting included, 1 to 86400; then it is cancelled (504)
    #[arg(long, allow_negative_numbers = true, default_value_t = 600, value_parser = clap::value_parser!(u32).range(1..=86400))]
    pub(crate) timeout: u32,
    /// Largest request body in MiB (uploaded references, base64 included), 1 to 1024
    #[arg(long, allow_negative_numbers = true, default_value_t = 64, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) max_body_mib: u16,
    /// Most pixels one request may ask for, images x width x height (1 to 335544320) [default: 8388608, eight 1024x1024 images]; more gets 400
    #[arg(long, allow_negative_numbers = true, default_value_t = 8 << 20, hide_default_value = true, value_parser = clap::value_parser!(u64).range(1..=335_544_320))]
    pub(crate) max_pixels: u64,
    /// Bearer token every request but /healthz and /readyz must carry [default: $KLEIN_API_KEY; none: no check]. Prefer the variable: a flag shows in the process list
    #[arg(long, value_name = "KEY")]
    pub(crate) api_key: Option<String>,
    /// Directory of LoRA files (.safetensors) that requests may name by file stem ("loras": ["style:0.8"]); without it, requests cannot use LoRAs. Clients never name paths
    #[arg(long, value_name = "DIR")]
    pub(crate) lora_dir: Option<PathBuf>,
    /// Release the text encoder after each prompt and the transformer before each decode (less memory, slower requests)
    #[arg(long)]
    pub(crate) low_memory: bool,
    /// Serve no web page at / (the API only)
    #[arg(long)]
    pub(crate) no_web: bool,
    // Last: its help headings apply to what follows them.
    #[command(flatten)]
    pub(crate) load: LoadArgs,
}

#[derive(Args)]
#[command(group(ArgGroup::new("input").required(true).args(["prompt", "prompts"])))]
pub(crate) struct GenerateArgs {
    /// The prompt (may be empty); or --prompts for many
    pub(crate) prompt: Option<String>,
    /// JSON Lines file, one image per line: {"prompt": "...", "seed": 7, "width": 512, "height": 512, "steps": 4, "guidance": 1.0, "refs": ["a.png"], "image": "src.png", "mask": "mask.png", "strength": 0.75, "mask_crop": 32, "loras": ["style.safetensors:0.8"], "name": "fox"} (only "prompt" is required; refs, image, mask and loras are relative to the file; a line without "loras" takes --lora). Other options apply to every line that does not set them. At most 64 MiB and 100000 lines
    #[arg(
        long,
        value_name = "FILE",
        requires = "out_dir",
        conflicts_with_all = ["output", "seed", "refs", "num_images", "quality"]
    )]
    pub(crate) prompts: Option<PathBuf>,
    /// Output directory of --prompts: NAME.png per line (default name: the line number, 0001) and
    /// summary.json. Lines whose output exists are skipped, so an interrupted run can be restarted
    #[arg(
        long,
        value_name = "DIR",
        requires = "prompts",
        conflicts_with = "prompt"
    )]
    pub(crate) out_dir: Option<PathBuf>,
    /// Output width in pixels, floored to a multiple of 16: 16 to 4096, and (width/16) x (height/16) plus the references' tokens at most 20480 (2288x2288 fits alone) [default: --image's width, else the first reference's, else the bundle's]
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<u32>("16 to 4096 pixels"))]
    pub(crate) width: Option<u32>,
    /// Output height in pixels, floored to a multiple of 16: 16 to 4096, within the same token budget as --width [default: --image's height, else the first reference's, else the bundle's]
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<u32>("16 to 4096 pixels"))]
    pub(crate) height: Option<u32>,
    /// Denoising steps, 1 to 1000 [default: the bundle's, 4 for distilled models]
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<usize>("1 to 1000"))]
    pub(crate) steps: Option<usize>,
    /// Classifier-free guidance scale, 0 to 100, base (non-distilled) models only [default: the bundle's]
    #[arg(long, allow_negative_numbers = true)]
    pub(crate) guidance: Option<f64>,
    /// What guidance steers away from, base models with guidance above 1 only [default: empty, as diffusers]
    #[arg(long, value_name = "TEXT")]
    pub(crate) negative_prompt: Option<String>,
    /// Seed of the initial noise (same seed, same image as diffusers) [default: random, printed]
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<u64>("0 to 18446744073709551615"))]
    pub(crate) seed: Option<u64>,
    /// Reference image (repeatable, at most 10): one to edit, several to compose
    #[arg(long = "ref", value_name = "IMAGE")]
    pub(crate) refs: Vec<PathBuf>,
    /// Source image to inpaint (with --mask) or to transform (img2img, without): the output has its size, floored to multiples of 16; --ref images are then extra references
    #[arg(long, value_name = "IMAGE")]
    pub(crate) image: Option<PathBuf>,
    /// Inpainting mask for --image, any size (resized to the source's): white is repainted, black kept (binarised at half grey, as diffusers)
    #[arg(long, value_name = "IMAGE", requires = "image")]
    pub(crate) mask: Option<PathBuf>,
    /// How much of --image is repainted, above 0 to 1: the share of the steps that run, from the source noised to that level [default: 1.0; diffusers' 0.8 runs the same 4 steps]
    #[arg(long, requires = "image", allow_negative_numbers = true, value_parser = parse_strength)]
    pub(crate) strength: Option<f64>,
    /// Inpaint only the mask's region (diffusers' padding_mask_crop): the box around the mask's non-black pixels, grown by PIXELS on each side and to the output's aspect ratio, is generated at the source's processing size, then pasted back into the whole source through the mask; the output has the source's size. The mask must have the source's size. PIXELS: 0 to 4096
    #[arg(long, value_name = "PIXELS", requires = "mask", allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(0..=MAX_SIDE as i64))]
    pub(crate) mask_crop: Option<u32>,
    /// LoRA to merge into the transformer, FILE or FILE:SCALE (repeatable, at most 16; scale -100 to 100, default 1; may be negative): diffusers/PEFT, BFL/ai-toolkit, kohya and LoKr (BFL, LyCORIS) .safetensors files, or a directory written by diffusers' save_lora_weights
    #[arg(long = "lora", value_name = "FILE[:SCALE]", value_parser = parse_lora())]
    pub(crate) loras: Vec<LoraSpec>,
    /// Images to generate for the prompt (one batch), 1 to 16
    #[arg(long, default_value_t = 1, allow_negative_numbers = true, value_parser = clap::value_parser!(u16).range(1..=MAX_BATCH as i64))]
    pub(crate) num_images: u16,
    /// Execution provider: cpu, cuda, cuda:N, coreml or auto
    #[arg(long, default_value = "cpu")]
    pub(crate) device: Device,
    /// Output file: .png (with the settings as text), .jpg/.jpeg (settings in a comment) or .webp (lossless); with --num-images N, files NAME-1.png ... NAME-N.png, written all or none
    #[arg(short, long, default_value = "klein.png")]
    pub(crate) output: PathBuf,
    /// JPEG quality of a .jpg/.jpeg output, 1 to 100 [default: 90]; refused with a lossless output (.png, .webp)
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(u8).range(1..=100))]
    pub(crate) quality: Option<u8>,
    /// Write a preview of the image being denoised to this PNG file after every --preview-every steps (1/8 of the output's side, the model's current estimate mapped linearly from the latents; with --num-images N, FILE-1.png ... FILE-N.png; replaced atomically)
    #[arg(long, value_name = "FILE")]
    pub(crate) preview: Option<PathBuf>,
    /// Steps between previews (and one after the last step), 1 to 65535
    #[arg(long, default_value_t = 1, requires = "preview", allow_negative_numbers = true, value_parser = clap::value_parser!(u16).range(1..))]
    pub(crate) preview_every: u16,
    /// Print nothing on stderr but errors and warnings
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Print the time spent in each stage
    #[arg(long)]
    pub(crate) timings: bool,
    // Last: its help headings apply to what follows them.
    #[command(flatten)]
    pub(crate) load: LoadArgs,
}

/// How to load the bundle: `generate` and `serve` take the same flags.
#[derive(Args)]
pub(crate) struct LoadArgs {
    /// Bundle directory [default: $KLEIN_MODEL, else the bundled tiny model]
    #[arg(long, short = 'm')]
    pub(crate) model: Option<PathBuf>,
    /// Threads per operator, 1 to 1024 [default: ONNX Runtime's choice, one per physical core]
    #[arg(long, allow_negative_numbers = true, value_parser = whole::<usize>("1 to 1024"))]
    pub(crate) threads: Option<usize>,
    /// Directory of an on-disk prompt-embedding cache
    #[arg(long)]
    pub(crate) prompt_cache: Option<PathBuf>,
    /// Most MiB the prompt cache's entries may take, 1 to 16777216; past it the least recently used are removed [default: 4096]
    #[arg(long, value_name = "MIB", requires = "prompt_cache", allow_negative_numbers = true, value_parser = whole::<u64>("1 to 16777216"))]
    pub(crate) prompt_cache_max_mib: Option<u64>,
    /// Do not check the sha256 of the bundle's files before loading. By default they are checked,
    /// and a stamp in $KLEIN_CACHE_DIR (else $XDG_CACHE_HOME/klein, else ~/.cache/klein) skips
    /// the check while no file changes
    #[arg(long)]
    pub(crate) no_verify_hashes: bool,
    /// Tiled VAE decoding and encoding, as diffusers' vae.enable_tiling(): on (every image larger than the bundle's VAE tile, 1024 px for FLUX.2), off, or auto (images over 1024x1024 pixels) [default: auto; on with --vae-tile-size]
    #[arg(long, value_name = "on|off|auto")]
    pub(crate) vae_tiling: Option<VaeTiling>,
    /// Side of the VAE's tiles in pixels, a multiple of 64 up to 4096 [default: the bundle's, 1024 for FLUX.2], as diffusers' vae.tile_sample_min_size: smaller tiles hold less memory at the cost of more overlap. Turns tiling on unless --vae-tiling is given (refused with --vae-tiling off)
    #[arg(long, value_name = "PIXELS", allow_negative_numbers = true, value_parser = parse_vae_tile_size)]
    pub(crate) vae_tile_size: Option<u32>,
    /// ONNX Runtime shared library [default: $ORT_DYLIB_PATH, else the one set up at build time]
    #[arg(long)]
    pub(crate) ort_lib: Option<PathBuf>,
    /// CPU: keep each graph as ONNX Runtime optimised it, with its prepacked weights, in DIR
    /// (created if missing): the first load writes it (about the bundle's size again), later
    /// loads map it instead of prepacking again
    #[arg(long, value_name = "DIR")]
    pub(crate) cpu_cache: Option<PathBuf>,
    /// Most GiB the CPU cache's entries may take, 1 to 16384; past it the least recently used are removed when a graph is saved [default: no limit]
    #[arg(long, value_name = "GIB", requires = "cpu_cache", allow_negative_numbers = true, value_parser = whole::<u64>("1 to 16384"))]
    pub(crate) cpu_cache_max_gib: Option<u64>,
    // Last: their help headings apply to what follows them.
    #[command(flatten)]
    pub(crate) cuda: CudaArgs,
    #[command(flatten)]
    pub(crate) coreml: CoreMlArgs,
}

impl LoadArgs {
    /// The VAE tiling asked for: a tile size asks for tiles, on unless the tiling is given.
    pub(crate) fn vae_tiling(&self) -> VaeTiling {
        match (self.vae_tiling, self.vae_tile_size) {
            (Some(tiling), _) => tiling,
            (None, Some(_)) => VaeTiling::On,
            (None, None) => VaeTiling::Auto,
        }
    }
}

/// The CUDA provider's flags (with `--device cuda` or `auto`).
#[derive(Args)]
#[command(next_help_heading = "CUDA (--device cuda or auto)")]
pub(crate) struct CudaArgs {
    /// CUDA: largest size of ONNX Runtime's GPU memory arena, in GiB, above 0 and below 1000000 [default: no limit]
    #[arg(long, value_name = "GIB", allow_negative_numbers = true)]
    pub(crate) cuda_mem_limit: Option<f64>,
    /// CUDA: grow the memory arena by what each allocation needs, not by powers of two
    #[arg(long)]
    pub(crate) cuda_arena_exact: bool,
    /// CUDA: cuDNN convolution algorithm search: heuristic, exhaustive or default [default: heuristic]
    #[arg(long, value_name = "SEARCH")]
    pub(crate) cuda_conv_search: Option<ConvSearch>,
    /// CUDA: TF32 tensor cores for float32 products (Ampere and newer; faster, 10-bit mantissa) [default: off]
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    pub(crate) cuda_tf32: Option<bool>,
}

/// The CoreML provider's flags (with `--device coreml` or `auto`).
#[derive(Args)]
#[command(next_help_heading = "CoreML (--device coreml or auto)")]
pub(crate) struct CoreMlArgs {
    /// CoreML: where graphs may run: all, cpu-gpu, cpu-ane (Neural Engine) or cpu [default: all]
    #[arg(long, value_name = "UNITS")]
    pub(crate) coreml_units: Option<ComputeUnits>,
    /// CoreML: keep compiled models in DIR between runs (created if missing)
    #[arg(long, value_name = "DIR")]
    pub(crate) coreml_cache: Option<PathBuf>,
}

#[derive(Args)]
pub(crate) struct InfoArgs {
    /// Bundle directory [default: $KLEIN_MODEL, else the bundled tiny model]
    pub(crate) model: Option<PathBuf>,
    /// Also check the sha256 of every file
    #[arg(long)]
    pub(crate) verify: bool,
    /// List what this LoRA would change (layers, rank, scale), FILE or FILE:SCALE (repeatable)
    #[arg(long = "lora", value_name = "FILE[:SCALE]", value_parser = parse_lora())]
    pub(crate) loras: Vec<LoraSpec>,
}

/// `FILE` or `FILE:SCALE`; the file's name need not be UTF-8.
fn parse_lora() -> impl clap::builder::TypedValueParser<Value = LoraSpec> {
    use clap::builder::TypedValueParser;
    clap::builder::OsStringValueParser::new().try_map(|text| match text.is_empty() {
        true => Err("give a LoRA file, FILE or FILE:SCALE".to_string()),
        false => Ok(LoraSpec::parse_os(&text)),
    })
}

/// `--host`: an IP address, or a name (`localhost`) looked up to its first address.
fn parse_host(text: &str) -> Result<std::net::IpAddr, String> {
    use std::net::ToSocketAddrs;
    if let Ok(address) = text.parse() {
        return Ok(address);
    }
    let how = "give an IP address, such as 127.0.0.1 (this machine only) or 0.0.0.0 (every network), or a name of this machine";
    match (text, 0).to_socket_addrs() {
        Ok(mut addresses) => addresses
            .next()
            .map(|a| a.ip())
            .ok_or_else(|| format!("`{text}` has no address; {how}")),
        Err(e) => Err(format!(
            "`{text}` is no IP address and cannot be looked up ({e}); {how}"
        )),
    }
}

/// `--strength`: a number in (0, 1], checked before anything is read.
fn parse_strength(text: &str) -> Result<f64, String> {
    let strength: f64 = text.parse().map_err(|e| format!("{e}"))?;
    klein::stages::inpaint::check_strength(strength).map_err(|e| e.to_string())?;
    Ok(strength)
}

/// A whole number of type `T` for an option whose values are `valid` (its help's words): text that
/// is not one (a negative number, a fraction, more than `T` holds) is refused naming them; the
/// range itself is checked where the option is used.
fn whole<T: std::str::FromStr>(
    valid: &'static str,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync + 'static {
    move |text| {
        text.parse()
            .map_err(|_| format!("{text} is not a whole number in range: use {valid}"))
    }
}

/// `--vae-tile-size`: a multiple of 64 up to the largest side, checked before anything is read.
fn parse_vae_tile_size(text: &str) -> Result<u32, String> {
    let pixels: u32 = text.parse().map_err(|e| format!("{e}"))?;
    klein::stages::vae_tiling::check_tile_size(pixels).map_err(|e| e.to_string())?;
    Ok(pixels)
}

/// The bundle to use: `--model`, else `$KLEIN_MODEL` (when not empty, as the Python module
/// reads it), else the bundled tiny model. A Hub id of a bundle repository not installed yet is
/// fetched and installed first.
pub(crate) fn default_model(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    model_dir(model, true)
}

/// [`default_model`] without fetching anything: a Hub id not installed stays as it is.
pub(crate) fn local_model(model: Option<PathBuf>) -> anyhow::Result<PathBuf> {
    model_dir(model, false)
}

fn model_dir(model: Option<PathBuf>, fetch: bool) -> anyhow::Result<PathBuf> {
    let from_env = || std::env::var_os("KLEIN_MODEL").filter(|m| !m.is_empty());
    match model.or_else(|| from_env().map(PathBuf::from)) {
        // A name or Hub id of an installed model (`klein-export pull`) is its bundle directory.
        Some(model) if !fetch => Ok(klein::bundle::installed::resolve(&model)),
        Some(model) => {
            use klein::bundle::installed::{default_name, locate, models_dir, resolve};
            let hub_id = model.to_str().filter(|text| default_name(text).is_some());
            if let (Some(id), false, Some(dir)) = (hub_id, resolve(&model).exists(), models_dir()) {
                eprintln!(
                    "klein: fetching {id} from the Hugging Face Hub and installing it in {}",
                    dir.display()
                );
            }
            Ok(locate(&model)?)
        }
        None => Ok(tiny_model_dir()?),
    }
}

/// The pipeline options of `args`, running on `device` with `loras`.
pub(crate) fn pipeline_options(
    args: &LoadArgs,
    device: Device,
    loras: Vec<LoraSpec>,
) -> PipelineOptions {
    let mut runtime = RuntimeOptions::default();
    if let Some(lib) = &args.ort_lib {
        runtime = runtime.with_library(lib);
    }
    let mut options = PipelineOptions::default()
        .with_device(device)
        .with_runtime(runtime)
        .with_verify_hashes(!args.no_verify_hashes)
        .with_loras(loras);
    options = options.with_vae_tiling(args.vae_tiling());
    if let Some(pixels) = args.vae_tile_size {
        options = options.with_vae_tile_size(pixels);
    }
    if let Some(threads) = args.threads {
        options = options.with_threads(threads);
    }
    if let Some(dir) = &args.prompt_cache {
        options = options.with_prompt_cache_dir(dir);
    }
    if let Some(mib) = args.prompt_cache_max_mib {
        options = options.with_prompt_cache_limit_mib(mib);
    }
    if let Some(dir) = &args.cpu_cache {
        options = options.with_cpu_cache_dir(dir);
    }
    if let Some(gib) = args.cpu_cache_max_gib {
        options = options.with_cpu_cache_limit_gib(gib);
    }
    let mut cuda = CudaOptions::default()
        .with_arena_same_as_requested(args.cuda.cuda_arena_exact)
        .with_conv_search(args.cuda.cuda_conv_search.unwrap_or_default());
    if let Some(gib) = args.cuda.cuda_mem_limit {
        cuda = cuda.with_memory_limit((gib * (1u64 << 30) as f64) as usize);
    }
    if let Some(tf32) = args.cuda.cuda_tf32 {
        cuda = cuda.with_tf32(tf32);
    }
    let mut coreml =
        CoreMlOptions::default().with_compute_units(args.coreml.coreml_units.unwrap_or_default());
    if let Some(dir) = &args.coreml.coreml_cache {
        coreml = coreml.with_cache_dir(dir);
    }
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
pub(crate) fn check_device_flags(args: &LoadArgs, device: Device) -> Result<(), String> {
    let cuda_flags = [
        ("--cuda-mem-limit", args.cuda.cuda_mem_limit.is_some()),
        ("--cuda-arena-exact", args.cuda.cuda_arena_exact),
        ("--cuda-conv-search", args.cuda.cuda_conv_search.is_some()),
        ("--cuda-tf32", args.cuda.cuda_tf32.is_some()),
    ];
    let coreml_flags = [
        ("--coreml-units", args.coreml.coreml_units.is_some()),
        ("--coreml-cache", args.coreml.coreml_cache.is_some()),
    ];
    let cpu_flags = [("--cpu-cache", args.cpu_cache.is_some())];
    let (cuda_ok, coreml_ok, cpu_ok) = match device {
        Device::Cuda(_) => (true, false, false),
        Device::CoreMl => (false, true, false),
        Device::Auto => (true, true, true),
        Device::Cpu => (false, false, true),
    };
    let groups = [
        (&cuda_flags[..], cuda_ok, "cuda"),
        (&coreml_flags[..], coreml_ok, "coreml"),
        (&cpu_flags[..], cpu_ok, "cpu"),
    ];
    for (flags, ok, applies) in groups {
        if let Some((flag, _)) = flags.iter().find(|(_, given)| *given && !ok) {
            return Err(format!(
                "{flag} does not apply to --device {device}; it applies with --device {applies} or auto"
            ));
        }
    }
    if args.vae_tile_size.is_some() && args.vae_tiling == Some(VaeTiling::Off) {
        return Err("--vae-tile-size does not apply with --vae-tiling off".into());
    }
    if let Some(gib) = args.cuda.cuda_mem_limit {
        if !(gib.is_finite() && gib > 0.0 && gib < 1e6) {
            return Err(format!(
                "--cuda-mem-limit {gib}: give a number of GiB above 0 and below 1000000"
            ));
        }
    }
    Ok(())
}
