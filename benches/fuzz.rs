//! Fuzzing on the stable toolchain (cargo-fuzz needs nightly): mutates seed inputs with a small
//! deterministic PRNG and feeds them to the entry points that read untrusted bytes, for a fixed
//! time per target. The targets and their invariants are in `tests/it/fuzz_targets.rs`:
//!
//! - `manifest`: `Manifest::from_json_bytes` (seeds: the tiny bundle's manifest.json and
//!   tests/fixtures/bundle_manifest.json);
//! - `reference`: `reference::decode_reference_bytes` (seeds: the images of tests/fixtures/reference/
//!   and of the decoding corpus, tests/fixtures/decode/);
//! - `tokenizer`: `PromptTokenizer::encode` on the input as lossy UTF-8 (seeds: the prompts of
//!   tests/fixtures/tokens.json).
//!
//! Every file in `tests/fixtures/fuzz/<target>/` is a seed too. A panic, or a result that breaks an
//! invariant, is a crash: the input is saved as `tests/fixtures/fuzz/<target>/crash-<sha256>`
//! (where `fuzz_regressions.rs` replays it) and printed; the command then exits with code 1.
//!
//! ```sh
//! cargo bench --bench fuzz                              # every target, 60 s each
//! cargo bench --bench fuzz -- --seconds 30 reference    # one target, 30 s
//! cargo bench --bench fuzz -- --seed 7 --iterations 1000 manifest   # a reproducible run
//! cargo bench --profile fuzz --bench fuzz               # with overflow checks and debug asserts
//! ```
//!
//! Mutations: bit flips, random and "interesting" bytes and integers (0, -1, 2^31-1, 2^32...),
//! byte insertion and deletion, chunk duplication, splicing with another input, truncation; for
//! JSON, edits of the parsed value (numbers out of range, wrong types, deleted keys, deep nesting);
//! for PNG, the IHDR fields, with chunk CRCs fixed afterwards half the time so that mutations get
//! past the CRC check. An input whose outcome (accepted, or the error with its numbers blanked) is
//! new joins the corpus, so later mutations start from inputs that reached new code.
use std::cell::RefCell;
use std::collections::HashSet;
use std::panic::{self, AssertUnwindSafe};
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::Value;
use sha2::{Digest, Sha256};

#[path = "../tests/it/fuzz_targets.rs"]
mod fuzz_targets;

use fuzz_targets::{corpus_dir, files_in, seed_files, Outcome, Targets, TARGETS};

const DEFAULT_SECONDS: u64 = 60;
const DEFAULT_SEED: u64 = 0x6b6c_6569_6e21;
/// Inputs are kept under this size (a tokenizer input this long is 250k+ tokens).
const MAX_INPUT: usize = 256 * 1024;
/// Most tokenizer inputs are cut to this many bytes (about 1,000 tokens of English).
const SHORT_PROMPT: usize = 4096;
/// The corpus stops growing at this many inputs.
const MAX_CORPUS: usize = 512;
/// Larger inputs are run but do not join the corpus (seeds excepted): mutating them is slow, and
/// they reach no new code (a prompt is cut at 512 tokens anyway).
const MAX_CORPUS_INPUT: usize = 16 * 1024;
/// An input slower than this is reported as a hang, like a crash.
const HANG: Duration = Duration::from_secs(10);

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if !args.iter().any(|a| a == "--bench") {
        println!("fuzz: skipped outside `cargo bench --bench fuzz`");
        return ExitCode::SUCCESS;
    }
    let options = match Options::parse(&args) {
        Ok(options) => options,
        Err(message) => {
            eprintln!("fuzz: {message}");
            eprintln!(
                "usage: cargo bench --bench fuzz -- [--seconds N] [--seed N] [--iterations N] [{}]",
                TARGETS.join("|")
            );
            return ExitCode::from(2);
        }
    };
    let targets = match Targets::new() {
        Ok(t) => t,
        Err(message) => {
            eprintln!("fuzz: cannot set up the targets: {message}");
            return ExitCode::FAILURE;
        }
    };
    install_panic_hook();
    let mut crashes = 0;
    for target in &options.targets {
        crashes += fuzz(&targets, target, &options);
    }
    if crashes == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

