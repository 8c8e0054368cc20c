//! File-system helpers shared by the bundle checks, the caches and the outputs: atomic writes
//! (`atomic`), working directories (`work_dir`) and streamed SHA-256.
use std::ffi::OsString;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use crate::error::{KleinError, Result};

mod atomic;
mod evict;
mod work_dir;

pub use atomic::{
    check_writable, replaced_file, write_all_atomic, write_atomic, MAX_FILE_NAME_BYTES,
};
pub use evict::{remove_least_recent, CacheItem};
pub use work_dir::{remove_stale, WorkDir};

/// Removes every temporary file a write of this process has in flight (staged outputs are lost;
/// files kept aside are put back) and every working directory it is filling ([`WorkDir`]). For a
/// signal handler before it exits; the library does not install one.
pub fn remove_pending_temp_files() {
    atomic::remove_pending();
    work_dir::remove_pending();
}

/// Read buffer for hashing: large enough that hashing, not system calls, sets the pace.
const HASH_BUFFER_BYTES: usize = 1 << 20;

/// A file's identity, for stamps that trust size and modification time: its inode number on Unix
/// (a file replaced by another, even with the same time, has another; the device number is left
/// out, as some setups change it at every mount), else 0 (no identity: size and time alone).
pub fn file_id(metadata: &std::fs::Metadata) -> u64 {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        metadata.ino()
    }
    #[cfg(not(unix))]
    {
        let _ = metadata;
        0
    }
}

/// Sets `path`'s modification time to now, as a write would: on Unix with `futimens(fd, NULL)`,
/// which any process that may write the file may do (setting an explicit time, as std's
/// `set_modified` does, is for the file's owner only, so another user's files in a shared cache
/// could not be renewed).
#[allow(unsafe_code)]
pub fn touch(path: &Path) -> std::io::Result<()> {
    let file = File::options().write(true).open(path)?;
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        // SAFETY: a valid open descriptor; NULL times mean "now" for both.
        match unsafe { libc::futimens(file.as_raw_fd(), std::ptr::null()) } {
            0 => Ok(()),
            _ => Err(std::io::Error::last_os_error()),
        }
    }
    #[cfg(not(unix))]
    {
        file.set_modified(std::time::SystemTime::now())
    }
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

/// Where klein keeps its caches (verification stamps, the ONNX Runtime library `klein setup`
/// installs): `$KLEIN_CACHE_DIR`, else `$XDG_CACHE_HOME/klein`, else `$HOME/.cache/klein`, else
/// `%LOCALAPPDATA%\klein`; `None` when none of these variables is set.
pub fn default_cache_dir() -> Option<PathBuf> {
    cache_dir_from(&|name| std::env::var_os(name))
}

/// [`default_cache_dir`] of the environment variables `env` gives.
pub fn cache_dir_from(env: &dyn Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("KLEIN_CACHE_DIR")
        .or_else(|| var("XDG_CACHE_HOME").map(|d| d.join("klein")))
        .or_else(|| var("HOME").map(|d| d.join(".cache").join("klein")))
        .or_else(|| var("LOCALAPPDATA").map(|d| d.join("klein")))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn touch_sets_the_modification_time_to_now() {
        let path = std::env::temp_dir().join(format!("klein-touch-{}", std::process::id()));
        std::fs::write(&path, b"x").unwrap();
        let old = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(old)
            .unwrap();
        touch(&path).unwrap();
        let modified = std::fs::metadata(&path).unwrap().modified().unwrap();
        std::fs::remove_file(&path).unwrap();
        assert!(modified > old + std::time::Duration::from_secs(3000));
        assert_eq!(std::fs::read(&path).ok(), None, "removed");
        assert!(touch(&path).is_err(), "a missing file is an error");
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
