//! `klein_runtime._klein`: the native half of the `klein_runtime` Python package
//! (python/klein_runtime/ is the other).
//!
//! A thin layer over [`klein::pipeline::Pipeline`]: the Python side turns PIL images, generators
//! and output types into the plain values taken here (paths, PNG bytes, integers) and back. Every
//! call that touches the pipeline runs with the GIL released (`py.detach`), the pipeline behind a
//! mutex; the progress callback re-attaches to call Python and to check for Ctrl-C. Errors are
//! Python exceptions carrying klein's message; nothing here panics on input.
#![warn(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![deny(unsafe_code)]
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::thread::ThreadId;
use std::time::Duration;

use klein::api::models;
use klein::limits;
use klein::pipeline::metadata::variant_name;
use klein::pipeline::{
    Generation, ImageInput, LoraSpec, MaskKind, Pipeline, PipelineOptions, Progress, RequestSpec,
    Timings, VaeTiling,
};
use klein::runtime::{Device, RuntimeOptions};
use klein::stages::output::{encode_image, ImageFormat};
use klein::KleinError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyTuple};

mod args;
mod errors;
mod openai;

use args::*;
use errors::*;

/// The pipeline, whatever a panic elsewhere left (klein does not panic on input).
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Marks the thread running a generation of a pipeline until dropped (see
/// [`PyPipeline::locked`]).
struct Generating<'a>(&'a Mutex<Option<ThreadId>>);

impl<'a> Generating<'a> {
    fn start(slot: &'a Mutex<Option<ThreadId>>) -> Generating<'a> {
        *lock(slot) = Some(std::thread::current().id());
        Generating(slot)
    }
}

impl Drop for Generating<'_> {
    fn drop(&mut self) {
        *lock(self.0) = None;
    }
}

/// The bundle's model, read once at load (its manifest does not change).
#[derive(Clone)]
struct ModelInfo {
    name: String,
    variant: &'static str,
    family: &'static str,
    distilled: bool,
    default_width: u32,
    default_height: u32,
    default_steps: u32,
    default_guidance: f64,
}

/// A loaded klein bundle. Calls from several threads take turns; each runs without the GIL.
#[pyclass(module = "klein_runtime._klein", name = "Pipeline", frozen)]
struct PyPipeline {
    pipeline: Mutex<Pipeline>,
    model: ModelInfo,
    bundle_dir: PathBuf,
    requested_device: String,
    /// The applied LoRAs, readable while a generation holds the pipeline.
    loras: Mutex<Vec<(PathBuf, f32)>>,
    /// The thread whose generation holds the pipeline, while one does.
    generating_on: Mutex<Option<ThreadId>>,
    /// Where the graphs loaded so far run, as of the last call that held the pipeline: readable
    /// while a generation holds it (from its own callback too).
    device_used: Mutex<String>,
    /// OpenAI's model object of the bundle (`klein::api::models`), `created` at load.
    openai_model: serde_json::Value,
}

/// What a generation made, before it becomes Python objects.
struct Made {
    generation: Generation,
    png: Option<Vec<Vec<u8>>>,
    references: Vec<String>,
    warnings: Vec<String>,
    device: String,
}

/// The result of `Pipeline.generate`.
#[pyclass(module = "klein_runtime._klein", name = "Generation", frozen)]
struct PyGeneration {
    images: Vec<Py<PyBytes>>,
    png: Option<Vec<Py<PyBytes>>>,
    #[pyo3(get)]
    width: u32,
    #[pyo3(get)]
    height: u32,
    #[pyo3(get)]
    steps: usize,
    #[pyo3(get)]
    guidance: f64,
    #[pyo3(get)]
    seed: u64,
    #[pyo3(get)]
    prompt_truncated: bool,
    #[pyo3(get)]
    timings: Vec<(String, f64)>,
    #[pyo3(get)]
    references: Vec<String>,
    #[pyo3(get)]
    warnings: Vec<String>,
    #[pyo3(get)]
    device: String,
}

#[pymethods]
impl PyGeneration {
    /// Each image's pixels: `height * width * 3` bytes, RGB, row-major.
    #[getter]
    fn images(&self, py: Python<'_>) -> Vec<Py<PyBytes>> {
        self.images.iter().map(|b| b.clone_ref(py)).collect()
    }

    /// Each image as a PNG file with the generation settings (as the CLI writes it), when asked.
    #[getter]
    fn png(&self, py: Python<'_>) -> Option<Vec<Py<PyBytes>>> {
        self.png
            .as_ref()
            .map(|files| files.iter().map(|b| b.clone_ref(py)).collect())
    }
}

