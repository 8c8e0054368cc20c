//! Typed errors of the library. Every variant names the file or stage and what would be valid.
use std::path::PathBuf;

pub type Result<T, E = KleinError> = std::result::Result<T, E>;

/// The [`KleinError::Io`] action of a LoRA file that cannot be read (its error is about `loras`).
pub const READING_LORA: &str = "reading the LoRA file";
/// The [`KleinError::Io`] action of a CPU cache directory that cannot be made (its error is about
/// `cpu_cache`).
pub const CREATING_CPU_CACHE: &str = "creating the CPU cache directory";
/// The [`KleinError::Io`] action of a prompt cache directory that cannot be made (its error is
/// about `prompt_cache`).
pub const CREATING_PROMPT_CACHE: &str = "creating the prompt cache directory";

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KleinError {
    /// A file could not be read or written.
    #[error("{path}: {action} failed")]
    Io {
        path: PathBuf,
        action: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The bundle is not one this runtime can use (missing file, bad manifest, wrong version...).
    #[error("bundle {path}: {reason}")]
    Bundle { path: PathBuf, reason: String },
    /// An image file could not be used as a reference.
    #[error("image {path}: {reason}")]
    Image { path: PathBuf, reason: String },
    /// A LoRA file that cannot be read, or does not fit the bundle.
    #[error("LoRA {path}: {reason}")]
    Lora { path: PathBuf, reason: String },
    /// A generation request that cannot be satisfied (size, steps, references...). `param`: the
    /// request's field the message is about (`width`, `strength`, ...), where it is one field,
    /// so that an API can name it without reading the message ([`KleinError::param`]).
    #[error("invalid request: {message}")]
    Request {
        message: String,
        param: Option<&'static str>,
    },
    /// The ONNX Runtime library could not be found or loaded.
    #[error("ONNX Runtime library: {0}")]
    RuntimeLibrary(String),
    /// A graph failed to load or run.
    #[error("{stage}: {message}")]
    Inference {
        stage: &'static str,
        message: String,
    },
    /// The caller's progress callback asked to stop.
    #[error("cancelled")]
    Cancelled,
    /// A scheduler setting (from the bundle's manifest) that this runtime does not implement.
    #[error("scheduler setting {setting}: {reason}")]
    Scheduler {
        setting: &'static str,
        reason: String,
    },
    /// The device the user asked for (an ONNX Runtime execution provider) cannot be used.
    #[error("device {device}: {message}")]
    Device { device: String, message: String },
    /// A model named by its Hugging Face Hub id that could not be fetched or is no klein bundle.
    #[error("{repo}: {reason}")]
    Hub { repo: String, reason: String },
}

impl KleinError {
    /// A [`KleinError::Request`] about no single field.
    pub fn request(message: impl Into<String>) -> Self {
        KleinError::Request {
            message: message.into(),
            param: None,
        }
    }

    /// A [`KleinError::Request`] about the request's field `param`.
    pub fn request_about(param: &'static str, message: impl Into<String>) -> Self {
        KleinError::Request {
            message: message.into(),
            param: Some(param),
        }
    }

    /// This error about the request's field `param`, if it is a [`KleinError::Request`] (other
    /// errors are returned unchanged).
    pub fn about(self, param: &'static str) -> Self {
        match self {
            KleinError::Request { message, .. } => KleinError::request_about(param, message),
            other => other,
        }
    }

    /// The field of the request or of the pipeline's options an error is about, if it is one:
    /// a [`KleinError::Request`]'s `param`, `loras` for every [`KleinError::Lora`] and a
    /// LoRA file that cannot be read ([`READING_LORA`]), `device` for a [`KleinError::Device`].
    pub fn param(&self) -> Option<&'static str> {
        match self {
            KleinError::Request { param, .. } => *param,
            KleinError::Lora { .. } => Some("loras"),
            KleinError::Device { .. } => Some("device"),
            KleinError::Io { action, .. } if *action == READING_LORA => Some("loras"),
            KleinError::Io { action, .. } if *action == CREATING_CPU_CACHE => Some("cpu_cache"),
            KleinError::Io { action, .. } if *action == CREATING_PROMPT_CACHE => {
                Some("prompt_cache")
            }
            KleinError::RuntimeLibrary(_) => Some("ort_library"),
            KleinError::Hub { .. } => Some("model"),
            _ => None,
        }
    }

    /// True when the error comes from what the user gave (files, options), not from the runtime
    /// or the machine: a full disk or quota, or memory the system would not give, while reading or
    /// writing a file is the machine's state, not a bad input. The CLI exits with code 2 for these.
    pub fn is_user_error(&self) -> bool {
        use std::io::ErrorKind::{OutOfMemory, QuotaExceeded, StorageFull};
        match self {
            KleinError::Inference { .. } | KleinError::Cancelled => false,
            KleinError::Io { source, .. } => {
                !matches!(source.kind(), StorageFull | QuotaExceeded | OutOfMemory)
            }
            _ => true,
        }
    }
}

/// The message of an error and of every error that caused it, joined with ": ".
pub fn chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> KleinError {
        KleinError::Io {
            path: PathBuf::from("out.png"),
            action: "writing the image",
            source: kind.into(),
        }
    }

    #[test]
    fn a_full_disk_is_not_a_user_error() {
        use std::io::ErrorKind::*;
        for kind in [StorageFull, QuotaExceeded, OutOfMemory] {
            assert!(!io(kind).is_user_error(), "{kind:?}");
        }
        for kind in [NotFound, PermissionDenied, IsADirectory, InvalidData] {
            assert!(io(kind).is_user_error(), "{kind:?}");
        }
        // ENOSPC as the OS reports it, not only a kind made by hand.
        #[cfg(unix)]
        assert!(!KleinError::Io {
            path: PathBuf::from("out.png"),
            action: "writing the image",
            source: std::io::Error::from_raw_os_error(libc::ENOSPC),
        }
        .is_user_error());
    }
}
