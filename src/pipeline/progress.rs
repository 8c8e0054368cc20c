//! Progress events: what the pipeline reports to the caller's callback, which may cancel.
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{KleinError, Result};
use crate::stages::output::RgbImage;

/// The pipeline stages, as reported to the progress callback and in [`Timings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    LoadTextEncoder,
    EncodePrompt,
    LoadVaeEncoder,
    EncodeReferences,
    /// When the transformer loaded while the prompt was encoded ([`super::Pipeline::generate`]):
    /// the time generation then waited for it.
    LoadTransformer,
    Denoise,
    LoadVaeDecoder,
    Decode,
}

impl Stage {
    pub fn label(self) -> &'static str {
        match self {
            Stage::LoadTextEncoder => "load text encoder",
            Stage::EncodePrompt => "encode prompt",
            Stage::LoadVaeEncoder => "load VAE encoder",
            Stage::EncodeReferences => "encode references",
            Stage::LoadTransformer => "load transformer",
            Stage::Denoise => "denoise",
            Stage::LoadVaeDecoder => "load VAE decoder",
            Stage::Decode => "decode",
        }
    }
}

/// Progress events. The callback returns `ControlFlow::Break(())` to cancel (checked between steps
/// and stages); the stage then ends with [`KleinError::Cancelled`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Progress {
    StageStarted(Stage),
    StageFinished(Stage, Duration),
    /// Denoising step `step` (1-based) of `total` finished.
    Step {
        step: usize,
        total: usize,
    },
    /// After the step of the same number, when the request asks for previews
    /// ([`crate::pipeline::Request::preview_every`]).
    Preview(Arc<StepPreview>),
}

/// A preview of the images being denoised: the model's current estimate of each, at 1/8 of the
/// output's side ([`crate::stages::preview`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepPreview {
    /// The step (1-based) after which it was made, of `total`.
    pub step: usize,
    pub total: usize,
    /// One per image of the batch (in a batch split into calls, those of the current call).
    pub images: Vec<RgbImage>,
    /// Index in the batch of `images[0]`.
    pub first_image: usize,
}

/// Seconds spent per stage, in the order they ran.
pub type Timings = Vec<(Stage, Duration)>;

/// The progress callback every stage takes (as `Option<&mut ProgressFn>`; `None`: no reports).
pub type ProgressFn<'a> = dyn FnMut(Progress) -> ControlFlow<()> + 'a;

/// Sends `event` to the callback; `Err(Cancelled)` when it asks to stop.
pub(crate) fn notify(progress: &mut Option<&mut ProgressFn<'_>>, event: Progress) -> Result<()> {
    match progress {
        Some(callback) => match callback(event) {
            ControlFlow::Continue(()) => Ok(()),
            ControlFlow::Break(()) => Err(KleinError::Cancelled),
        },
        None => Ok(()),
    }
}

/// Runs `work` as `stage`, reporting its start and its duration.
pub(crate) fn timed<T>(
    progress: &mut Option<&mut ProgressFn<'_>>,
    stage: Stage,
    work: impl FnOnce(&mut Option<&mut ProgressFn<'_>>) -> Result<T>,
) -> Result<T> {
    notify(progress, Progress::StageStarted(stage))?;
    let start = Instant::now();
    let value = work(progress)?;
    notify(progress, Progress::StageFinished(stage, start.elapsed()))?;
    Ok(value)
}
