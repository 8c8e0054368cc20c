//! Request fields shared by every route, checked here so that each error names its field: sizes,
//! counts, seeds, output formats, LoRA names (resolved in `--lora-dir`, never a client's path).
use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use klein::limits::{MAX_IMAGE_TOKENS, MAX_SIDE};
use klein::pipeline::lora::inspect;
use klein::pipeline::{LoraSpec, Pipeline};
use klein::stages::output::ImageFormat;
use serde::de::{Deserialize, Deserializer, Error as _, SeqAccess, Visitor};

use super::error::ApiError;

/// A JSON array of at most `MAX` items, or `null` for none (`#[serde(deserialize_with =
/// "at_most::<_, _, 16>")]`), refused at the item past it: a client's array of millions is not built, on the HTTP threads,
/// before its length is checked.
pub(crate) fn at_most<'de, D, T, const MAX: usize>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Bounded<T, const MAX: usize>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Bounded<T, MAX> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "an array of at most {MAX} items")
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut items = Vec::new();
            while let Some(item) = seq.next_element()? {
                if items.len() == MAX {
                    return Err(A::Error::custom(format!(
                        "more than {MAX} items: at most {MAX} are taken"
                    )));
                }
                items.push(item);
            }
            Ok(items)
        }
    }
    /// `null` is no items, as an absent field (`Option<Vec<_>>` took it so).
    struct Nullable<T, const MAX: usize>(PhantomData<T>);
    impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for Nullable<T, MAX> {
        type Value = Vec<T>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            write!(f, "an array of at most {MAX} items, or null")
        }
        fn visit_none<E: serde::de::Error>(self) -> Result<Vec<T>, E> {
            Ok(Vec::new())
        }
        fn visit_unit<E: serde::de::Error>(self) -> Result<Vec<T>, E> {
            Ok(Vec::new())
        }
        fn visit_some<D: Deserializer<'de>>(self, inner: D) -> Result<Vec<T>, D::Error> {
            inner.deserialize_seq(Bounded::<T, MAX>(PhantomData))
        }
    }
    deserializer.deserialize_option(Nullable::<T, MAX>(PhantomData))
}

/// `size`: `WxH` or `auto` (the first reference's size, else the bundle's default).
pub(crate) fn parse_size(size: Option<&str>) -> Result<(Option<u32>, Option<u32>), ApiError> {
    let Some(text) = size
        .map(str::trim)
        .filter(|s| !s.eq_ignore_ascii_case("auto"))
    else {
        return Ok((None, None));
    };
    let bad = || {
        ApiError::field(
            "size",
            format!(
                "size `{text}`: give WIDTHxHEIGHT (16 to {MAX_SIDE} each and at most \
                 {MAX_IMAGE_TOKENS} tokens of 16x16 pixels, such as 1024x1024; up to 2288x2288) \
                 or auto"
            ),
        )
    };
    let (w, h) = text.split_once(['x', 'X']).ok_or_else(bad)?;
    let (w, h): (u32, u32) = (w.parse().map_err(|_| bad())?, h.parse().map_err(|_| bad())?);
    // Their bounds are the library's (RequestSpec::check), about `size`.
    Ok((Some(w), Some(h)))
}

/// A JSON whole number as a count (saturated: any count past `usize` is out of bounds anyway).
pub(crate) fn whole(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `response_format`: only `b64_json` (klein serve keeps no files to link to).
pub(crate) fn check_response_format(format: Option<&str>) -> Result<(), ApiError> {
    match format {
        None | Some("b64_json") => Ok(()),
        Some(other) => Err(ApiError::field(
            "response_format",
            if other == "url" {
                "response_format `url` is not supported: klein serve stores no images to link to; use b64_json".to_string()
            } else {
                format!(
                    "response_format `{}`: give b64_json",
                    other.chars().take(40).collect::<String>()
                )
            },
        )),
    }
}

/// The fields that name the output format and its JPEG quality, and the lowest quality each
/// takes: OpenAI's `output_compression` runs 0 to 100 (0 is written at quality 1), klein's own
/// `quality` 1 to 100.
#[derive(Debug, Clone, Copy)]
pub(crate) struct FormatFields {
    format: &'static str,
    quality: &'static str,
    lowest: u64,
}

pub(crate) const OPENAI_FORMAT_FIELDS: FormatFields = FormatFields {
    format: "output_format",
    quality: "output_compression",
    lowest: 0,
};
pub(crate) const NATIVE_FORMAT_FIELDS: FormatFields = FormatFields {
    format: "format",
    quality: "quality",
    lowest: 1,
};

/// The output format (`png`, `jpeg`, `webp`) and the JPEG quality (1-100; default 90, as
/// `klein generate --quality`), from the fields `fields` names.
pub(crate) fn image_format(
    format: Option<&str>,
    compression: Option<u64>,
    fields: FormatFields,
) -> Result<ImageFormat, ApiError> {
    let FormatFields {
        format: format_field,
        quality: quality_field,
        lowest,
    } = fields;
    let quality = match compression {
        None => 90,
        Some(q) if (lowest..=100).contains(&q) => q.max(1) as u8,
        Some(q) => {
            return Err(ApiError::field(
                quality_field,
                format!("{quality_field} {q}: give a JPEG quality of {lowest} to 100"),
            ))
        }
    };
    match format.map(str::to_ascii_lowercase).as_deref() {
        None | Some("png") => Ok(ImageFormat::Png),
        Some("jpeg" | "jpg") => Ok(ImageFormat::Jpeg { quality }),
        Some("webp") => Ok(ImageFormat::WebP),
        Some(other) => Err(ApiError::field(
            format_field,
            format!("{format_field} `{other}`: give png, jpeg or webp"),
        )),
    }
}

/// The MIME type of a format, for the native route's answer.
pub(crate) fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "png",
        ImageFormat::Jpeg { .. } => "jpeg",
        ImageFormat::WebP => "webp",
    }
}

