//! ONNX Runtime: finding the library, choosing the device, building and running sessions.
//!
//! This is the only module that uses `ort` (its 2.0 release candidates rename things between
//! releases; the blast radius stays in this file). Everything else sees [`Graph`], [`TensorInput`]
//! and owned `ndarray` outputs.
//!
//! # Finding the ONNX Runtime library
//! `ort` is built with `load-dynamic`: the library is opened at run time, never linked or
//! downloaded. [`init`] looks, in this order, for:
//! 1. the path in [`RuntimeOptions::with_library`] (the CLI's `--ort-library`);
//! 2. the `ORT_DYLIB_PATH` environment variable;
//! 3. the path baked in at build time from `KLEIN_ORT_DYLIB` (the build scripts export the output
//!    of `scripts/setup-ort.sh`); skipped when that file no longer exists;
//! 4. `libonnxruntime.so*` / `libonnxruntime*.dylib` / `onnxruntime.dll` next to the executable;
//! 5. the same in `<executable dir>/../../.ort/` (`target/debug/klein` -> `<repo>/.ort/`, the
//!    folder `scripts/setup-ort.sh` fills).
//!
//! A path given by 1 or 2 that does not exist is an error, not a reason to look further. The
//! library is loaded once per process; [`RuntimeInfo`] says which file was used and why.
//!
//! # Devices
//! [`Device::Cpu`], [`Device::Cuda`] and [`Device::CoreMl`] are registered with
//! `error_on_failure()`: a device that cannot be used is an error, never a silent CPU fallback.
//! [`Device::Auto`] tries CUDA, then CoreML (each only when klein was compiled with the `cuda` /
//! `coreml` feature), then the CPU, and [`Graph::device`] records the one actually used.
//!
//! # Thread safety
//! [`Graph`] is `Send + Sync`, but [`Graph::run`] takes `&mut self`: `ort` requires exclusive
//! access to a session while it runs (some ONNX Runtime allocators are not thread safe). To share
//! one graph between threads, put it behind a `Mutex`; ONNX Runtime parallelises inside one run.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use half::{bf16, f16};
use ndarray::{ArrayD, ArrayView, ArrayViewD, CowArray, Dimension, IxDyn};
use ort::environment::Environment;
use ort::error::ErrorCode;
use ort::memory::{AllocationDevice, AllocatorType, MemoryInfo, MemoryType};
use ort::session::builder::{GraphOptimizationLevel, SessionBuilder};
use ort::session::{IoBinding, Session, SessionInputValue, SessionOutputs};
use ort::value::{DynValue, DynValueRef, Outlet, Tensor, TensorElementType, TensorRef, ValueType};

use crate::error::{KleinError, Result};
use crate::manifest::{DimSpec, Dtype, GraphSpec, TensorSpec};

/// Environment variable naming the ONNX Runtime library (the name `ort` itself uses).
pub const ORT_DYLIB_ENV: &str = "ORT_DYLIB_PATH";

/// Library path baked in at build time (`KLEIN_ORT_DYLIB=... cargo build`).
const BUILD_TIME_LIBRARY: Option<&str> = option_env!("KLEIN_ORT_DYLIB");

/// What to tell a user who has no usable library.
const HOW_TO_PROVIDE: &str = "Provide ONNX Runtime 1.31 or newer: set ORT_DYLIB_PATH to its shared library \
     (libonnxruntime.so.1.31.1 from the `onnxruntime` Python wheel works), or run scripts/setup-ort.sh in the \
     klein repository: it installs the library into .ort/, where a klein built in that repository finds it";

/// Receives ONNX Runtime's own log messages of level warning and above.
pub type LogSink = Arc<dyn Fn(LogLevel, &str) + Send + Sync>;

/// Severity of an ONNX Runtime log message passed to a [`LogSink`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum LogLevel {
    /// Something may be slow or unexpected (e.g. nodes placed on the CPU).
    Warning,
    /// An operation failed.
    Error,
    /// ONNX Runtime cannot continue.
    Fatal,
}

/// Process-wide options, given to [`init`] before the first graph loads.
#[derive(Clone, Default)]
#[non_exhaustive]
pub struct RuntimeOptions {
    /// Explicit ONNX Runtime library; `None` searches (see the module docs).
    pub library: Option<PathBuf>,
    /// Where ONNX Runtime's warnings go; `None` discards them (the library never prints).
    pub log_sink: Option<LogSink>,
}

impl RuntimeOptions {
    /// Uses this ONNX Runtime shared library instead of searching for one.
    pub fn with_library(mut self, path: impl Into<PathBuf>) -> Self {
        self.library = Some(path.into());
        self
    }

    /// Forwards ONNX Runtime's warnings and errors to `sink`.
    pub fn with_log_sink(mut self, sink: LogSink) -> Self {
        self.log_sink = Some(sink);
        self
    }
}

