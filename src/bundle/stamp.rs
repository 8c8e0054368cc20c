//! Hash verification of a bundle's files, and the stamps that let a later load skip it while no
//! file changed.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::manifest::{Manifest, MANIFEST_FILE};
use crate::error::{KleinError, Result};
use crate::fsutil::{file_id, hex, sha256_file, write_atomic};

/// Folder of the verification stamps inside the cache directory ([`default_cache_dir`]).
const STAMP_DIR: &str = "verified";
/// Files modified less than this long before a verification started are not stamped. File systems
/// take modification times from a coarse clock, so a file rewritten just after it was hashed can
/// keep the time the stamp recorded ("racy" files, in git's words). Such a bundle is hashed again
/// on its next load, and stamped then.
const RACY_WINDOW: Duration = Duration::from_secs(2);

impl Manifest {
    /// [`Manifest::verify_hashes`], skipped when a stamp in `cache_dir` shows that no file changed
    /// since the last successful verification.
    ///
    /// The stamp (`<cache_dir>/verified/<key>.json`, the key a hash of the bundle's canonical path
    /// and of its manifest.json) records each file's size, modification time (ns), identity and expected
    /// sha256. It is used only when all of them still agree, and written after a verification
    /// that passed, unless a file changed while it was hashed or was modified within 2 s of it
    /// (see `RACY_WINDOW`). `cache_dir` `None`, or a stamp that cannot be read or written, means
    /// hashing every time; failures to write are ignored.
    ///
    /// A stamp catches corruption and ordinary edits (any write updates the modification time),
    /// and files replaced by others with the old time (another inode); not a file rewritten in
    /// place whose time is set back: use [`Manifest::verify_hashes`] for that.
    pub fn verify_hashes_cached(
        &self,
        bundle_dir: &Path,
        cache_dir: Option<&Path>,
    ) -> Result<Verification> {
        let started = SystemTime::now();
        let stamp_path = cache_dir.and_then(|dir| stamp_path(bundle_dir, dir));
        let before = self.stamp(bundle_dir);
        if let (Some(path), Some(expected)) = (&stamp_path, &before) {
            let stored = std::fs::read(path)
                .ok()
                .and_then(|bytes| serde_json::from_slice::<Stamp>(&bytes).ok());
            if stored.as_ref() == Some(expected) {
                return Ok(Verification {
                    hashed: false,
                    stamp: stamp_path,
                });
            }
        }
        self.verify_hashes(bundle_dir)?;
        let settled = |stamp: &Stamp| {
            let cutoff = started
                .checked_sub(RACY_WINDOW)
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            stamp
                .files
                .values()
                .all(|f| u128::from(f.modified_ns) < cutoff)
        };
        let written = match (stamp_path, before) {
            (Some(path), Some(before))
                if settled(&before) && self.stamp(bundle_dir).as_ref() == Some(&before) =>
            {
                write_stamp(&path, &before).then_some(path)
            }
            _ => None,
        };
        Ok(Verification {
            hashed: true,
            stamp: written,
        })
    }

    /// The stamp this bundle would have now: every file's size and modification time as on disk,
    /// with the manifest's hash. `None` when a time or the bundle's canonical path is unavailable.
    fn stamp(&self, bundle_dir: &Path) -> Option<Stamp> {
        let bundle = std::fs::canonicalize(bundle_dir).ok()?;
        let files = self
            .files
            .iter()
            .map(|(name, entry)| {
                let meta = std::fs::metadata(bundle.join(name)).ok()?;
                let modified = meta.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
                Some((
                    name.clone(),
                    StampedFile {
                        bytes: meta.len(),
                        modified_ns: u64::try_from(modified.as_nanos()).ok()?,
                        file_id: file_id(&meta),
                        sha256: entry.sha256.to_ascii_lowercase(),
                    },
                ))
            })
            .collect::<Option<BTreeMap<_, _>>>()?;
        Some(Stamp {
            bundle: bundle.to_string_lossy().into_owned(),
            files,
        })
    }

    /// Checks the SHA-256 of every file in `files` against the manifest. Files are hashed in
    /// parallel with a streaming reader; every mismatch is reported, not only the first.
    pub fn verify_hashes(&self, bundle_dir: &Path) -> Result<()> {
        let mismatches: Vec<String> = self
            .files
            .par_iter()
            .map(|(name, entry)| {
                let path = bundle_dir.join(name);
                let found = sha256_file(&path)?;
                Ok((!found.eq_ignore_ascii_case(&entry.sha256)).then(|| {
                    format!(
                        "{name}: sha256 is {found}, manifest.json says {}",
                        entry.sha256
                    )
                }))
            })
            .collect::<Result<Vec<Option<String>>>>()?
            .into_iter()
            .flatten()
            .collect();
        if mismatches.is_empty() {
            Ok(())
        } else {
            Err(KleinError::Bundle {
                path: bundle_dir.to_path_buf(),
                reason: format!(
                    "{} file(s) do not match manifest.json (corrupted or modified; copy or export the bundle again): {}",
                    mismatches.len(),
                    mismatches.join("; ")
                ),
            })
        }
    }
}

/// The result of [`Manifest::verify_hashes_cached`] (which fails when a file does not match).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verification {
    /// The files were hashed; false when a stamp showed them unchanged since they last were.
    pub hashed: bool,
    /// The stamp that vouched for the files or was written after hashing them; `None` when there
    /// is no cache directory, the stamp could not be written, or a file was modified too recently.
    pub stamp: Option<PathBuf>,
}

/// What a verification stamp records. A stamp vouches for a bundle only if it equals the one
/// computed now ([`Manifest::stamp`]).
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Stamp {
    /// The bundle's canonical path.
    bundle: String,
    /// Every file of the manifest's `files`.
    files: BTreeMap<String, StampedFile>,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct StampedFile {
    bytes: u64,
    /// Modification time, nanoseconds since the Unix epoch.
    modified_ns: u64,
    /// The file's identity ([`crate::fsutil::file_id`], its inode on Unix): a copy put in its
    /// place with the old time (`rsync -a`, `tar x`, `cp -p` to a new name then moved) is another
    /// file. Absent from older stamps (0: on Unix, such a stamp no longer matches).
    #[serde(default)]
    file_id: u64,
    /// The sha256 manifest.json gives (lower case), which the file matched.
    sha256: String,
}

pub use crate::fsutil::default_cache_dir;

/// `<cache_dir>/verified/<sha256 of the canonical bundle path and of manifest.json>.json`, or
/// `None` when the bundle's path or manifest cannot be read.
fn stamp_path(bundle_dir: &Path, cache_dir: &Path) -> Option<PathBuf> {
    let bundle = std::fs::canonicalize(bundle_dir).ok()?;
    let manifest = std::fs::read(bundle.join(MANIFEST_FILE)).ok()?;
    let mut hasher = Sha256::new();
    hasher.update(bundle.as_os_str().as_encoded_bytes());
    hasher.update([0]);
    hasher.update(Sha256::digest(&manifest));
    Some(
        cache_dir
            .join(STAMP_DIR)
            .join(format!("{}.json", hex(&hasher.finalize()))),
    )
}

/// Writes a stamp atomically; false on any failure (a stamp only saves time).
fn write_stamp(path: &Path, stamp: &Stamp) -> bool {
    let Ok(bytes) = serde_json::to_vec_pretty(stamp) else {
        return false;
    };
    path.parent()
        .is_some_and(|dir| std::fs::create_dir_all(dir).is_ok())
        && write_atomic(path, &bytes).is_ok()
}
