//! The graphs a pipeline holds, one slot per [`Component`], loaded on first use and checked
//! against the manifest's contract. For static-shape bundles, the per-bucket slots hold the graphs
//! of one bucket at a time.
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use super::lora::LoraSet;
use super::progress::{timed, ProgressFn, Stage};
use super::warnings::Warnings;
use crate::bundle::contract::check_graph;
use crate::bundle::manifest::QuantizationSpec;
use crate::bundle::support::{auto_skip, has_8bit_int8_codes, DYNAMIC};
use crate::bundle::{Component, Manifest};
use crate::error::{KleinError, Result};
use crate::runtime::{self, load_graph, Device, Graph, SessionConfig};

/// The loaded graphs of a pipeline.
#[derive(Debug, Default)]
pub(crate) struct LoadedGraphs {
    /// By [`Component::index`].
    slots: [Option<Graph>; 4],
    /// Static-shape bundles: the bucket whose graphs the per-bucket slots hold.
    bucket: Option<usize>,
    /// Where each graph loaded so far runs, and the devices auto skipped for it.
    placements: Vec<Placement>,
    /// Problems loading left behind (see [`Graph::take_warnings`]).
    warnings: Warnings,
    /// Whether [`uint8_weights_warning`] was given (once per pipeline: it is about the bundle).
    warned_uint8_weights: bool,
    /// A graph loading on a thread of its own ([`LoadedGraphs::start_loading`]).
    loading: Option<(Component, JoinHandle<Result<Graph>>)>,
}

impl Drop for LoadedGraphs {
    fn drop(&mut self) {
        self.finish_loading();
    }
}

/// Where one graph runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    pub component: Component,
    /// The device its session runs on (never auto).
    pub device: Device,
    /// The devices auto tried first or skipped, each with why.
    pub skipped: Vec<(Device, String)>,
}

/// Where a graph comes from: the bundle, its manifest and the session settings.
pub(crate) struct GraphSource<'a> {
    pub dir: &'a Path,
    pub manifest: &'a Manifest,
    pub session: &'a SessionConfig,
    /// Merged into the transformer's weights when it loads.
    pub loras: &'a LoraSet,
    /// Where merged LoRA weights are written while the transformer's session is created.
    pub scratch: &'a Path,
    /// The text encoder stays loaded after a prompt ([`super::PipelineOptions::with_keep_text_encoder`]).
    pub keeps_text_encoder: bool,
}

impl LoadedGraphs {
    /// The graph of `component` (of `bucket`, for a static-shape bundle's per-bucket graphs),
    /// loaded and checked on first use. Switching buckets releases the other bucket's graphs.
    pub fn get(
        &mut self,
        component: Component,
        bucket: Option<usize>,
        source: &GraphSource<'_>,
        progress: &mut Option<&mut ProgressFn<'_>>,
    ) -> Result<&mut Graph> {
        if component.is_per_bucket() && self.bucket != bucket {
            for c in Component::PER_BUCKET {
                self.slots[c.index()] = None;
            }
            self.bucket = bucket;
        }
        if self.slots[component.index()].is_none() {
            if let Some(graph) = self.wait_for(component, progress)? {
                self.install(component, graph, source.manifest);
            }
        }
        let slot = &mut self.slots[component.index()];
        if slot.is_none() {
            let (path, session) = session_of(component, bucket, source)?;
            // Its threads leave the cores to a load running beside it.
            let session = session.without_spinning(self.loading.is_some());
            let spec = source.manifest.graphs.get(component);
            let graph = timed(progress, load_stage(component), |_| {
                let merged = match component {
                    Component::Transformer => {
                        source
                            .loras
                            .merged_graph(source.manifest, source.dir, source.scratch)?
                    }
                    _ => None,
                };
                let graph = match &merged {
                    Some(merged) => load_graph(
                        component.as_str(),
                        &merged.path,
                        &session.clone().without_caches(),
                        &merged.initializers,
                    )?,
                    None => load_graph(component.as_str(), &path, &session, &[])?,
                };
                check_graph(component, spec, &graph)?;
                Ok(graph)
            })?;
            self.install(component, graph, source.manifest);
        }
        self.slots[component.index()]
            .as_mut()
            .ok_or_else(|| unreachable!("the slot was filled above"))
    }

