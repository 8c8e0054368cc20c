//! `klein generate --prompts FILE --out-dir DIR`: one generation per JSON line, one pipeline for all,
//! outputs that exist skipped, and a `summary.json` written after every line.
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;
use klein::fsutil::write_atomic;
use klein::limits::{MAX_BATCH_FILE_BYTES, MAX_BATCH_LINES};
use klein::pipeline::{ImageInput, Pipeline, PromptMemo, Request};
use klein::stages::output::encode_png;
use klein::KleinError;
use serde::Serialize;

/// A line's inpainting inputs: source image, mask, strength and mask crop padding.
type InpaintFiles<'a> = (Option<&'a Path>, Option<&'a Path>, Option<f64>, Option<u32>);

use crate::args::{default_model, local_model, pipeline_options, GenerateArgs};
use crate::jsonl::{parse_batch, BatchLine};
use crate::report::Reporter;
use crate::{is_user_error, UsageError};

const SUMMARY_FILE: &str = "summary.json";
/// The batch summary, `summary.json` in the output directory.
#[derive(Serialize)]
struct Summary<'a> {
    prompts: String,
    out_dir: String,
    model: Option<String>,
    lines: &'a [LineRecord],
    totals: Totals,
    /// Present (true) only in the summary written when the batch is interrupted.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    interrupted: bool,
}

#[derive(Serialize, Default)]
struct Totals {
    lines: usize,
    ok: usize,
    skipped: usize,
    error: usize,
    not_run: usize,
    seconds: f64,
}

/// What an interrupt writes as the summary: the batch's state at its last summary, the lines not
/// run yet marked `not_run` then (or `ok`, if their output exists by then). Locked while a summary
/// is written, so that an interrupt waits for that write and no later one replaces its own.
static INTERRUPTED_SUMMARY: Mutex<Option<Snapshot>> = Mutex::new(None);

/// The summary's parts, as the last summary written had them.
struct Snapshot {
    path: PathBuf,
    prompts: String,
    out_dir: String,
    model: Option<String>,
    records: Vec<LineRecord>,
    started: Instant,
}

fn snapshot_lock() -> std::sync::MutexGuard<'static, Option<Snapshot>> {
    INTERRUPTED_SUMMARY
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// For the interrupt handler: waits for a summary write in flight, runs `cleanup` (the temporary
/// files of writes in flight), writes a running batch's summary as interrupted, and exits with
/// `code`, the lock held.
pub(crate) fn interrupted(cleanup: impl FnOnce(), code: i32) -> ! {
    let mut snapshot = snapshot_lock();
    cleanup();
    if let Some(mut s) = snapshot.take() {
        for record in &mut s.records {
            if record.status != Status::Pending {
                continue;
            }
            // Written whole (renamed into place) just before the interrupt: done.
            let written = record
                .output
                .as_deref()
                .is_some_and(|o| Path::new(o).is_file());
            record.status = if written { Status::Ok } else { Status::NotRun };
            record.message = Some(match written {
                true => "written as the batch was interrupted (its seed is in the PNG)".into(),
                false => "not run: the batch was interrupted".into(),
            });
        }
        let written = s
            .json(true)
            .and_then(|json| Ok(write_atomic(&s.path, &json)?));
        if written.is_ok() {
            eprintln!(
                "klein: interrupted: {} marks the lines not run",
                s.path.display()
            );
        }
    }
    crate::exit_at_once(code)
}

impl Snapshot {
    /// The text of `summary.json` with these parts.
    fn json(&self, interrupted: bool) -> anyhow::Result<Vec<u8>> {
        let summary = Summary {
            prompts: self.prompts.clone(),
            out_dir: self.out_dir.clone(),
            model: self.model.clone(),
            totals: totals_of(&self.records, self.started),
            lines: &self.records,
            interrupted,
        };
        let mut json = serde_json::to_vec_pretty(&summary)?;
        json.push(b'\n');
        Ok(json)
    }
}

fn totals_of(records: &[LineRecord], started: Instant) -> Totals {
    let count = |status| records.iter().filter(|r| r.status == status).count();
    Totals {
        lines: records.len(),
        ok: count(Status::Ok),
        skipped: count(Status::Skipped),
        error: count(Status::Error),
        not_run: count(Status::NotRun),
        seconds: seconds(started.elapsed()),
    }
}