struct Options {
    seconds: u64,
    seed: u64,
    iterations: Option<u64>,
    targets: Vec<String>,
}

impl Options {
    fn parse(args: &[String]) -> Result<Options, String> {
        let mut options = Options {
            seconds: DEFAULT_SECONDS,
            seed: DEFAULT_SEED,
            iterations: None,
            targets: Vec::new(),
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            let mut number = |flag: &str| -> Result<u64, String> {
                let value = args.next().ok_or(format!("{flag} needs a value"))?;
                value
                    .parse()
                    .map_err(|_| format!("{flag} {value}: not a whole number"))
            };
            match arg.as_str() {
                "--bench" => {}
                "--seconds" => options.seconds = number("--seconds")?,
                "--seed" => options.seed = number("--seed")?,
                "--iterations" => options.iterations = Some(number("--iterations")?),
                name if TARGETS.contains(&name) => options.targets.push(name.to_string()),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        if options.targets.is_empty() {
            options.targets = TARGETS.iter().map(|t| t.to_string()).collect();
        }
        Ok(options)
    }
}

thread_local! {
    /// The message and location of the last panic on this thread, set by the panic hook.
    static LAST_PANIC: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Records panics instead of printing them: the fuzzer reports each distinct one once.
fn install_panic_hook() {
    panic::set_hook(Box::new(|info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(non-string panic payload)".to_string());
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        LAST_PANIC.with(|last| *last.borrow_mut() = format!("panic at {location}: {message}"));
    }));
}

/// Runs one target for the time budget; returns the number of distinct crashes found.
fn fuzz(targets: &Targets, target: &str, options: &Options) -> usize {
    let mut corpus = initial_corpus(target);
    let seeds = corpus.len();
    if corpus.is_empty() {
        corpus.push(Vec::new());
    }
    let mut rng = Rng::new(options.seed ^ fnv(target.as_bytes()));
    let mut outcomes: HashSet<String> = HashSet::new();
    let mut crash_kinds: HashSet<String> = HashSet::new();
    let mut crash_inputs = 0u64;
    let mut accepted = 0u64;
    let mut slowest = (Duration::ZERO, Vec::new());
    let budget = Duration::from_secs(options.seconds);
    let start = Instant::now();
    let mut iterations = 0u64;
    // The seeds themselves first, unmutated.
    let mut pending: Vec<Vec<u8>> = corpus.clone();
    loop {
        let (input, seed) = match pending.pop() {
            Some(input) => (input, true),
            None => {
                if start.elapsed() >= budget || options.iterations.is_some_and(|n| iterations >= n)
                {
                    break;
                }
                (mutate(&mut rng, &corpus, target), false)
            }
        };
        iterations += 1;
        let began = Instant::now();
        let result = panic::catch_unwind(AssertUnwindSafe(|| targets.run(target, &input)));
        let elapsed = began.elapsed();
        if elapsed > slowest.0 {
            slowest = (elapsed, input.clone());
        }
        let crash = match result {
            Err(_) => Some(LAST_PANIC.with(|last| last.borrow().clone())),
            Ok(Outcome::Violation(problem)) => Some(format!("invariant: {problem}")),
            Ok(_) if elapsed > HANG => Some(format!("hang: {:.1} s", elapsed.as_secs_f64())),
            Ok(outcome) => {
                if matches!(outcome, Outcome::Accepted(_)) {
                    accepted += 1;
                }
                if outcomes.insert(signature(&outcome))
                    && !seed
                    && corpus.len() < MAX_CORPUS
                    && input.len() <= MAX_CORPUS_INPUT
                {
                    corpus.push(input.clone());
                }
                None
            }
        };
        if let Some(description) = crash {
            crash_inputs += 1;
            // One report per kind: the panic location or the invariant, values blanked.
            if crash_kinds.insert(crash_kind(&description)) {
                let saved = save_crash(target, &input);
                println!("fuzz {target}: CRASH {description}");
                println!("  input ({} bytes) saved as {}", input.len(), saved);
                println!("  input: {}", preview(&input));
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    println!(
        "fuzz {target}: {iterations} iterations in {seconds:.1} s ({:.0}/s), {accepted} accepted; \
         corpus {seeds} seeds -> {} inputs, {} distinct outcomes; {} crash kind(s) from {crash_inputs} \
         input(s); slowest input {:.1} ms ({} bytes)",
        iterations as f64 / seconds.max(1e-9),
        corpus.len(),
        outcomes.len(),
        crash_kinds.len(),
        slowest.0.as_secs_f64() * 1000.0,
        slowest.1.len()
    );
    crash_kinds.len()
}

/// What kind of outcome this is, whatever the values in it: a new kind adds its input to the
/// corpus.
fn signature(outcome: &Outcome) -> String {
    match outcome {
        Outcome::Accepted(class) => format!("accepted {class}"),
        Outcome::Refused(message) => format!("refused {}", blank_values(message, 24)),
        Outcome::Violation(problem) => format!("violation {}", blank_values(problem, 12)),
    }
}

/// A crash's kind: the panic's location and message, or the broken invariant, values blanked.
fn crash_kind(description: &str) -> String {
    match description.strip_prefix("panic at ") {
        Some(rest) => {
            let (location, message) = rest.split_once(": ").unwrap_or((rest, ""));
            format!("panic at {location}: {}", blank_values(message, 12))
        }
        None => blank_values(description, 12),
    }
}

/// The first `words` words of `message` with quoted and bracketed parts replaced by `_` and every
/// word that is not plain ASCII letters by `#`.
fn blank_values(message: &str, words: usize) -> String {
    let mut unquoted = String::new();
    // The opening and closing delimiters being inside, and how deep.
    let mut inside: Option<(char, char, usize)> = None;
    for c in message.chars() {
        inside = match (inside, c) {
            (None, '`' | '"' | '[' | '{') => {
                unquoted.push('_');
                let close = match c {
                    '[' => ']',
                    '{' => '}',
                    quote => quote,
                };
                Some((c, close, 1))
            }
            (None, _) => {
                unquoted.push(c);
                None
            }
            (Some((open, close, depth)), _) if c == close => {
                (depth > 1).then_some((open, close, depth - 1))
            }
            (Some((open, close, depth)), _) if c == open => Some((open, close, depth + 1)),
            (still, _) => still,
        };
    }
    let kept: Vec<&str> = unquoted
        .split_whitespace()
        .map(|w| {
            let word = w
                .trim_end_matches([':', ',', '.', ';', ')'])
                .trim_start_matches('(');
            if word
                .chars()
                .all(|c| c.is_ascii_alphabetic() || c == '_' || c == '-')
            {
                w
            } else {
                "#"
            }
        })
        .take(words)
        .collect();
    kept.join(" ")
}

/// The seed files and saved inputs of `target`, plus, for the tokenizer, the fixture prompts.
fn initial_corpus(target: &str) -> Vec<Vec<u8>> {
    let mut corpus: Vec<Vec<u8>> = seed_files(target)
        .into_iter()
        .chain(files_in(&corpus_dir(target)))
        .filter(|p| p.file_name().is_some_and(|n| n != "README.md"))
        .filter_map(|p| std::fs::read(p).ok())
        .map(|mut bytes| {
            bytes.truncate(MAX_INPUT);
            bytes
        })
        .collect();
    if target == "tokenizer" {
        let tokens = fuzz_targets::repo().join("tests/fixtures/tokens.json");
        if let Ok(Value::Object(fixture)) = std::fs::read(tokens)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
        {
            if let Some(Value::Array(cases)) = fixture.get("cases") {
                for case in cases {
                    if let Some(prompt) = case.get("prompt").and_then(Value::as_str) {
                        corpus.push(prompt.as_bytes().to_vec());
                    }
                }
            }
        }
    }
    corpus.sort();
    corpus.dedup();
    corpus
}

/// Saves a crashing input under `tests/fixtures/fuzz/<target>/crash-<sha256 prefix>`.
fn save_crash(target: &str, input: &[u8]) -> String {
    let digest: String = Sha256::digest(input)
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect();
    let dir = corpus_dir(target);
    let path = dir.join(format!("crash-{digest}"));
    match std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, input)) {
        Ok(()) => relative(&path),
        Err(e) => format!("(not saved: {}: {e})", path.display()),
    }
}

fn relative(path: &Path) -> String {
    path.strip_prefix(fuzz_targets::repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The first bytes of an input, escaped.
fn preview(input: &[u8]) -> String {
    const SHOWN: usize = 300;
    let text: String = input[..input.len().min(SHOWN)].escape_ascii().to_string();
    if input.len() > SHOWN {
        format!("{text}... ({} more bytes)", input.len() - SHOWN)
    } else {
        text
    }
}

// ---- mutations ----

/// SplitMix64: small, fast, and the same sequence everywhere for a seed.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n` > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, one_in: usize) -> bool {
        self.below(one_in) == 0
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

const INTERESTING_BYTES: [u8; 8] = [0, 1, 0x0f, 0x10, 0x7f, 0x80, 0xfe, 0xff];
const INTERESTING_INTS: [u64; 14] = [
    0,
    1,
    2,
    16,
    64,
    255,
    0x7fff,
    0xffff,
    0x10000,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];
/// Text the tokenizer and JSON targets are given more often than chance would.
const INTERESTING_TEXT: [&str; 16] = [
    "\0",
    "<|im_end|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<think>",
    "\u{FFFD}",
    "\u{202E}",
    "\u{200D}",
    "\u{0301}\u{0301}\u{0301}",
    "👩‍👩‍👧",
    "\u{10FFFF}",
    "\r\n",
    "\\ud800",
    "1e309",
    "-0",
    "18446744073709551616",
];

/// One mutated input: 1, 2, 4 or 8 stacked mutations of a corpus input.
fn mutate(rng: &mut Rng, corpus: &[Vec<u8>], target: &str) -> Vec<u8> {
    if target == "manifest" && rng.chance(2) {
        // Structural edits start from the inputs that are JSON.
        let json: Vec<&Vec<u8>> = corpus.iter().filter(|c| c.first() == Some(&b'{')).collect();
        if !json.is_empty() {
            let base = rng.pick(&json).as_slice();
            if let Some(edited) = mutate_json(rng, base) {
                return edited;
            }
        }
    }
    // Large inputs (seeds such as the 100,000-character prompt) take most of the time: pick them
    // one time in eight as often as the others.
    let mut input = rng.pick(corpus);
    while input.len() > MAX_CORPUS_INPUT && !rng.chance(8) {
        input = rng.pick(corpus);
    }
    let mut input = input.clone();
    let rounds = 1 << rng.below(4);
    for _ in 0..rounds {
        mutate_bytes(rng, &mut input, corpus, target);
    }
    if target == "reference" && rng.chance(2) {
        fix_png_crcs(&mut input);
    }
    // Tokenising takes time in proportion to the length, and a prompt is cut at 512 tokens
    // anyway: most tokenizer inputs stay short, one in eight may be long.
    if target == "tokenizer" && !rng.chance(8) {
        input.truncate(SHORT_PROMPT);
    }
    input.truncate(MAX_INPUT);
    input
}

fn mutate_bytes(rng: &mut Rng, input: &mut Vec<u8>, corpus: &[Vec<u8>], target: &str) {
    let len = input.len();
    let position = |rng: &mut Rng| if len == 0 { 0 } else { rng.below(len) };
    match rng.below(12) {
        0 if len > 0 => {
            let i = position(rng);
            input[i] ^= 1 << rng.below(8);
        }
        1 if len > 0 => {
            let i = position(rng);
            input[i] = rng.next() as u8;
        }
        2 if len > 0 => {
            let i = position(rng);
            input[i] = *rng.pick(&INTERESTING_BYTES);
        }
        3 => {
            // An interesting 16-, 32- or 64-bit integer, either byte order.
            let width = *rng.pick(&[2usize, 4, 8]);
            if len >= width {
                let value = *rng.pick(&INTERESTING_INTS);
                let bytes = if rng.chance(2) {
                    value.to_le_bytes()
                } else {
                    value.to_be_bytes()
                };
                let i = rng.below(len - width + 1);
                let take = if rng.chance(2) {
                    &bytes[..width]
                } else {
                    &bytes[8 - width..]
                };
                input[i..i + width].copy_from_slice(take);
            }
        }
        4 => {
            let i = if len == 0 { 0 } else { rng.below(len + 1) };
            let count = 1 + rng.below(16);
            let bytes: Vec<u8> = (0..count).map(|_| rng.next() as u8).collect();
            input.splice(i..i, bytes);
        }
        5 if len > 0 => {
            let i = position(rng);
            let most = if rng.chance(4) { len } else { 16 };
            let count = 1 + rng.below((len - i).min(most));
            input.drain(i..i + count);
        }
        6 if len > 0 => {
            // Duplicate a chunk somewhere else (repeated structures, long runs).
            let i = position(rng);
            let count = 1 + rng.below((len - i).min(256));
            let chunk = input[i..i + count].to_vec();
            let copies = if rng.chance(8) { 1 + rng.below(64) } else { 1 };
            let at = rng.below(len + 1);
            for _ in 0..copies {
                input.splice(at..at, chunk.iter().copied());
            }
        }
        7 => {
            // Splice: this input's head with another input's tail.
            let other = rng.pick(corpus);
            let head = if len == 0 { 0 } else { rng.below(len + 1) };
            let tail = if other.is_empty() {
                0
            } else {
                rng.below(other.len())
            };
            input.truncate(head);
            input.extend_from_slice(&other[tail..]);
        }
        8 if len > 0 => {
            let keep = rng.below(len);
            input.truncate(keep);
        }
        9 | 10 if target != "reference" => {
            let i = if len == 0 { 0 } else { rng.below(len + 1) };
            let text = rng.pick(&INTERESTING_TEXT).as_bytes().to_vec();
            input.splice(i..i, text);
        }
        9 | 10 if input.starts_with(PNG_SIGNATURE) => mutate_ihdr(rng, input),
        11 if target == "tokenizer" && rng.chance(16) => {
            // A very long prompt: the input repeated up to the size limit.
            let unit = if input.is_empty() {
                b"word ".to_vec()
            } else {
                input.clone()
            };
            while input.len() < MAX_INPUT / 2 {
                input.extend_from_slice(&unit);
            }
        }
        _ => {
            if len > 0 {
                let i = position(rng);
                input[i] = input[i].wrapping_add(1 + rng.below(3) as u8);
            }
        }
    }
}

const PNG_SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";

/// Overwrites a field of the IHDR chunk (width, height, bit depth, colour type, interlace).
fn mutate_ihdr(rng: &mut Rng, png: &mut [u8]) {
    // signature (8), length (4), "IHDR" (4), then width (4), height (4), depth, colour, ...
    if png.len() < 8 + 8 + 13 || &png[12..16] != b"IHDR" {
        return;
    }
    match rng.below(4) {
        0 | 1 => {
            let at = 16 + 4 * rng.below(2);
            let value = *rng.pick(&INTERESTING_INTS) as u32;
            let value = if rng.chance(2) {
                value
            } else {
                rng.next() as u32 % 20_000
            };
            png[at..at + 4].copy_from_slice(&value.to_be_bytes());
        }
        2 => png[24] = *rng.pick(&[0, 1, 2, 4, 8, 16, 32]),
        _ => png[25 + rng.below(3)] = *rng.pick(&[0, 1, 2, 3, 4, 6, 7]),
    }
}

/// Recomputes the CRC of every complete chunk of a PNG, so mutations reach the decoder proper.
fn fix_png_crcs(png: &mut [u8]) {
    if !png.starts_with(PNG_SIGNATURE) {
        return;
    }
    let mut at = PNG_SIGNATURE.len();
    while at + 12 <= png.len() {
        let length = u32::from_be_bytes([png[at], png[at + 1], png[at + 2], png[at + 3]]) as usize;
        let end = match (at + 8).checked_add(length) {
            Some(end) if end + 4 <= png.len() => end,
            _ => return,
        };
        let crc = crc32fast::hash(&png[at + 4..end]);
        png[end..end + 4].copy_from_slice(&crc.to_be_bytes());
        at = end + 4;
    }
}

/// An edit of the parsed JSON (one node changed), written back compact or pretty; `None` when the
/// input is not JSON.
fn mutate_json(rng: &mut Rng, input: &[u8]) -> Option<Vec<u8>> {
    let mut value: Value = serde_json::from_slice(input).ok()?;
    let edits = 1 + rng.below(3);
    for _ in 0..edits {
        edit_random_node(rng, &mut value);
    }
    let pretty = if rng.chance(2) {
        serde_json::to_vec_pretty(&value).ok()
    } else {
        None
    };
    // Deep nesting pretty-printed grows quadratically; compact then.
    pretty
        .filter(|p| p.len() <= MAX_INPUT)
        .or_else(|| serde_json::to_vec(&value).ok())
        .filter(|p| p.len() <= MAX_INPUT)
}

/// Walks down from `value` to a random node and edits it.
fn edit_random_node(rng: &mut Rng, value: &mut Value) {
    // Go deeper with probability 3/4 while there is somewhere to go.
    let children = match value {
        Value::Object(map) => map.len(),
        Value::Array(items) => items.len(),
        _ => 0,
    };
    if children > 0 && !rng.chance(4) {
        let i = rng.below(children);
        let child = match value {
            Value::Object(map) => map.values_mut().nth(i),
            Value::Array(items) => items.get_mut(i),
            _ => None,
        };
        if let Some(child) = child {
            edit_random_node(rng, child);
            return;
        }
    }
    match rng.below(6) {
        0 => *value = interesting_json(rng),
        1 => {
            // Delete a key or an element.
            match value {
                Value::Object(map) if !map.is_empty() => {
                    let key = map.keys().nth(rng.below(map.len())).cloned();
                    if let Some(key) = key {
                        map.remove(&key);
                    }
                }
                Value::Array(items) if !items.is_empty() => {
                    let i = rng.below(items.len());
                    items.remove(i);
                }
                _ => *value = Value::Null,
            }
        }
        2 => {
            // Duplicate an element, or add an unknown key.
            match value {
                Value::Array(items) if !items.is_empty() => {
                    let item = items[rng.below(items.len())].clone();
                    items.push(item);
                }
                Value::Object(map) => {
                    map.insert("unknown_key".into(), interesting_json(rng));
                }
                _ => *value = Value::Array(vec![value.clone()]),
            }
        }
        3 => {
            // Nest: deep arrays (serde_json's recursion limit is 128).
            let depth = *rng.pick(&[2usize, 100, 127, 128, 129, 1000]);
            let mut nested = value.clone();
            for _ in 0..depth {
                nested = Value::Array(vec![nested]);
            }
            *value = nested;
        }
        4 => {
            if let Value::Number(n) = value {
                // Neighbours of the number: off by one, negated, scaled.
                let x = n.as_f64().unwrap_or(0.0);
                let candidates = [x + 1.0, x - 1.0, -x, x * 1e6, x / 3.0, x.floor() + 0.5];
                *value = serde_json::Number::from_f64(*rng.pick(&candidates))
                    .map(Value::Number)
                    .unwrap_or(Value::Null);
            } else {
                *value = interesting_json(rng);
            }
        }
        _ => {
            if let Value::String(s) = value {
                let text = rng.pick(&INTERESTING_TEXT);
                if rng.chance(2) {
                    s.push_str(text);
                } else {
                    *s = text.repeat(1 + rng.below(4));
                }
            } else {
                *value = interesting_json(rng);
            }
        }
    }
}

fn interesting_json(rng: &mut Rng) -> Value {
    let numbers = [
        "0",
        "-1",
        "1",
        "2",
        "16",
        "4294967295",
        "4294967296",
        "9007199254740993",
        "18446744073709551615",
        "-9223372036854775808",
        "9223372036854775807",
        "1e308",
        "-1e308",
        "5e-324",
        "0.5",
        "-0.0",
    ];
    match rng.below(8) {
        0..=3 => {
            let number = *rng.pick(&numbers);
            serde_json::from_str(number).unwrap_or(Value::Null)
        }
        4 => Value::String(rng.pick(&INTERESTING_TEXT).to_string()),
        5 => Value::Bool(rng.chance(2)),
        6 => Value::Null,
        _ => Value::Array(Vec::new()),
    }
}