    /// Starts loading `component`'s graph (from the bundle, without LoRAs; not a per-bucket
    /// graph) on a thread of its own; [`LoadedGraphs::get`] waits for it.
    pub fn start_loading(&mut self, component: Component, source: &GraphSource<'_>) -> Result<()> {
        let (path, session) = session_of(component, None, source)?;
        let spec = source.manifest.graphs.get(component).clone();
        let loading = std::thread::spawn(move || {
            let graph = load_graph(component.as_str(), &path, &session, &[])?;
            check_graph(component, &spec, &graph)?;
            Ok(graph)
        });
        self.loading = Some((component, loading));
        Ok(())
    }

    /// Whether `component`'s graph is loading on a thread of its own.
    pub fn is_loading(&self, component: Component) -> bool {
        self.loading.as_ref().is_some_and(|(c, _)| *c == component)
    }

    /// The graph loading on a thread for `component`, once loaded (`None`: none is loading). The
    /// load stage reports the time spent waiting for it.
    fn wait_for(
        &mut self,
        component: Component,
        progress: &mut Option<&mut ProgressFn<'_>>,
    ) -> Result<Option<Graph>> {
        let Some((_, loading)) = self.loading.take_if(|(loading, _)| *loading == component) else {
            return Ok(None);
        };
        timed(progress, load_stage(component), |_| {
            let graph = loading.join().map_err(|_| KleinError::Inference {
                stage: component.as_str(),
                message: "loading the graph panicked".to_string(),
            })?;
            graph.map(Some)
        })
    }

    /// Puts a loaded graph in its slot.
    fn install(&mut self, component: Component, mut graph: Graph, manifest: &Manifest) {
        self.warnings.extend(graph.take_warnings());
        let quantization = manifest.graphs.get(component).quantization.as_ref();
        let converted = runtime::converts_int8_weights(false);
        if !self.warned_uint8_weights {
            let warning = uint8_weights_warning(component, graph.device(), quantization, converted);
            self.warned_uint8_weights = warning.is_some();
            self.warnings.extend(warning);
        }
        self.placements.retain(|p| p.component != component);
        self.placements.push(Placement {
            component,
            device: graph.device(),
            skipped: graph.skipped_devices().to_vec(),
        });
        self.slots[component.index()] = Some(graph);
    }

    /// The files loading `component`'s graph (of `bucket`) will read (see [`runtime::graph_files`]);
    /// empty when they are not known: a static-shape bundle's per-bucket graph before a bucket is
    /// chosen, or a transformer that LoRAs are merged into (built from a rewritten graph).
    pub fn files(
        component: Component,
        bucket: Option<usize>,
        source: &GraphSource<'_>,
    ) -> Vec<PathBuf> {
        let merges = component == Component::Transformer && !source.loras.is_empty();
        match session_of(component, bucket, source) {
            Ok((path, session)) if !merges => {
                runtime::graph_files(component.as_str(), &path, &session)
            }
            _ => Vec::new(),
        }
    }

    /// Releases the session of `component` (its memory goes back now).
    pub fn release(&mut self, component: Component) {
        self.slots[component.index()] = None;
        if self.is_loading(component) {
            self.finish_loading();
        }
    }

    /// Waits for the graph loading on a thread, if any, and drops it. A process must not exit
    /// while ONNX Runtime creates a session on another thread: its exit handlers then crash it
    /// (seen as a signal, not exit code 2, after an error in the text encoder).
    fn finish_loading(&mut self) {
        if let Some((_, loading)) = self.loading.take() {
            let _ = loading.join();
        }
    }

    /// The graph of `component` if it is loaded (of the current bucket, for per-bucket graphs).
    pub fn loaded(&mut self, component: Component) -> Option<&mut Graph> {
        self.slots[component.index()].as_mut()
    }

    /// The device of the graph loaded last.
    pub fn device_used(&self) -> Option<Device> {
        self.placements.last().map(|p| p.device)
    }

    /// Problems that did not stop a load, taken once.
    pub fn take_warnings(&mut self) -> Vec<String> {
        self.warnings.take()
    }

    /// Where each graph loaded so far runs, in the order they were loaded.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }
}

