//! Atomic writes: whole files or nothing, for one file or a set (the images of one command), with
//! the temporary files known so that a signal handler can remove them.
//!
//! A file is written to a hidden temporary file in its directory, synced, renamed over its path,
//! and the directory synced (so the rename survives a power loss, on Unix). A set is staged whole
//! before the first rename; files it replaces are kept aside until every rename has succeeded and
//! put back if one fails. A crash (not an error) between two renames can still leave part of a
//! set new: no file system renames several files as one. A symbolic link is followed (the file it
//! names is replaced, the link kept), and a path that names a device, FIFO or socket
//! (`/dev/null`, `/dev/stdout`) is written in place: a rename would replace it with a file.
use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use crate::error::{KleinError, Result};

/// Temporary files that exist now (written or kept aside), for [`remove_pending`].
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Removes every temporary file a write of this process has in flight (staged outputs are lost;
/// files kept aside are put back).
pub(super) fn remove_pending() {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(PoisonError::into_inner));
    for path in pending {
        let _ = std::fs::remove_file(path);
    }
}

/// A temporary file registered in [`PENDING`] while it lives; dropping it removes the file.
struct Temp {
    path: PathBuf,
}

impl Temp {
    fn next_to(path: &Path) -> Temp {
        let temp = Temp {
            path: temp_path(path),
        };
        PENDING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(temp.path.clone());
        temp
    }

    /// The file is now somewhere else (renamed): nothing to remove.
    fn forget(self) {
        let path = self.path.clone();
        PENDING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|p| *p != path);
        std::mem::forget(self);
    }
}

impl Drop for Temp {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
        PENDING
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .retain(|p| *p != self.path);
    }
}

fn io_error<'a>(
    path: &'a Path,
    action: &'static str,
) -> impl FnOnce(std::io::Error) -> KleinError + 'a {
    move |source| KleinError::Io {
        path: path.to_path_buf(),
        action,
        source,
    }
}

/// Writes `bytes` to `path` atomically: on any error `path` is untouched and no temporary file is
/// left.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_all_atomic(&[(path, bytes)])
}

/// Writes every file or none: all are staged (written and synced) first, then renamed into
/// place; if a write or a rename fails, the files already renamed are taken back (the ones they
/// replaced are restored) and the error is returned. Devices and FIFOs are written in place after
/// the staging and before the renames (what they were sent cannot be taken back).
pub fn write_all_atomic(files: &[(&Path, &[u8])]) -> Result<()> {
    if let Some(&(dir, _)) = files.iter().find(|(path, _)| path.is_dir()) {
        return Err(KleinError::Io {
            path: dir.to_path_buf(),
            action: "write (it is a directory)",
            source: std::io::Error::from(std::io::ErrorKind::IsADirectory),
        });
    }
    let mut staged = Vec::with_capacity(files.len());
    let mut in_place = Vec::new();
    for &(path, bytes) in files {
        let target = match destination(path) {
            Destination::InPlace(device) => {
                in_place.push((device, bytes));
                continue;
            }
            Destination::File(target) => target,
        };
        let temp = Temp::next_to(&target);
        let mut file = std::fs::File::create(&temp.path).map_err(io_error(path, "create"))?;
        file.write_all(bytes).map_err(io_error(path, "write"))?;
        file.sync_all().map_err(io_error(path, "sync"))?;
        staged.push((target, temp));
    }
    for (device, bytes) in in_place {
        std::fs::OpenOptions::new()
            .write(true)
            .open(device)
            .and_then(|mut file| file.write_all(bytes))
            .map_err(io_error(device, "write"))?;
    }
    // (target, the file it replaced, kept aside) for every rename done.
    let mut done: Vec<(&Path, Option<Temp>)> = Vec::with_capacity(staged.len());
    for (path, temp) in &staged {
        let path = path.as_path();
        let result = (|| {
            let aside = if path.exists() {
                let aside = Temp::next_to(path);
                std::fs::rename(path, &aside.path).map_err(io_error(
                    path,
                    "replace the existing file (moved aside first)",
                ))?;
                Some(aside)
            } else {
                None
            };
            match std::fs::rename(&temp.path, path) {
                Ok(()) => Ok(aside),
                Err(e) => {
                    if let Some(aside) = aside {
                        let _ = std::fs::rename(&aside.path, path);
                        aside.forget();
                    }
                    Err(io_error(path, "rename into place")(e))
                }
            }
        })();
        match result {
            Ok(aside) => done.push((path, aside)),
            Err(error) => {
                for (path, aside) in done.into_iter().rev() {
                    match aside {
                        Some(aside) => {
                            let _ = std::fs::rename(&aside.path, path);
                            aside.forget();
                        }
                        None => {
                            let _ = std::fs::remove_file(path);
                        }
                    }
                }
                return Err(error);
            }
        }
    }
    drop(done); // removes the replaced files kept aside
    for (path, temp) in staged {
        temp.forget(); // renamed into place
        sync_parent(&path);
    }
    Ok(())
}

