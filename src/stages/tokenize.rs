//! Stage 1a: prompt to token ids, as diffusers' `Flux2KleinPipeline._get_qwen3_prompt_embeds`.
//!
//! The reference renders the chat template around the prompt, then calls
//! `tokenizer(text, padding="max_length", truncation=True, max_length=512)`. For one user message
//! the template is plain concatenation, so the bundle stores it as a prefix and a suffix
//! (`manifest.json` `tokenizer`, written by the exporter from the checkpoint's own template):
//!
//! 1. `text = prompt_prefix + prompt + prompt_suffix`
//!    (Qwen3: `<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n`).
//! 2. Tokenise `text` without the post-processor's special tokens (Qwen adds none anyway). Special
//!    tokens typed in the prompt, such as `<|im_end|>`, become their special ids, as in transformers
//!    with `split_special_tokens=False` (the Qwen3 default).
//! 3. Keep the first `max_sequence_length` ids: a long prompt loses the template suffix, exactly as
//!    the reference does (truncation side is right).
//! 4. Pad to exactly `max_sequence_length` with `pad_token_id` on `padding_side`; the attention mask
//!    is 1 for real tokens, 0 for padding. FLUX.3 (`pad_multiple`, `Flux3TextEncoderStep`): pad to
//!    the kept length rounded up to a multiple of 80 instead, at most `max_sequence_length`.

use std::path::{Path, PathBuf};
use std::thread::JoinHandle;

use serde::{Deserialize, Serialize};
use tokenizers::Tokenizer;

use super::tokenizer_file::read_tokenizer;
use crate::error::{KleinError, Result};

/// `tokenizer`: how a prompt becomes `input_ids` and `attention_mask` (the manifest's `tokenizer` section).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TokenizerSpec {
    /// Hugging Face `tokenizers` file inside the bundle.
    pub file: String,
    /// Chat-template text before the user's prompt.
    pub prompt_prefix: String,
    /// Chat-template text after the user's prompt.
    pub prompt_suffix: String,
    /// The padding token's text (`<|endoftext|>` for Qwen3).
    pub pad_token: String,
    /// The padding token's id (151643 for Qwen3).
    pub pad_token_id: u32,
    /// Which side padding goes on.
    pub padding_side: PaddingSide,
    /// Every prompt is truncated and padded to exactly this many tokens (512 for klein).
    pub max_sequence_length: usize,
    /// Whether the tokenizer's post-processor adds its special tokens (false for klein).
    pub add_special_tokens: bool,
    /// FLUX.3: the window is the prompt's length rounded up to a multiple of this (80), at most
    /// `max_sequence_length`, not `max_sequence_length` itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pad_multiple: Option<usize>,
}

impl TokenizerSpec {
    /// The window of a prompt of `tokens` tokens (after truncation): `max_sequence_length`, or
    /// with `pad_multiple` the length rounded up to it, at most `max_sequence_length`.
    pub fn window(&self, tokens: usize) -> usize {
        match self.pad_multiple {
            Some(m) if m > 0 => tokens
                .div_ceil(m)
                .saturating_mul(m)
                .min(self.max_sequence_length),
            _ => self.max_sequence_length,
        }
    }

    /// Whether prompt embeddings of `length` tokens are a window of this tokenizer.
    pub fn is_window(&self, length: usize) -> bool {
        match self.pad_multiple {
            Some(m) if m > 0 => {
                length > 0
                    && length <= self.max_sequence_length
                    && (length.is_multiple_of(m) || length == self.max_sequence_length)
            }
            _ => length == self.max_sequence_length,
        }
    }

    /// The windows [`TokenizerSpec::is_window`] accepts, in words.
    pub fn windows(&self) -> String {
        match self.pad_multiple {
            Some(m) if m > 0 => format!("a multiple of {m} up to {}", self.max_sequence_length),
            _ => self.max_sequence_length.to_string(),
        }
    }
}

/// `tokenizer.padding_side`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PaddingSide {
    /// Pads before the prompt.
    Left,
    /// Pads after the prompt (the Qwen3 default).
    Right,
}

/// Token ids of one prompt, exactly its window long ([`TokenizerSpec::window`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    /// `[max_sequence_length]` token ids, padding included.
    pub input_ids: Vec<i64>,
    /// `[max_sequence_length]`: 1 for a real token, 0 for padding.
    pub attention_mask: Vec<i64>,
    /// The templated prompt was longer than `max_sequence_length` and was cut.
    pub truncated: bool,
}

/// The checkpoint's tokenizer with the bundle's template and padding rules.
#[derive(Debug, Clone)]
pub struct PromptTokenizer {
    tokenizer: Tokenizer,
    spec: TokenizerSpec,
}

