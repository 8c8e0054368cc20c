//! Batch jobs: one generation per line of a JSON Lines file (`klein generate --prompts`).
//!
//! Each non-blank line is an object:
//!
//! ```json
//! {"prompt": "a red fox", "seed": 7, "width": 768, "height": 512, "steps": 4, "guidance": 1.0,
//!  "refs": ["refs/fox.png"], "loras": ["style.safetensors:0.8"], "name": "fox"}
//! {"prompt": "a red hat", "image": "photo.png", "mask": "hat.png", "strength": 0.75}
//! {"prompt": "a blue hat", "image": "photo.png", "mask": "hat.png", "mask_crop": 32}
//! ```
//!
//! Only `prompt` is required; unknown keys are refused (a typo such as `"sead"` would otherwise be
//! silently ignored). `image`, `mask`, `strength` and `mask_crop` inpaint (as `--image`, `--mask`,
//! `--strength`, `--mask-crop`; a line without `image` takes the command line's). `refs`, `image`, `mask` and
//! `loras` are relative to the directory of the file; a line without
//! `loras` takes the command line's `--lora`s, `"loras": []` none. `name` is the output file
//! stem; by default the line number, zero-padded to four digits (`0007`). A line that cannot be
//! used is reported as a [`LineError`], and the others still run.
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use klein::fsutil::MAX_FILE_NAME_BYTES;
use klein::pipeline::LoraSpec;
use serde::Deserialize;

/// Digits of the default output name (the line number): `0001` ... `9999`, then `10000`.
const NAME_DIGITS: usize = 4;

/// One usable line.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct BatchLine {
    /// 1-based line number in the file.
    pub line: usize,
    /// Output file stem (`name`, else the zero-padded line number).
    pub name: String,
    pub prompt: String,
    pub seed: Option<u64>,
    pub width: Option<u32>,
    pub height: Option<u32>,
    pub steps: Option<usize>,
    pub guidance: Option<f64>,
    pub negative_prompt: Option<String>,
    /// Reference images, resolved against the file's directory.
    pub refs: Vec<PathBuf>,
    /// Inpainting and img2img: the source, its mask and the strength (paths resolved).
    pub image: Option<PathBuf>,
    pub mask: Option<PathBuf>,
    pub strength: Option<f64>,
    /// `padding_mask_crop` (as `--mask-crop`).
    pub mask_crop: Option<u32>,
    /// LoRAs of this line, resolved against the file's directory (`None`: the command line's).
    pub loras: Option<Vec<LoraSpec>>,
}

/// A line that cannot be used, with what is known of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct LineError {
    /// 1-based line number in the file.
    pub line: usize,
    /// The output name the line has or would have had.
    pub name: String,
    /// The prompt, when the line has one.
    pub prompt: Option<String>,
    /// What is wrong and what would be valid.
    pub message: String,
}

/// The JSON object of one line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct LineJson {
    prompt: String,
    seed: Option<u64>,
    width: Option<u32>,
    height: Option<u32>,
    steps: Option<usize>,
    guidance: Option<f64>,
    negative_prompt: Option<String>,
    #[serde(default)]
    refs: Vec<PathBuf>,
    image: Option<PathBuf>,
    mask: Option<PathBuf>,
    strength: Option<f64>,
    mask_crop: Option<u32>,
    /// `FILE` or `FILE:SCALE` each.
    loras: Option<Vec<String>>,
    name: Option<String>,
}

/// The default output name of line `line` (1-based): `0001`.
pub(crate) fn default_name(line: usize) -> String {
    format!("{line:0NAME_DIGITS$}")
}

