//! Devices (ONNX Runtime execution providers), their options, and their registration on a
//! session builder: a device the user names is registered with `error_on_failure()`.
use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};

#[cfg(any(feature = "cuda", feature = "coreml"))]
use super::library::error_chain;

use crate::error::{KleinError, Result};

/// Where a graph runs: an ONNX Runtime execution provider.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Device {
    /// The CPU execution provider.
    Cpu,
    /// An NVIDIA GPU by CUDA device id (needs the `cuda` feature and a CUDA build of ONNX Runtime).
    Cuda(u32),
    /// Apple's CoreML (needs the `coreml` feature, macOS).
    CoreMl,
    /// CUDA device 0, then CoreML (each only when compiled in), then the CPU: the first that works.
    #[default]
    Auto,
}

impl Device {
    /// The kind of device, as `--device` names it: `cpu`, `cuda`, `coreml` or `auto`.
    pub fn kind(&self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
            Device::CoreMl => "coreml",
            Device::Auto => "auto",
        }
    }

    /// ONNX Runtime's name of the execution provider, for reports (`"auto"` for [`Device::Auto`]).
    pub fn ep_name(&self) -> &'static str {
        match self {
            Device::Cpu => "CPUExecutionProvider",
            Device::Cuda(_) => "CUDAExecutionProvider",
            Device::CoreMl => "CoreMLExecutionProvider",
            Device::Auto => "auto",
        }
    }

    /// Refuses a device this build cannot use (CUDA or CoreML without its cargo feature), so that
    /// a load fails at once rather than at the first graph.
    pub fn check_compiled(&self) -> Result<()> {
        let missing = match self {
            Device::Cuda(_) if !cfg!(feature = "cuda") => {
                "CUDA support; rebuild with `--features cuda`"
            }
            Device::CoreMl if !cfg!(feature = "coreml") => {
                "CoreML support; rebuild with `--features coreml`"
            }
            _ => return Ok(()),
        };
        Err(KleinError::Device {
            device: self.to_string(),
            message: format!("this klein was built without {missing}"),
        })
    }
}

impl Device {
    /// The devices [`Device::Auto`] tries, in order: CUDA device 0 and CoreML where compiled in,
    /// then the CPU.
    pub fn auto_candidates() -> Vec<Device> {
        let mut candidates = Vec::new();
        if cfg!(feature = "cuda") {
            candidates.push(Device::Cuda(0));
        }
        if cfg!(feature = "coreml") {
            candidates.push(Device::CoreMl);
        }
        candidates.push(Device::Cpu);
        candidates
    }

    /// The device a graph is likely to run on before it loads: this one, or for auto the first
    /// device it may try (not in `skip`) whose execution provider the loaded ONNX Runtime library
    /// has. A guess: that provider can still fail when the session is created (no GPU), and auto
    /// then goes on to the next device.
    pub(crate) fn likely(self, skip: &[(Device, String)]) -> Device {
        #[cfg(any(feature = "cuda", feature = "coreml"))]
        use ort::ep::ExecutionProvider;
        if self != Device::Auto {
            return self;
        }
        let has_provider = |device: Device| match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => ort::ep::CUDA::is_available().unwrap_or(false),
            #[cfg(feature = "coreml")]
            Device::CoreMl => ort::ep::CoreML::is_available().unwrap_or(false),
            Device::Cpu => true,
            _ => false,
        };
        Device::auto_candidates()
            .into_iter()
            .filter(|device| !skip.iter().any(|(skipped, _)| skipped == device))
            .find(|&device| has_provider(device))
            .unwrap_or(Device::Cpu)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cuda(id) => write!(f, "cuda:{id}"),
            _ => f.write_str(self.kind()),
        }
    }
}

impl FromStr for Device {
    type Err = KleinError;

