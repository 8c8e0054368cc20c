//! File-system helpers shared by the bundle checks, the caches and the outputs: atomic writes and
//! streamed SHA-256.
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use sha2::{Digest, Sha256};

use crate::error::{KleinError, Result};

/// Read buffer for hashing: large enough that hashing, not system calls, sets the pace.
const HASH_BUFFER_BYTES: usize = 1 << 20;

/// Writes `bytes` to `path` atomically: a hidden temporary file in the same directory, synced, then
/// renamed over `path`. On any error the temporary file is removed and `path` is untouched.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(path);
    let io = |action, source| KleinError::Io {
        path: path.to_path_buf(),
        action,
        source,
    };
    let result = (|| {
        let mut file = std::fs::File::create(&tmp).map_err(|e| io("create", e))?;
        file.write_all(bytes).map_err(|e| io("write", e))?;
        file.sync_all().map_err(|e| io("sync", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io("rename into place", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `.NAME.klein-tmp-PID-N`: unique per process and per call, so that threads writing the same
/// path at once (two pipelines stamping one bundle) do not share a temporary file.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.klein-tmp-{}-{n}", std::process::id()))
}

/// Lower-case hexadecimal of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

/// Lower-case hex SHA-256 of a file, streamed.
pub fn sha256_file(path: &Path) -> Result<String> {
    let io_error = |source| KleinError::Io {
        path: path.to_path_buf(),
        action: "hashing",
        source,
    };
    let mut file = File::open(path).map_err(io_error)?;
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; HASH_BUFFER_BYTES];
    loop {
        let n = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_error(e)),
        };
        hasher.update(&buffer[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn failed_write_leaves_no_file() {
        let dir = std::env::temp_dir().join(format!("klein-out-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let missing = dir.join("no-such-dir").join("x.png");
        assert!(write_atomic(&missing, b"data").is_err());
        let ok = dir.join("x.png");
        write_atomic(&ok, b"data").unwrap();
        assert_eq!(std::fs::read(&ok).unwrap(), b"data");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .collect();
        assert_eq!(leftovers.len(), 1, "only the output file remains");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn hashes_as_sha256sum() {
        // sha256 of "abc" (FIPS 180-2, appendix B.1).
        let want = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert_eq!(sha256_hex(b"abc"), want);
        let path = std::env::temp_dir().join(format!("klein-hash-{}", std::process::id()));
        std::fs::write(&path, b"abc").unwrap();
        assert_eq!(sha256_file(&path).unwrap(), want);
        std::fs::remove_file(&path).unwrap();
    }
}