impl fmt::Debug for RuntimeOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RuntimeOptions")
            .field("library", &self.library)
            .field(
                "log_sink",
                &self.log_sink.as_ref().map(|_| "Fn(LogLevel, &str)"),
            )
            .finish()
    }
}

/// How the ONNX Runtime library was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LibrarySource {
    /// [`RuntimeOptions::with_library`].
    Explicit,
    /// The `ORT_DYLIB_PATH` environment variable.
    EnvVar,
    /// `KLEIN_ORT_DYLIB` at build time.
    BuildTime,
    /// Next to the executable.
    NextToExecutable,
    /// `<executable dir>/../../.ort/`, filled by `scripts/setup-ort.sh`.
    RepoOrtDir,
}

impl fmt::Display for LibrarySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LibrarySource::Explicit => "given explicitly",
            LibrarySource::EnvVar => "from ORT_DYLIB_PATH",
            LibrarySource::BuildTime => "baked in at build time from KLEIN_ORT_DYLIB",
            LibrarySource::NextToExecutable => "found next to the executable",
            LibrarySource::RepoOrtDir => "found in the repository's .ort/ folder",
        })
    }
}

/// The ONNX Runtime library this process uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeInfo {
    /// Path of the loaded library.
    pub library: PathBuf,
    /// How it was found.
    pub source: LibrarySource,
}

struct Runtime {
    info: RuntimeInfo,
    environment: Environment,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Loads the ONNX Runtime library and creates the process-wide environment, once.
///
/// Later calls return the same [`RuntimeInfo`]; they fail if they ask for a different library or
/// a log sink, which can no longer take effect. [`load_graph`] calls this with default options
/// when nothing has yet.
pub fn init(options: RuntimeOptions) -> Result<&'static RuntimeInfo> {
    let RuntimeOptions { library, log_sink } = options;
    // Checked before anything else so that a bad path always gets the same answer.
    if let Some(path) = &library {
        if !path.is_file() {
            return Err(KleinError::RuntimeLibrary(format!(
                "{} (given explicitly) does not exist. {HOW_TO_PROVIDE}",
                path.display()
            )));
        }
    }
    let _guard = INIT_LOCK.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(runtime) = RUNTIME.get() {
        if let Some(path) = &library {
            if !same_file(path, &runtime.info.library) {
                return Err(KleinError::RuntimeLibrary(format!(
                    "already loaded from {}; cannot switch to {} in the same process",
                    runtime.info.library.display(),
                    path.display()
                )));
            }
        }
        if log_sink.is_some() {
            return Err(KleinError::RuntimeLibrary(
                "already initialised; a log sink must be given to the first runtime::init"
                    .to_string(),
            ));
        }
        return Ok(&runtime.info);
    }

    let (path, source) = locate_library(library.as_deref())?;
    let builder = ort::init_from(&path).map_err(|e| {
        KleinError::RuntimeLibrary(format!(
            "{} ({source}) could not be loaded: {}. {HOW_TO_PROVIDE}",
            path.display(),
            error_chain(&e)
        ))
    })?;
    let logger: ort::logging::LoggerFunction =
        Arc::new(move |level, _category, _id, _location, message| {
            let level = match level {
                ort::logging::LogLevel::Verbose | ort::logging::LogLevel::Info => return,
                ort::logging::LogLevel::Warning => LogLevel::Warning,
                ort::logging::LogLevel::Error => LogLevel::Error,
                ort::logging::LogLevel::Fatal => LogLevel::Fatal,
            };
            if let Some(sink) = &log_sink {
                sink(level, message);
            }
        });
    let environment = builder
        .with_name("klein")
        .with_telemetry(false)
        .with_logger(logger)
        .build()
        .map_err(|e| {
            KleinError::RuntimeLibrary(format!(
                "{} loaded, but its environment could not be created: {}",
                path.display(),
                error_chain(&e)
            ))
        })?;
    // A custom logger starts at verbose; only warnings and above are wanted.
    environment.set_log_level(ort::logging::LogLevel::Warning);
    let runtime = RUNTIME.get_or_init(|| Runtime {
        info: RuntimeInfo {
            library: path,
            source,
        },
        environment,
    });
    Ok(&runtime.info)
}

/// The library in use, once [`init`] has succeeded.
pub fn runtime_info() -> Option<&'static RuntimeInfo> {
    RUNTIME.get().map(|r| &r.info)
}

fn runtime() -> Result<&'static Runtime> {
    if let Some(runtime) = RUNTIME.get() {
        return Ok(runtime);
    }
    init(RuntimeOptions::default())?;
    RUNTIME
        .get()
        .ok_or_else(|| KleinError::RuntimeLibrary("initialisation did not complete".to_string()))
}