/// The warning for a graph on the CPU whose 8-bit int8 weights ONNX Runtime converts to uint8 here
/// (`converted`: [`runtime::converts_int8_weights`] of 8-bit codes, true on x86-64 CPUs without
/// VNNI), with what keeps the fast kernels.
fn uint8_weights_warning(
    component: Component,
    device: Device,
    quantization: Option<&QuantizationSpec>,
    converted: bool,
) -> Option<String> {
    (device == Device::Cpu && converted && has_8bit_int8_codes(quantization)).then(|| {
        format!(
            "this CPU has no VNNI, so ONNX Runtime runs this bundle's 8-bit int8 weights as uint8 (exact, \
             on slower kernels; first in the {} graph); a bundle quantized with `--quantize int8 --method \
             dynamic --reduce-range` (7-bit codes) keeps the fast kernels here",
            component.as_str()
        )
    })
}

/// The graph file of `component` (of `bucket`) and the settings of its session.
fn session_of(
    component: Component,
    bucket: Option<usize>,
    source: &GraphSource<'_>,
) -> Result<(PathBuf, SessionConfig)> {
    let path = source
        .dir
        .join(graph_file(source.manifest, component, bucket)?);
    let spec = source.manifest.graphs.get(component);
    let mut session = source
        .session
        .clone()
        .with_auto_skip(auto_skip(spec.precision, spec.quantization.as_ref()))
        .with_prepacking(prepacks(
            component,
            spec.quantization.as_ref(),
            source.keeps_text_encoder,
        ))
        .without_cpu_arena(component == Component::Transformer)
        .without_memory_pattern(component == Component::Transformer)
        .with_7bit_int8_weights(spec.quantization.as_ref().is_some_and(|q| q.reduce_range));
    if let Some(tag) = cache_tag(source.manifest, &path) {
        session = session.with_cache_tag(tag);
    }
    Ok((path, session))
}

/// Whether `component`'s session prepacks its weights (see [`SessionConfig::with_prepacking`]):
/// the transformer and quantized graphs do, except a dynamic-int8 text encoder that is released
/// after its prompt. That one runs once or twice (a prompt and its negative) and computes the same
/// result unpacked, and prepacking at load cost more than it saves: the wide checkpoint's encoder
/// on an AMX host loaded in 2.5 s and ran in 2.9 s prepacked, against 0.1 s and 3.6 s unpacked
/// (benches/RESULTS.md, "Load time: weight prepacking").
fn prepacks(
    component: Component,
    quantization: Option<&QuantizationSpec>,
    keeps_text_encoder: bool,
) -> bool {
    match (component, quantization) {
        (Component::Transformer, _) => true,
        (Component::TextEncoder, Some(q)) if q.method == DYNAMIC => keeps_text_encoder,
        (_, quantization) => quantization.is_some(),
    }
}

/// The file of `component`'s graph: the bucket's for a static-shape bundle's per-bucket graphs,
/// else the manifest's.
fn graph_file(manifest: &Manifest, component: Component, bucket: Option<usize>) -> Result<&str> {
    let spec = manifest.graphs.get(component);
    let Some(shapes) = &manifest.static_shapes else {
        return Ok(&spec.file);
    };
    if !component.is_per_bucket() {
        return Ok(&spec.file);
    }
    let bucket =
        bucket
            .and_then(|b| shapes.buckets.get(b))
            .ok_or_else(|| KleinError::Inference {
                stage: "pipeline",
                message: format!("no bucket chosen for the {component} graph"),
            })?;
    // A bundle without references keeps its dynamic VAE encoder.
    Ok(bucket.file(component).unwrap_or(&spec.file))
}

/// What identifies the graph file at `path` and its external data in the CPU cache: each file's
/// name, size and sha256 as the manifest records them (the files were checked against them unless
/// hashes are not verified; sizes always are). Copies of a bundle share entries. `None` when the
/// manifest does not list the graph file.
pub(crate) fn cache_tag(manifest: &Manifest, path: &Path) -> Option<String> {
    let name = path.file_name()?.to_str()?;
    let data_prefix = format!("{name}.");
    manifest.files.get(name)?;
    let tag = manifest
        .files
        .iter()
        .filter(|(file, _)| *file == name || file.starts_with(&data_prefix))
        .map(|(file, entry)| format!("{file} {} {}", entry.sha256, entry.bytes))
        .collect::<Vec<_>>()
        .join("\n");
    Some(tag)
}