/// Parses every non-blank line of a JSON Lines file; `base_dir` is the file's directory, against
/// which reference paths are resolved. Output names must be plain file names and unique: a line
/// whose name an earlier line already has (by default or explicitly) is an error.
pub(crate) fn parse_batch(
    text: &[u8],
    base_dir: &Path,
) -> Vec<std::result::Result<BatchLine, LineError>> {
    let mut used: HashMap<String, usize> = HashMap::new();
    let mut parsed = Vec::new();
    for (index, raw) in text.split(|&b| b == b'\n').enumerate() {
        let line = index + 1;
        let fail = |name: String, prompt: Option<String>, message: String| LineError {
            line,
            name,
            prompt,
            message,
        };
        let raw = raw.strip_suffix(b"\r").unwrap_or(raw);
        // A line that is not UTF-8 is that line's error, as invalid JSON is.
        let raw = match std::str::from_utf8(raw) {
            Ok(raw) => raw,
            Err(e) => {
                parsed.push(Err(fail(
                    default_name(line),
                    None,
                    format!(
                        "not UTF-8 text (byte {} of the line); save the file as UTF-8",
                        e.valid_up_to() + 1
                    ),
                )));
                used.entry(name_key(&default_name(line))).or_insert(line);
                continue;
            }
        };
        if raw.trim().is_empty() {
            continue;
        }
        let json: LineJson = match serde_json::from_str(raw) {
            Ok(json) => json,
            Err(e) => {
                // Keep the prompt for the report when the line is JSON with a string prompt.
                let prompt = serde_json::from_str::<serde_json::Value>(raw)
                    .ok()
                    .and_then(|v| v.get("prompt").and_then(|p| p.as_str()).map(str::to_string));
                let kind = if e.is_data() {
                    "invalid line"
                } else {
                    "invalid JSON"
                };
                // serde's position is in the line's own text (always "line 1"): the column
                // alone, so that the message names one line, the file's.
                let text = e.to_string();
                let reason = match text.rfind(" at line ") {
                    Some(at) if e.line() > 0 => format!("{} at column {}", &text[..at], e.column()),
                    _ => text,
                };
                parsed.push(Err(fail(
                    default_name(line),
                    prompt,
                    format!(
                        "{kind}: {reason}; each line must be an object such as {{\"prompt\": \"a cat\", \"seed\": 1}}"
                    ),
                )));
                used.entry(name_key(&default_name(line))).or_insert(line);
                continue;
            }
        };
        let name = json.name.clone().unwrap_or_else(|| default_name(line));
        if let Err(reason) = check_name(&name) {
            parsed.push(Err(fail(name, Some(json.prompt), format!("name {reason}"))));
            continue;
        }
        if let Some(&first) = used.get(&name_key(&name)) {
            parsed.push(Err(fail(
                name.clone(),
                Some(json.prompt),
                format!(
                    "name `{name}` is already used by line {first}; names must be unique, ignoring \
                     case (macOS and Windows file names are case-insensitive)"
                ),
            )));
            continue;
        }
        used.insert(name_key(&name), line);
        parsed.push(Ok(BatchLine {
            line,
            name,
            prompt: json.prompt,
            seed: json.seed,
            width: json.width,
            height: json.height,
            steps: json.steps,
            guidance: json.guidance,
            negative_prompt: json.negative_prompt,
            refs: json.refs.iter().map(|r| base_dir.join(r)).collect(),
            image: json.image.map(|p| base_dir.join(p)),
            mask: json.mask.map(|p| base_dir.join(p)),
            strength: json.strength,
            mask_crop: json.mask_crop,
            loras: json.loras.map(|loras| {
                loras
                    .iter()
                    .map(|text| {
                        let spec = LoraSpec::parse(text);
                        LoraSpec::new(base_dir.join(spec.path()), spec.scale())
                    })
                    .collect()
            }),
        }));
    }
    parsed
}

/// Two names that are one file on a case-insensitive file system have the same key.
fn name_key(name: &str) -> String {
    name.to_lowercase()
}

/// Device names Windows reserves in every directory, with any extension (`CON.png` too).
const WINDOWS_RESERVED: &[&str] = &[
    "con", "prn", "aux", "nul", "com1", "com2", "com3", "com4", "com5", "com6", "com7", "com8",
    "com9", "lpt1", "lpt2", "lpt3", "lpt4", "lpt5", "lpt6", "lpt7", "lpt8", "lpt9",
];

