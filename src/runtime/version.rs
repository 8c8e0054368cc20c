//! ONNX Runtime release numbers: the one the loaded library reports, and the oldest one a bundle
//! asks for (`min_onnxruntime_version` in its manifest).
use std::fmt;

use serde::{Deserialize, Serialize};

/// A release number `major.minor.patch` (`"1.31"` reads as `1.31.0`); a string in JSON (the
/// manifest's `min_onnxruntime_version`, which its parse error names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct OrtVersion {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl OrtVersion {
    /// Reads `"1.31.1"` or `"1.31"`; `None` for anything else (a suffix such as `"1.31.1-dev"`
    /// reads as its numbers, since a development build of 1.31.1 has 1.31.1's operators).
    pub fn parse(text: &str) -> Option<OrtVersion> {
        let numbers = text.split(['-', '+']).next()?;
        let parts: Vec<&str> = numbers.split('.').collect();
        let whole = (2..=3).contains(&parts.len())
            && parts
                .iter()
                .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()));
        whole.then(|| OrtVersion::parse_leading(numbers)).flatten()
    }

    /// The release number at the start of what a library reports: `"1.31.1"`, but also a
    /// development or vendor build's `"1.32.0.dev20260101"` or `"1.31.1+cuda"` (as `1.32.0`,
    /// `1.31.1`); `None` without at least `major.minor`.
    pub fn parse_leading(text: &str) -> Option<OrtVersion> {
        let mut numbers = text
            .split('.')
            .map(|part| {
                let digits = &part[..part.bytes().take_while(u8::is_ascii_digit).count()];
                (digits.parse::<u32>().ok(), digits.len() == part.len())
            })
            .take(3);
        let (major, whole) = numbers.next()?;
        let major = major.filter(|_| whole)?;
        let (minor, whole) = numbers.next()?;
        let minor = minor?;
        let patch = if whole {
            numbers.next().and_then(|(patch, _)| patch).unwrap_or(0)
        } else {
            0
        };
        Some(OrtVersion {
            major,
            minor,
            patch,
        })
    }
}

impl TryFrom<String> for OrtVersion {
    type Error = String;

    fn try_from(text: String) -> Result<Self, Self::Error> {
        OrtVersion::parse(&text).ok_or_else(|| {
            format!("min_onnxruntime_version {text:?} is not a release number such as \"1.31.0\"")
        })
    }
}

impl From<OrtVersion> for String {
    fn from(version: OrtVersion) -> String {
        version.to_string()
    }
}

impl fmt::Display for OrtVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::OrtVersion;

    #[test]
    fn parses_release_numbers_and_orders_them_numerically() {
        let v = |text| OrtVersion::parse(text);
        assert_eq!(
            v("1.31.1"),
            Some(OrtVersion {
                major: 1,
                minor: 31,
                patch: 1
            })
        );
        assert_eq!(v("1.31"), v("1.31.0"));
        assert_eq!(v("1.32.0-dev"), v("1.32.0"));
        assert!(v("1.9.0") < v("1.31.0"), "numeric, not text, order");
        assert!(v("1.31.1") > v("1.31.0"));
        for bad in [
            "", "1", "1.", "1.x.0", "1.31.0.2", "v1.31.0", " 1.31.0", "1.-3.0",
        ] {
            assert_eq!(v(bad), None, "{bad:?}");
        }
        // What a library reports: the leading release number.
        let lead = |text| OrtVersion::parse_leading(text);
        assert_eq!(lead("1.31.1"), v("1.31.1"));
        assert_eq!(lead("1.32.0.dev20260101"), v("1.32.0"));
        assert_eq!(lead("1.31.1+cuda"), v("1.31.1"));
        assert_eq!(lead("1.33rc1"), v("1.33.0"));
        assert_eq!(lead("1.31"), v("1.31.0"));
        for bad in ["", "1", "v1.31.0", "1x.31", "1.x"] {
            assert_eq!(lead(bad), None, "{bad:?}");
        }
    }
}