/// What happened to one line of the prompts file.
#[derive(Serialize, Clone)]
struct LineRecord {
    /// 1-based line number in the prompts file.
    line: usize,
    name: String,
    /// The output file (absent for a line whose name is unusable).
    #[serde(skip_serializing_if = "Option::is_none")]
    output: Option<String>,
    prompt: Option<String>,
    /// The seed used (or, for a skipped line, the one stored in the existing PNG).
    seed: Option<u64>,
    status: Status,
    #[serde(skip_serializing_if = "Option::is_none")]
    message: Option<String>,
    /// `user` (exit code 2) or `runtime` (exit code 1), for errors.
    #[serde(skip_serializing_if = "Option::is_none")]
    error_kind: Option<&'static str>,
    seconds: f64,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Status {
    Ok,
    Skipped,
    Error,
    /// Not run because an earlier line hit a bundle or device error, which every line would hit.
    NotRun,
    /// Not run yet (seen only in the summary written while the batch runs).
    Pending,
}

/// Seconds rounded to milliseconds, for the summary.
fn seconds(elapsed: std::time::Duration) -> f64 {
    (elapsed.as_secs_f64() * 1000.0).round() / 1000.0
}

/// Errors that every later line would hit as well: the batch stops at the first one.
fn is_fatal(error: &anyhow::Error) -> bool {
    error.chain().any(|e| {
        e.downcast_ref::<KleinError>().is_some_and(|k| {
            matches!(
                k,
                KleinError::Bundle { .. }
                    | KleinError::RuntimeLibrary(..)
                    | KleinError::Device { .. }
            )
        })
    })
}

/// The seed stored in an existing output PNG, if it can be read.
fn stored_seed(path: &Path) -> Option<u64> {
    let file = std::fs::File::open(path).ok()?;
    let reader = png::Decoder::new(std::io::BufReader::new(file))
        .read_info()
        .ok()?;
    let chunk = reader
        .info()
        .utf8_text
        .iter()
        .find(|chunk| chunk.keyword == "seed")?;
    chunk.get_text().ok()?.parse().ok()
}

struct BatchRun<'a> {
    prompts: &'a Path,
    out_dir: &'a Path,
    model: Option<String>,
    records: Vec<LineRecord>,
    started: Instant,
}

impl BatchRun<'_> {
    fn totals(&self) -> Totals {
        totals_of(&self.records, self.started)
    }

    /// The summary's parts as they are now.
    fn snapshot(&self) -> Snapshot {
        Snapshot {
            path: self.out_dir.join(SUMMARY_FILE),
            prompts: self.prompts.display().to_string(),
            out_dir: self.out_dir.display().to_string(),
            model: self.model.clone(),
            records: self.records.clone(),
            started: self.started,
        }
    }

    /// Writes `summary.json` atomically: a reader never sees half of it. Keeps what an interrupt
    /// would write (nothing once `last`: the batch is done, and an interrupt from now on leaves
    /// this summary as it is), and holds off an interrupt until this summary is in place.
    fn write_summary(&self, last: bool) -> anyhow::Result<PathBuf> {
        let mut kept = snapshot_lock();
        let snapshot = self.snapshot();
        let (path, json) = (snapshot.path.clone(), snapshot.json(false)?);
        *kept = (!last).then_some(snapshot);
        write_atomic(&path, &json)?;
        Ok(path)
    }
}