/// Finds the ONNX Runtime library without loading it (the search order is in the module docs).
pub fn locate_library(explicit: Option<&Path>) -> Result<(PathBuf, LibrarySource)> {
    if let Some(path) = explicit {
        return existing(path, LibrarySource::Explicit, "given explicitly");
    }
    if let Some(value) = std::env::var_os(ORT_DYLIB_ENV).filter(|v| !v.is_empty()) {
        return existing(
            Path::new(&value),
            LibrarySource::EnvVar,
            "the value of ORT_DYLIB_PATH",
        );
    }
    let mut looked = Vec::new();
    if let Some(baked) = BUILD_TIME_LIBRARY.filter(|s| !s.is_empty()) {
        let baked = Path::new(baked);
        if baked.is_file() {
            return Ok((baked.to_path_buf(), LibrarySource::BuildTime));
        }
        looked.push(format!(
            "{} (baked in at build time, now missing)",
            baked.display()
        ));
    }
    match std::env::current_exe() {
        Ok(exe) => {
            let exe_dir = exe.parent().unwrap_or(Path::new("."));
            if let Some(found) = library_in_dir(exe_dir) {
                return Ok((found, LibrarySource::NextToExecutable));
            }
            looked.push(exe_dir.display().to_string());
            if let Some(repo) = exe_dir.ancestors().nth(2) {
                let ort_dir = repo.join(".ort");
                if let Some(found) = library_in_dir(&ort_dir) {
                    return Ok((found, LibrarySource::RepoOrtDir));
                }
                looked.push(ort_dir.display().to_string());
            }
        }
        Err(e) => looked.push(format!("(the executable's folder: unknown, {e})")),
    }
    Err(KleinError::RuntimeLibrary(format!(
        "no ONNX Runtime library found; ORT_DYLIB_PATH is not set and none was in: {}. {HOW_TO_PROVIDE}",
        looked.join(", ")
    )))
}

fn existing(path: &Path, source: LibrarySource, what: &str) -> Result<(PathBuf, LibrarySource)> {
    if path.is_file() {
        Ok((path.to_path_buf(), source))
    } else {
        Err(KleinError::RuntimeLibrary(format!(
            "{} ({what}) does not exist. {HOW_TO_PROVIDE}",
            path.display()
        )))
    }
}

/// The ONNX Runtime main library in `dir` (not its provider plug-ins): the unversioned name if
/// present, else the highest versioned one (`libonnxruntime.so.1.31.1`, as the wheel ships it).
fn library_in_dir(dir: &Path) -> Option<PathBuf> {
    let (unversioned, prefix, suffix) = if cfg!(target_os = "windows") {
        ("onnxruntime.dll", "onnxruntime.dll", "")
    } else if cfg!(target_os = "macos") {
        ("libonnxruntime.dylib", "libonnxruntime.", ".dylib")
    } else {
        ("libonnxruntime.so", "libonnxruntime.so.", "")
    };
    let names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|entry| entry.ok())
        .filter(|entry| entry.path().is_file())
        .filter_map(|entry| entry.file_name().into_string().ok())
        .filter(|name| name == unversioned || (name.starts_with(prefix) && name.ends_with(suffix)))
        .collect();
    if names.iter().any(|name| name == unversioned) {
        return Some(dir.join(unversioned));
    }
    names.into_iter().max().map(|name| dir.join(name))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

/// The message of an error and of every error that caused it, joined with ": ".
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

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
    /// ONNX Runtime's name of the execution provider, for reports (`"auto"` for [`Device::Auto`]).
    pub fn ep_name(&self) -> &'static str {
        match self {
            Device::Cpu => "CPUExecutionProvider",
            Device::Cuda(_) => "CUDAExecutionProvider",
            Device::CoreMl => "CoreMLExecutionProvider",
            Device::Auto => "auto",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(id) => write!(f, "cuda:{id}"),
            Device::CoreMl => f.write_str("coreml"),
            Device::Auto => f.write_str("auto"),
        }
    }
}

impl FromStr for Device {
    type Err = KleinError;

    /// Parses `cpu`, `cuda`, `cuda:N`, `coreml` or `auto` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let invalid = || {
            KleinError::Request(format!(
                "unknown device `{s}`; use cpu, cuda, cuda:N, coreml or auto"
            ))
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
    fn to_ort(self) -> GraphOptimizationLevel {
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
            _ => Err(KleinError::Request(format!(
                "unknown cuDNN conv search `{s}`; use heuristic, exhaustive or default"
            ))),
        }
    }
}