    /// Parses `cpu`, `cuda`, `cuda:N`, `coreml` or `auto` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let invalid = || {
            KleinError::request_about(
                "device",
                format!("unknown device `{s}`; use cpu, cuda, cuda:N, coreml or auto"),
            )
        };
        match lower.as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            "coreml" => Ok(Device::CoreMl),
            "auto" => Ok(Device::Auto),
            other => match other.strip_prefix("cuda:") {
                Some(id) => id.parse().map(Device::Cuda).map_err(|_| invalid()),
                None => Err(invalid()),
            },
        }
    }
}

/// How hard ONNX Runtime rewrites a graph when building a session.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OptimizationLevel {
    /// No rewrites.
    Disable,
    /// Constant folding and redundant-node removal.
    Basic,
    /// Plus node fusions.
    Extended,
    /// Plus layout transformations (ORT's level 3, `ORT_ENABLE_LAYOUT`).
    Layout,
    /// Everything (`ORT_ENABLE_ALL`): ONNX Runtime's own default, as in Python's `InferenceSession`.
    #[default]
    All,
}

impl OptimizationLevel {
    pub(super) fn to_ort(self) -> GraphOptimizationLevel {
        match self {
            OptimizationLevel::Disable => GraphOptimizationLevel::Disable,
            OptimizationLevel::Basic => GraphOptimizationLevel::Level1,
            OptimizationLevel::Extended => GraphOptimizationLevel::Level2,
            OptimizationLevel::Layout => GraphOptimizationLevel::Level3,
            OptimizationLevel::All => GraphOptimizationLevel::All,
        }
    }
}

/// How cuDNN picks a convolution algorithm for each new input shape (CUDA).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvSearch {
    /// cuDNN's heuristic, no benchmarking (klein's default: the VAE's convolutions change shape
    /// with every output size, and an exhaustive search per shape costs seconds).
    #[default]
    Heuristic,
    /// Benchmark every algorithm on the first run of each shape (ONNX Runtime's default): the
    /// fastest kernels for repeated runs at one size.
    Exhaustive,
    /// cuDNN's default algorithm, no search at all.
    Default,
}

impl FromStr for ConvSearch {
    type Err = KleinError;

    /// Parses `heuristic`, `exhaustive` or `default`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "heuristic" => Ok(ConvSearch::Heuristic),
            "exhaustive" => Ok(ConvSearch::Exhaustive),
            "default" => Ok(ConvSearch::Default),
            _ => Err(KleinError::request(format!(
                "unknown cuDNN conv search `{s}`; use heuristic, exhaustive or default"
            ))),
        }
    }
}

/// The CUDA execution provider's settings people tune; each `None` keeps ONNX Runtime's default.
#[derive(Debug, Clone, Default)]
pub struct CudaOptions {
    /// Largest size of ONNX Runtime's CUDA memory arena, in bytes (`gpu_mem_limit`).
    pub(crate) memory_limit: Option<usize>,
    /// Grow the arena by what each allocation asks instead of by powers of two
    /// (`arena_extend_strategy`): a smaller peak on a shared GPU, more allocations.
    pub(crate) arena_same_as_requested: bool,
    /// cuDNN's convolution algorithm search.
    pub(crate) conv_search: ConvSearch,
    /// TF32 tensor-core products for float32 MatMul/Conv on Ampere and newer (`use_tf32`):
    /// faster, with 10-bit mantissa products. Off unless asked for, unlike ONNX Runtime's own
    /// default: on an H200 the tiny fp32 bundle's image differed from the CPU's by up to 10 levels
    /// (52.9 dB) with it on and 1 level (75.3 dB) with it off, and klein's images are meant to be
    /// diffusers'. fp16 bundles run their large products in float16 either way.
    pub(crate) tf32: bool,
}

