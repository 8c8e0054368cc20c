//! glibc's heap for a command (Linux, glibc; library side: `klein::runtime`'s heap settings):
//! freed memory kept for the next step (given back for each VAE decode), with transparent huge
//! pages for float transformers.
use std::sync::OnceLock;

use klein::bundle::Manifest;
use klein::pipeline::VaeTiling;
use klein::runtime::{retain_freed_memory, start_tunables, GLIBC_TUNABLES};

use crate::args::{local_model, Command, LoadArgs};

/// What [`tune_heap`] left the heap with, for `--timings`.
static SETTING: OnceLock<String> = OnceLock::new();

/// Sets the heap for `command`, first thing in `main` (before any thread starts). Generations
/// and the server ([`keeps_heap`]) keep freed memory with `mallopt`; those with no VAE tiles asked
/// for ([`huge_pages_pay`]) whose transformer is float start klein again instead, with
/// `GLIBC_TUNABLES` set to `start_tunables`'s value where that gives huge pages (the process is
/// replaced: this returns only where it was not needed or failed).
pub(crate) fn tune_heap(command: &Command) {
    let keep = keeps_heap(command);
    // The cheap checks first: the restarted process (its variable set) reads no manifest.
    if let Some(tunables) = start_tunables().filter(|_| huge_pages_pay(command)) {
        if load_args(command).is_some_and(runs_a_float_transformer) {
            start_again(tunables);
        }
    }
    let setting = match std::env::var(GLIBC_TUNABLES) {
        Ok(tunables) => format!("{GLIBC_TUNABLES}={tunables}"),
        Err(_) if keep && retain_freed_memory() => "freed memory kept (mallopt)".to_string(),
        Err(_) => "the allocator's defaults".to_string(),
    };
    let _ = SETTING.set(setting);
}

/// The heap's setting (`--timings`): the tunables klein or the user started it with, or else
/// whether freed memory is kept.
pub(crate) fn heap_setting() -> &'static str {
    SETTING.get().map_or("not set", String::as_str)
}

/// Whether the bundle `load` names has a float transformer, whose large activations huge pages
/// serve faster (fp32 step 5-15%; benches/RESULTS.md, "Heap"). Quantized bundles gained nothing: the wide
/// dds bundle at 1024x1024 encoded its prompt in 7.0-8.1 s with them against 6.3-6.4 s, decoded
/// in 23.6-26.8 against 27.2-28.7 s, 55.4 against 52.6-53.9 s end to end. False where the
/// manifest cannot be read: the command then says why itself.
fn runs_a_float_transformer(load: &LoadArgs) -> bool {
    local_model(load.model.clone())
        .and_then(|model| Ok(Manifest::load(&model)?))
        .is_ok_and(|manifest| manifest.graphs.transformer.quantization.is_none())
}

/// Replaces the process by klein again, same arguments, with `GLIBC_TUNABLES=tunables`; returns
/// only if that failed (said on stderr: the run goes on without huge pages). The variable being
/// set is what stops the new process from starting again.
fn start_again(tunables: &str) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let mut args = std::env::args_os();
        let arg0 = args.next().unwrap_or_else(|| "klein".into());
        // `/proc/self/exe` runs this very file, even if it was replaced or deleted since.
        let error = std::process::Command::new("/proc/self/exe")
            .arg0(arg0)
            .args(args)
            .env(GLIBC_TUNABLES, tunables)
            .exec();
        eprintln!("klein: warning: could not start again with {GLIBC_TUNABLES}={tunables} ({error}); running without huge pages");
    }
    #[cfg(not(target_os = "linux"))]
    let _ = tunables;
}