/// The CUDA execution provider's settings people tune; each `None` keeps ONNX Runtime's default.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct CudaOptions {
    /// Largest size of ONNX Runtime's CUDA memory arena, in bytes (`gpu_mem_limit`).
    pub memory_limit: Option<usize>,
    /// Grow the arena by what each allocation asks instead of by powers of two
    /// (`arena_extend_strategy`): a smaller peak on a shared GPU, more allocations.
    pub arena_same_as_requested: bool,
    /// cuDNN's convolution algorithm search.
    pub conv_search: ConvSearch,
    /// TF32 tensor-core products for float32 MatMul/Conv on Ampere and newer (`use_tf32`):
    /// faster, with 10-bit mantissa products.
    pub tf32: Option<bool>,
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
            _ => Err(KleinError::Request(format!(
                "unknown CoreML compute units `{s}`; use all, cpu-gpu, cpu-ane (Neural Engine) or cpu"
            ))),
        }
    }
}

/// The CoreML execution provider's settings.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct CoreMlOptions {
    /// Where CoreML may run the graphs.
    pub compute_units: ComputeUnits,
    /// Directory where compiled CoreML models are kept between processes
    /// (`ModelCacheDirectory`), keyed by the `COREML_CACHE_KEY` the exporter writes into each
    /// graph (a digest of the graph and its weights). `None`: every load compiles again.
    pub cache_dir: Option<PathBuf>,
}

/// Options of every session [`load_graph`] builds.
#[derive(Debug, Clone, Default)]
#[non_exhaustive]
pub struct SessionConfig {
    /// Where to run.
    pub device: Device,
    /// Threads inside one operator; `None` lets ONNX Runtime choose (one per physical core).
    pub intra_threads: Option<usize>,
    /// Graph optimisation level.
    pub optimization: OptimizationLevel,
    /// Settings of the CUDA provider (used when the device is CUDA, or auto picks it).
    pub cuda: CudaOptions,
    /// Settings of the CoreML provider (used when the device is CoreML, or auto picks it).
    pub coreml: CoreMlOptions,
}

impl SessionConfig {
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
}

/// Name, element type and shape of one graph input or output, as ONNX Runtime reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Element type, `None` for a type the bundle contract never uses (or a non-tensor).
    pub dtype: Option<Dtype>,
    /// Human-readable type, e.g. `float32` or `Sequence<Tensor<f32>>`.
    pub type_name: String,
    /// Dimensions; `None` for a dynamic one.
    pub shape: Vec<Option<u64>>,
}

impl TensorInfo {
    fn from_outlet(outlet: &Outlet) -> Self {
        let name = outlet.name().to_string();
        match outlet.dtype() {
            ValueType::Tensor { ty, shape, .. } => {
                let dtype = dtype_of(*ty);
                TensorInfo {
                    name,
                    dtype,
                    type_name: dtype
                        .map_or_else(|| format!("tensor({ty})"), |d| d.as_str().to_string()),
                    shape: shape.iter().map(|&d| u64::try_from(d).ok()).collect(),
                }
            }
            other => TensorInfo {
                name,
                dtype: None,
                type_name: other.to_string(),
                shape: Vec::new(),
            },
        }
    }

    fn shape_string(&self) -> String {
        let dims: Vec<String> = self
            .shape
            .iter()
            .map(|d| d.map_or("?".to_string(), |d| d.to_string()))
            .collect();
        format!("[{}]", dims.join(", "))
    }
}

fn dtype_of(ty: TensorElementType) -> Option<Dtype> {
    Some(match ty {
        TensorElementType::Float32 => Dtype::Float32,
        TensorElementType::Float16 => Dtype::Float16,
        TensorElementType::Bfloat16 => Dtype::Bfloat16,
        TensorElementType::Float64 => Dtype::Float64,
        TensorElementType::Int64 => Dtype::Int64,
        TensorElementType::Int32 => Dtype::Int32,
        TensorElementType::Int8 => Dtype::Int8,
        TensorElementType::Uint8 => Dtype::Uint8,
        TensorElementType::Bool => Dtype::Bool,
        _ => return None,
    })
}

/// One input of [`Graph::run`]: a borrowed `f32` or `i64` array of any shape. An `f32` input is
/// converted when the graph takes `float16` or `bfloat16`.
#[derive(Debug, Clone)]
pub enum TensorInput<'a> {
    /// Floating-point data.
    F32(ArrayViewD<'a, f32>),
    /// Integer data (token ids, masks, position ids).
    I64(ArrayViewD<'a, i64>),
}

impl TensorInput<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            TensorInput::F32(_) => Dtype::Float32,
            TensorInput::I64(_) => Dtype::Int64,
        }
    }
}

impl<'a, D: Dimension> From<ArrayView<'a, f32, D>> for TensorInput<'a> {
    fn from(view: ArrayView<'a, f32, D>) -> Self {
        TensorInput::F32(view.into_dyn())
    }
}

impl<'a, D: Dimension> From<ArrayView<'a, i64, D>> for TensorInput<'a> {
    fn from(view: ArrayView<'a, i64, D>) -> Self {
        TensorInput::I64(view.into_dyn())
    }
}

