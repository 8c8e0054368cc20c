//! Reading a Hugging Face `tokenizer.json`: a BPE tokenizer in half the time of
//! `Tokenizer::from_file`, anything else by `from_file` itself.
//!
//! `from_file` reads the whole model through serde's untagged buffering: the 151,936-entry Qwen3
//! vocabulary is copied into a generic JSON map, cloned, and only then into the BPE's own
//! (0.29-0.33 s here, the larger part of the time before the first prompt can be encoded). For a
//! file whose model is `"type": "BPE"` and whose every field is one this reader knows, it parses
//! the vocabulary and merges straight into the BPE builder's types and builds the tokenizer the way
//! `from_file` does (the tokenizer crate's `serialization.rs`): the model, then the normalizer,
//! pre-tokenizer, post-processor and decoder as the crate deserializes them, then the added tokens
//! through `add_tokens`, each of which must keep the id the file gives it (0.15-0.16 s). Any other
//! file (another model type, merges written as `"a b"` strings, a field this reader does not
//! know, an added token whose id would move) is read by `from_file`, so the result never differs
//! from the crate's own reading. The file's truncation and padding are not read:
//! [`super::tokenize::PromptTokenizer::load`] switches both off.

use std::path::Path;

use serde::de::IgnoredAny;
use serde::Deserialize;
use tokenizers::models::bpe::{BpeBuilder, Merges, Vocab, BPE};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    Tokenizer,
};

/// Reads the tokenizer at `path` (see the module docs); the error is `from_file`'s, as text.
pub(crate) fn read_tokenizer(path: &Path) -> Result<Tokenizer, String> {
    match std::fs::read(path).ok().and_then(|bytes| read_bpe(&bytes)) {
        Some(tokenizer) => Ok(tokenizer),
        None => Tokenizer::from_file(path).map_err(|e| e.to_string()),
    }
}

/// The top level of `tokenizer.json`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenizerFile {
    version: Option<String>,
    #[serde(rename = "truncation")]
    _truncation: Option<IgnoredAny>,
    #[serde(rename = "padding")]
    _padding: Option<IgnoredAny>,
    #[serde(default)]
    added_tokens: Vec<AddedTokenEntry>,
    normalizer: Option<NormalizerWrapper>,
    pre_tokenizer: Option<PreTokenizerWrapper>,
    post_processor: Option<PostProcessorWrapper>,
    decoder: Option<DecoderWrapper>,
    model: BpeModel,
}

/// One `added_tokens` entry: the token and the id the file gives it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AddedTokenEntry {
    id: u32,
    content: String,
    single_word: bool,
    lstrip: bool,
    rstrip: bool,
    normalized: bool,
    special: bool,
}

/// `model` of a BPE tokenizer, merges as pairs (the format `tokenizers` writes since 0.20).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct BpeModel {
    #[serde(rename = "type")]
    kind: String,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
    vocab: Vocab,
    merges: Merges,
}

