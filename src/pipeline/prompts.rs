//! Prompt embeddings, and [`PromptMemo`]: those a batch uses again, kept in memory (the disk
//! cache across processes is [`super::prompt_cache`]).
use std::collections::{HashMap, HashSet};

use ndarray::Array3;

use crate::error::Result;

/// Prompt embeddings `[1, L, D]` and whether the prompt was truncated to the maximum length.
#[derive(Debug, Clone)]
pub struct PromptEmbeds {
    pub embeds: Array3<f32>,
    pub truncated: bool,
}

/// Prompt embeddings kept while later lines still need them.
#[derive(Debug, Default)]
pub struct PromptMemo {
    /// Uses still to come, per prompt.
    remaining: HashMap<String, usize>,
    kept: HashMap<String, PromptEmbeds>,
}

impl PromptMemo {
    /// A memo for lines that will use `prompts`, in any order (one entry per use).
    pub fn new<'a>(prompts: impl IntoIterator<Item = &'a str>) -> PromptMemo {
        let mut remaining = HashMap::new();
        for prompt in prompts {
            *remaining.entry(prompt.to_string()).or_insert(0) += 1;
        }
        PromptMemo {
            remaining,
            kept: HashMap::new(),
        }
    }

    /// Embeddings for the next use of `prompt`: the kept ones, or `encode(prompt)` when a later use
    /// will need them too. `None` for a prompt used once (the pipeline encodes it as usual).
    /// Kept embeddings are dropped at their last use.
    pub fn take(
        &mut self,
        prompt: &str,
        encode: impl FnOnce(&str) -> Result<PromptEmbeds>,
    ) -> Result<Option<PromptEmbeds>> {
        let left = self.use_one(prompt);
        if left == 0 {
            return Ok(self.kept.remove(prompt));
        }
        if let Some(kept) = self.kept.get(prompt) {
            return Ok(Some(kept.clone()));
        }
        let embeds = encode(prompt)?;
        self.kept.insert(prompt.to_string(), embeds.clone());
        Ok(Some(embeds))
    }

    /// A use of `prompt` that will not happen (its line failed before generating).
    pub fn forget(&mut self, prompt: &str) {
        if self.use_one(prompt) == 0 {
            self.kept.remove(prompt);
        }
    }

    /// Prompts whose embeddings are kept now.
    pub fn kept(&self) -> HashSet<&str> {
        self.kept.keys().map(String::as_str).collect()
    }

    /// Counts one use of `prompt`; returns the uses left after it.
    fn use_one(&mut self, prompt: &str) -> usize {
        match self.remaining.get_mut(prompt) {
            Some(count) => {
                *count = count.saturating_sub(1);
                let left = *count;
                if left == 0 {
                    self.remaining.remove(prompt);
                }
                left
            }
            None => 0,
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    fn embeds(value: f32) -> PromptEmbeds {
        PromptEmbeds {
            embeds: Array3::from_elem((1, 2, 3), value),
            truncated: false,
        }
    }

    /// A prompt used three times is encoded once, kept in between, and dropped at its last use; a
    /// prompt used once is left to the pipeline.
    #[test]
    fn memo_encodes_repeated_prompts_once() {
        let mut memo = PromptMemo::new(["a", "b", "a", "a"]);
        let mut encoded = Vec::new();
        let mut encode = |p: &str| {
            encoded.push(p.to_string());
            Ok(embeds(encoded.len() as f32))
        };
        assert!(memo.take("a", &mut encode).unwrap().is_some());
        assert_eq!(
            memo.take("b", &mut encode).unwrap().map(|e| e.truncated),
            None
        );
        assert!(memo.take("a", &mut encode).unwrap().is_some());
        assert_eq!(memo.kept(), HashSet::from(["a"]));
        let last = memo.take("a", &mut encode).unwrap().unwrap();
        assert_eq!(last.embeds[[0, 0, 0]], 1.0, "the kept embeddings");
        assert!(memo.kept().is_empty(), "dropped after the last use");
        assert_eq!(encoded, ["a"]);
    }

    #[test]
    fn forgotten_uses_release_kept_embeddings() {
        let mut memo = PromptMemo::new(["a", "a"]);
        memo.take("a", |_| Ok(embeds(1.0))).unwrap();
        memo.forget("a");
        assert!(memo.kept().is_empty());
    }
}