/// The text of the prompts file, refused past [`MAX_BATCH_FILE_BYTES`]: unread where its size is
/// known, else (a pipe, a device) once that much has been read.
fn read_prompts(prompts: &Path) -> anyhow::Result<Vec<u8>> {
    let too_large = |size: String| {
        UsageError(format!(
            "--prompts {} is {size} bytes: at most {MAX_BATCH_FILE_BYTES} are read; split it",
            prompts.display()
        ))
    };
    let size = std::fs::metadata(prompts).map_or(0, |m| m.len());
    if size > MAX_BATCH_FILE_BYTES {
        return Err(too_large(size.to_string()).into());
    }
    let unreadable = |e: std::io::Error| {
        UsageError(format!(
            "--prompts {}: cannot read it ({e}); give a JSON Lines file, one {{\"prompt\": ...}} per line",
            prompts.display()
        ))
    };
    let mut text = Vec::new();
    std::fs::File::open(prompts)
        .and_then(|file| file.take(MAX_BATCH_FILE_BYTES + 1).read_to_end(&mut text))
        .map_err(unreadable)?;
    if text.len() as u64 > MAX_BATCH_FILE_BYTES {
        return Err(too_large(format!("more than {MAX_BATCH_FILE_BYTES}")).into());
    }
    // A byte-order mark, as some Windows editors write one, is not part of the first line.
    if text.starts_with("\u{feff}".as_bytes()) {
        text.drain(.."\u{feff}".len());
    }
    Ok(text)
}

/// `klein generate --prompts FILE --out-dir DIR`: one image per line, on one loaded pipeline.
/// Exit code 2 if a line failed for a user error, else 1 if one failed in the runtime, else 0.
pub(crate) fn generate_batch(
    args: &GenerateArgs,
    prompts: &Path,
    out_dir: &Path,
) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    // The command line's numbers (the lines' defaults) before anything is read; a line's own are
    // checked when it runs, and a bad one is reported in the summary.
    crate::generate::with_inpaint_flags(crate::generate::command_line_spec(args, ""), args)
        .check()
        .map_err(|e| crate::generate::spec_error(e, true))?;
    let text = read_prompts(prompts)?;
    let lines = text
        .split(|&b| b == b'\n')
        .filter(|l| !l.trim_ascii().is_empty())
        .count();
    if lines > MAX_BATCH_LINES {
        return Err(UsageError(format!(
            "--prompts {} has {lines} lines: at most {MAX_BATCH_LINES} run in one batch; split it",
            prompts.display()
        ))
        .into());
    }
    if out_dir.exists() && !out_dir.is_dir() {
        return Err(UsageError(format!(
            "--out-dir {} exists and is not a directory",
            out_dir.display()
        ))
        .into());
    }
    // The directories about to be made, removed again (while empty) if the batch stops before
    // writing anything there: a refused run leaves no output.
    let made: Vec<&Path> = out_dir.ancestors().take_while(|d| !d.exists()).collect();
    std::fs::create_dir_all(out_dir).map_err(|e| {
        UsageError(format!(
            "--out-dir {}: cannot create it ({e})",
            out_dir.display()
        ))
    })?;
    let ran = run_batch(args, prompts, out_dir, &text, started);
    if ran.is_err() {
        for dir in made {
            if std::fs::remove_dir(dir).is_err() {
                break; // not empty: something was written there
            }
        }
    }
    ran
}

/// [`generate_batch`] once `out_dir` exists: sorts the lines of `text` (the file `prompts`), runs
/// them and writes the summary.
fn run_batch(
    args: &GenerateArgs,
    prompts: &Path,
    out_dir: &Path,
    text: &[u8],
    started: Instant,
) -> anyhow::Result<ExitCode> {
    crate::outputs::check_writable(
        &format!("--out-dir {}", out_dir.display()),
        &out_dir.join(SUMMARY_FILE),
    )?;
    let base = prompts
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let previews = crate::generate::preview_files(args, 1, &[])?;
    // Every PNG of the output directory may be a line's output (and a file there is taken as
    // done when the batch runs again): a preview there could take a line's name.
    // The preview's own directory entry, not where a link there leads: a link named NAME.png
    // would still take that line's name.
    let dir_of = |p: &Path| {
        let dir = p.parent().filter(|d| !d.as_os_str().is_empty());
        dir.unwrap_or(Path::new(".")).canonicalize().ok()
    };
    let out_dir_resolved = out_dir.canonicalize().ok();
    if let Some(preview) = previews
        .iter()
        .find(|p| out_dir_resolved.is_some() && dir_of(p) == out_dir_resolved)
    {
        return Err(UsageError(format!(
            "--preview {} is in --out-dir {}, whose PNG files are the lines' outputs; put the preview elsewhere",
            preview.display(),
            out_dir.display()
        ))
        .into());
    }
    let reporter = Reporter::new(args.quiet).with_previews(previews);
    let mut run = BatchRun {
        prompts,
        out_dir,
        model: None,
        records: Vec::new(),
        started,
    };
    let to_run = run.sort_lines(text, base, &reporter);
    if run.records.is_empty() {
        return Err(UsageError(format!(
            "--prompts {} has no lines; give one {{\"prompt\": ...}} object per line",
            prompts.display()
        ))
        .into());
    }
    if to_run.is_empty() {
        // No line loads the pipeline (all done or refused): the summary still names the model.
        run.model = local_model(args.load.model.clone())
            .ok()
            .and_then(|bundle| klein::bundle::Manifest::load(&bundle).ok())
            .map(|manifest| manifest.model.name);
    } else {
        warn_unused_inpaint_flags(args, &to_run);
        // An interrupt from now on (the bundle's load included) has this run's summary to write.
        *snapshot_lock() = Some(run.snapshot());
        run.run_lines(args, to_run, &reporter)?;
    }
    run.finish(&reporter)
}

