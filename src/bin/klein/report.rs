//! What the command line tells the user on stderr: progress, warnings, timings.
use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::io::IsTerminal;
use std::ops::ControlFlow;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use klein::fsutil::write_all_atomic;
use klein::pipeline::{Generation, LoraSummary, Pipeline, Progress, Stage, StepPreview};
use klein::stages::output::{encode_image, ImageFormat};

/// Progress on stderr: a bar when stderr is a terminal and --quiet is not given; step previews
/// written to `--preview` files.
pub(crate) struct Reporter {
    bar: ProgressBar,
    quiet: bool,
    /// The preview file of each image of a generation (`--preview`).
    previews: Vec<PathBuf>,
    /// Whether a preview could not be written (said once; the generation goes on).
    preview_failed: Cell<bool>,
    /// The seconds of each denoising step of the last generation (`--timings`), and when the
    /// last step (or the denoising) began.
    steps: RefCell<Vec<Duration>>,
    step_began: Cell<Option<Instant>>,
    /// The pipeline warnings printed so far.
    warned: RefCell<HashSet<String>>,
}

/// Where the generation running now is, for the interrupt handler's message: the stage's label
/// and, while denoising, the last step finished of how many.
static WHERE: Mutex<Option<(&'static str, usize, usize)>> = Mutex::new(None);

/// What an interrupt stopped: `interrupted at step k/N` while denoising, else the stage, else
/// nothing (none had started).
pub(crate) fn interrupted_at() -> Option<String> {
    let at = *WHERE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    at.map(|(stage, step, total)| match total {
        0 => format!("interrupted during {stage}"),
        _ => format!("interrupted at step {step}/{total}"),
    })
}

fn set_where(at: (&'static str, usize, usize)) {
    *WHERE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(at);
}

impl Reporter {
    pub(crate) fn new(quiet: bool) -> Reporter {
        let bar = ProgressBar::hidden();
        if !quiet && std::io::stderr().is_terminal() {
            bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{msg:28} [{bar:30}] {pos}/{len} {elapsed}")
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
        }
        Reporter {
            bar,
            quiet,
            previews: Vec::new(),
            preview_failed: Cell::new(false),
            steps: RefCell::new(Vec::new()),
            step_began: Cell::new(None),
            warned: RefCell::new(HashSet::new()),
        }
    }

    /// Writes the previews of image `i` to `paths[i]`.
    pub(crate) fn with_previews(mut self, paths: Vec<PathBuf>) -> Reporter {
        self.previews = paths;
        self
    }

    /// Each preview image as a PNG over its file, atomically (a viewer never sees half a file).
    fn write_previews(&self, preview: &StepPreview) {
        for (i, image) in preview.images.iter().enumerate() {
            let Some(path) = self.previews.get(preview.first_image + i) else {
                continue;
            };
            let text = [(
                "step".to_string(),
                format!("{}/{}", preview.step, preview.total),
            )];
            let written = encode_image(image, ImageFormat::Png, &text)
                .and_then(|png| write_all_atomic(&[(path.as_path(), png.as_slice())]));
            if let Err(error) = written {
                if !self.preview_failed.replace(true) {
                    self.bar
                        .suspend(|| eprintln!("klein: warning: preview not written: {error}"));
                }
            }
        }
    }

    /// A line on stderr, unless --quiet.
    pub(crate) fn say(&self, line: impl std::fmt::Display) {
        if !self.quiet {
            self.bar.suspend(|| eprintln!("{line}"));
        }
    }

    /// The progress callback for one generation; `prefix` goes before each stage's name.
    pub(crate) fn callback<'a>(
        &'a self,
        prefix: &'a str,
    ) -> impl FnMut(Progress) -> ControlFlow<()> + 'a {
        move |event: Progress| {
            let bar = &self.bar;
            match event {
                Progress::StageStarted(stage) => {
                    if stage == Stage::Denoise {
                        self.steps.borrow_mut().clear();
                        self.step_began.set(Some(Instant::now()));
                    }
                    // Position first: a redraw between the two calls shows 0/N, never the last
                    // stage's N/1 (which stayed on screen while the VAE decoder loaded: "3/1").
                    set_where((stage.label(), 0, 0));
                    bar.set_message(format!("{prefix}{}", stage.label()));
                    bar.set_position(0);
                    bar.set_length(1);
                }
                Progress::Step { step, total } => {
                    let now = Instant::now();
                    if let Some(began) = self.step_began.replace(Some(now)) {
                        self.steps.borrow_mut().push(now - began);
                    }
                    set_where((Stage::Denoise.label(), step, total));
                    bar.set_message(format!("{prefix}denoise"));
                    bar.set_length(total as u64);
                    bar.set_position(step as u64);
                }
                Progress::StageFinished(..) => bar.set_position(bar.length().unwrap_or(1)),
                Progress::Preview(preview) => self.write_previews(&preview),
                _ => {}
            }
            ControlFlow::Continue(())
        }
    }

    pub(crate) fn clear(&self) {
        self.bar.finish_and_clear();
        self.bar.reset();
    }

    /// The pipeline's warnings, the prompt's truncation and, with --timings, the stage times of a finished generation.
    pub(crate) fn report(
        &self,
        pipeline: &mut Pipeline,
        generation: &Generation,
        timings: bool,
        label: &str,
    ) {
        for warning in pipeline.take_warnings() {
            // Once per process: a batch's lines often share one (guidance on a distilled model).
            if self.warned.borrow_mut().insert(warning.clone()) {
                eprintln!("klein: warning: {label}{warning}");
            }
        }
        for placement in pipeline.placements() {
            for (device, why) in &placement.skipped {
                self.say(format!(
                    "auto: the {} graph skipped {device}: {why}",
                    placement.component
                ));
            }
        }
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
            // Each step's seconds (a step's preview, if any, counts in the next step's).
            let steps: Vec<String> = self
                .steps
                .borrow()
                .iter()
                .map(|d| format!("{:.3}", d.as_secs_f64()))
                .collect();
            if !steps.is_empty() {
                eprintln!("{:>20}: {} s", "denoise steps", steps.join(", "));
            }
            for placement in pipeline.placements() {
                eprintln!("{:>20}: runs on {}", placement.component, placement.device);
            }
            eprintln!("{:>20}: {}", "heap", crate::heap::heap_setting());
        }
    }
}

/// `klein info --lora`: a LoRA's format, scale and every layer it changes (stdout).
pub(crate) fn print_lora(lora: &LoraSummary) {
    println!(
        "LoRA:         {} ({}, scale {}): {} layers",
        lora.path.display(),
        lora.format,
        lora.scale,
        lora.modules.len()
    );
    for m in &lora.modules {
        let kind = m.rank.map_or("LoKr".to_string(), |r| format!("rank {r}"));
        println!(
            "  {:48} [{}, {}]  {kind:>8}  x{}  <- {}",
            m.module, m.shape.0, m.shape.1, m.file_scale, m.source
        );
    }
}