impl CudaOptions {
    /// Caps ONNX Runtime's CUDA memory arena at `bytes` (`gpu_mem_limit`).
    pub fn with_memory_limit(mut self, bytes: usize) -> Self {
        self.memory_limit = Some(bytes);
        self
    }
    /// Grows the arena by what each allocation asks (`arena_extend_strategy`).
    pub fn with_arena_same_as_requested(mut self, exact: bool) -> Self {
        self.arena_same_as_requested = exact;
        self
    }
    /// cuDNN's convolution algorithm search (default: heuristic).
    pub fn with_conv_search(mut self, search: ConvSearch) -> Self {
        self.conv_search = search;
        self
    }
    /// TF32 products for float32 MatMul/Conv on or off (default: off).
    pub fn with_tf32(mut self, tf32: bool) -> Self {
        self.tf32 = tf32;
        self
    }
}

/// The hardware CoreML may run a graph on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ComputeUnits {
    /// CPU, GPU and Neural Engine: CoreML decides per operation.
    #[default]
    All,
    /// CPU and GPU.
    CpuAndGpu,
    /// CPU and Neural Engine.
    CpuAndNeuralEngine,
    /// CPU only.
    CpuOnly,
}

impl FromStr for ComputeUnits {
    type Err = KleinError;

    /// Parses `all`, `cpu-gpu`, `cpu-ane` or `cpu`.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "all" => Ok(ComputeUnits::All),
            "cpu-gpu" => Ok(ComputeUnits::CpuAndGpu),
            "cpu-ane" => Ok(ComputeUnits::CpuAndNeuralEngine),
            "cpu" => Ok(ComputeUnits::CpuOnly),
            _ => Err(KleinError::request(format!(
                "unknown CoreML compute units `{s}`; use all, cpu-gpu, cpu-ane (Neural Engine) or cpu"
            ))),
        }
    }
}

/// The CoreML execution provider's settings.
#[derive(Debug, Clone, Default)]
pub struct CoreMlOptions {
    /// Where CoreML may run the graphs.
    pub(crate) compute_units: ComputeUnits,
    /// Directory where compiled CoreML models are kept between processes
    /// (`ModelCacheDirectory`), keyed by the `COREML_CACHE_KEY` the exporter writes into each
    /// graph (a digest of the graph and its weights). `None`: every load compiles again.
    pub(crate) cache_dir: Option<PathBuf>,
}

impl CoreMlOptions {
    /// Where CoreML may run the graphs (default: all units).
    pub fn with_compute_units(mut self, units: ComputeUnits) -> Self {
        self.compute_units = units;
        self
    }
    /// Keeps compiled CoreML models in `dir` between processes.
    pub fn with_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cache_dir = Some(dir.into());
        self
    }
}

/// Options of every session [`super::load_graph`] builds.
#[derive(Debug, Clone, Default)]
pub struct SessionConfig {
    /// Where to run.
    pub(crate) device: Device,
    /// Threads inside one operator; `None` lets ONNX Runtime choose (one per physical core).
    pub(crate) intra_threads: Option<usize>,
    /// Graph optimisation level.
    pub(crate) optimization: OptimizationLevel,
    /// Settings of the CUDA provider (used when the device is CUDA, or auto picks it).
    pub(crate) cuda: CudaOptions,
    /// Settings of the CoreML provider (used when the device is CoreML, or auto picks it).
    pub(crate) coreml: CoreMlOptions,
    /// Devices [`Device::Auto`] must not try for this graph, each with why (set per graph by the
    /// pipeline from what the bundle's precision allows).
    pub(crate) auto_skip: Vec<(Device, String)>,
    /// Whether ONNX Runtime prepacks this graph's weights for its CPU kernels at session creation
    /// (set per graph by the pipeline, see [`Self::with_prepacking`]).
    pub(crate) prepack: bool,
    /// Whether this session runs without ONNX Runtime's CPU memory arena (see
    /// [`Self::without_cpu_arena`]).
    pub(crate) no_cpu_arena: bool,
    /// Whether this session, where it runs on the CPU, allocates its activations one by one on
    /// every run instead of ONNX Runtime's memory pattern (see [`Self::without_memory_pattern`]).
    pub(crate) no_memory_pattern: bool,
    /// Whether this session's pool threads sleep instead of spinning between operators (see
    /// [`Self::without_spinning`]).
    pub(crate) no_spinning: bool,
    /// Whether this graph's int8 weight codes stay within [-64, 64] (`--reduce-range`), so that
    /// u8 x s8 products cannot saturate on any CPU (see [`Self::with_7bit_int8_weights`]).
    pub(crate) int8_weights_7bit: bool,
    /// Where CPU sessions keep their optimised graphs with prepacked weights between processes
    /// (see [`Self::with_cpu_cache_dir`]); `None`: every load optimises and prepacks again.
    pub(crate) cpu_cache_dir: Option<PathBuf>,
    /// Most GiB the CPU cache's entries may take (see [`Self::with_cpu_cache_limit_gib`]);
    /// `None`: no limit.
    pub(crate) cpu_cache_gib: Option<u64>,
    /// What identifies this graph's files in the CPU cache (set per graph by the pipeline from the
    /// manifest's sha256s); `None`: the graph is not cached.
    pub(crate) cache_tag: Option<String>,
}

