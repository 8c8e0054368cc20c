//! Static-shape bundles (`klein-export convert --static-shapes 1024x1024,768x1024 [--refs N]`):
//! graphs with fixed input shapes, one set per output size ("bucket"), for CoreML, which compiles
//! a graph for the shapes it is given.
//!
//! The manifest's `static_shapes` lists the buckets. Each has its own transformer and VAE-decoder
//! graph (and VAE-encoder graph when it takes references), all of one component sharing one
//! weights file. Every graph runs batch 1 and the tokenizer's sequence length; each bucket takes
//! exactly `refs` references, each of the output's size. A request that fits no bucket is refused
//! with the sizes that exist.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::component::Component;

/// `static_shapes` in manifest.json.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StaticShapes {
    /// Images per graph call (1: several images run one after the other).
    pub batch: usize,
    /// Prompt tokens (the tokenizer's `max_sequence_length`).
    pub seq: usize,
    /// Reference images per generation, each of the output's size.
    pub refs: usize,
    /// Output sizes, each with its graph files.
    pub buckets: Vec<Bucket>,
}

/// One output size and its graphs.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bucket {
    pub width: u32,
    pub height: u32,
    /// Component name ([`Component::PER_BUCKET`]) to graph file.
    pub files: BTreeMap<String, String>,
}

impl StaticShapes {
    /// Problems of this section against the rest of the manifest (empty: consistent).
    pub(crate) fn problems(
        &self,
        pixel_multiple: u32,
        max_sequence_length: usize,
        max_side: u32,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        if self.batch != 1 {
            problems.push(format!(
                "static_shapes.batch is {}; this runtime runs static graphs of batch 1",
                self.batch
            ));
        }
        if self.seq != max_sequence_length {
            problems.push(format!(
                "static_shapes.seq {} != tokenizer.max_sequence_length {max_sequence_length}",
                self.seq
            ));
        }
        if self.buckets.is_empty() {
            problems.push("static_shapes.buckets is empty".to_string());
        }
        // Component names in sorted order, as the map's keys come.
        let mut wanted: Vec<&str> = Component::PER_BUCKET
            .into_iter()
            .filter(|&c| c != Component::VaeEncoder || self.refs > 0)
            .map(Component::as_str)
            .collect();
        wanted.sort_unstable();
        for (i, bucket) in self.buckets.iter().enumerate() {
            let name = bucket.name();
            for side in [bucket.width, bucket.height] {
                if pixel_multiple == 0 || side % pixel_multiple != 0 || side == 0 || side > max_side
                {
                    problems.push(format!(
                        "static_shapes bucket {name}: sides must be multiples of {pixel_multiple} up to {max_side}"
                    ));
                }
            }
            if self.buckets[..i]
                .iter()
                .any(|b| (b.width, b.height) == (bucket.width, bucket.height))
            {
                problems.push(format!("static_shapes bucket {name} is listed twice"));
            }
            let have: Vec<&str> = bucket.files.keys().map(String::as_str).collect();
            if have != wanted {
                problems.push(format!(
                    "static_shapes bucket {name} has graphs for {have:?}; with {} reference(s) it needs {wanted:?}",
                    self.refs
                ));
            }
        }
        problems
    }

    /// Every bucket graph file, with its component.
    pub fn files(&self) -> impl Iterator<Item = (&str, &String)> {
        self.buckets
            .iter()
            .flat_map(|b| b.files.iter().map(|(c, f)| (c.as_str(), f)))
    }