/// The stage that loads `component`'s graph.
fn load_stage(component: Component) -> Stage {
    match component {
        Component::TextEncoder => Stage::LoadTextEncoder,
        Component::Transformer => Stage::LoadTransformer,
        Component::VaeEncoder => Stage::LoadVaeEncoder,
        Component::VaeDecoder => Stage::LoadVaeDecoder,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quantization(method: &str) -> QuantizationSpec {
        serde_json::from_value(serde_json::json!({"method": method, "bits": 8}))
            .expect("a valid quantization spec")
    }

    #[test]
    fn seven_bit_weights_are_read_from_the_manifest() {
        let reduced: QuantizationSpec = serde_json::from_value(
            serde_json::json!({"method": DYNAMIC, "bits": 8, "reduce_range": true}),
        )
        .expect("a valid quantization spec");
        assert!(reduced.reduce_range);
        assert!(!quantization(DYNAMIC).reduce_range, "absent: full range");
    }

    #[test]
    fn converted_8bit_weights_are_warned_about_on_the_cpu_only() {
        let reduced: QuantizationSpec = serde_json::from_value(
            serde_json::json!({"method": DYNAMIC, "bits": 8, "reduce_range": true}),
        )
        .expect("a valid quantization spec");
        let (dynamic, qdq) = (quantization(DYNAMIC), quantization("QDQ"));
        let warning =
            uint8_weights_warning(Component::Transformer, Device::Cpu, Some(&dynamic), true)
                .expect("warned");
        assert!(
            warning.contains("transformer") && warning.contains("--reduce-range"),
            "{warning}"
        );
        assert!(
            uint8_weights_warning(Component::VaeDecoder, Device::Cpu, Some(&qdq), true).is_some()
        );
        let quiet = [
            (Device::Cpu, Some(&dynamic), false), // a CPU with VNNI: nothing converted
            (Device::Cpu, Some(&reduced), true),  // 7-bit codes keep the fast kernels
            (Device::Cpu, None, true),            // float weights
            (Device::Cuda(0), Some(&dynamic), true),
        ];
        for (device, q, converted) in quiet {
            assert_eq!(
                uint8_weights_warning(Component::Transformer, device, q, converted),
                None,
                "{device} {q:?} {converted}"
            );
        }
        let nbits = quantization("MatMulNBits");
        assert_eq!(
            uint8_weights_warning(Component::TextEncoder, Device::Cpu, Some(&nbits), true),
            None
        );
    }

    #[test]
    fn only_the_transformer_runs_without_arena_and_memory_pattern() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/klein-tiny");
        let manifest = Manifest::load(&dir).expect("the bundled tiny model");
        let (session, loras) = (SessionConfig::default(), LoraSet::default());
        let source = GraphSource {
            dir: &dir,
            manifest: &manifest,
            session: &session,
            loras: &loras,
            scratch: &dir,
            keeps_text_encoder: false,
        };
        for component in Component::ALL {
            let (_, config) = session_of(component, None, &source).expect("a session config");
            let transformer = component == Component::Transformer;
            assert_eq!(config.no_cpu_arena, transformer, "{component:?}");
            assert_eq!(config.no_memory_pattern, transformer, "{component:?}");
        }
    }

    #[test]
    fn only_a_released_dynamic_int8_text_encoder_skips_prepacking() {
        let (dynamic, nbits) = (quantization(DYNAMIC), quantization("MatMulNBits"));
        for keeps in [false, true] {
            assert!(prepacks(Component::Transformer, None, keeps));
            assert!(prepacks(Component::Transformer, Some(&dynamic), keeps));
            // MatMulNBits runs another kernel unpacked, with another result.
            assert!(prepacks(Component::TextEncoder, Some(&nbits), keeps));
            assert!(!prepacks(Component::TextEncoder, None, keeps));
            assert!(!prepacks(Component::VaeDecoder, None, keeps));
            assert!(prepacks(
                Component::VaeDecoder,
                Some(&quantization("QDQ")),
                keeps
            ));
        }
        assert!(!prepacks(Component::TextEncoder, Some(&dynamic), false));
        assert!(prepacks(Component::TextEncoder, Some(&dynamic), true));
    }
}