/// Seconds per stage label, in the order the stages first ran (repeated stages added up).
fn seconds_per_stage(timings: &Timings) -> Vec<(String, f64)> {
    let mut totals: Vec<(String, Duration)> = Vec::new();
    for (stage, elapsed) in timings {
        match totals.iter_mut().find(|(label, _)| label == stage.label()) {
            Some((_, total)) => *total += *elapsed,
            None => totals.push((stage.label().to_string(), *elapsed)),
        }
    }
    totals
        .into_iter()
        .map(|(label, total)| (label, total.as_secs_f64()))
        .collect()
}

impl PyPipeline {
    /// The pipeline, locked (waiting for another thread's call to end); refused on the thread
    /// whose generation holds it: a callback or preview calling its own pipeline would wait for
    /// itself forever.
    fn locked(&self) -> klein::Result<MutexGuard<'_, Pipeline>> {
        if *lock(&self.generating_on) == Some(std::thread::current().id()) {
            return Err(KleinError::request(
                "this pipeline is running the generation whose callback or preview made this call; \
                 use another klein.Pipeline there, or call after the generation returns",
            ));
        }
        Ok(lock(&self.pipeline))
    }

    fn run_generation(
        &self,
        spec: RequestSpec,
        png: bool,
        callback: Option<Py<PyAny>>,
        preview: Option<Py<PyAny>>,
    ) -> Result<Made, Failure> {
        let mut locked = self.locked().map_err(Failure::Klein)?;
        let _generating = Generating::start(&self.generating_on);
        let pipeline = &mut *locked;
        let made = (|| -> Result<Made, Failure> {
            let request = pipeline.prepare(&spec).map_err(Failure::Spec)?;
            let label = |image: &ImageInput| image.label().to_string_lossy().into_owned();
            let labels: Vec<String> = spec.references.iter().map(label).collect();

            let mut python_error: Option<PyErr> = None;
            let mut on_progress = |event: Progress| -> ControlFlow<()> {
                Python::attach(|py| {
                    if let Err(interrupt) = py.check_signals() {
                        python_error = Some(interrupt);
                        return ControlFlow::Break(());
                    }
                    let called = match (event, &callback, &preview) {
                        (Progress::Step { step, total }, Some(callback), _) => {
                            callback.call1(py, (step, total))
                        }
                        (Progress::Preview(p), _, Some(preview)) => {
                            let images: Vec<(Py<PyBytes>, u32, u32)> = p
                                .images
                                .iter()
                                .map(|i| (PyBytes::new(py, &i.pixels).unbind(), i.width, i.height))
                                .collect();
                            preview.call1(py, (p.step, p.total, images))
                        }
                        _ => return ControlFlow::Continue(()),
                    };
                    match called {
                        Ok(answer) if answer.bind(py).is(PyBool::new(py, false)) => {
                            ControlFlow::Break(())
                        }
                        Ok(_) => ControlFlow::Continue(()),
                        Err(raised) => {
                            python_error = Some(raised);
                            ControlFlow::Break(())
                        }
                    }
                })
            };
            let generated = pipeline.generate(&request, Some(&mut on_progress));
            let generation = match (generated, python_error) {
                (Ok(generation), _) => generation,
                (Err(KleinError::Cancelled), Some(raised)) => return Err(Failure::Python(raised)),
                (Err(error), _) => return Err(Failure::Klein(error)),
            };
            let png = if png {
                let hash = pipeline.bundle_sha256().map_err(Failure::Klein)?;
                let mut text =
                    pipeline.image_metadata(&generation, &request.prompt, &labels, &hash);
                for (key, image) in [("image", &spec.source), ("mask_image", &spec.mask)] {
                    if let Some(image) = image {
                        text.push((key.into(), label(image)));
                    }
                }
                let files = generation
                    .images
                    .iter()
                    .map(|image| encode_image(image, ImageFormat::Png, &text))
                    .collect::<klein::Result<Vec<_>>>()
                    .map_err(Failure::Klein)?;
                Some(files)
            } else {
                None
            };
            Ok(Made {
                generation,
                png,
                references: labels,
                warnings: pipeline.take_warnings(),
                device: pipeline.device_name(),
            })
        })();
        // Graphs load during a generation, also one that fails.
        *lock(&self.device_used) = pipeline.device_name();
        made
    }
}