/// Checks, before the work that makes its bytes, that [`write_atomic`] can write `path`: a
/// temporary file is created beside the file it would replace and removed (a device, FIFO or
/// socket is not touched: writing it cannot be tried without effect).
pub fn check_writable(path: &Path) -> Result<()> {
    match destination(path) {
        Destination::InPlace(_) => Ok(()),
        Destination::File(target) => {
            let temp = Temp::next_to(&target);
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temp.path)
                .map(drop)
                .map_err(|source| KleinError::Io {
                    path: target
                        .parent()
                        .filter(|p| !p.as_os_str().is_empty())
                        .unwrap_or(Path::new("."))
                        .to_path_buf(),
                    action: "create a file in the directory",
                    source,
                })
        }
    }
}

/// Where the bytes meant for a path go.
enum Destination<'a> {
    /// A file replaced by a rename: the path, or the file its symbolic links lead to.
    File(PathBuf),
    /// A device, FIFO or socket, written in place.
    InPlace(&'a Path),
}

fn destination(path: &Path) -> Destination<'_> {
    match std::fs::metadata(path) {
        Ok(meta) if !meta.is_file() && !meta.is_dir() => Destination::InPlace(path),
        _ => Destination::File(followed(path, MAX_LINKS)),
    }
}

/// The file [`write_atomic`] replaces for `path`, whose name its temporary file extends: `path`
/// with its symbolic links followed (a device, FIFO or socket: `path`, written in place).
pub fn replaced_file(path: &Path) -> PathBuf {
    match destination(path) {
        Destination::File(file) => file,
        Destination::InPlace(path) => path.to_path_buf(),
    }
}

/// Symbolic links followed before giving up (Linux's own limit).
const MAX_LINKS: u32 = 40;

/// `path` with its symbolic links followed, also to a file that does not exist yet: `path` itself
/// when it is no link, or the last link when there are more than `hops`.
fn followed(path: &Path, hops: u32) -> PathBuf {
    match std::fs::read_link(path) {
        Ok(target) if hops > 0 => {
            let target = match path.parent() {
                Some(dir) => dir.join(target), // an absolute target replaces `dir`
                None => target,
            };
            followed(&target, hops - 1)
        }
        _ => path.to_path_buf(),
    }
}

