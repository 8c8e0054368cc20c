//! Finding and loading the ONNX Runtime library, once per process (search order in the
//! [`super`] module docs).
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use ort::environment::Environment;

use super::locate::{LibrarySource, HOW_TO_PROVIDE};
use super::version::OrtVersion;
pub(super) use crate::error::chain as error_chain;
use crate::error::{KleinError, Result};

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
pub struct RuntimeOptions {
    /// Explicit ONNX Runtime library; `None` searches (see the module docs).
    pub(crate) library: Option<PathBuf>,
    /// Where ONNX Runtime's warnings go; `None` discards them (the library never prints).
    pub(crate) log_sink: Option<LogSink>,
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

/// The ONNX Runtime library this process uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuntimeInfo {
    /// Path of the loaded library.
    pub library: PathBuf,
    /// How it was found.
    pub source: LibrarySource,
    /// The release the library reports (`OrtGetApiBase()->GetVersionString()`); `None` when it
    /// reports no release number.
    pub version: Option<OrtVersion>,
}

pub(super) struct Runtime {
    info: RuntimeInfo,
    pub(super) environment: Environment,
}

static RUNTIME: OnceLock<Runtime> = OnceLock::new();
static INIT_LOCK: Mutex<()> = Mutex::new(());

/// Loads the ONNX Runtime library and creates the process-wide environment, once.
///
/// Later calls return the same [`RuntimeInfo`]; they fail if they ask for a different library or
/// a log sink, which can no longer take effect. `load_graph` calls this with default options
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

    let (path, source) = super::locate::locate_library(library.as_deref())?;
    // Absolute, so that `ort` and `library_version` open this file (`ort` would try a relative
    // path beside the executable first).
    let path = std::path::absolute(&path).unwrap_or(path);
    // Before `ort` commits the process to this file: a file that is no ONNX Runtime is refused
    // with nothing loaded for good.
    let not_loaded = |why: String| {
        KleinError::RuntimeLibrary(format!(
            "{} ({source}) could not be loaded: {why}. {HOW_TO_PROVIDE}",
            path.display()
        ))
    };
    let version = library_version(&path).map_err(not_loaded)?;
    let builder = ort::init_from(&path).map_err(|e| not_loaded(error_chain(&e)))?;
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
            version,
        },
        environment,
    });
    Ok(&runtime.info)
}

/// The library in use, once [`init`] has succeeded.
pub fn runtime_info() -> Option<&'static RuntimeInfo> {
    RUNTIME.get().map(|r| &r.info)
}

pub(super) fn runtime() -> Result<&'static Runtime> {
    if let Some(runtime) = RUNTIME.get() {
        return Ok(runtime);
    }
    init(RuntimeOptions::default())?;
    RUNTIME
        .get()
        .ok_or_else(|| KleinError::RuntimeLibrary("initialisation did not complete".to_string()))
}

/// The release the library at `path` reports; `None` when it is not a release number (a
/// development or vendor build: its bundles' requirements are then not checked).
#[allow(unsafe_code)]
fn library_version(path: &Path) -> std::result::Result<Option<OrtVersion>, String> {
    // SAFETY: `OrtGetApiBase` and `GetVersionString` take nothing and return static data in every
    // ONNX Runtime release (`ort` calls both the same way); the text is copied before the library
    // handle is dropped (which only releases this reference to it).
    let text = unsafe {
        let library = libloading::Library::new(path).map_err(|e| e.to_string())?;
        let get_base: libloading::Symbol<unsafe extern "C" fn() -> *const ort::sys::OrtApiBase> =
            library
                .get(b"OrtGetApiBase")
                .map_err(|_| "it does not export OrtGetApiBase: not an ONNX Runtime library")?;
        let base = get_base();
        if base.is_null() {
            return Err("its OrtGetApiBase returned nothing".to_string());
        }
        let text = ((*base).GetVersionString)();
        if text.is_null() {
            return Ok(None);
        }
        std::ffi::CStr::from_ptr(text)
            .to_string_lossy()
            .into_owned()
    };
    Ok(OrtVersion::parse_leading(&text))
}

fn same_file(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}