#[pymethods]
impl PyPipeline {
    /// Loads the bundle at `model` (see `klein.Pipeline`; here every argument is explicit).
    #[new]
    #[allow(clippy::too_many_arguments)] // the keyword arguments of a Python call
    #[pyo3(signature = (model, *, device = "cpu", threads = None, loras = Vec::new(), verify_hashes = true, keep_text_encoder = false, release_transformer = false, vae_tiling = "auto", vae_tile_size = None, cpu_cache = None, cpu_cache_max_gib = None, prompt_cache = None, prompt_cache_max_mib = None, ort_lib = None))]
    fn new(
        py: Python<'_>,
        model: PathBuf,
        device: &str,
        threads: Option<usize>,
        loras: Vec<LoraArg>,
        verify_hashes: bool,
        keep_text_encoder: bool,
        release_transformer: bool,
        vae_tiling: &str,
        vae_tile_size: Option<u32>,
        cpu_cache: Option<PathBuf>,
        cpu_cache_max_gib: Option<u64>,
        prompt_cache: Option<PathBuf>,
        prompt_cache_max_mib: Option<u64>,
        ort_lib: Option<PathBuf>,
    ) -> PyResult<Self> {
        let device = Device::from_str(device).map_err(|e| to_py_err(py, &e))?;
        let vae_tiling = VaeTiling::from_str(vae_tiling).map_err(|message| {
            to_py_err(
                py,
                &KleinError::request_about("vae_tiling", format!("vae_tiling {message}")),
            )
        })?;
        let loras: Vec<LoraSpec> = loras.into_iter().map(LoraArg::spec).collect();
        let mut runtime = RuntimeOptions::default();
        if let Some(library) = ort_lib {
            runtime = runtime.with_library(library);
        }
        let mut options = PipelineOptions::default()
            .with_device(device)
            .with_runtime(runtime)
            .with_verify_hashes(verify_hashes)
            .with_keep_text_encoder(keep_text_encoder)
            .with_release_transformer(release_transformer)
            .with_vae_tiling(vae_tiling)
            .with_loras(loras.clone());
        if let Some(threads) = threads {
            options = options.with_threads(threads);
        }
        if let Some(dir) = cpu_cache {
            options = options.with_cpu_cache_dir(dir);
        }
        if let Some(gib) = cpu_cache_max_gib {
            options = options.with_cpu_cache_limit_gib(gib);
        }
        if let Some(dir) = prompt_cache {
            options = options.with_prompt_cache_dir(dir);
        }
        if let Some(mib) = prompt_cache_max_mib {
            options = options.with_prompt_cache_limit_mib(mib);
        }
        if let Some(pixels) = vae_tile_size {
            options = options.with_vae_tile_size(pixels);
        }
        // Hashing a bundle takes seconds: other Python threads run meanwhile.
        let pipeline = py
            .detach(|| Pipeline::load(&model, options))
            .map_err(|e| to_py_err(py, &e))?;
        let m = &pipeline.manifest().model;
        let info = ModelInfo {
            name: m.name.clone(),
            variant: variant_name(m.variant),
            family: match m.family {
                klein::bundle::ModelFamily::Flux2 => "flux2",
                klein::bundle::ModelFamily::Flux3 => "flux3",
            },
            distilled: m.is_distilled,
            default_width: m.default_width,
            default_height: m.default_height,
            default_steps: m.default_steps,
            default_guidance: m.default_guidance,
        };
        let bundle_dir = pipeline.bundle_dir().to_path_buf();
        let device_used = pipeline.device_name();
        let loaded_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let openai_model = models::model_object(pipeline.manifest(), &m.name, loaded_at, None);
        Ok(PyPipeline {
            pipeline: Mutex::new(pipeline),
            model: info,
            bundle_dir,
            requested_device: device.to_string(),
            loras: Mutex::new(
                loras
                    .iter()
                    .map(|l| (l.path().to_path_buf(), l.scale()))
                    .collect(),
            ),
            generating_on: Mutex::new(None),
            device_used: Mutex::new(device_used),
            openai_model,
        })
    }