impl SessionConfig {
    /// What of these settings can change the outputs of a graph that runs on `device`, for caches
    /// of outputs (the prompt cache): the device, the optimisation level, TF32 on CUDA, where
    /// CoreML runs. Threads and memory settings change no output. `device` is where the graph ran
    /// or will run ([`Device::likely`] for auto before a load).
    pub(crate) fn numerics(&self, device: Device) -> String {
        let level = self.optimization;
        match device {
            Device::Cpu => format!("cpu {level:?}"),
            Device::Cuda(_) => format!("cuda {level:?} tf32={}", self.cuda.tf32),
            Device::CoreMl => format!("coreml {level:?} {:?}", self.coreml.compute_units),
            Device::Auto => format!(
                "auto {level:?} tf32={} {:?}",
                self.cuda.tf32, self.coreml.compute_units
            ),
        }
    }

    /// Keeps this graph out of the caches keyed by the bundle's graph (the CPU cache's tag,
    /// CoreML's `COREML_CACHE_KEY`): for a graph with LoRA weights merged in, which those entries
    /// would otherwise give back without them.
    pub(crate) fn without_caches(mut self) -> Self {
        self.cache_tag = None;
        self.coreml.cache_dir = None;
        self
    }

    /// Runs on `device`.
    pub fn with_device(mut self, device: Device) -> Self {
        self.device = device;
        self
    }

    /// Uses `threads` threads inside one operator.
    pub fn with_intra_threads(mut self, threads: usize) -> Self {
        self.intra_threads = Some(threads);
        self
    }

    /// Uses this graph optimisation level.
    pub fn with_optimization(mut self, level: OptimizationLevel) -> Self {
        self.optimization = level;
        self
    }

    /// Uses these CUDA settings.
    pub fn with_cuda(mut self, cuda: CudaOptions) -> Self {
        self.cuda = cuda;
        self
    }

    /// Uses these CoreML settings.
    pub fn with_coreml(mut self, coreml: CoreMlOptions) -> Self {
        self.coreml = coreml;
        self
    }

    /// Devices auto must not try, with why.
    pub(crate) fn with_auto_skip(mut self, skip: Vec<(Device, String)>) -> Self {
        self.auto_skip = skip;
        self
    }

    /// Prepacks the weights at session creation (ONNX Runtime's default) or not
    /// (`session.disable_prepacking`). The pipeline prepacks the transformer (unpacked, its
    /// products round differently with the batch size, and a batch's first image would no longer
    /// equal the same image made alone) and quantized graphs (MatMulNBits' packed layout); not the
    /// float text encoder and VAE: prepacking was most of the wide text encoder's load (45.9 s
    /// against 0.21 s without) for a run 3.5 s faster (benches/RESULTS.md, "Load time").
    pub(crate) fn with_prepacking(mut self, prepack: bool) -> Self {
        self.prepack = prepack;
        self
    }