/// The command line's `--mask`, `--strength` and `--mask-crop` go with its `--image`: a line
/// with its own image takes its own (or none). Said once, not left unseen.
fn warn_unused_inpaint_flags(args: &GenerateArgs, to_run: &ToRun) {
    let given: Vec<&str> = [
        (args.mask.is_some(), "--mask"),
        (args.strength.is_some(), "--strength"),
        (args.mask_crop.is_some(), "--mask-crop"),
    ]
    .into_iter()
    .filter_map(|(set, flag)| set.then_some(flag))
    .collect();
    let own = to_run
        .iter()
        .filter(|(_, line, _)| line.image.is_some())
        .count();
    if !given.is_empty() && own > 0 {
        eprintln!(
            "klein: warning: {own} line(s) give their own \"image\": the command line's {} apply \
             only to the lines without one (a line gives its own \"mask\", \"strength\", \"mask_crop\")",
            given.join(", ")
        );
    }
}

/// A line to run: its record's index, the line, and its output file.
type ToRun = Vec<(usize, BatchLine, PathBuf)>;

impl BatchRun<'_> {
    /// 1. Every line: refused, skipped (its output exists) or to run (returned).
    fn sort_lines(&mut self, text: &[u8], base: &Path, reporter: &Reporter) -> ToRun {
        let (prompts, out_dir) = (self.prompts, self.out_dir);
        let mut to_run: Vec<(usize, BatchLine, PathBuf)> = Vec::new();
        for parsed in parse_batch(text, base) {
            match parsed {
                Err(error) => {
                    eprintln!(
                        "klein: error: {}: line {}: {}",
                        prompts.display(),
                        error.line,
                        error.message
                    );
                    self.records.push(LineRecord {
                        line: error.line,
                        name: error.name,
                        output: None,
                        prompt: error.prompt,
                        seed: None,
                        status: Status::Error,
                        message: Some(error.message),
                        error_kind: Some("user"),
                        seconds: 0.0,
                    });
                }
                Ok(line) => {
                    let output = out_dir.join(format!("{}.png", line.name));
                    if output.exists() && !output.is_file() {
                        // Not a finished output (those are files, written whole): the line fails.
                        let message = format!(
                            "{} exists and is not a file; remove it or give the line another name",
                            output.display()
                        );
                        eprintln!(
                            "klein: error: {}: line {}: {message}",
                            prompts.display(),
                            line.line
                        );
                        self.records.push(LineRecord {
                            line: line.line,
                            name: line.name.clone(),
                            output: None,
                            prompt: Some(line.prompt.clone()),
                            seed: line.seed,
                            status: Status::Error,
                            message: Some(message),
                            error_kind: Some("user"),
                            seconds: 0.0,
                        });
                        continue;
                    }
                    let skipped = output.exists();
                    if skipped {
                        reporter.say(format!(
                            "line {} ({}): skipped, {} exists",
                            line.line,
                            line.name,
                            output.display()
                        ));
                    }
                    self.records.push(LineRecord {
                        line: line.line,
                        name: line.name.clone(),
                        output: Some(output.display().to_string()),
                        prompt: Some(line.prompt.clone()),
                        seed: line
                            .seed
                            .or_else(|| skipped.then(|| stored_seed(&output)).flatten()),
                        status: if skipped {
                            Status::Skipped
                        } else {
                            Status::Pending
                        },
                        message: skipped.then(|| {
                            "the output exists (outputs are written whole; delete it to make it again)"
                                .to_string()
                        }),
                        error_kind: None,
                        seconds: 0.0,
                    });
                    if !skipped {
                        to_run.push((self.records.len() - 1, line, output));
                    }
                }
            }
        }
        to_run
    }

    /// 2. The lines to run, on one pipeline that keeps the text encoder loaded.
    fn run_lines(
        &mut self,
        args: &GenerateArgs,
        to_run: ToRun,
        reporter: &Reporter,
    ) -> anyhow::Result<()> {
        let model = default_model(args.load.model.clone())?;
        let options = pipeline_options(&args.load, args.device, args.loras.clone())
            .with_keep_text_encoder(true);
        let mut pipeline = Pipeline::load(&model, options)?;
        let bundle_hash = pipeline.bundle_sha256()?;
        self.model = Some(pipeline.manifest().model.name.clone());
        // This run's summary (the lines to run `pending`) replaces an earlier run's at once.
        self.write_summary(false)?;
        reporter.say(format!(
            "model: {} ({}), {} line(s) to run",
            pipeline.manifest().model.name,
            model.display(),
            to_run.len()
        ));
        let mut memo = PromptMemo::new(to_run.iter().map(|(_, line, _)| line.prompt.as_str()));
        let mut fatal: Option<String> = None;
        let total = to_run.len();
        for (n, (index, line, output)) in to_run.into_iter().enumerate() {
            if let Some(reason) = &fatal {
                memo.forget(&line.prompt);
                let record = &mut self.records[index];
                record.status = Status::NotRun;
                record.message = Some(format!("not run: an earlier line failed with: {reason}"));
                continue;
            }
            let line_started = Instant::now();
            let seed = line.seed.unwrap_or_else(klein::pipeline::random_seed);
            let job = BatchJob {
                line: &line,
                seed,
                output: &output,
                bundle_hash: &bundle_hash,
                progress: format!("[{}/{total}] ", n + 1),
            };
            let result = job.run(&mut pipeline, &mut memo, args, reporter);
            reporter.clear();
            let record = &mut self.records[index];
            record.seed = Some(seed);
            record.seconds = seconds(line_started.elapsed());
            match result {
                Ok(()) => {
                    record.status = Status::Ok;
                    println!("{}", output.display());
                }
                Err(error) => {
                    eprintln!(
                        "klein: error: line {} ({}): {error:#}",
                        line.line, line.name
                    );
                    record.status = Status::Error;
                    record.message = Some(format!("{error:#}"));
                    record.error_kind = Some(if is_user_error(&error) {
                        "user"
                    } else {
                        "runtime"
                    });
                    if is_fatal(&error) {
                        fatal = Some(format!("{error:#}"));
                    }
                }
            }
            // Kept current while the batch runs: after a crash it says how far it got.
            if let Err(error) = self.write_summary(false) {
                eprintln!("klein: warning: {error:#}");
            }
        }
        reporter.say(format!("device: {}", pipeline.device_name()));
        Ok(())
    }

    /// 3. The summary, and the exit code.
    fn finish(&self, reporter: &Reporter) -> anyhow::Result<ExitCode> {
        let summary = self.write_summary(true)?;
        let totals = self.totals();
        let user_errors = self
            .records
            .iter()
            .filter(|r| r.error_kind == Some("user"))
            .count();
        reporter.say(format!(
            "batch: {} line(s): {} ok, {} skipped, {} failed ({user_errors} user error(s)), {} not run, in {:.1} s; summary in {}",
            totals.lines,
            totals.ok,
            totals.skipped,
            totals.error,
            totals.not_run,
            totals.seconds,
            summary.display()
        ));
        Ok(if user_errors > 0 {
            ExitCode::from(2)
        } else if totals.error > 0 {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        })
    }
}

