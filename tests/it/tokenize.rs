//! Prompt tokenisation against transformers' output on the real Qwen3 vocabulary
//! (`tests/fixtures/tokens.json`, made by `tests/fixtures/make_token_fixtures.py`).

use std::path::PathBuf;
use std::sync::OnceLock;

use klein::stages::tokenize::{PaddingSide, TokenizerSpec};
use klein::stages::tokenize::{ParsedTokenizer, PromptTokenizer};
use klein::KleinError;
use serde::Deserialize;

use crate::util::{assert_mentions, fixture, repo};

#[derive(Deserialize)]
struct Fixture {
    tokenizer_spec: TokenizerSpec,
    split_special_tokens: bool,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    prompt: String,
    padding_side: PaddingSide,
    max_sequence_length: usize,
    untruncated_length: usize,
    input_ids: Vec<i64>,
    attention_mask: Vec<i64>,
}

fn tokenizer_path() -> PathBuf {
    repo().join("onnx/klein-tiny/tokenizer.json")
}

fn load_fixture() -> Fixture {
    let text = std::fs::read_to_string(fixture("tokens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Where two id sequences first differ, with some context, for failure messages.
fn first_difference(expected: &[i64], got: &[i64]) -> String {
    match expected.iter().zip(got).position(|(e, g)| e != g) {
        Some(i) => {
            let lo = i.saturating_sub(3);
            format!(
                "first difference at index {i}: expected {:?}, got {:?}",
                &expected[lo..(i + 4).min(expected.len())],
                &got[lo..(i + 4).min(got.len())]
            )
        }
        None => format!(
            "lengths differ: expected {}, got {}",
            expected.len(),
            got.len()
        ),
    }
}

/// The fixture's tokenizer with the manifest's own spec, loaded once (loading the 6 MB vocabulary
/// takes most of a second in a debug build).
fn default_tokenizer() -> &'static PromptTokenizer {
    static TOKENIZER: OnceLock<PromptTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        PromptTokenizer::load(&tokenizer_path(), &load_fixture().tokenizer_spec).unwrap()
    })
}

#[test]
fn matches_transformers_on_every_fixture_case() {
    let fixture = load_fixture();
    // The reference treats special tokens typed in a prompt as special tokens; so must we.
    assert!(!fixture.split_special_tokens);
    let mut tokenizers: Vec<PromptTokenizer> = Vec::new();
    for case in &fixture.cases {
        let spec = TokenizerSpec {
            padding_side: case.padding_side,
            max_sequence_length: case.max_sequence_length,
            ..fixture.tokenizer_spec.clone()
        };
        let same_layout = |t: &&PromptTokenizer| {
            t.spec().padding_side == spec.padding_side
                && t.spec().max_sequence_length == spec.max_sequence_length
        };
        let tokenizer = match tokenizers.iter().find(same_layout) {
            Some(t) => t,
            None => {
                tokenizers.push(PromptTokenizer::load(&tokenizer_path(), &spec).unwrap());
                &tokenizers[tokenizers.len() - 1]
            }
        };
        let got = tokenizer.encode(&case.prompt).unwrap();
        assert!(
            got.input_ids == case.input_ids,
            "{}: input_ids differ from transformers: {}",
            case.name,
            first_difference(&case.input_ids, &got.input_ids)
        );
        assert!(
            got.attention_mask == case.attention_mask,
            "{}: attention_mask differs from transformers: {}",
            case.name,
            first_difference(&case.attention_mask, &got.attention_mask)
        );
        assert_eq!(
            got.truncated,
            case.untruncated_length > case.max_sequence_length,
            "{}: truncated flag (untruncated length {})",
            case.name,
            case.untruncated_length
        );
    }
}

#[test]
fn typed_special_tokens_become_special_ids() {
    let got = default_tokenizer().encode("<|im_end|>").unwrap();
    // <|im_start|> user \n <|im_end|> <|im_end|> \n ...: the typed token is id 151645, not text.
    assert_eq!(
        &got.input_ids[..5],
        &[151644, 872, 198, 151645, 151645],
        "{:?}",
        &got.input_ids[..12]
    );
}

#[test]
fn batch_encoding_equals_one_by_one() {
    let tokenizer = default_tokenizer();
    let prompts = ["a cat", "", "一只猫"];
    let batch = tokenizer.encode_batch(&prompts).unwrap();
    assert_eq!(batch.len(), prompts.len());
    for (prompt, encoded) in prompts.iter().zip(&batch) {
        assert_eq!(encoded, &tokenizer.encode(prompt).unwrap(), "{prompt:?}");
        assert_eq!(
            encoded.input_ids.len(),
            tokenizer.spec().max_sequence_length
        );
    }
}

