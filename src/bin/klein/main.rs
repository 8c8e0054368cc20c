//! The `klein` command line: parses flags ([`args`]), reports progress on stderr ([`report`]),
//! writes image files ([`outputs`]); `--prompts` runs a JSON Lines batch ([`batch`], [`jsonl`]).
//! All the work is done by the library.
use std::process::ExitCode;

use clap::Parser;
use klein::fsutil::remove_pending_temp_files;
use klein::KleinError;

mod args;
mod batch;
mod generate;
mod heap;
mod info;
mod jsonl;
mod models;
mod outputs;
mod report;
mod serve;
mod setup;

use args::{check_device_flags, Cli, Command, GenerateArgs};

/// Exit code after SIGINT, SIGTERM or SIGHUP (128 + SIGINT, as shells report Ctrl-C).
const INTERRUPTED: i32 = 130;

fn main() -> ExitCode {
    let cli = Cli::parse();
    heap::tune_heap(&cli.command);
    let result = match cli.command {
        Command::Generate(args) => {
            install_interrupt_handler();
            generate(*args)
        }
        Command::Info(args) => {
            end_quietly_on_a_closed_pipe();
            info::info(args).map(|()| ExitCode::SUCCESS)
        }
        // The server handles SIGTERM and Ctrl-C itself: it finishes accepted requests first.
        Command::Serve(args) => serve::serve(*args).map(|()| ExitCode::SUCCESS),
        Command::Setup(args) => setup::setup(args).map(|()| ExitCode::SUCCESS),
        Command::Models => {
            end_quietly_on_a_closed_pipe();
            models::models().map(|()| ExitCode::SUCCESS)
        }
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("klein: error: {error:#}");
            ExitCode::from(if is_user_error(&error) { 2 } else { 1 })
        }
    }
}

/// `klein info | head`: the process ends, as other Unix tools do, when the reader closes the pipe
/// (Rust ignores SIGPIPE, and the next line printed would panic). Only for `info`, which writes
/// nothing but its report: `generate` keeps its interrupt handler's clean-up, and `serve` handles
/// closed connections itself.
fn end_quietly_on_a_closed_pipe() {
    #[cfg(unix)]
    // SAFETY: sets a signal's disposition to its default before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Interrupted (Ctrl-C, SIGTERM, SIGHUP): removes the temporary files of a write in flight, so
/// that no hidden partial file is left, writes a running batch's summary as interrupted, then
/// exits. Outputs are renamed into place only whole.
fn install_interrupt_handler() {
    let handler = ctrlc::set_handler(|| {
        if let Some(at) = report::interrupted_at() {
            eprintln!("\nklein: {at}");
        }
        batch::interrupted(remove_pending_temp_files, INTERRUPTED)
    });
    if let Err(error) = handler {
        eprintln!("klein: warning: no interrupt handler ({error}); an interrupted write may leave a temporary file");
    }
}

/// Ends the process with `code` without running its exit handlers. ONNX Runtime's handlers tear
/// down state that a session being created on another thread still uses: an interrupt during a
/// load then ended in SIGSEGV instead of 130 (1 of 18 runs interrupted 0.2-0.8 s in).
pub(crate) fn exit_at_once(code: i32) -> ! {
    #[cfg(unix)]
    // SAFETY: POSIX `_exit` takes any status and does not return.
    unsafe {
        libc::_exit(code)
    }
    #[cfg(not(unix))]
    std::process::exit(code)
}

/// Whether an error comes from what the user gave (exit code 2) rather than from the runtime (1).
pub(crate) fn is_user_error(error: &anyhow::Error) -> bool {
    error.chain().any(|e| {
        e.downcast_ref::<KleinError>()
            .is_some_and(KleinError::is_user_error)
            || e.downcast_ref::<UsageError>().is_some()
    })
}

/// A command-line mistake only the binary can see (the library's checks return [`KleinError`]s).
/// Exits with code 2, as every user error does.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct UsageError(pub(crate) String);

fn generate(args: GenerateArgs) -> anyhow::Result<ExitCode> {
    check_device_flags(&args.load, args.device).map_err(UsageError)?;
    match (&args.prompts, &args.out_dir, &args.prompt) {
        (Some(prompts), Some(out_dir), _) => batch::generate_batch(&args, prompts, out_dir),
        (_, _, Some(prompt)) => generate::generate_one(&args, prompt).map(|()| ExitCode::SUCCESS),
        // clap requires a prompt or --prompts with --out-dir.
        _ => Err(UsageError("give a prompt, or --prompts FILE --out-dir DIR".to_string()).into()),
    }
}
