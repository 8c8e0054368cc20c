//! The request fields the HTTP front ends share (`klein serve` and, through the Python
//! bindings, the Ray Serve deployment): JSON bodies whose errors name their field, sizes,
//! counts, output formats, and the job a request becomes ([`Job`]: the library's
//! [`RequestSpec`] and the fields its values came in). The OpenAI images API is [`openai`], its
//! model routes [`models`].
use std::fmt;
use std::marker::PhantomData;

use serde::de::{Deserialize, DeserializeOwned, Deserializer, Error as _, SeqAccess, Visitor};

use crate::limits::{MAX_IMAGE_TOKENS, MAX_SIDE};
use crate::pipeline::{Generation, ImageInput, Input, Pipeline, RequestSpec, Rule, SpecError};
use crate::stages::output::{encode_image, ImageFormat};

pub mod models;
pub mod openai;

/// A finished job: the encoded images and what they were made with ([`Job::output`]).
#[derive(Debug, Clone)]
pub struct Output {
    pub images: Vec<Vec<u8>>,
    pub seed: u64,
    pub width: u32,
    pub height: u32,
    pub steps: usize,
    pub guidance: f64,
    pub prompt_truncated: bool,
    /// The text stored in the images (PNG text chunks, the JPEG comment).
    pub metadata: Vec<(String, String)>,
    /// Seconds per stage, in the order they ran.
    pub timings: Vec<(&'static str, f64)>,
    /// What the request asked for that changed nothing, or a problem that did not stop it.
    pub warnings: Vec<String>,
}

/// A request the API refuses (HTTP 400): the message, and the request field at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct FieldError {
    pub message: String,
    pub param: Option<String>,
}