/// A name must be usable as a file name in the output directory, on every platform.
fn check_name(name: &str) -> std::result::Result<(), String> {
    const FORBIDDEN: &[char] = &['/', '\\', ':', '*', '?', '"', '<', '>', '|'];
    if name.is_empty() || name == "." || name == ".." {
        return Err(format!("`{name}` is not a file name"));
    }
    // The output's name, `.png` included, and its temporary file's must fit the file system.
    let longest = MAX_FILE_NAME_BYTES - ".png".len();
    if name.len() > longest {
        return Err(format!(
            "is {} bytes long; an output name is at most {longest} bytes before `.png`",
            name.len()
        ));
    }
    let stem = name.split('.').next().unwrap_or(name).trim_end();
    if WINDOWS_RESERVED.contains(&stem.to_ascii_lowercase().as_str()) {
        return Err(format!(
            "`{name}` is a device name on Windows ({}); choose another name",
            WINDOWS_RESERVED.join(", ")
        ));
    }
    if name.to_ascii_lowercase().ends_with(".png") {
        return Err(format!(
            "`{name}` ends with .png; give the name without it (the output is NAME.png)"
        ));
    }
    if name.ends_with(['.', ' ']) {
        return Err(format!(
            "`{name}` ends with a dot or a space, which Windows drops from file names"
        ));
    }
    if let Some(c) = name
        .chars()
        .find(|c| FORBIDDEN.contains(c) || c.is_control())
    {
        return Err(format!(
            "`{}` contains {c:?}; use a plain file name (without .png), such as `fox-1`",
            name.escape_debug()
        ));
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn lines_parse_with_defaults_and_resolved_refs() {
        let text = "{\"prompt\": \"a\"}\n\n{\"prompt\": \"b\", \"seed\": 3, \"refs\": [\"r.png\", \"/abs/s.png\"], \"name\": \"bee\"}\n";
        let parsed = parse_batch(text.as_bytes(), Path::new("dir"));
        assert_eq!(parsed.len(), 2, "the blank line is skipped: {parsed:?}");
        let first = parsed[0].as_ref().unwrap();
        assert_eq!(
            (first.line, first.name.as_str(), first.seed),
            (1, "0001", None)
        );
        let second = parsed[1].as_ref().unwrap();
        assert_eq!(
            (second.line, second.name.as_str(), second.seed),
            (3, "bee", Some(3))
        );
        assert_eq!(
            second.refs,
            [PathBuf::from("dir/r.png"), PathBuf::from("/abs/s.png")]
        );
    }

    #[test]
    fn bad_lines_are_errors_with_their_line_and_name() {
        let text = [
            "not json",
            "{\"seed\": 1}",
            "{\"prompt\": \"x\", \"sead\": 1}",
            "{\"prompt\": \"x\", \"name\": \"../up\"}",
            "{\"prompt\": \"x\", \"name\": \"0001\"}",
            "{\"prompt\": \"x\", \"width\": -5}",
            "{\"prompt\": \"x\", \"name\": \"Fox\"}",
            "{\"prompt\": \"x\", \"name\": \"fox\"}",
            "{\"prompt\": \"x\", \"name\": \"CON\"}",
            "{\"prompt\": \"x\", \"name\": \"nul.tar\"}",
            "{\"prompt\": \"x\", \"name\": \"end.\"}",
            "{\"prompt\": \"x\", \"name\": \"fox.PNG\"}",
        ]
        .join("\n");
        // Line 13: `café` in Latin-1 (é is the one byte 0xE9), not UTF-8; line 14: a long name.
        let mut bytes = text.into_bytes();
        bytes.extend_from_slice(b"\n{\"prompt\": \"caf\xe9\"}\n");
        let long_name = "n".repeat(300);
        bytes.extend_from_slice(
            format!("{{\"prompt\": \"x\", \"name\": \"{long_name}\"}}").as_bytes(),
        );
        let parsed = parse_batch(&bytes, Path::new("."));
        let errors: Vec<&LineError> = parsed.iter().filter_map(|p| p.as_ref().err()).collect();
        assert_eq!(errors.len(), 13, "{parsed:?}");
        let expect = [
            (1, "0001", "invalid JSON"),
            (2, "0002", "missing field `prompt`"),
            (3, "0003", "unknown field `sead`"),
            (4, "../up", "contains '/'"),
            (5, "0001", "already used by line 1"),
            (6, "0006", "invalid value: integer `-5`"),
            (8, "fox", "already used by line 7"),
            (9, "CON", "device name on Windows"),
            (10, "nul.tar", "device name on Windows"),
            (11, "end.", "ends with a dot"),
            (12, "fox.PNG", "give the name without it"),
            (13, "0013", "not UTF-8 text (byte 16 of the line)"),
            (14, long_name.as_str(), "300 bytes long"),
        ];
        for (error, (line, name, needle)) in errors.iter().zip(expect) {
            assert_eq!((error.line, error.name.as_str()), (line, name), "{error:?}");
            assert!(
                error.message.contains(needle),
                "line {line}: {}",
                error.message
            );
        }
        assert_eq!(errors[3].prompt.as_deref(), Some("x"));
        // One "line" per message, the file's: serde's position in the line is its column.
        for error in &errors[..3] {
            assert!(!error.message.contains("line 1"), "{}", error.message);
        }
        assert!(
            errors[0].message.contains("at column"),
            "{}",
            errors[0].message
        );
    }
}