    /// Generates `num_images` images for `prompt` with the GIL released. `references`: paths
    /// (labelled by the string as given) or `(file bytes, label)` pairs. `callback(step, total)`
    /// runs after every denoising step; returning `False` cancels. `source` (and `mask`, a path
    /// or a pair as a reference; its white repaints, or with `mask_transparent` its fully
    /// transparent pixels, as OpenAI's edits) inpaints with `strength` (default 1.0), cropped to
    /// the mask's region with `mask_crop` pixels of padding when given. `preview(step, total,
    /// [(rgb, width, height)])` gets step previews every `preview_every` steps (default 1).
    #[pyo3(signature = (prompt, *, references = Vec::new(), width = None, height = None, steps = None, guidance = None, negative_prompt = None, seed = None, num_images = 1, png = false, callback = None, source = None, mask = None, mask_transparent = false, strength = None, mask_crop = None, preview_every = None, preview = None))]
    #[allow(clippy::too_many_arguments)] // the keyword arguments of a Python call
    fn generate(
        &self,
        py: Python<'_>,
        prompt: String,
        references: Vec<ReferenceArg<'_>>,
        width: Option<u32>,
        height: Option<u32>,
        steps: Option<usize>,
        guidance: Option<f64>,
        negative_prompt: Option<String>,
        seed: Option<u64>,
        num_images: usize,
        png: bool,
        callback: Option<Py<PyAny>>,
        source: Option<ReferenceArg<'_>>,
        mask: Option<ReferenceArg<'_>>,
        mask_transparent: bool,
        strength: Option<f64>,
        mask_crop: Option<u32>,
        preview_every: Option<usize>,
        preview: Option<Py<PyAny>>,
    ) -> PyResult<PyGeneration> {
        let mut spec = RequestSpec::new(prompt);
        spec.seed = seed;
        spec.num_images = num_images;
        spec.width = width;
        spec.height = height;
        spec.steps = steps;
        spec.guidance = guidance;
        spec.negative_prompt = negative_prompt;
        spec.references = references.into_iter().map(image_input).collect();
        spec.source = source.map(image_input);
        spec.mask = mask.map(image_input);
        if mask_transparent {
            spec.mask_kind = MaskKind::Transparent;
        }
        spec.strength = strength;
        spec.mask_crop = mask_crop;
        spec.preview_every = preview.as_ref().and(preview_every.or(Some(1)));
        // Every number and rule given, and every file's header, before a graph loads.
        spec.check().map_err(|e| spec_err(py, &e))?;
        let made = py
            .detach(|| self.run_generation(spec, png, callback, preview))
            .map_err(|failure| match failure {
                Failure::Klein(error) => to_py_err(py, &error),
                Failure::Spec(error) => spec_err(py, &error),
                Failure::Python(raised) => raised,
            })?;
        let bytes = |data: &[u8]| PyBytes::new(py, data).unbind();
        let g = &made.generation;
        Ok(PyGeneration {
            images: g.images.iter().map(|image| bytes(&image.pixels)).collect(),
            png: made
                .png
                .as_ref()
                .map(|files| files.iter().map(|f| bytes(f)).collect()),
            width: g.width,
            height: g.height,
            steps: g.steps,
            guidance: g.guidance,
            seed: g.seed,
            prompt_truncated: g.prompt_truncated,
            timings: seconds_per_stage(&g.timings),
            references: made.references,
            warnings: made.warnings,
            device: made.device,
        })
    }

    /// The JSON of OpenAI's model object of this pipeline's model, as `klein serve` answers
    /// `GET /v1/models/{id}` (`created`: when the pipeline loaded; `klein.max_pixels`: null, no
    /// cap); with `model_id`, a LookupError (the answer's 404 message) unless it is the model's.
    #[pyo3(signature = (model_id=None))]
    fn openai_model(&self, model_id: Option<&str>) -> PyResult<String> {
        let object = self.openai_model.clone();
        let object = match model_id {
            Some(id) => {
                models::retrieve(object, id).map_err(pyo3::exceptions::PyLookupError::new_err)?
            }
            None => object,
        };
        Ok(object.to_string())
    }

    /// Runs a checked OpenAI images request (`klein.OpenAiRequest`) with the GIL released; the
    /// answer's JSON, as `klein serve` answers it.
    fn answer_openai(&self, py: Python<'_>, request: &openai::PyOpenAiRequest) -> PyResult<String> {
        openai::answer(self, py, request)
    }

    /// Applies `loras` in place of the current ones (empty: none); only the transformer reloads.
    fn set_loras(&self, py: Python<'_>, loras: Vec<LoraArg>) -> PyResult<()> {
        let specs: Vec<LoraSpec> = loras.into_iter().map(LoraArg::spec).collect();
        py.detach(|| self.locked()?.set_loras(&specs))
            .map_err(|e| to_py_err(py, &e))?;
        *self.loras.lock().unwrap_or_else(PoisonError::into_inner) = specs
            .iter()
            .map(|l| (l.path().to_path_buf(), l.scale()))
            .collect();
        Ok(())
    }

    /// The applied LoRAs, `(path, scale)`.
    #[getter]
    fn loras(&self) -> Vec<(PathBuf, f64)> {
        // Each scale as the shortest decimal that is its f32 (0.8, not 0.800000011920929).
        lock(&self.loras)
            .iter()
            .map(|(path, scale)| {
                (
                    path.clone(),
                    scale.to_string().parse().unwrap_or(f64::from(*scale)),
                )
            })
            .collect()
    }