impl PromptTokenizer {
    /// Loads a Hugging Face `tokenizer.json` and checks it against the manifest: the pad token must
    /// exist with the declared id. Any truncation or padding configured inside the file is switched
    /// off; [`PromptTokenizer::encode`] applies the manifest's.
    pub fn load(path: &Path, spec: &TokenizerSpec) -> Result<Self> {
        let bundle_error = |reason: String| KleinError::Bundle {
            path: path.to_path_buf(),
            reason,
        };
        if !path.is_file() {
            return Err(bundle_error("tokenizer file is missing".to_string()));
        }
        let mut tokenizer = read_tokenizer(path)
            .map_err(|e| bundle_error(format!("not a valid tokenizer.json: {e}")))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| bundle_error(format!("cannot switch off the file's truncation: {e}")))?;
        tokenizer.with_padding(None);

        match tokenizer.token_to_id(&spec.pad_token) {
            Some(id) if id == spec.pad_token_id => {}
            Some(id) => {
                return Err(bundle_error(format!(
                    "pad token `{}` has id {id}, manifest.json says {}",
                    spec.pad_token, spec.pad_token_id
                )))
            }
            None => {
                return Err(bundle_error(format!(
                    "pad token `{}` (manifest.json tokenizer.pad_token) is not in the vocabulary",
                    spec.pad_token
                )))
            }
        }
        if spec.max_sequence_length == 0 {
            return Err(bundle_error(
                "manifest.json tokenizer.max_sequence_length is 0".to_string(),
            ));
        }
        Ok(PromptTokenizer {
            tokenizer,
            spec: spec.clone(),
        })
    }

    /// The manifest entry this tokenizer follows.
    pub fn spec(&self) -> &TokenizerSpec {
        &self.spec
    }

    /// Encodes one prompt: template, tokenise, truncate, pad (see the module docs).
    pub fn encode(&self, prompt: &str) -> Result<Encoded> {
        let spec = &self.spec;
        let text = format!("{}{prompt}{}", spec.prompt_prefix, spec.prompt_suffix);
        let encoding = self
            .tokenizer
            .encode_fast(text.as_str(), spec.add_special_tokens)
            .map_err(|e| KleinError::request(format!("the prompt could not be tokenised: {e}")))?;
        let max_len = spec.max_sequence_length;
        let ids = encoding.get_ids();
        let truncated = ids.len() > max_len;
        let kept = &ids[..ids.len().min(max_len)];
        let pad_len = spec.window(kept.len()) - kept.len();
        let pad_id = i64::from(spec.pad_token_id);

        let tokens = kept.iter().map(|&id| i64::from(id));
        let (input_ids, attention_mask): (Vec<i64>, Vec<i64>) = match spec.padding_side {
            // [kept ; pad]
            PaddingSide::Right => tokens
                .map(|id| (id, 1))
                .chain(std::iter::repeat_n((pad_id, 0), pad_len))
                .unzip(),
            // [pad ; kept]
            PaddingSide::Left => std::iter::repeat_n((pad_id, 0), pad_len)
                .chain(tokens.map(|id| (id, 1)))
                .unzip(),
        };
        Ok(Encoded {
            input_ids,
            attention_mask,
            truncated,
        })
    }

    /// Encodes several prompts; each is [`PromptTokenizer::encode`]d independently (the reference
    /// tokenises prompt by prompt), so all results have the same length.
    pub fn encode_batch<S: AsRef<str>>(&self, prompts: &[S]) -> Result<Vec<Encoded>> {
        prompts.iter().map(|p| self.encode(p.as_ref())).collect()
    }
}

/// A [`PromptTokenizer`] parsed on a thread of its own: reading the Qwen3 `tokenizer.json` takes
/// 0.3-0.6 s, which then overlaps with ONNX Runtime's start and the text encoder's load. Its
/// errors are those of [`PromptTokenizer::load`], returned by [`ParsedTokenizer::get`].
#[derive(Debug)]
pub struct ParsedTokenizer {
    path: PathBuf,
    /// The parse, until [`ParsedTokenizer::get`] waits for it.
    running: Option<JoinHandle<Result<PromptTokenizer>>>,
    /// The tokenizer, or why the file is not one (set when `running` is taken).
    parsed: std::result::Result<PromptTokenizer, String>,
}

impl ParsedTokenizer {
    /// Starts parsing the tokenizer at `path`.
    pub fn start(path: PathBuf, spec: TokenizerSpec) -> Self {
        let file = path.clone();
        let running = std::thread::spawn(move || PromptTokenizer::load(&file, &spec));
        ParsedTokenizer {
            path,
            running: Some(running),
            parsed: Err("not parsed yet".to_string()),
        }
    }

    /// The tokenizer, once its parse has ended; every call after a failure returns it again.
    pub fn get(&mut self) -> Result<&PromptTokenizer> {
        if let Some(running) = self.running.take() {
            self.parsed = match running.join() {
                Ok(Ok(tokenizer)) => Ok(tokenizer),
                Ok(Err(KleinError::Bundle { reason, .. })) => Err(reason),
                Ok(Err(error)) => Err(crate::error::chain(&error)),
                Err(_) => Err("parsing the tokenizer panicked".to_string()),
            };
        }
        self.parsed.as_ref().map_err(|reason| KleinError::Bundle {
            path: self.path.clone(),
            reason: reason.clone(),
        })
    }
}