impl FieldError {
    /// A bad value of the field `param`.
    pub fn new(param: &str, message: impl Into<String>) -> Self {
        FieldError {
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    /// A body that is wrong as a whole.
    pub fn body(message: impl Into<String>) -> Self {
        FieldError {
            message: message.into(),
            param: None,
        }
    }
}

/// An uploaded image: its name (the upload's file name, or `image-N`), its bytes, and the
/// request field it came in (`refs[0]`, `image`, `mask`), which errors about it name.
#[derive(Debug, Clone)]
pub struct Upload {
    pub label: String,
    pub bytes: Vec<u8>,
    pub field: String,
}

/// One generation: the library's spec, and the request fields its values came in, so that an
/// error names the client's field.
#[derive(Debug, Clone)]
pub struct Job {
    pub request: RequestSpec,
    /// The field of each reference (`refs[0]`, `image`), in order.
    pub reference_fields: Vec<String>,
    /// The field that sets `width` and `height`: `size` (OpenAI), or `None` where each is its own.
    pub size_field: Option<&'static str>,
    /// The field of the image count (`n`, `num_images`) and of the references (`image`, `refs`).
    pub count_field: &'static str,
    pub references_field: &'static str,
    pub format: ImageFormat,
}

impl Job {
    pub fn new(
        request: RequestSpec,
        (count_field, references_field): (&'static str, &'static str),
        size_field: Option<&'static str>,
        format: ImageFormat,
    ) -> Self {
        Job {
            request,
            reference_fields: Vec::new(),
            size_field,
            count_field,
            references_field,
            format,
        }
    }

    /// A reference image, after those added so far.
    pub fn add_reference(&mut self, upload: Upload) {
        self.reference_fields.push(upload.field);
        (self.request.references).push(ImageInput::encoded(upload.bytes, upload.label));
    }

    /// The request's field an error of the library is about ([`crate::KleinError::param`],
    /// [`SpecError::input`]).
    pub fn field_of(&self, error: &SpecError) -> Option<String> {
        match error.input {
            Some(Input::Reference(i)) => self.reference_fields.get(i).cloned(),
            Some(Input::Source) => Some("image".into()),
            Some(Input::Mask) => Some("mask".into()),
            None => match error.error.param()? {
                named @ ("width" | "height") => Some(self.size_field.unwrap_or(named).into()),
                "num_images" => Some(self.count_field.into()),
                "references" => Some(self.references_field.into()),
                other => Some(other.into()),
            },
        }
    }

    /// The answer of `generation`, which `pipeline` made of this job: the images encoded in the
    /// job's format with their text (the pipeline's, and the source and mask's names), and the
    /// pipeline's warnings. `lora_names`: the LoRAs as clients named them, stored in place of
    /// their paths.
    pub fn output(
        &self,
        pipeline: &mut Pipeline,
        generation: &Generation,
        bundle_hash: &str,
        lora_names: Option<Vec<String>>,
    ) -> crate::Result<Output> {
        let label = |image: &ImageInput| image.label().to_string_lossy().into_owned();
        let labels: Vec<String> = self.request.references.iter().map(label).collect();
        let mut metadata =
            pipeline.image_metadata(generation, &self.request.prompt, &labels, bundle_hash);
        if let Some(names) = lora_names {
            if let Some((_, value)) = metadata.iter_mut().find(|(key, _)| key == "loras") {
                *value = serde_json::Value::from(names).to_string();
            }
        }
        for (key, image) in [
            ("image", &self.request.source),
            ("mask_image", &self.request.mask),
        ] {
            if let Some(image) = image {
                metadata.push((key.into(), label(image)));
            }
        }
        let mut warnings = pipeline.take_warnings();
        if generation.prompt_truncated {
            warnings.push(format!(
                "the prompt is longer than {} tokens and was truncated, as the reference pipeline does",
                pipeline.manifest().tokenizer.max_sequence_length
            ));
        }
        let images = generation
            .images
            .iter()
            .map(|image| encode_image(image, self.format, &metadata))
            .collect::<crate::Result<Vec<_>>>()?;
        Ok(Output {
            images,
            seed: generation.seed,
            width: generation.width,
            height: generation.height,
            steps: generation.steps,
            guidance: generation.guidance,
            prompt_truncated: generation.prompt_truncated,
            metadata,
            timings: generation
                .timings
                .iter()
                .map(|(stage, d)| (stage.label(), d.as_secs_f64()))
                .collect(),
            warnings,
        })
    }

    /// Checks every number, rule and image header of the request ([`RequestSpec::check`]).
    pub fn check(&self) -> Result<(), FieldError> {
        self.request.check().map_err(|error| {
            let (param, message) = self.error_of(&error);
            FieldError {
                message: message.map_or_else(|| crate::error::chain(&error.error), str::to_string),
                param,
            }
        })
    }

    /// A library error's field ([`Job::field_of`]), and its message as the API words it (the
    /// rules in the fields' names).
    pub fn error_of(&self, error: &SpecError) -> (Option<String>, Option<&'static str>) {
        match error.rule {
            Some(Rule::NeedsSource) => (
                Some("image".into()),
                Some("mask, strength and padding_mask_crop need a source image (the image field)"),
            ),
            _ => (self.field_of(error), None),
        }
    }
}

/// A JSON array of at most `MAX` items, or `null` for none (`#[serde(deserialize_with =
/// "at_most::<_, _, 16>")]`), refused at the item past it: a client's array of millions is not built, on the HTTP threads,
/// before its length is checked.
pub fn at_most<'de, D, T, const MAX: usize>(deserializer: D) -> Result<Vec<T>, D::Error>
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
pub fn parse_size(size: Option<&str>) -> Result<(Option<u32>, Option<u32>), FieldError> {
    let Some(text) = size
        .map(str::trim)
        .filter(|s| !s.eq_ignore_ascii_case("auto"))
    else {
        return Ok((None, None));
    };
    let bad = || {
        FieldError::new(
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
pub fn whole(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// `response_format`: only `b64_json` (klein serve keeps no files to link to).
pub fn check_response_format(format: Option<&str>) -> Result<(), FieldError> {
    match format {
        None | Some("b64_json") => Ok(()),
        Some(other) => Err(FieldError::new(
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
pub struct FormatFields {
    pub format: &'static str,
    pub quality: &'static str,
    pub lowest: u64,
}

pub const OPENAI_FORMAT_FIELDS: FormatFields = FormatFields {
    format: "output_format",
    quality: "output_compression",
    lowest: 0,
};
pub const NATIVE_FORMAT_FIELDS: FormatFields = FormatFields {
    format: "format",
    quality: "quality",
    lowest: 1,
};

/// The output format (`png`, `jpeg`, `webp`) and the JPEG quality (1-100; default 90, as
/// `klein generate --quality`), from the fields `fields` names.
pub fn image_format(
    format: Option<&str>,
    compression: Option<u64>,
    fields: FormatFields,
) -> Result<ImageFormat, FieldError> {
    let FormatFields {
        format: format_field,
        quality: quality_field,
        lowest,
    } = fields;
    let quality = match compression {
        None => 90,
        Some(q) if (lowest..=100).contains(&q) => q.max(1) as u8,
        Some(q) => {
            return Err(FieldError::new(
                quality_field,
                format!("{quality_field} {q}: give a JPEG quality of {lowest} to 100"),
            ))
        }
    };
    match format.map(str::to_ascii_lowercase).as_deref() {
        None | Some("png") => Ok(ImageFormat::Png),
        Some("jpeg" | "jpg") => Ok(ImageFormat::Jpeg { quality }),
        Some("webp") => Ok(ImageFormat::WebP),
        Some(other) => Err(FieldError::new(
            format_field,
            format!("{format_field} `{other}`: give png, jpeg or webp"),
        )),
    }
}

/// The MIME type of a format, for the native route's answer.
pub fn format_name(format: ImageFormat) -> &'static str {
    match format {
        ImageFormat::Png => "png",
        ImageFormat::Jpeg { .. } => "jpeg",
        ImageFormat::WebP => "webp",
    }
}

/// A JSON object body; errors name the field (`steps: invalid type...`).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, FieldError> {
    // serde would also read a struct from an array of its fields in order.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(FieldError::body(
            "the body must be a JSON object ({\"prompt\": ...})",
        ));
    }
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(field_error)?;
    // Whitespace only after the object: a second object (`{..}{"n": 99}`) is not ignored.
    deserializer.end().map_err(|error| {
        FieldError::body(format!(
            "the body is not valid JSON: {error} after the object"
        ))
    })?;
    Ok(value)
}

/// [`parse_json`] for a body already made into a JSON value (the edits form).
pub fn parse_value<T: DeserializeOwned>(value: serde_json::Value) -> Result<T, FieldError> {
    serde_path_to_error::deserialize(value).map_err(field_error)
}

fn field_error(error: serde_path_to_error::Error<serde_json::Error>) -> FieldError {
    let path = error.path().to_string();
    let inner = error.into_inner();
    if inner.is_syntax() || inner.is_eof() || inner.is_io() {
        // A field's value JSON cannot hold (`1e309`) is named by its field.
        let field = (inner.is_syntax() && path != "." && path != "?").then_some(path);
        return FieldError {
            param: field,
            message: format!("the body is not valid JSON: {inner}"),
        };
    }
    let message = client_message(&inner.to_string());
    // Missing and unknown fields are errors of the object; the message names the field.
    let param = if path == "." || path == "?" {
        message.split('`').nth(1).map(str::to_string)
    } else {
        Some(path.clone())
    };
    let mut text = if param.as_deref() == Some(path.as_str()) {
        format!("{path}: {message}")
    } else {
        message
    };
    if let Some(valid) = param.as_deref().and_then(valid_numbers) {
        text = format!("{text} ({valid})");
    }
    FieldError {
        param,
        message: text,
    }
}

/// The values a numeric field takes, as a client should read them (the bounds are the CLI's).
pub fn valid_numbers(field: &str) -> Option<String> {
    use crate::limits::{MAX_BATCH, MAX_GUIDANCE, MAX_SIDE, MAX_STEPS, MIN_SIDE};
    Some(match field {
        "width" | "height" => format!("{MIN_SIDE} to {MAX_SIDE} pixels"),
        "steps" => format!("a whole number, 1 to {MAX_STEPS}"),
        "n" | "num_images" => format!("a whole number, 1 to {MAX_BATCH}"),
        "seed" => format!("a whole number, 0 to {}", u64::MAX),
        "guidance" => format!("a number, 0 to {MAX_GUIDANCE}"),
        "strength" => "a number above 0, at most 1".to_string(),
        "padding_mask_crop" => format!("a whole number of pixels, 0 to {MAX_SIDE}"),
        "output_compression" | "quality" => "a whole number, 1 to 100".to_string(),
        "preview_every" => "a whole number of steps, 1 or more".to_string(),
        "partial_images" => {
            "0 (partial images come with stream, which OpenAI's routes do not do here)".to_string()
        }
        _ => return None,
    })
}

/// A deserialisation message as a client should read it: the server's type names (`struct
/// RefBody`, `u64`) as what they are in JSON, a quoted string shortened ([`shorten_quoted`]), and
/// without serde's position (`at line 1 column 35`: the field is named instead).
fn client_message(message: &str) -> String {
    let message = match message.rsplit_once(" at line ") {
        Some((text, position))
            if position
                .split(" column ")
                .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit())) =>
        {
            text
        }
        _ => message,
    };
    let mut shortened = shorten_quoted(message);
    for (rust, json) in [
        ("expected u64", "expected a whole number of 0 or more"),
        ("expected u32", "expected a whole number of 0 or more"),
        ("expected u16", "expected a whole number of 0 or more"),
        ("expected f64", "expected a number"),
        ("expected f32", "expected a number"),
    ] {
        shortened = shortened.replace(rust, json);
    }
    let mut out = String::with_capacity(shortened.len());
    let mut rest = shortened.as_str();
    while let Some(at) = rest.find("struct ") {
        out.push_str(&rest[..at]);
        out.push_str("a JSON object");
        rest = rest[at + "struct ".len()..]
            .trim_start_matches(|c: char| c.is_alphanumeric() || c == '_');
    }
    out.push_str(rest);
    out
}

/// `message` with the string that serde quotes in `invalid type: string "...", expected ...` (a
/// base64 image given where an object belongs, megabytes long) cut to its first characters.
fn shorten_quoted(message: &str) -> String {
    const QUOTED_CHARS: usize = 40;
    const OPEN: &str = "string \"";
    let (Some(open), Some(close)) = (message.find(OPEN), message.rfind("\", expected")) else {
        return message.to_string();
    };
    let start = open + OPEN.len();
    let quoted = message.get(start..close).unwrap_or_default();
    match quoted.char_indices().nth(QUOTED_CHARS) {
        Some((cut, _)) => format!("{}...{}", &message[..start + cut], &message[close..]),
        None => message.to_string(),
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
            let mut request = RequestSpec::new("x");
            (request.width, request.height) = (width, height);
            let job = Job::new(request, ("n", "image"), Some("size"), ImageFormat::Png);
            let e = job.check().unwrap_err();
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
}