    #[getter]
    fn model_name(&self) -> &str {
        &self.model.name
    }

    /// `4b`, `9b`, `tiny` or `custom`.
    #[getter]
    fn variant(&self) -> &str {
        self.model.variant
    }

    /// `flux2` (FLUX.2-klein) or `flux3` (FLUX.3 Image Klein).
    #[getter]
    fn family(&self) -> &str {
        self.model.family
    }

    #[getter]
    fn is_distilled(&self) -> bool {
        self.model.distilled
    }

    #[getter]
    fn default_width(&self) -> u32 {
        self.model.default_width
    }

    #[getter]
    fn default_height(&self) -> u32 {
        self.model.default_height
    }

    #[getter]
    fn default_steps(&self) -> u32 {
        self.model.default_steps
    }

    #[getter]
    fn default_guidance(&self) -> f64 {
        self.model.default_guidance
    }

    #[getter]
    fn bundle_dir(&self) -> PathBuf {
        self.bundle_dir.clone()
    }

    /// The device asked for at load (`cpu`, `cuda:0`, `coreml`, `auto`).
    #[getter]
    fn device(&self) -> &str {
        &self.requested_device
    }

    /// Where the graphs loaded so far run (`cpu`, or per graph), as of the last call that ended;
    /// `none` before the first.
    #[getter]
    fn device_used(&self) -> String {
        lock(&self.device_used).clone()
    }

    /// sha256 of the bundle's manifest.json (stored in every PNG); needs no lock of the pipeline.
    fn bundle_sha256(&self, py: Python<'_>) -> PyResult<String> {
        py.detach(|| klein::pipeline::metadata::manifest_sha256(&self.bundle_dir))
            .map_err(|e| to_py_err(py, &e))
    }

    fn __repr__(&self) -> String {
        format!(
            "klein.Pipeline(model={:?}, name={:?}, variant={:?}, device={:?})",
            self.bundle_dir.display().to_string(),
            self.model.name,
            self.model.variant,
            self.requested_device
        )
    }
}

/// The kinds of device this build can run on, in the order `device="auto"` tries them: `cuda`
/// and `coreml` where compiled in (their cargo features), then `cpu`. Whether the machine has
/// the device is known only when a pipeline loads on it.
fn device_kinds() -> Vec<&'static str> {
    Device::auto_candidates().iter().map(Device::kind).collect()
}

/// The version of the klein library this module was built with.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The directory of the bundled tiny model (random weights), written to the cache directory on
/// first use: the model `klein.Pipeline()` runs when none is named, as the CLI does.
#[pyfunction]
fn tiny_model_dir(py: Python<'_>) -> PyResult<PathBuf> {
    klein::bundle::bundled::tiny_model_dir().map_err(|e| to_py_err(py, &e))
}

/// A seed for a generation that names none, below 2^53, as the CLI and the server draw it.
#[pyfunction]
fn random_seed() -> u64 {
    klein::pipeline::random_seed()
}

#[pymodule]
fn _klein(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let classes = exceptions(py)?;
    m.add("KleinError", classes.base.bind(py))?;
    m.add("InvalidInputError", classes.invalid_input.bind(py))?;
    m.add("CancelledError", classes.cancelled.bind(py))?;
    m.add_class::<PyPipeline>()?;
    m.add_class::<PyGeneration>()?;
    m.add_class::<openai::PyOpenAiRequest>()?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(random_seed, m)?)?;
    m.add_function(wrap_pyfunction!(tiny_model_dir, m)?)?;
    // The bounds klein checks (src/limits.rs), for callers that check a request's fields first.
    m.add("MAX_SIDE", limits::MAX_SIDE)?;
    m.add("MAX_BATCH", limits::MAX_BATCH)?;
    m.add("MAX_STEPS", limits::MAX_STEPS)?;
    m.add("MAX_GUIDANCE", limits::MAX_GUIDANCE)?;
    m.add("MAX_REFERENCES", limits::MAX_REFERENCES)?;
    m.add("MAX_PROMPT_BYTES", limits::MAX_PROMPT_BYTES)?;
    m.add("MAX_THREADS", limits::MAX_THREADS)?;
    m.add("MAX_PROMPT_CACHE_MIB", limits::MAX_PROMPT_CACHE_MIB)?;
    m.add("MAX_CPU_CACHE_GIB", limits::MAX_CPU_CACHE_GIB)?;
    m.add("DEVICES", PyTuple::new(py, device_kinds())?)?;
    Ok(())
}