/// One line of a batch, ready to run.
struct BatchJob<'a> {
    line: &'a BatchLine,
    seed: u64,
    output: &'a Path,
    bundle_hash: &'a str,
    /// `[n/total] `, before the stage names of the progress bar.
    progress: String,
}

impl BatchJob<'_> {
    /// Loads the references, takes the prompt's embeddings from the memo (or leaves them to the
    /// pipeline), generates and writes the PNG atomically.
    fn run(
        &self,
        pipeline: &mut Pipeline,
        memo: &mut PromptMemo,
        args: &GenerateArgs,
        reporter: &Reporter,
    ) -> anyhow::Result<()> {
        let line = self.line;
        let checked = self.request(pipeline, args);
        let (request, (width, height)) = match checked {
            Ok(checked) => checked,
            Err(error) => {
                memo.forget(&line.prompt);
                return Err(error);
            }
        };
        let request = match memo.take(&line.prompt, |p| pipeline.encode_prompt(p, None))? {
            Some(embeds) => request.with_prompt_embeds(embeds),
            None => request,
        };
        reporter.say(format!(
            "{}line {} ({}): seed {}, {width}x{height}",
            self.progress, line.line, line.name, self.seed
        ));
        let generation =
            pipeline.generate(&request, Some(&mut reporter.callback(&self.progress)))?;
        reporter.clear();
        reporter.report(
            pipeline,
            &generation,
            args.timings,
            &format!("line {}: ", line.line),
        );
        let refs: Vec<String> = line.refs.iter().map(|r| r.display().to_string()).collect();
        let mut text = pipeline.image_metadata(&generation, &line.prompt, &refs, self.bundle_hash);
        let (image, mask, _, _) = self.inpaint_files(args);
        text.extend(crate::generate::inpaint_metadata(image, mask));
        let image = generation
            .images
            .first()
            .context("the pipeline returned no image")?;
        write_atomic(self.output, &encode_png(image, &text)?)?;
        Ok(())
    }

    /// The line's source image, mask, strength and mask crop: with its own image, its own mask,
    /// strength and crop; else each from the line, else from the command line.
    fn inpaint_files<'b>(&'b self, args: &'b GenerateArgs) -> InpaintFiles<'b> {
        let line = self.line;
        match &line.image {
            Some(image) => (
                Some(image),
                line.mask.as_deref(),
                line.strength,
                line.mask_crop,
            ),
            None => (
                args.image.as_deref(),
                line.mask.as_deref().or(args.mask.as_deref()),
                line.strength.or(args.strength),
                line.mask_crop.or(args.mask_crop),
            ),
        }
    }

    /// The request of the line (its values, else the command line's; its LoRAs applied, images
    /// loaded) and its output size, checked before the prompt is encoded.
    fn request(
        &self,
        pipeline: &mut Pipeline,
        args: &GenerateArgs,
    ) -> anyhow::Result<(Request, (u32, u32))> {
        let line = self.line;
        let mut spec = crate::generate::command_line_spec(args, &line.prompt);
        spec.seed = Some(self.seed);
        spec.width = line.width.or(args.width);
        spec.height = line.height.or(args.height);
        spec.steps = line.steps.or(args.steps);
        spec.guidance = line.guidance.or(args.guidance);
        spec.negative_prompt = line
            .negative_prompt
            .clone()
            .or_else(|| args.negative_prompt.clone());
        let (image, mask, strength, mask_crop) = self.inpaint_files(args);
        spec.source = image.map(ImageInput::file);
        spec.mask = mask.map(ImageInput::file);
        spec.strength = strength;
        spec.mask_crop = mask_crop;
        spec.references = line.refs.iter().cloned().map(ImageInput::File).collect();
        // Only the transformer reloads when a line's LoRAs differ from the previous line's.
        spec.loras = Some(line.loras.clone().unwrap_or_else(|| args.loras.clone()));
        // The output first (a file there must be writable), then every number and image.
        crate::outputs::check_writable(&format!("output {}", self.output.display()), self.output)?;
        let request = pipeline
            .prepare(&spec)
            .map_err(|e| crate::generate::spec_error(e, false))?;
        let size = pipeline.output_size(&request)?;
        Ok((request, size))
    }
}