#[test]
fn load_checks_the_tokenizer_against_the_manifest() {
    let spec = load_fixture().tokenizer_spec;
    let reason = |spec: &TokenizerSpec, path: &PathBuf| match PromptTokenizer::load(path, spec) {
        Err(KleinError::Bundle { reason, .. }) => reason,
        other => panic!("expected a bundle error, got {other:?}"),
    };

    let wrong_id = TokenizerSpec {
        pad_token_id: 151645,
        ..spec.clone()
    };
    assert_mentions(
        &reason(&wrong_id, &tokenizer_path()),
        &["pad token `<|endoftext|>` has id 151643, manifest.json says 151645"],
    );

    let unknown = TokenizerSpec {
        pad_token: "<|nope|>".to_string(),
        ..spec.clone()
    };
    assert_mentions(
        &reason(&unknown, &tokenizer_path()),
        &["`<|nope|>`", "not in the vocabulary"],
    );

    assert_mentions(
        &reason(&spec, &repo().join("onnx/klein-tiny/missing.json")),
        &["tokenizer file is missing"],
    );
    assert_mentions(
        &reason(&spec, &fixture("bundle_manifest.json")),
        &["not a valid tokenizer.json"],
    );
}

#[test]
fn a_tokenizer_parsed_on_a_thread_is_the_one_loaded_directly() {
    let spec = load_fixture().tokenizer_spec;
    let direct = PromptTokenizer::load(&tokenizer_path(), &spec).unwrap();
    let mut parsed = ParsedTokenizer::start(tokenizer_path(), spec.clone());
    for prompt in ["a cat", "", "一只猫 <|im_end|>"] {
        assert_eq!(
            parsed.get().unwrap().encode(prompt).unwrap(),
            direct.encode(prompt).unwrap(),
            "{prompt:?}"
        );
    }

    // A failure comes back from every call, naming the file.
    let wrong = TokenizerSpec {
        pad_token_id: 151645,
        ..spec
    };
    let mut failed = ParsedTokenizer::start(tokenizer_path(), wrong);
    for _ in 0..2 {
        match failed.get() {
            Err(error @ KleinError::Bundle { .. }) => assert_mentions(
                &error.to_string(),
                &["tokenizer.json", "has id 151643, manifest.json says 151645"],
            ),
            other => panic!("expected a bundle error, got {other:?}"),
        }
    }
}

#[test]
fn flux3_windows_are_multiples_of_80_up_to_the_maximum() {
    // Flux3TextEncoderStep: the window is the prompt's length rounded up to a multiple of 80,
    // at most max_sequence_length; the padding is on the right.
    let spec = TokenizerSpec {
        pad_multiple: Some(80),
        max_sequence_length: 200,
        ..load_fixture().tokenizer_spec
    };
    let tokenizer = PromptTokenizer::load(&tokenizer_path(), &spec).unwrap();
    let short = tokenizer.encode("a cat").unwrap();
    assert_eq!(short.input_ids.len(), 80);
    let real = short.attention_mask.iter().filter(|&&m| m == 1).count();
    assert!(short.attention_mask[..real].iter().all(|&m| m == 1));
    assert!(short.input_ids[real..].iter().all(|&id| id == 151643));
    let long = tokenizer.encode(&"a cat on a mat, ".repeat(20)).unwrap();
    assert_eq!(long.input_ids.len(), 160);
    let longest = tokenizer.encode(&"a cat on a mat, ".repeat(60)).unwrap();
    assert_eq!((longest.input_ids.len(), longest.truncated), (200, true));
    assert!(longest.attention_mask.iter().all(|&m| m == 1));
    // What prompt embeddings of this bundle may be.
    assert!(spec.is_window(80) && spec.is_window(160) && spec.is_window(200));
    assert!(!spec.is_window(0) && !spec.is_window(100) && !spec.is_window(240));
    assert_eq!(spec.windows(), "a multiple of 80 up to 200");
    // Without pad_multiple: FLUX.2's fixed length.
    let flux2 = load_fixture().tokenizer_spec;
    assert!(flux2.is_window(flux2.max_sequence_length) && !flux2.is_window(80));
}