    /// Runs without ONNX Runtime's CPU memory arena (`no`), so that freed activations go back to
    /// the allocator instead of staying reserved by the session. The pipeline does this for the
    /// transformer: one step at 1024x1024 on the wide checkpoint peaked at 3.9 instead of 6.4 GiB,
    /// no slower. The text encoder and VAE keep the arena: without it, on the same host, the 512x512
    /// decode took 17-18 s instead of 14.5 s (benches/RESULTS.md, "Memory at large sizes").
    pub(crate) fn without_cpu_arena(mut self, no: bool) -> Self {
        self.no_cpu_arena = no;
        self
    }

    /// Where the session runs on the CPU, allocates each run's activations one by one (`no`)
    /// instead of by ONNX Runtime's memory pattern, which from a shape's second run on takes all
    /// of them as one block sized by the first run's plan. The pipeline does this for the
    /// transformer, which runs at one shape for every step: with the pattern, its second step
    /// asks the allocator for a new block of gigabytes while the first step's freed activations lie
    /// in pieces (the kept heap grows by that much, and each new page is a page fault), and the
    /// block stays mapped. Without it every step allocates as the first did, in the memory the first
    /// freed. Wide fp32 transformer, 1024x1024, kept heap with huge pages, 3 runs in one process:
    /// 29.5, 21.9, 21.8 s at a peak of 5.23 GiB without the pattern, 27.4, 25.3 (7.5 s of system
    /// time), 20.1 s at 6.93 GiB with it; the CLI at 1536x1536, 4 steps, peaked at 11.6 instead of
    /// 16.8-17.1 GiB, steps even, tiled decode 8-11% slower (benches/RESULTS.md, "Heap"). Other devices keep
    /// the pattern: their arenas serve the block from memory they hold already.
    pub(crate) fn without_memory_pattern(mut self, no: bool) -> Self {
        self.no_memory_pattern = no;
        self
    }

    /// Declares the graph's int8 weights 7-bit (codes in [-64, 64], the manifest's
    /// `reduce_range`): on CPUs without VNNI the session then keeps ONNX Runtime's u8 x s8 kernels,
    /// which are exact for such codes, instead of converting the weights to uint8 for slower u8 x u8
    /// kernels (`cpu_features::int8_products_saturate`). Undeclared graphs are converted there.
    pub fn with_7bit_int8_weights(mut self, yes: bool) -> Self {
        self.int8_weights_7bit = yes;
        self
    }

    /// Pool threads that wait without spinning (`session.intra_op.allow_spinning` 0), so that
    /// they leave the core to another thread of the process between operators. The pipeline does
    /// this for the text encoder while the transformer loads beside it: on the wide dds bundle
    /// (2 cores) the prompt encoded in 3.5-3.8 s instead of 3.8-4.0 s.
    pub(crate) fn without_spinning(mut self, no: bool) -> Self {
        self.no_spinning = no;
        self
    }

    /// Keeps CPU sessions' optimised graphs, with their prepacked weights, in `dir` between
    /// processes: the first load of a graph saves it (its weights twice over on disk: as the bundle
    /// has them and prepacked), later loads memory-map it instead of optimising and prepacking
    /// again. Entries are keyed by the graph's files, the ONNX Runtime build, the CPU's
    /// instruction sets and the session settings that shape them; graphs with merged LoRA weights
    /// are not cached (benches/RESULTS.md, "Load time").
    pub fn with_cpu_cache_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.cpu_cache_dir = Some(dir.into());
        self
    }

    /// Most GiB the CPU cache directory's entries may take together (those of other bundles
    /// included; 1 to [`crate::limits::MAX_CPU_CACHE_GIB`]; default: no limit): when a save
    /// passes it, the least recently used entries are removed until the rest fit, the one just
    /// saved kept. Refused without [`Self::with_cpu_cache_dir`].
    pub fn with_cpu_cache_limit_gib(mut self, gib: u64) -> Self {
        self.cpu_cache_gib = Some(gib);
        self
    }

    /// Tags this graph for the CPU cache with what identifies its files.
    pub(crate) fn with_cache_tag(mut self, tag: String) -> Self {
        self.cache_tag = Some(tag);
        self
    }
}

