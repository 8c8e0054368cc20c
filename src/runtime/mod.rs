//! ONNX Runtime: finding the library, choosing the device, building and running sessions.
//!
//! This is the only module that uses `ort` (its 2.0 release candidates rename things between
//! releases; the blast radius stays in this folder). Everything else sees [`Graph`],
//! [`TensorInput`] and owned `ndarray` outputs. `library` finds and loads ONNX Runtime,
//! `device` turns a [`Device`] and its options into execution providers, `tensor` converts
//! data in and out, and `graph` builds, binds and runs sessions. [`retain_freed_memory`] keeps
//! the memory runs free in glibc's heap for the next run ([`give_back_freed_memory`] returns it
//! for VAE decodes and tiled VAE passes), and [`start_tunables`] adds huge pages
//! for a process that starts again (the CLI and server use both).
//!
//! # Finding the ONNX Runtime library
//! `ort` is built with `load-dynamic`: the library is opened at run time, never linked or
//! downloaded. [`init`] looks, in this order, for:
//! 1. the path in [`RuntimeOptions::with_library`] (the CLI's `--ort-lib`);
//! 2. the `ORT_DYLIB_PATH` environment variable;
//! 3. the path baked in at build time from `KLEIN_ORT_DYLIB` (the build scripts export the output
//!    of `scripts/setup-ort.sh`); skipped when that file no longer exists;
//! 4. `libonnxruntime.so*` / `libonnxruntime*.dylib` / `onnxruntime.dll` next to the executable;
//! 5. the same in `<executable dir>/../../.ort/` (`target/debug/klein` -> `<repo>/.ort/`, the
//!    folder `scripts/setup-ort.sh` fills);
//! 6. the same in `<cache dir>/ort/`, which `klein setup` fills
//!    ([`crate::fsutil::default_cache_dir`]);
//! 7. the `onnxruntime` Python package's `capi/` folder: of the active environment
//!    (`$VIRTUAL_ENV`, `$CONDA_PREFIX`), else of `python3`;
//! 8. the system's library folders (`LD_LIBRARY_PATH` / `DYLD_LIBRARY_PATH`, `/usr/local/lib`,
//!    `/usr/lib`...).
//!
//! A path given by 1 or 2 that does not exist is an error, not a reason to look further. The
//! library is loaded once per process; [`RuntimeInfo`] says which file was used, why, and its
//! release (a bundle that needs a newer one is refused).
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

mod cpu_cache;
mod cpu_features;
mod denormals;
mod device;
mod graph;
mod heap;
mod library;
mod locate;
pub mod onnx_proto;
mod prefetch;
mod tensor;
mod version;

pub(crate) use cpu_features::converts_int8_weights;
pub use cpu_features::{detected_features, int8_products_saturate};
pub use device::{
    ComputeUnits, ConvSearch, CoreMlOptions, CudaOptions, Device, OptimizationLevel, SessionConfig,
};
pub use graph::{describe_skipped, graph_files, load_graph, Graph};
pub use heap::{
    give_back_freed_memory, retain_freed_memory, start_tunables, GivenBack, GLIBC_TUNABLES,
};
pub use library::{init, runtime_info, LogLevel, LogSink, RuntimeInfo, RuntimeOptions};
pub use locate::{library_in_dir, locate_library, LibrarySource, ORT_DYLIB_ENV, SETUP_DIR};
pub use prefetch::{fits_in_memory, prefetch, prefetch_in_turn};
pub use tensor::{
    tensor_names, Dtype, Initializer, InitializerData, Outputs, TensorInfo, TensorInput,
};
pub use version::OrtVersion;