    /// The sizes, e.g. `1024x1024, 768x1024`.
    pub fn sizes(&self) -> String {
        self.buckets
            .iter()
            .map(Bucket::name)
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// The bucket of an output of `width` x `height`, or why there is none.
    pub fn bucket_for_size(&self, width: u32, height: u32) -> Result<usize, String> {
        self.buckets
            .iter()
            .position(|b| (b.width, b.height) == (width, height))
            .ok_or_else(|| {
                format!(
                    "this bundle has static shapes (for CoreML) and generates only {}, not {width}x{height}; \
                     choose one of those sizes, or use a bundle exported without --static-shapes",
                    self.sizes()
                )
            })
    }

    /// The bucket of a whole request: its output size, and references that (after preprocessing)
    /// must number `refs` and each have the output's size.
    pub fn bucket_for_request(
        &self,
        width: u32,
        height: u32,
        references: &[(u32, u32)],
    ) -> Result<usize, String> {
        let index = self.bucket_for_size(width, height)?;
        if references.len() != self.refs {
            return Err(format!(
                "this bundle has static shapes (for CoreML) for exactly {} reference image(s) per generation, \
                 the request has {}; use a bundle exported with `--refs {}`, or one without --static-shapes",
                self.refs,
                references.len(),
                references.len()
            ));
        }
        if let Some((i, (w, h))) = references
            .iter()
            .enumerate()
            .find(|(_, &size)| size != (width, height))
        {
            return Err(format!(
                "this bundle has static shapes (for CoreML): each reference must have the output's size \
                 {width}x{height} after preprocessing, reference {} is {w}x{h}; resize it, or use a bundle \
                 exported without --static-shapes",
                i + 1
            ));
        }
        Ok(index)
    }
}

impl Bucket {
    /// The graph file of `component` in this bucket (`None`: the component has no bucket graph).
    pub fn file(&self, component: Component) -> Option<&String> {
        self.files.get(component.as_str())
    }

    /// `WIDTHxHEIGHT`.
    pub fn name(&self) -> String {
        format!("{}x{}", self.width, self.height)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(refs: usize, sizes: &[(u32, u32)]) -> StaticShapes {
        let buckets = sizes
            .iter()
            .map(|&(width, height)| {
                let mut files = BTreeMap::new();
                let mut components = vec!["transformer", "vae_decoder"];
                if refs > 0 {
                    components.push("vae_encoder");
                }
                for c in components {
                    files.insert(c.to_string(), format!("{c}.{width}x{height}.onnx"));
                }
                Bucket {
                    width,
                    height,
                    files,
                }
            })
            .collect();
        StaticShapes {
            batch: 1,
            seq: 512,
            refs,
            buckets,
        }
    }

    #[test]
    fn picks_the_bucket_of_the_size() {
        let s = shapes(0, &[(1024, 1024), (768, 1024), (1024, 768)]);
        assert_eq!(s.bucket_for_size(768, 1024), Ok(1));
        assert_eq!(s.bucket_for_request(1024, 768, &[]), Ok(2));
        let e = s.bucket_for_size(512, 512).expect_err("refused");
        assert!(
            e.contains("only 1024x1024, 768x1024, 1024x768, not 512x512"),
            "{e}"
        );
    }

    #[test]
    fn references_must_match_in_number_and_size() {
        let s = shapes(1, &[(64, 64)]);
        assert_eq!(s.bucket_for_request(64, 64, &[(64, 64)]), Ok(0));
        let e = s.bucket_for_request(64, 64, &[]).expect_err("refused");
        assert!(e.contains("exactly 1 reference image(s)"), "{e}");
        let e = s
            .bucket_for_request(64, 64, &[(64, 64), (64, 64)])
            .expect_err("refused");
        assert!(e.contains("`--refs 2`"), "{e}");
        let e = s
            .bucket_for_request(64, 64, &[(80, 48)])
            .expect_err("refused");
        assert!(e.contains("reference 1 is 80x48"), "{e}");
    }

    #[test]
    fn inconsistent_sections_are_reported() {
        assert!(shapes(1, &[(64, 64)]).problems(16, 512, 4096).is_empty());
        let mut s = shapes(0, &[(64, 64), (64, 64), (72, 64)]);
        s.batch = 2;
        s.seq = 77;
        s.buckets[0].files.remove("vae_decoder");
        let problems = s.problems(16, 512, 4096).join("\n");
        for needle in [
            "batch is 2",
            "seq 77 != tokenizer.max_sequence_length 512",
            "bucket 64x64 is listed twice",
            "bucket 72x64: sides must be multiples of 16",
            "bucket 64x64 has graphs for [\"transformer\"]",
        ] {
            assert!(problems.contains(needle), "{needle}: {problems}");
        }
        assert!(shapes(0, &[]).problems(16, 512, 4096)[0].contains("empty"));
    }
}