/// The tokenizer of a BPE `tokenizer.json`, or `None` for any file this reader leaves to
/// `from_file`.
fn read_bpe(bytes: &[u8]) -> Option<Tokenizer> {
    let file: TokenizerFile = serde_json::from_slice(bytes).ok()?;
    let model = file.model;
    if file.version.is_some_and(|v| v != "1.0") || model.kind != "BPE" {
        return None;
    }
    // A missing or null option keeps the builder's default.
    fn set<T>(
        builder: BpeBuilder,
        value: Option<T>,
        with: fn(BpeBuilder, T) -> BpeBuilder,
    ) -> BpeBuilder {
        match value {
            Some(value) => with(builder, value),
            None => builder,
        }
    }
    let builder = BPE::builder().vocab_and_merges(model.vocab, model.merges);
    let builder = set(builder, model.fuse_unk, BpeBuilder::fuse_unk);
    let builder = set(builder, model.byte_fallback, BpeBuilder::byte_fallback);
    let builder = set(builder, model.ignore_merges, BpeBuilder::ignore_merges);
    let builder = set(builder, model.dropout, BpeBuilder::dropout);
    let builder = set(builder, model.unk_token, BpeBuilder::unk_token);
    let builder = set(
        builder,
        model.continuing_subword_prefix,
        BpeBuilder::continuing_subword_prefix,
    );
    let builder = set(
        builder,
        model.end_of_word_suffix,
        BpeBuilder::end_of_word_suffix,
    );
    let mut tokenizer = Tokenizer::new(builder.build().ok()?);
    tokenizer
        .with_normalizer(file.normalizer)
        .with_pre_tokenizer(file.pre_tokenizer)
        .with_post_processor(file.post_processor)
        .with_decoder(file.decoder);
    let (ids, tokens): (Vec<u32>, Vec<AddedToken>) = file
        .added_tokens
        .into_iter()
        .map(|entry| {
            let token = AddedToken {
                content: entry.content,
                single_word: entry.single_word,
                lstrip: entry.lstrip,
                rstrip: entry.rstrip,
                normalized: entry.normalized,
                special: entry.special,
            };
            (entry.id, token)
        })
        .unzip();
    tokenizer.add_tokens(&tokens);
    let ids_kept = (tokens.iter().zip(ids))
        .all(|(token, id)| tokenizer.token_to_id(&token.content) == Some(id));
    ids_kept.then_some(tokenizer)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn bundled() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/klein-tiny/tokenizer.json")
    }

    /// Texts that reach every part of the Qwen3 tokenizer: the chat template's special tokens,
    /// special tokens typed in a prompt, Unicode that NFC changes, other scripts, emoji, digits,
    /// contractions, runs of whitespace and newlines, the empty text.
    const TEXTS: [&str; 7] = [
        "<|im_start|>user\na red fox in the snow<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
        "Cafe\u{301} ü Ü 中文字符 日本語 한국어 🦊🎄 <|endoftext|><|im_end|>x<think>",
        "12345 3.14159 '$1,000' they're we've I'LL 's",
        "  leading  spaces\t\ttabs\r\n\r\nline\n   ",
        "a<|im_start|>b <|im_end|> c",
        "",
        "\u{0}\u{7f}\u{200b}\u{feff}",
    ];

    fn assert_same(a: &Tokenizer, b: &Tokenizer) {
        assert_eq!(a.get_vocab(true), b.get_vocab(true));
        assert_eq!(
            a.get_added_vocabulary().get_vocab(),
            b.get_added_vocabulary().get_vocab()
        );
        for text in TEXTS {
            let (x, y) = (
                a.encode(text, false).unwrap(),
                b.encode(text, false).unwrap(),
            );
            assert_eq!(
                (x.get_ids(), x.get_offsets()),
                (y.get_ids(), y.get_offsets()),
                "{text:?}"
            );
            let (x, y) = (a.encode(text, true).unwrap(), b.encode(text, true).unwrap());
            assert_eq!(x.get_ids(), y.get_ids(), "{text:?}");
            let decoded = (a.decode(x.get_ids(), false), b.decode(y.get_ids(), false));
            assert_eq!(decoded.0.unwrap(), decoded.1.unwrap(), "{text:?}");
        }
    }

    #[test]
    fn the_bundled_tokenizer_is_read_directly_and_equals_from_file() {
        let bytes = std::fs::read(bundled()).unwrap();
        let direct = read_bpe(&bytes).expect("the Qwen3 tokenizer.json takes the direct path");
        assert_same(&direct, &Tokenizer::from_file(bundled()).unwrap());
    }

    /// Rewrites the bundled file with `edit` into a temporary file, returns its path.
    fn edited(name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(bundled()).unwrap()).unwrap();
        edit(&mut json);
        let path = std::env::temp_dir().join(format!("klein-{}-{name}.json", std::process::id()));
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        path
    }

    /// A change to a `tokenizer.json`'s JSON.
    type Edit = dyn FnOnce(&mut serde_json::Value);

    #[test]
    fn files_the_reader_does_not_know_are_read_by_from_file() {
        let cases: [(&str, Box<Edit>); 3] = [
            // merges as "a b" strings, the format before tokenizers 0.20
            (
                "legacy-merges",
                Box::new(|j| {
                    let merges = j["model"]["merges"].as_array().unwrap();
                    let strings = merges
                        .iter()
                        .map(|pair| {
                            let (a, b) = (pair[0].as_str().unwrap(), pair[1].as_str().unwrap());
                            serde_json::Value::String(format!("{a} {b}"))
                        })
                        .collect();
                    j["model"]["merges"] = serde_json::Value::Array(strings);
                }),
            ),
            (
                "unknown-field",
                Box::new(|j| j["model"]["new_option"] = true.into()),
            ),
            // an added token whose file id is not the one it gets
            (
                "moved-id",
                Box::new(|j| j["added_tokens"][0]["id"] = 151_999.into()),
            ),
        ];
        for (name, edit) in cases {
            let path = edited(name, edit);
            let bytes = std::fs::read(&path).unwrap();
            assert!(read_bpe(&bytes).is_none(), "{name}: left to from_file");
            let read = read_tokenizer(&path).unwrap();
            assert_same(&read, &Tokenizer::from_file(&path).unwrap());
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn an_unreadable_file_gives_from_file_s_error() {
        let path = edited("broken", |j| *j = serde_json::Value::String("no".into()));
        let error = read_tokenizer(&path).unwrap_err();
        assert_eq!(error, Tokenizer::from_file(&path).unwrap_err().to_string());
        std::fs::remove_file(&path).unwrap();
    }
}