/// The LoRAs a server offers: the `.safetensors` files of `--lora-dir`, by file stem, listed
/// when the server starts. A client names one (`"style"` or `"style:0.8"`); a name that is not
/// in the list is refused, whatever it contains, so no client-made path is ever opened.
#[derive(Debug, Default)]
pub(crate) struct LoraCatalog {
    files: BTreeMap<String, PathBuf>,
}

impl LoraCatalog {
    pub(crate) fn scan(dir: Option<&Path>) -> anyhow::Result<LoraCatalog> {
        let Some(dir) = dir else {
            return Ok(LoraCatalog::default());
        };
        let entries = std::fs::read_dir(dir).map_err(|e| {
            crate::UsageError(format!(
                "--lora-dir {}: {e}; give a directory of .safetensors files",
                dir.display()
            ))
        })?;
        let mut files = BTreeMap::new();
        for entry in entries.flatten() {
            let path = entry.path();
            let is_lora = path
                .extension()
                .is_some_and(|e| e.eq_ignore_ascii_case("safetensors"));
            if let (true, Some(stem)) = (is_lora && path.is_file(), path.file_stem()) {
                files.insert(stem.to_string_lossy().into_owned(), path);
            }
        }
        Ok(LoraCatalog { files })
    }

    pub(crate) fn names(&self) -> impl Iterator<Item = &str> {
        self.files.keys().map(String::as_str)
    }

    /// `NAME` or `NAME:SCALE`.
    pub(crate) fn resolve(&self, text: &str) -> Result<LoraSpec, ApiError> {
        let (name, scale) = match text.rsplit_once(':') {
            Some((name, scale)) => {
                let scale: f32 = scale.parse().map_err(|_| {
                    ApiError::field(
                        "loras",
                        format!("LoRA `{text}`: the scale after `:` is not a number"),
                    )
                })?;
                (name, scale)
            }
            None => (text, 1.0),
        };
        let path = self.files.get(name).ok_or_else(|| {
            let offered: Vec<&str> = self.names().collect();
            ApiError::field(
                "loras",
                if offered.is_empty() {
                    format!("LoRA `{name}`: this server offers no LoRAs (it was started without --lora-dir)")
                } else {
                    format!("LoRA `{name}` is not offered; this server has: {}", offered.join(", "))
                },
            )
        })?;
        // Checked under its name: a message never shows the server's path.
        LoraSpec::new(name, scale)
            .check()
            .map_err(|e| ApiError::from_klein(&e, Some("loras")))?;
        Ok(LoraSpec::new(path, scale))
    }

    /// Reads every LoRA and checks it against `pipeline`'s bundle, as a request would apply it:
    /// a file that is broken or does not fit the model stops the server from starting, rather
    /// than being offered and failing every request that names it.
    pub(crate) fn check_against(&self, pipeline: &Pipeline) -> anyhow::Result<()> {
        for (name, path) in &self.files {
            let spec = LoraSpec::new(path, 1.0);
            inspect(&[spec], pipeline.manifest(), pipeline.bundle_dir()).map_err(|e| {
                crate::UsageError(format!(
                    "--lora-dir: LoRA `{name}` cannot be offered: {}; remove it or fix it",
                    klein::error::chain(&e)
                ))
            })?;
        }
        Ok(())
    }