/// Syncs the directory of `path`, so that a rename in it is durable (Unix; elsewhere a no-op).
/// Best effort: the data itself was synced before the rename.
fn sync_parent(path: &Path) {
    #[cfg(unix)]
    if let Some(dir) = path.parent() {
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        if let Ok(dir) = std::fs::File::open(dir) {
            let _ = dir.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

/// Longest file name [`write_atomic`] can write: file systems take 255 bytes, and the temporary
/// file beside it (`.NAME.klein-tmp-PID-N`) adds up to 35.
pub const MAX_FILE_NAME_BYTES: usize = 220;

/// `.NAME.klein-tmp-PID-N`: unique per process and per call, so that threads writing the same
/// path at once (two pipelines stamping one bundle) do not share a temporary file.
fn temp_path(path: &Path) -> PathBuf {
    static COUNTER: AtomicUsize = AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // Built as an OsString: a name that is not UTF-8 keeps its bytes.
    let mut name = OsString::from(".");
    name.push(path.file_name().unwrap_or_default());
    name.push(format!(".klein-tmp-{}-{n}", std::process::id()));
    path.with_file_name(name)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// A name that is not UTF-8 keeps its bytes in its temporary file's name (it was built
    /// lossily, with U+FFFD in place of the byte), and is written.
    #[cfg(unix)]
    #[test]
    fn names_that_are_not_utf8_keep_their_bytes() {
        use std::os::unix::ffi::OsStrExt;
        let dir = std::env::temp_dir().join(format!("klein-latin1-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(std::ffi::OsStr::from_bytes(b"caf\xe9.png"));
        let temp = temp_path(&path);
        let temp_name = temp.file_name().unwrap().as_bytes();
        assert!(
            temp_name.starts_with(b".caf\xe9.png.klein-tmp-"),
            "{temp:?}"
        );
        write_atomic(&path, b"data").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"data");
        std::fs::remove_dir_all(&dir).unwrap();
    }

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

    /// The second file cannot be written (its path is a directory): the first keeps its old
    /// content, and no temporary file is left.
    #[test]
    fn a_set_is_written_whole_or_not_at_all() {
        let dir = std::env::temp_dir().join(format!("klein-set-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("b.png")).unwrap();
        std::fs::write(dir.join("a.png"), b"old").unwrap();
        let (a, b) = (dir.join("a.png"), dir.join("b.png"));
        assert!(write_all_atomic(&[(&a, b"new"), (&b, b"new")]).is_err());
        assert_eq!(std::fs::read(&a).unwrap(), b"old");
        assert_eq!(names(&dir), ["a.png", "b.png"]);
        std::fs::remove_dir(&b).unwrap();
        write_all_atomic(&[(&a, b"new a"), (&b, b"new b")]).unwrap();
        assert_eq!(std::fs::read(&a).unwrap(), b"new a");
        assert_eq!(std::fs::read(&b).unwrap(), b"new b");
        assert_eq!(names(&dir), ["a.png", "b.png"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A symbolic link is kept and the file it names replaced, also when that file does not exist
    /// yet (a relative link, resolved from the link's directory).
    #[cfg(unix)]
    #[test]
    fn a_link_is_followed_not_replaced() {
        let dir = std::env::temp_dir().join(format!("klein-link-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("real")).unwrap();
        let link = dir.join("link.png");
        std::os::unix::fs::symlink("real/out.png", &link).unwrap();
        write_atomic(&link, b"first").unwrap(); // the link dangled
        write_atomic(&link, b"second").unwrap();
        assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
        assert_eq!(std::fs::read(dir.join("real/out.png")).unwrap(), b"second");
        assert_eq!(names(&dir.join("real")), ["out.png"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A directory that cannot be written (sysfs refuses new files, also to root) is found
    /// before any work; a writable one is left as it was.
    #[cfg(target_os = "linux")]
    #[test]
    fn writability_checked_without_a_trace() {
        let err = check_writable(Path::new("/sys/klein-probe.png")).unwrap_err();
        assert!(
            err.to_string().contains("/sys"),
            "the directory is named: {err}"
        );
        let dir = std::env::temp_dir().join(format!("klein-probe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        check_writable(&dir.join("x.png")).unwrap();
        assert!(names(&dir).is_empty(), "nothing left: {:?}", names(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A FIFO (as a device such as /dev/null) is written in place and stays what it was.
    #[cfg(unix)]
    #[test]
    fn a_fifo_is_written_in_place() {
        use std::io::Read;
        use std::os::unix::fs::FileTypeExt;
        let dir = std::env::temp_dir().join(format!("klein-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("out.png");
        let made = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap();
        assert!(made.success());
        // Opened for reading and writing (Linux), the FIFO lets the writer open it at once and
        // holds what it is sent.
        let mut pipe = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&fifo)
            .unwrap();
        write_atomic(&fifo, b"through the pipe").unwrap();
        let kind = std::fs::symlink_metadata(&fifo).unwrap().file_type();
        assert!(kind.is_fifo(), "{kind:?}");
        let mut sent = [0u8; 16];
        pipe.read_exact(&mut sent).unwrap();
        assert_eq!(&sent, b"through the pipe");
        assert_eq!(names(&dir), ["out.png"]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A temporary file is listed for the signal handler while it exists, and removed with its
    /// listing when dropped. (`remove_pending_temp_files` itself is exercised by the CLI's
    /// interrupt test: calling it here would race with the other tests' writes.)
    #[test]
    fn temporary_files_are_listed_while_they_exist() {
        let dir = std::env::temp_dir().join(format!("klein-pending-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let temp = Temp::next_to(&dir.join("x.png"));
        std::fs::write(&temp.path, b"partial").unwrap();
        let listed = |p: &Path| PENDING.lock().unwrap().iter().any(|q| q == p);
        let path = temp.path.clone();
        assert!(listed(&path));
        drop(temp);
        assert!(!listed(&path));
        assert!(names(&dir).is_empty(), "{:?}", names(&dir));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