/// An input in the element type and memory layout ONNX Runtime needs.
enum PreparedInput<'a> {
    F32(CowArray<'a, f32, IxDyn>),
    I64(CowArray<'a, i64, IxDyn>),
    F16(ArrayD<f16>),
    Bf16(ArrayD<bf16>),
}

impl PreparedInput<'_> {
    /// An ONNX Runtime tensor viewing this data.
    fn tensor(&self, stage: &'static str, path: &Path) -> Result<DynValueRef<'_>> {
        let made = match self {
            PreparedInput::F32(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::I64(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::F16(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
            PreparedInput::Bf16(a) => TensorRef::from_array_view(a).map(|t| t.into_dyn()),
        };
        made.map_err(|e| run_error(stage, path, &e))
    }

    /// An ONNX Runtime tensor owning this data. `IoBinding::bind_input` clones a tensor that
    /// borrows its data, and in ort 2.0.0-rc.15 that clone deadlocks (it takes a lock it already
    /// holds); an owned tensor is bound as it is.
    fn into_owned_tensor(self, stage: &'static str, path: &Path) -> Result<DynValue> {
        let made = match self {
            PreparedInput::F32(a) => Tensor::from_array(a.into_owned()).map(|t| t.into_dyn()),
            PreparedInput::I64(a) => Tensor::from_array(a.into_owned()).map(|t| t.into_dyn()),
            PreparedInput::F16(a) => Tensor::from_array(a).map(|t| t.into_dyn()),
            PreparedInput::Bf16(a) => Tensor::from_array(a).map(|t| t.into_dyn()),
        };
        made.map_err(|e| run_error(stage, path, &e))
    }
}

/// Bindings one graph keeps for [`Graph::run_with_constants`]: a prompt and its negative.
const MAX_BINDINGS: usize = 2;

fn run_error(stage: &'static str, path: &Path, e: &ort::Error) -> KleinError {
    KleinError::Inference {
        stage,
        message: format!("running {}: {}", path.display(), error_chain(e)),
    }
}

/// Every output of a run, converted to `f32`.
fn extract_outputs(stage: &'static str, results: &SessionOutputs<'_>) -> Result<Outputs> {
    let fail = |message: String| KleinError::Inference { stage, message };
    let mut values = Vec::with_capacity(results.len());
    for (name, value) in results.iter() {
        let extract_error =
            |e: ort::Error| fail(format!("reading output `{name}`: {}", error_chain(&e)));
        let array = match value.dtype() {
            ValueType::Tensor {
                ty: TensorElementType::Float32,
                ..
            } => value
                .try_extract_array::<f32>()
                .map_err(extract_error)?
                .to_owned(),
            ValueType::Tensor {
                ty: TensorElementType::Float16,
                ..
            } => value
                .try_extract_array::<f16>()
                .map_err(extract_error)?
                .mapv(f32::from),
            ValueType::Tensor {
                ty: TensorElementType::Bfloat16,
                ..
            } => value
                .try_extract_array::<bf16>()
                .map_err(extract_error)?
                .mapv(f32::from),
            other => {
                return Err(fail(format!(
                    "output `{name}` is {other}; klein reads float32/float16/bfloat16 outputs only"
                )))
            }
        };
        values.push((name.to_string(), array));
    }
    Ok(Outputs { stage, values })
}

/// The outputs of one [`Graph::run`], converted to owned `f32` arrays.
#[derive(Debug)]
pub struct Outputs {
    stage: &'static str,
    values: Vec<(String, ArrayD<f32>)>,
}

impl Outputs {
    /// Removes and returns the output called `name`.
    pub fn take(&mut self, name: &str) -> Result<ArrayD<f32>> {
        match self.values.iter().position(|(n, _)| n == name) {
            Some(i) => Ok(self.values.swap_remove(i).1),
            None => Err(KleinError::Inference {
                stage: self.stage,
                message: format!(
                    "no output `{name}` (outputs left: {})",
                    self.values
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
        }
    }
}

/// A loaded ONNX graph, ready to run.
pub struct Graph {
    name: &'static str,
    path: PathBuf,
    session: Session,
    device: Device,
    skipped_devices: Vec<(Device, String)>,
    inputs: Vec<TensorInfo>,
    outputs: Vec<TensorInfo>,
    metadata: BTreeMap<String, String>,
    /// [`Graph::run_with_constants`]'s bound inputs, by key, oldest first.
    bindings: Vec<(u64, IoBinding)>,
}

impl fmt::Debug for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Graph")
            .field("name", &self.name)
            .field("path", &self.path)
            .field("device", &self.device)
            .field("inputs", &self.inputs)
            .field("outputs", &self.outputs)
            .finish_non_exhaustive()
    }
}

/// Builds the session of one graph file: the one place sessions are made.
///
/// `name` is the component (`text_encoder`, `transformer`, ...): errors name it as their stage.
/// Initialises the runtime with default options when [`init`] has not been called.
pub fn load_graph(name: &'static str, path: &Path, config: &SessionConfig) -> Result<Graph> {
    let SessionConfig {
        device,
        intra_threads,
        optimization,
        cuda,
        coreml,
    } = config.clone();
    if !path.is_file() {
        return Err(KleinError::Bundle {
            path: path.to_path_buf(),
            reason: format!("the {name} graph file is missing"),
        });
    }
    let runtime = runtime()?;
    let build = |device: Device| -> std::result::Result<Session, LoadFailure> {
        let builder = Session::builder(&runtime.environment)
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?
            .with_optimization_level(optimization.to_ort())
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?;
        let builder = match intra_threads {
            Some(n) => builder
                .with_intra_threads(n)
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?,
            None => builder,
        };
        let mut builder = register_device(builder, device, &cuda, &coreml)?;
        builder.commit_from_file(path).map_err(|e| match e.code() {
            // The file itself is not a graph ONNX Runtime can read: a bad bundle, not a bad run.
            ErrorCode::InvalidProtobuf | ErrorCode::InvalidGraph | ErrorCode::NoModel => {
                LoadFailure::File(error_chain(&e))
            }
            _ => LoadFailure::Session(error_chain(&e)),
        })
    };

    let candidates: Vec<Device> = match device {
        Device::Auto => {
            let mut c = Vec::new();
            if cfg!(feature = "cuda") {
                c.push(Device::Cuda(0));
            }
            if cfg!(feature = "coreml") {
                c.push(Device::CoreMl);
            }
            c.push(Device::Cpu);
            c
        }
        named => vec![named],
    };
    let mut skipped_devices = Vec::new();
    let mut loaded = None;
    for candidate in candidates {
        match build(candidate) {
            Ok(session) => {
                loaded = Some((candidate, session));
                break;
            }
            Err(failure) if candidate != Device::Cpu && device == Device::Auto => {
                skipped_devices.push((candidate, failure.message().to_string()));
            }
            Err(LoadFailure::Device(message)) => {
                return Err(KleinError::Device {
                    device: candidate.to_string(),
                    message: format!(
                        "{message} (choose the cpu device, or auto to fall back to the CPU)"
                    ),
                })
            }
            Err(LoadFailure::File(message)) => {
                return Err(KleinError::Bundle {
                    path: path.to_path_buf(),
                    reason: format!(
                        "ONNX Runtime cannot read it as the {name} graph ({message}); the file is corrupt or \
                         not an ONNX graph: check the bundle with `klein info --verify` and copy or export it again"
                    ),
                })
            }
            Err(LoadFailure::Session(message)) => {
                return Err(KleinError::Inference {
                    stage: name,
                    message: format!("loading {} on {candidate}: {message}", path.display()),
                })
            }
        }
    }
    let (device, session) = loaded.ok_or_else(|| KleinError::Inference {
        stage: name,
        message: format!("no device could load {}", path.display()),
    })?;

    let inputs = session
        .inputs()
        .iter()
        .map(TensorInfo::from_outlet)
        .collect();
    let outputs = session
        .outputs()
        .iter()
        .map(TensorInfo::from_outlet)
        .collect();
    let metadata = read_metadata(&session).map_err(|message| KleinError::Bundle {
        path: path.to_path_buf(),
        reason: format!("cannot read the graph's metadata: {message}"),
    })?;
    Ok(Graph {
        name,
        path: path.to_path_buf(),
        session,
        device,
        skipped_devices,
        inputs,
        outputs,
        metadata,
        bindings: Vec::new(),
    })
}

/// Why building one session failed: the device, the graph file, or the session itself.
enum LoadFailure {
    Device(String),
    /// ONNX Runtime cannot parse the file as a graph (corrupt, or not ONNX).
    File(String),
    Session(String),
}

impl LoadFailure {
    fn message(&self) -> &str {
        match self {
            LoadFailure::Device(m) | LoadFailure::File(m) | LoadFailure::Session(m) => m,
        }
    }
}

/// Registers the execution provider of a concrete (non-`Auto`) device, failing loudly.
fn register_device(
    builder: SessionBuilder,
    device: Device,
    cuda: &CudaOptions,
    coreml: &CoreMlOptions,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    match device {
        Device::Cpu | Device::Auto => Ok(builder),
        Device::Cuda(id) => register_cuda(builder, id, cuda),
        Device::CoreMl => register_coreml(builder, coreml),
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
    if let Some(tf32) = options.tf32 {
        ep = ep.with_tf32(tf32);
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

/// The model's custom metadata map (ONNX `metadata_props`).
fn read_metadata(session: &Session) -> std::result::Result<BTreeMap<String, String>, String> {
    let metadata = session.metadata().map_err(|e| error_chain(&e))?;
    let keys = metadata.custom_keys().map_err(|e| error_chain(&e))?;
    keys.into_iter()
        .map(|key| match metadata.custom(&key) {
            Some(value) => Ok((key, value)),
            None => Err(format!("metadata key `{key}` has no readable value")),
        })
        .collect()
}

impl Graph {
    /// The component name given to [`load_graph`].
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The `.onnx` file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The device the session actually runs on (never [`Device::Auto`]).
    pub fn device(&self) -> Device {
        self.device
    }

    /// Devices [`Device::Auto`] tried before [`Graph::device`], each with why it was not used.
    pub fn skipped_devices(&self) -> &[(Device, String)] {
        &self.skipped_devices
    }

    /// The graph's inputs, in graph order.
    pub fn inputs(&self) -> &[TensorInfo] {
        &self.inputs
    }

    /// The graph's outputs, in graph order.
    pub fn outputs(&self) -> &[TensorInfo] {
        &self.outputs
    }

    /// The graph's custom metadata (`klein.component`, `klein.format_version`, ...); checked by
    /// [`GraphSpec::check_metadata`].
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Checks the graph's inputs and outputs against the manifest's I/O contract: the same names,
    /// element types and ranks, and equal sizes where both sides fix a dimension. Every mismatch
    /// is reported, naming the graph, the tensor, what was expected and what was found.
    pub fn check_io(&self, declared: &GraphSpec) -> Result<()> {
        let mut problems = Vec::new();
        compare_tensors("input", &declared.inputs, &self.inputs, &mut problems);
        compare_tensors("output", &declared.outputs, &self.outputs, &mut problems);
        if problems.is_empty() {
            Ok(())
        } else {
            Err(KleinError::Bundle {
                path: self.path.clone(),
                reason: format!(
                    "the {} graph does not match manifest.json: {}",
                    self.name,
                    problems.join("; ")
                ),
            })
        }
    }

    /// Runs the graph. Every graph input must be given exactly once, by name; `f32` data goes to
    /// float32 inputs (converted for float16/bfloat16 ones) and `i64` data to int64 inputs.
    /// Non-contiguous views are copied to standard layout. Returns every output as `f32`.
    pub fn run(&mut self, inputs: &[(&str, TensorInput<'_>)]) -> Result<Outputs> {
        let prepared = self.prepare(inputs, &[])?;
        let stage = self.name;
        let path = &self.path;
        let mut session_inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(prepared.len());
        for (name, value) in &prepared {
            let value = value.tensor(stage, path)?;
            session_inputs.push((Cow::Borrowed(*name), value.into()));
        }
        let results = self
            .session
            .run(session_inputs)
            .map_err(|e| run_error(stage, path, &e))?;
        extract_outputs(stage, &results)
    }

    /// Runs like [`Graph::run`], with the inputs in `constants` bound once per `key` and reused
    /// while later calls give the same key (ONNX Runtime's IoBinding). On CUDA they are copied to
    /// the GPU once instead of at every call: the prompt embeddings and position ids stay on the
    /// device across the denoising steps, and only the latents and timestep travel. `constants`
    /// are read only when `key` is new; the graph keeps the two most recent keys (a prompt and
    /// its negative under guidance). `inputs` are the graph's other inputs.
    pub fn run_with_constants(
        &mut self,
        key: u64,
        constants: &[(&str, TensorInput<'_>)],
        inputs: &[(&str, TensorInput<'_>)],
    ) -> Result<Outputs> {
        let stage = self.name;
        let constant_names: Vec<&str> = constants.iter().map(|(n, _)| *n).collect();
        let prepared = self.prepare(inputs, &constant_names)?;
        let index = match self.bindings.iter().position(|(k, _)| *k == key) {
            Some(index) => index,
            None => {
                let binding = self.bind(constants)?;
                if self.bindings.len() == MAX_BINDINGS {
                    self.bindings.remove(0);
                }
                self.bindings.push((key, binding));
                self.bindings.len() - 1
            }
        };
        let path = &self.path;
        let (_, binding) = &mut self.bindings[index];
        for (name, value) in prepared {
            let value = value.into_owned_tensor(stage, path)?;
            binding
                .bind_input(name, &value)
                .map_err(|e| run_error(stage, path, &e))?;
        }
        let results = self
            .session
            .run_binding(binding)
            .map_err(|e| run_error(stage, path, &e))?;
        extract_outputs(stage, &results)
    }

    /// A binding of `constants` (copied now to where the session wants them) and of every output
    /// to host memory.
    fn bind(&self, constants: &[(&str, TensorInput<'_>)]) -> Result<IoBinding> {
        let (stage, path) = (self.name, &self.path);
        let fail = |e: ort::Error| run_error(stage, path, &e);
        let mut binding = self.session.create_binding().map_err(fail)?;
        let others: Vec<&str> = self
            .inputs
            .iter()
            .map(|i| i.name.as_str())
            .filter(|n| !constants.iter().any(|(c, _)| c == n))
            .collect();
        for (name, value) in self.prepare(constants, &others)? {
            let value = value.into_owned_tensor(stage, path)?;
            binding.bind_input(name, &value).map_err(fail)?;
        }
        let host = MemoryInfo::new(
            AllocationDevice::CPU,
            0,
            AllocatorType::Device,
            MemoryType::Default,
        )
        .map_err(fail)?;
        for output in &self.outputs {
            binding
                .bind_output_to_device(&output.name, &host)
                .map_err(fail)?;
        }
        Ok(binding)
    }

    /// Checks `inputs` against the graph (known names, each once, element types) and converts
    /// them to the graph's element types. Together with `elsewhere` (inputs given another way)
    /// they must cover every graph input.
    fn prepare<'a, 'n>(
        &self,
        inputs: &'a [(&'n str, TensorInput<'_>)],
        elsewhere: &[&str],
    ) -> Result<Vec<(&'n str, PreparedInput<'a>)>> {
        let stage = self.name;
        let fail = |message: String| KleinError::Inference { stage, message };
        let mut prepared: Vec<(&str, PreparedInput<'_>)> = Vec::with_capacity(inputs.len());
        for (name, input) in inputs {
            if prepared.iter().any(|(n, _)| n == name) || elsewhere.contains(name) {
                return Err(fail(format!("input `{name}` given twice")));
            }
            let info = self
                .inputs
                .iter()
                .find(|i| i.name == *name)
                .ok_or_else(|| {
                    fail(format!(
                        "the graph has no input `{name}` (its inputs: {})",
                        names(&self.inputs)
                    ))
                })?;
            let value = match (input, info.dtype) {
                (TensorInput::F32(v), Some(Dtype::Float32)) => {
                    PreparedInput::F32(v.as_standard_layout())
                }
                (TensorInput::F32(v), Some(Dtype::Float16)) => {
                    PreparedInput::F16(v.mapv(f16::from_f32))
                }
                (TensorInput::F32(v), Some(Dtype::Bfloat16)) => {
                    PreparedInput::Bf16(v.mapv(bf16::from_f32))
                }
                (TensorInput::I64(v), Some(Dtype::Int64)) => {
                    PreparedInput::I64(v.as_standard_layout())
                }
                (given, _) => {
                    return Err(fail(format!(
                        "input `{name}` takes {}, was given {}",
                        info.type_name,
                        given.dtype()
                    )))
                }
            };
            prepared.push((*name, value));
        }
        if let Some(missing) = self.inputs.iter().find(|i| {
            !prepared.iter().any(|(n, _)| *n == i.name) && !elsewhere.contains(&i.name.as_str())
        }) {
            return Err(fail(format!("input `{}` was not given", missing.name)));
        }
        Ok(prepared)
    }
}

fn names(tensors: &[TensorInfo]) -> String {
    tensors
        .iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Appends to `problems` every difference between the declared and the actual tensors of a graph.
fn compare_tensors(
    kind: &str,
    declared: &[TensorSpec],
    actual: &[TensorInfo],
    problems: &mut Vec<String>,
) {
    for spec in declared {
        let Some(found) = actual.iter().find(|t| t.name == spec.name) else {
            problems.push(format!(
                "{kind} `{}` is in manifest.json but not in the graph (graph {kind}s: {})",
                spec.name,
                names(actual)
            ));
            continue;
        };
        if found.dtype != Some(spec.dtype) {
            problems.push(format!(
                "{kind} `{}`: expected {}, found {}",
                spec.name, spec.dtype, found.type_name
            ));
        }
        let expected_shape = format!(
            "[{}]",
            spec.shape
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        );
        if found.shape.len() != spec.shape.len() {
            problems.push(format!(
                "{kind} `{}`: expected shape {expected_shape} (rank {}), found {} (rank {})",
                spec.name,
                spec.shape.len(),
                found.shape_string(),
                found.shape.len()
            ));
            continue;
        }
        for (axis, (want, got)) in spec.shape.iter().zip(&found.shape).enumerate() {
            if let (DimSpec::Fixed(want), Some(got)) = (want, got) {
                if want != got {
                    problems.push(format!(
                        "{kind} `{}` dimension {axis}: expected {want} (shape {expected_shape}), found {got} (shape {})",
                        spec.name,
                        found.shape_string()
                    ));
                }
            }
        }
    }
    for tensor in actual {
        if !declared.iter().any(|spec| spec.name == tensor.name) {
            problems.push(format!(
                "{kind} `{}` ({}) is in the graph but not in manifest.json",
                tensor.name, tensor.type_name
            ));
        }
    }
}