/// Whether `command` keeps freed activations mapped for the next step (runtime/heap.rs): every
/// generation and the server. The pipeline gives the heap back before each VAE decode (whole or tiled) and keeps it again after it (`give_back_freed_memory`), so
/// the steps keep their gain and the decoder its memory: wide dds at 1536x1536 (auto's tiles),
/// denoising 3-9% faster at the same peak; at 1024x1024 with `--vae-tile-size 512`, 3 alternating
/// pairs, denoise 40.1-42.4 s against 47.5-54.2 s, peak 2.89 against 2.88 GiB, images byte-equal
/// (benches/RESULTS.md, "Heap"). Kept through the decoder, the heap took its memory back: 4.1-8.9 GB peaks
/// against 3.4 GB with those tiles, 4.50-4.52 GiB against 3.78-3.80 GiB decoded whole.
fn keeps_heap(command: &Command) -> bool {
    load_args(command).is_some()
}

/// Whether a float transformer's generation starts with huge pages (and the heap kept through
/// every decode, tiled or whole: a process started with `GLIBC_TUNABLES` is not given back): every generation and
/// the server without VAE tiles asked for, auto's tiles included. There its steps and decode
/// still gained (wide fp32 at 1536x1536, 2 steps, 2 alternating pairs: decode 136.6 and 138.5 s
/// against 147.8 and 157.7 s, denoise 126.6 and 101.3 s against 124.9 and 148.8 s) for a higher
/// peak (12.08 and 11.33 GiB against 10.90 and 10.91 GiB: freed activations stay mapped for the
/// decoder); huge pages without the kept heap gained nothing there (349.2 and 312.6 s against
/// 341.5 and 305.8 s end to end; benches/RESULTS.md, "Heap"). Those pairs ran the transformer with ONNX
/// Runtime's memory pattern; without it (now) the steps leave less memory mapped and the decode
/// gains less (145.7 and 153.8 s, 4 steps, peak 11.6 GiB). Asked-for tiles are there to save
/// memory: those keep the `mallopt` heap, which is given back for them.
fn huge_pages_pay(command: &Command) -> bool {
    load_args(command).is_some_and(|load| load.vae_tiling() != VaeTiling::On)
}

/// The bundle and session arguments of a command that loads a bundle.
fn load_args(command: &Command) -> Option<&LoadArgs> {
    match command {
        Command::Generate(args) => Some(&args.load),
        Command::Serve(args) => Some(&args.load),
        Command::Info(_) | Command::Setup(_) | Command::Models => None,
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{huge_pages_pay, keeps_heap};
    use crate::args::{Cli, Command};

    fn command(args: &[&str]) -> Command {
        Cli::try_parse_from(args).expect("valid arguments").command
    }

    #[test]
    fn generations_and_the_server_keep_the_heap() {
        let keeps = |args: &[&str]| keeps_heap(&command(args));
        assert!(keeps(&["klein", "generate", "a fox"]));
        assert!(keeps(&["klein", "serve", "--vae-tiling", "off"]));
        // Tiles, asked for or auto's: the pipeline gives the heap back for them.
        assert!(keeps(&["klein", "generate", "a fox", "--vae-tiling", "on"]));
        assert!(keeps(&["klein", "serve", "--vae-tile-size", "512"]));
        assert!(keeps(&[
            "klein", "generate", "a fox", "--width", "1536", "--height", "1536"
        ]));
        assert!(!keeps(&["klein", "info"]));
    }

    #[test]
    fn huge_pages_unless_tiles_are_asked_for() {
        let pays = |args: &[&str]| huge_pages_pay(&command(args));
        assert!(pays(&["klein", "generate", "a fox"]));
        // Auto tiles at this size; huge pages and the kept heap still pay for float steps.
        assert!(pays(&[
            "klein", "generate", "a fox", "--width", "1536", "--height", "1536"
        ]));
        assert!(pays(&["klein", "serve"]));
        assert!(pays(&["klein", "serve", "--vae-tiling", "off"]));
        assert!(!pays(&["klein", "generate", "a fox", "--vae-tiling", "on"]));
        assert!(!pays(&[
            "klein",
            "generate",
            "a fox",
            "--vae-tile-size",
            "512"
        ]));
        assert!(!pays(&["klein", "serve", "--vae-tiling", "on"]));
        assert!(!pays(&["klein", "info"]));
    }
}