/// Why building one session failed: the device, the graph file, or the session itself.
pub(super) enum LoadFailure {
    Device(String),
    /// ONNX Runtime cannot parse the file as a graph (corrupt, or not ONNX).
    File(String),
    Session(String),
}

impl LoadFailure {
    pub(super) fn message(&self) -> &str {
        match self {
            LoadFailure::Device(m) | LoadFailure::File(m) | LoadFailure::Session(m) => m,
        }
    }
}

/// Registers the execution provider of a concrete (non-`Auto`) device, failing loudly.
///
/// With `strict` (a device the user named), a CoreML session may not place a node the device
/// cannot run on the CPU (`session.disable_cpu_ep_fallback`): such a graph fails to load. CUDA
/// sessions are not restricted so: ONNX Runtime places shape computations on the CPU on purpose,
/// and with the fallback disabled even the tiny bundle's text encoder failed to load on an H200.
/// Registering the named provider still fails loudly on both.
pub(super) fn register_device(
    builder: SessionBuilder,
    device: Device,
    strict: bool,
    cuda: &CudaOptions,
    coreml: &CoreMlOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    let builder = match device {
        Device::Cpu | Device::Auto => return Ok(builder),
        Device::Cuda(id) => return register_cuda(builder, id, cuda),
        Device::CoreMl => register_coreml(builder, coreml)?,
    };
    if strict {
        builder
            .with_disable_cpu_fallback()
            .map_err(|e| LoadFailure::Session(e.to_string()))
    } else {
        Ok(builder)
    }
}

#[cfg(feature = "cuda")]
fn register_cuda(
    builder: SessionBuilder,
    id: u32,
    options: &CudaOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    use ort::ep::cuda::ConvAlgorithmSearch;
    use ort::ep::{ArenaExtendStrategy, ExecutionProvider};
    let id = i32::try_from(id)
        .map_err(|_| LoadFailure::Device(format!("CUDA device id {id} is too large")))?;
    match ort::ep::CUDA::is_available() {
        Ok(true) => {}
        Ok(false) => {
            return Err(LoadFailure::Device(
                "this ONNX Runtime library was built without CUDAExecutionProvider; point ORT_DYLIB_PATH \
                 at a CUDA build (the `onnxruntime-gpu` wheel's library)"
                    .to_string(),
            ))
        }
        Err(e) => return Err(LoadFailure::Device(error_chain(&e))),
    }
    let mut ep = ort::ep::CUDA::default()
        .with_device_id(id)
        .with_tf32(options.tf32)
        .with_conv_algorithm_search(match options.conv_search {
            ConvSearch::Heuristic => ConvAlgorithmSearch::Heuristic,
            ConvSearch::Exhaustive => ConvAlgorithmSearch::Exhaustive,
            ConvSearch::Default => ConvAlgorithmSearch::Default,
        });
    if let Some(limit) = options.memory_limit {
        ep = ep.with_memory_limit(limit);
    }
    if options.arena_same_as_requested {
        ep = ep.with_arena_extend_strategy(ArenaExtendStrategy::SameAsRequested);
    }
    builder
        .with_execution_providers([ep.build().error_on_failure()])
        .map_err(|e| LoadFailure::Device(error_chain(&e)))
}

#[cfg(not(feature = "cuda"))]
fn register_cuda(
    _builder: SessionBuilder,
    _id: u32,
    _options: &CudaOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    Err(LoadFailure::Device(
        "this klein was built without CUDA support; rebuild with `--features cuda`".to_string(),
    ))
}