    pub(crate) fn resolve_all(&self, names: &[String]) -> Result<Vec<LoraSpec>, ApiError> {
        let specs = names
            .iter()
            .map(|n| self.resolve(n))
            .collect::<Result<Vec<_>, _>>()?;
        klein::pipeline::lora::check_specs(&specs)
            .map_err(|e| ApiError::from_klein(&e, Some("loras")))?;
        Ok(specs)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size(Some("512x768")).unwrap(), (Some(512), Some(768)));
        assert_eq!(parse_size(Some("auto")).unwrap(), (None, None));
        assert_eq!(parse_size(None).unwrap(), (None, None));
        for bad in ["512", "x", "-1x5", "1e3x512"] {
            let e = parse_size(Some(bad)).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("size"), "{bad}");
        }
        // Sides out of bounds are the library's to refuse (RequestSpec::check), about `size`.
        for bad in ["0x512", "512x99999", "4096x4096"] {
            let (width, height) = parse_size(Some(bad)).unwrap();
            let mut request = klein::pipeline::RequestSpec::new("x");
            (request.width, request.height) = (width, height);
            let spec = super::super::jobs::JobSpec::new(
                request,
                ("n", "image"),
                Some("size"),
                ImageFormat::Png,
            );
            let e = spec.api_error(spec.request.check().unwrap_err());
            assert_eq!(e.param.as_deref(), Some("size"), "{bad}");
        }
    }

    #[test]
    fn arrays_are_refused_past_their_bound() {
        #[derive(Debug, serde::Deserialize)]
        struct Body {
            #[serde(default, deserialize_with = "at_most::<_, _, 2>")]
            names: Vec<String>,
        }
        let parse = |json: &str| serde_json::from_str::<Body>(json).map(|b| b.names);
        assert_eq!(parse(r#"{"names": ["a", "b"]}"#).unwrap(), ["a", "b"]);
        assert!(parse("{}").unwrap().is_empty());
        assert!(parse(r#"{"names": null}"#).unwrap().is_empty());
        // Refused at the third item: what follows it is never read (here, not even valid JSON).
        let error = parse(r#"{"names": ["a", "b", "c", oops"#).unwrap_err();
        assert!(error.to_string().contains("more than 2 items"), "{error}");
        assert!(parse(r#"{"names": "a"}"#).is_err());
    }

    #[test]
    fn formats() {
        assert_eq!(
            image_format(Some("JPEG"), Some(70), OPENAI_FORMAT_FIELDS).unwrap(),
            ImageFormat::Jpeg { quality: 70 }
        );
        assert_eq!(
            image_format(None, None, OPENAI_FORMAT_FIELDS).unwrap(),
            ImageFormat::Png
        );
        assert_eq!(
            image_format(Some("gif"), None, NATIVE_FORMAT_FIELDS)
                .unwrap_err()
                .param
                .as_deref(),
            Some("format")
        );
        // OpenAI's range is 0 to 100, klein's own 1 to 100.
        assert_eq!(
            image_format(Some("jpeg"), Some(0), OPENAI_FORMAT_FIELDS).unwrap(),
            ImageFormat::Jpeg { quality: 1 }
        );
        assert_eq!(
            image_format(Some("webp"), Some(0), OPENAI_FORMAT_FIELDS).unwrap(),
            ImageFormat::WebP
        );
        for (fields, field) in [
            (OPENAI_FORMAT_FIELDS, "output_compression"),
            (NATIVE_FORMAT_FIELDS, "quality"),
        ] {
            let bad = [101].iter().chain((fields.lowest == 1).then_some(&0));
            for &q in bad {
                let error = image_format(None, Some(q), fields).unwrap_err();
                assert_eq!(error.param.as_deref(), Some(field), "{q}");
            }
        }
        assert!(check_response_format(Some("url")).is_err());
    }

    #[test]
    fn lora_names_never_become_paths() {
        let dir = std::env::temp_dir().join(format!("klein-serve-loras-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("style.safetensors"), b"x").unwrap();
        std::fs::write(dir.join("notes.txt"), b"x").unwrap();
        let catalog = LoraCatalog::scan(Some(&dir)).unwrap();
        assert_eq!(catalog.names().collect::<Vec<_>>(), ["style"]);
        let spec = catalog.resolve("style:0.5").unwrap();
        assert_eq!(
            (spec.path(), spec.scale()),
            (dir.join("style.safetensors").as_path(), 0.5)
        );
        for bad in [
            "../style",
            "/etc/passwd",
            "notes",
            "style.safetensors",
            "style:x",
            "style:500",
        ] {
            assert_eq!(
                catalog.resolve(bad).unwrap_err().param.as_deref(),
                Some("loras"),
                "{bad}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
