//! Sessions: the one place they are built ([`load_graph`]), run, and bound (IoBinding).
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use ort::ep::ExecutionProvider;
use ort::error::ErrorCode;
use ort::memory::{AllocationDevice, Allocator, AllocatorType, MemoryInfo, MemoryType};
use ort::session::builder::SessionBuilder;
use ort::session::{IoBinding, OutputSelector, RunOptions, Session, SessionInputValue};
use ort::value::Tensor;

use super::cpu_cache::{CacheEntry, Saved};
use super::cpu_features::converts_int8_weights;
use super::denormals::flushed;
use super::device::{register_device, Device, LoadFailure, OptimizationLevel, SessionConfig};
use super::library::{error_chain, runtime};
use super::tensor::{
    extract_outputs, run_error, tensor_names, Dtype, Initializer, Outputs, PreparedInput,
    TensorInfo, TensorInput,
};
use crate::error::{KleinError, Result};

/// Bindings one graph keeps for [`Graph::run_with_constants`]: a prompt and its negative.
const MAX_BINDINGS: usize = 2;

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
    /// Problems that did not stop the load (a CPU cache entry that could not be written).
    warnings: Vec<String>,
    /// [`Graph::run_with_constants`]'s bound inputs, by key, oldest first.
    bindings: Vec<(u64, IoBinding)>,
    /// Whether the session runs on the CPU with ONNX Runtime's memory arena, which
    /// [`Graph::run_then_free_arena`] frees (ONNX Runtime refuses the run where there is none).
    cpu_arena: bool,
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
/// `initializers` replace the graph's initializers of the same names (merged LoRA weights).
/// Initialises the runtime with default options when [`super::init`] has not been called.
pub fn load_graph(
    name: &'static str,
    path: &Path,
    config: &SessionConfig,
    initializers: &[Initializer],
) -> Result<Graph> {
    let SessionConfig {
        device,
        intra_threads,
        optimization,
        cuda,
        coreml,
        auto_skip,
        prepack,
        no_cpu_arena,
        no_memory_pattern,
        no_spinning,
        int8_weights_7bit,
        cpu_cache_dir: _,
        cpu_cache_gib,
        cache_tag: _,
    } = config.clone();
    if !path.is_file() {
        return Err(KleinError::Bundle {
            path: path.to_path_buf(),
            reason: format!("the {name} graph file is missing"),
        });
    }
    let runtime = runtime()?;
    let uint8_weights = converts_int8_weights(int8_weights_7bit);
    // Initializers stored in the graph file: patched into its bytes, which ONNX Runtime then reads
    // from memory (external data, if any, is still found next to the file).
    let patched = if initializers.iter().any(Initializer::is_in_file) {
        let mut bytes = std::fs::read(path).map_err(|source| KleinError::Io {
            path: path.to_path_buf(),
            action: "reading the graph to merge weights into",
            source,
        })?;
        for initializer in initializers {
            initializer
                .patch(&mut bytes)
                .map_err(|reason| KleinError::Bundle {
                    path: path.to_path_buf(),
                    reason,
                })?;
        }
        Some(bytes)
    } else {
        None
    };
    let model_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    // `from`: the file to load; `Cached` loads a saved optimised graph as it is, `Save` writes the
    // optimised graph and its prepacked weights to the given file.
    let build = |device: Device, from: &LoadFrom| -> std::result::Result<Session, LoadFailure> {
        let level = match from {
            LoadFrom::Cached(_) => OptimizationLevel::Disable,
            _ => optimization,
        };
        let builder = Session::builder(&runtime.environment)
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?
            .with_optimization_level(level.to_ort())
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?
            // On the session's pool threads; the calling thread's are set around each run.
            .with_config_entry("session.set_denormal_as_zero", "1")
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?
            .with_config_entry(
                "session.intra_op.allow_spinning",
                if no_spinning { "0" } else { "1" },
            )
            .map_err(|e| LoadFailure::Session(error_chain(&e)))?;
        let builder = if uint8_weights {
            builder
                .with_config_entry("session.x64quantprecision", "1")
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?
        } else {
            builder
        };
        let builder = match from {
            LoadFrom::Save(file) => save_optimized(builder, file)?,
            _ => builder,
        };
        let builder = match patched {
            // Where a graph read from memory finds its external data.
            Some(_) => builder
                .with_config_entry(
                    "session.model_external_initializers_file_folder_path",
                    model_dir.to_string_lossy(),
                )
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?,
            None => builder,
        };
        let builder = if prepack {
            builder
        } else {
            builder
                .with_config_entry("session.disable_prepacking", "1")
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?
        };
        let builder = match intra_threads {
            Some(n) => builder
                .with_intra_threads(n)
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?,
            None => builder,
        };
        let mut builder = if no_memory_pattern && device == Device::Cpu {
            builder
                .with_memory_pattern(false)
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?
        } else {
            builder
        };
        if no_cpu_arena {
            // A session option (DisableCpuMemArena), whatever the device.
            ort::ep::CPU::default()
                .with_arena_allocator(false)
                .register(&mut builder)
                .map_err(|e| LoadFailure::Session(error_chain(&e)))?;
        }
        for initializer in initializers {
            if let Some(value) = initializer.external_value() {
                builder = builder
                    .with_external_initializer(initializer.name(), value)
                    .map_err(|e| LoadFailure::Session(error_chain(&e)))?;
            }
        }
        let strict = config.device != Device::Auto;
        let mut builder = register_device(builder, device, strict, &cuda, &coreml)?;
        // ONNX Runtime sets this thread's denormal flags when it creates its first session;
        // `flushed` puts them back.
        let committed = flushed(|| match (&patched, from) {
            (_, LoadFrom::Cached(file)) => builder.commit_from_file(file),
            (Some(bytes), _) => builder.commit_from_memory(bytes),
            (None, _) => builder.commit_from_file(path),
        });
        committed.map_err(|e| {
            let message = error_chain(&e);
            match e.code() {
                // The file itself is not a graph ONNX Runtime can read: a bad bundle, not a bad run.
                ErrorCode::InvalidProtobuf | ErrorCode::InvalidGraph | ErrorCode::NoModel => {
                    LoadFailure::File(message)
                }
                // On the CPU only the graph's files and the memory can fail a session: an opset
                // or operator this runtime lacks, external data out of bounds, a shape that does
                // not infer are the bundle's (errors of code FAIL, where ONNX Runtime says why).
                _ if device == Device::Cpu && !is_out_of_memory(&message) => {
                    LoadFailure::File(message)
                }
                _ => LoadFailure::Session(message),
            }
        })
    };

    let mut skipped_devices = Vec::new();
    let candidates: Vec<Device> = match device {
        Device::Auto => {
            skipped_devices.extend(auto_skip.iter().cloned());
            Device::auto_candidates()
                .into_iter()
                .filter(|d| !auto_skip.iter().any(|(skip, _)| skip == d))
                .collect()
        }
        named => vec![named],
    };
    if candidates.is_empty() {
        return Err(KleinError::Device {
            device: device.to_string(),
            message: format!(
                "no device auto may use can run the {name} graph: {}",
                describe_skipped(&skipped_devices)
            ),
        });
    }
    // The CPU cache holds graphs as the bundle has them: not with merged LoRA weights (patched
    // in here, or in a rewritten copy, whose config has no cache tag).
    let cache = initializers
        .is_empty()
        .then(|| cache_entry(name, config))
        .flatten();
    let mut warnings = Vec::new();
    let last = candidates.len() - 1;
    let mut loaded = None;
    for (i, candidate) in candidates.into_iter().enumerate() {
        let built = match &cache {
            Some(entry) if candidate == Device::Cpu => {
                let limit = cpu_cache_gib.map(|gib| gib.saturating_mul(1 << 30));
                let build = |from: &LoadFrom| build(candidate, from);
                build_cached(entry, name, build, limit, &mut warnings)
            }
            _ => build(candidate, &LoadFrom::Bundle),
        };
        match built {
            Ok(session) => {
                loaded = Some((candidate, session));
                break;
            }
            Err(failure) if i < last => {
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
                // A file that cannot be opened (no read permission) is named as such, not as
                // corrupt: ONNX Runtime's message does not tell the two apart.
                if let Err(source) = std::fs::File::open(path) {
                    return Err(KleinError::Io {
                        path: path.to_path_buf(),
                        action: "opening the graph",
                        source,
                    });
                }
                return Err(KleinError::Bundle {
                    path: path.to_path_buf(),
                    reason: format!(
                        "ONNX Runtime cannot read it as the {name} graph ({message}); the file is corrupt or \
                         not an ONNX graph this runtime can run: check the bundle with `klein info --verify` and \
                         copy or export it again"
                    ),
                });
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
        warnings,
        bindings: Vec::new(),
        cpu_arena: device == Device::Cpu && !no_cpu_arena,
    })
}

/// The CPU cache entry of graph `name` under `config`; `None` without a cache directory or tag.
fn cache_entry(name: &str, config: &SessionConfig) -> Option<CacheEntry> {
    Some(CacheEntry::new(
        config.cpu_cache_dir.as_ref()?,
        name,
        config.cache_tag.as_ref()?,
        ort::info(),
        config.optimization,
        config.prepack,
        converts_int8_weights(config.int8_weights_7bit),
    ))
}

/// The files [`load_graph`] will read for graph `name` at `path` (with no initializers replaced),
/// those that exist: the CPU cache's saved copy when there is one and the CPU may run the graph,
/// else the graph file; each with its external data (`<file>.data`). For [`super::prefetch`].
pub fn graph_files(name: &str, path: &Path, config: &SessionConfig) -> Vec<PathBuf> {
    let cpu_possible = matches!(config.device, Device::Cpu | Device::Auto);
    let file = cpu_possible
        .then(|| cache_entry(name, config)?.intact())
        .flatten()
        .unwrap_or_else(|| path.to_path_buf());
    let mut data = file.clone().into_os_string();
    data.push(".data");
    [file, PathBuf::from(data)]
        .into_iter()
        .filter(|f| f.is_file())
        .collect()
}

/// Whether ONNX Runtime's message says that memory ran out (its allocators' and C++'s words).
fn is_out_of_memory(message: &str) -> bool {
    [
        "bad_alloc",
        "bad allocation",
        "Failed to allocate",
        "out of memory",
    ]
    .iter()
    .any(|words| message.contains(words))
}

/// Which file a session is built from.
enum LoadFrom {
    /// The bundle's graph (or its bytes with merged weights).
    Bundle,
    /// The bundle's graph, saving the optimised graph and its prepacked weights to this file.
    Save(PathBuf),
    /// A saved optimised graph, loaded without further optimisation.
    Cached(PathBuf),
}

/// Builds a CPU session through the cache `entry`: from the saved graph if there is one (marked
/// used), else from the bundle's, saving it, then removing the least recently used entries past
/// `limit` bytes. A saved graph ONNX Runtime cannot load is discarded and saved again; a save that
/// fails (a full disk, say) is removed, and the bundle's graph is loaded without it, with a
/// warning.
fn build_cached(
    entry: &CacheEntry,
    name: &str,
    build: impl Fn(&LoadFrom) -> std::result::Result<Session, LoadFailure>,
    limit: Option<u64>,
    warnings: &mut Vec<String>,
) -> std::result::Result<Session, LoadFailure> {
    let unusable = match entry.saved() {
        Saved::Intact(saved) => {
            // Marked used before the load: an eviction meanwhile (another graph's save, here or
            // in another process) takes the least recently used entries, not this one.
            entry.used();
            match build(&LoadFrom::Cached(saved)) {
                Ok(session) => return Ok(session),
                Err(failure) => Some(format!("could not be loaded ({})", failure.message())),
            }
        }
        Saved::Changed => Some(
            "is not as it was saved (a file's size, time or inode changed since, or an older \
             klein saved it)"
                .to_string(),
        ),
        Saved::Missing => None,
    };
    if let Some(why) = unusable {
        let copy = format!(
            "the CPU cache's copy of the {name} graph ({}) {why}",
            entry.dir().display()
        );
        if let Err(error) = entry.discard() {
            warnings.push(format!(
                "{copy}, and cannot be removed ({error}): the graph was loaded from the bundle; \
                 remove that copy to use the cache again"
            ));
            return build(&LoadFrom::Bundle);
        }
        warnings.push(format!("{copy}, so it was saved again"));
    }
    let (partial, file) = match entry.start() {
        Ok(started) => started,
        Err(error) => {
            warnings.push(format!(
                "the {name} graph was not saved to the CPU cache ({}): {error}",
                entry.dir().display()
            ));
            return build(&LoadFrom::Bundle);
        }
    };
    match build(&LoadFrom::Save(file)) {
        Ok(session) => {
            let dir = partial.path().to_path_buf();
            if let Err(error) = entry.finish(partial) {
                warnings.push(format!(
                    "the {name} graph was not saved to the CPU cache ({}): {error}",
                    dir.display()
                ));
            } else if let Some(limit) = limit {
                match entry.evict_others(limit) {
                    Err(error) => warnings.push(format!(
                        "an old entry of the CPU cache could not be removed: {error}"
                    )),
                    Ok(recent) if recent > 0 => warnings.push(format!(
                        "saving the {name} graph to the CPU cache removed entries used in the \
                         last 10 minutes ({recent}): the limit is smaller than the graphs in use, \
                         which are then saved again at every load; raise it"
                    )),
                    Ok(_) => {}
                }
            }
            Ok(session)
        }
        Err(failure) => {
            drop(partial);
            let session = build(&LoadFrom::Bundle)?;
            warnings.push(format!(
                "the {name} graph was not saved to the CPU cache: {}",
                failure.message()
            ));
            Ok(session)
        }
    }
}

/// Session options that write the optimised graph to `file`, its weights (the prepacked ones
/// included) to `file` + `.data`.
fn save_optimized(
    builder: SessionBuilder,
    file: &Path,
) -> std::result::Result<SessionBuilder, LoadFailure> {
    let fail = |e: ort::Error<SessionBuilder>| LoadFailure::Session(error_chain(&e));
    let data = format!(
        "{}.data",
        file.file_name().unwrap_or_default().to_string_lossy()
    );
    builder
        .with_optimized_model_path(file)
        .map_err(fail)?
        .with_config_entry(
            "session.optimized_model_external_initializers_file_name",
            data,
        )
        .map_err(fail)?
        .with_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes",
            "1024",
        )
        .map_err(fail)?
        .with_config_entry("session.save_external_prepacked_constant_initializers", "1")
        .map_err(fail)
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

    /// Problems that did not stop the load, taken once.
    pub fn take_warnings(&mut self) -> Vec<String> {
        std::mem::take(&mut self.warnings)
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

    /// The graph's custom metadata (`klein.component`, `klein.format_version`, ...), checked by
    /// `bundle::contract`.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// Runs the graph. Every graph input must be given exactly once, by name; `f32` data goes to
    /// float32 inputs (converted for float16/bfloat16 ones) and `i64` data to int64 inputs.
    /// Non-contiguous views are copied to standard layout. Returns every output as `f32`.
    pub fn run(&mut self, inputs: &[(&str, TensorInput<'_>)]) -> Result<Outputs> {
        self.run_with(inputs, None)
    }

    /// Runs like [`Graph::run`], then gives the memory that ONNX Runtime's CPU memory arena holds
    /// back to the system (`memory.enable_memory_arena_shrinkage`); the same as [`Graph::run`]
    /// where the session has no such arena (another device, or made without it). `outputs` names
    /// each output once, with the shape this run gives it: they are written outside the arena, since
    /// ONNX Runtime frees only regions with nothing left in them (with the output in the arena,
    /// the tiny decoder at 1024x1024 kept 1 of the 2.1 GiB it grew by). The arena otherwise keeps
    /// what the largest run needed for the session's life: a pipeline that makes several images
    /// kept its VAE decoder's activations under the next image's steps. The pipeline frees it
    /// after each VAE pass (batch mode, wide dds, 2 images at 1024x1024: benches/RESULTS.md, "Heap"). The next
    /// run allocates its activations anew.
    pub fn run_then_free_arena(
        &mut self,
        inputs: &[(&str, TensorInput<'_>)],
        outputs: &[(&str, &[usize])],
    ) -> Result<Outputs> {
        let mut graph_outputs = self.outputs.iter().map(|o| o.name.as_str());
        let each_once = outputs.len() == self.outputs.len()
            && graph_outputs.all(|name| outputs.iter().filter(|(n, _)| *n == name).count() == 1);
        if !each_once {
            let names: Vec<&str> = outputs.iter().map(|(name, _)| *name).collect();
            return Err(KleinError::Inference {
                stage: self.name,
                message: format!(
                    "outputs to make outside the arena: {names:?}; the graph's are {}",
                    tensor_names(&self.outputs)
                ),
            });
        }
        let outside_arena = self.cpu_arena.then_some(outputs);
        self.run_with(inputs, outside_arena)
    }

    /// Runs the graph; with `outside_arena` (every output's name and shape), into outputs made by
    /// ONNX Runtime's plain CPU allocator, and the arena freed after the run.
    fn run_with(
        &mut self,
        inputs: &[(&str, TensorInput<'_>)],
        outside_arena: Option<&[(&str, &[usize])]>,
    ) -> Result<Outputs> {
        let prepared = self.prepare(inputs, &[])?;
        let stage = self.name;
        let path = &self.path;
        let mut session_inputs: Vec<(Cow<'_, str>, SessionInputValue<'_>)> =
            Vec::with_capacity(prepared.len());
        for (name, value) in &prepared {
            let value = value.tensor(stage, path)?;
            session_inputs.push((Cow::Borrowed(*name), value.into()));
        }
        let fail = |e: ort::Error| run_error(stage, path, &e);
        let Some(outside_arena) = outside_arena else {
            let results = flushed(|| self.session.run(session_inputs)).map_err(fail)?;
            return extract_outputs(stage, &results);
        };
        let internal = |message: String| KleinError::Inference { stage, message };
        let plain = Allocator::default(); // ONNX Runtime's CPU allocator without an arena
        let mut selector = OutputSelector::default();
        for &(name, shape) in outside_arena {
            let info = self.outputs.iter().find(|o| o.name == name);
            selector = match info.and_then(|o| o.dtype) {
                Some(Dtype::Float32) => {
                    selector.preallocate(name, Tensor::<f32>::new(&plain, shape).map_err(fail)?)
                }
                Some(Dtype::Float16) => {
                    selector.preallocate(name, Tensor::<f16>::new(&plain, shape).map_err(fail)?)
                }
                Some(Dtype::Bfloat16) => {
                    selector.preallocate(name, Tensor::<bf16>::new(&plain, shape).map_err(fail)?)
                }
                _ => {
                    return Err(internal(format!(
                        "output `{name}` is not a float tensor: it cannot be made outside the arena"
                    )))
                }
            };
        }
        let mut options = RunOptions::new().map_err(fail)?.with_outputs(selector);
        options
            .set("memory.enable_memory_arena_shrinkage", "cpu:0")
            .map_err(fail)?;
        let results =
            flushed(|| self.session.run_with_options(session_inputs, &options)).map_err(fail)?;
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
        let results = flushed(|| self.session.run_binding(binding))
            .map_err(|e| run_error(stage, path, &e))?;
        extract_outputs(stage, &results)
    }

    /// Drops the inputs [`Graph::run_with_constants`] bound (a KV bundle's reference K/V among
    /// them): their memory goes back now, and the next call binds its constants anew.
    pub fn forget_constants(&mut self) {
        self.bindings.clear();
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
                        tensor_names(&self.inputs)
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

/// `cuda:0: why; cpu: why`, for messages about the devices auto skipped.
pub fn describe_skipped(skipped: &[(Device, String)]) -> String {
    skipped
        .iter()
        .map(|(device, why)| format!("{device}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}