#[cfg(feature = "coreml")]
fn register_coreml(
    builder: SessionBuilder,
    options: &CoreMlOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    use ort::ep::coreml::{ComputeUnits as Units, ModelFormat};
    use ort::ep::ExecutionProvider;
    match ort::ep::CoreML::is_available() {
        Ok(true) => {}
        Ok(false) => {
            return Err(LoadFailure::Device(
                "this ONNX Runtime library was built without CoreMLExecutionProvider (it ships only in \
                 the macOS builds)"
                    .to_string(),
            ))
        }
        Err(e) => return Err(LoadFailure::Device(error_chain(&e))),
    }
    let mut ep = ort::ep::CoreML::default()
        // MLProgram (Core ML 5+) runs float16 and more operators than the NeuralNetwork format.
        .with_model_format(ModelFormat::MLProgram)
        .with_compute_units(match options.compute_units {
            ComputeUnits::All => Units::All,
            ComputeUnits::CpuAndGpu => Units::CPUAndGPU,
            ComputeUnits::CpuAndNeuralEngine => Units::CPUAndNeuralEngine,
            ComputeUnits::CpuOnly => Units::CPUOnly,
        });
    if let Some(dir) = &options.cache_dir {
        ep = ep.with_model_cache_dir(dir.display());
    }
    builder
        .with_execution_providers([ep.build().error_on_failure()])
        .map_err(|e| LoadFailure::Device(error_chain(&e)))
}

#[cfg(not(feature = "coreml"))]
fn register_coreml(
    _builder: SessionBuilder,
    _options: &CoreMlOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    Err(LoadFailure::Device(
        "this klein was built without CoreML support; rebuild with `--features coreml`".to_string(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prompt cache's device key: settings that change outputs part entries, others do not.
    #[test]
    fn numerics_name_what_changes_outputs() {
        let config = |device| SessionConfig::default().with_device(device);
        let numerics = |config: &SessionConfig| config.numerics(config.device);
        let cpu = numerics(&config(Device::Cpu));
        assert_eq!(cpu, numerics(&config(Device::Cpu).with_intra_threads(7)));
        let cuda = config(Device::Cuda(0));
        let tf32 = cuda
            .clone()
            .with_cuda(CudaOptions::default().with_tf32(true));
        let coreml = config(Device::CoreMl);
        let on_cpu_only = coreml
            .clone()
            .with_coreml(CoreMlOptions::default().with_compute_units(ComputeUnits::CpuOnly));
        let all = [
            cpu.clone(),
            numerics(&cuda),
            numerics(&tf32),
            numerics(&coreml),
            numerics(&on_cpu_only),
            numerics(&config(Device::Cpu).with_optimization(OptimizationLevel::Basic)),
        ];
        let distinct: std::collections::HashSet<_> = all.iter().collect();
        assert_eq!(distinct.len(), all.len(), "{all:?}");
        // Auto is keyed by the device it runs on.
        let auto = config(Device::Auto);
        assert_eq!(auto.numerics(Device::Cpu), cpu);
        assert_eq!(auto.numerics(Device::Cuda(0)), numerics(&cuda));
    }

    /// Auto's likely device: the CPU where no other provider is compiled in (or none but the CPU
    /// may run the graph); a named device is itself.
    #[test]
    fn auto_is_likely_the_cpu_without_other_providers() {
        assert_eq!(Device::Cuda(1).likely(&[]), Device::Cuda(1));
        let others: Vec<_> = Device::auto_candidates()
            .into_iter()
            .filter(|d| *d != Device::Cpu)
            .map(|d| (d, "skipped".to_string()))
            .collect();
        assert_eq!(Device::Auto.likely(&others), Device::Cpu);
        if Device::auto_candidates() == [Device::Cpu] {
            assert_eq!(Device::Auto.likely(&[]), Device::Cpu);
        }
    }
}
