//! Working directories: folders a process fills and then renames into place or removes (a CPU
//! cache entry being saved, a LoRA merge's scratch copy). Each is registered while it lives, so
//! that an interrupt removes it ([`super::remove_pending_temp_files`]); one left by a process that
//! was killed is removed by a later process once it is a day old ([`remove_stale`]).
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Working directories that exist now.
static PENDING: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Age after which a working directory is taken as left behind: a live process keeps its own for
/// seconds to minutes.
const STALE_AFTER: Duration = Duration::from_secs(24 * 3600);

/// A working directory: removed, with what is in it, when dropped (after a rename there is
/// nothing left to remove) or by an interrupt.
#[derive(Debug)]
pub struct WorkDir(PathBuf);

impl WorkDir {
    /// Creates `path` (and its parents), empty: a leftover of an earlier process with the same
    /// name is removed first.
    pub fn create(path: PathBuf) -> std::io::Result<WorkDir> {
        let dir = WorkDir(path);
        lock().push(dir.0.clone());
        if dir.0.exists() {
            std::fs::remove_dir_all(&dir.0)?;
        }
        std::fs::create_dir_all(&dir.0)?;
        Ok(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        // A directory left behind (another process holds it open) is only disk space.
        let _ = std::fs::remove_dir_all(&self.0);
        lock().retain(|p| *p != self.0);
    }
}

fn lock() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    PENDING.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Removes every working directory of this process (for a signal handler before it exits).
pub(super) fn remove_pending() {
    for path in std::mem::take(&mut *lock()) {
        let _ = std::fs::remove_dir_all(path);
    }
}

/// Removes the directories in `root` whose names `is_work_dir` takes and that were last modified
/// more than a day ago: left by a process that was killed while it filled them.
pub fn remove_stale(root: &Path, is_work_dir: impl Fn(&str) -> bool) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    for entry in entries.flatten() {
        let stale = entry
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_AFTER);
        if stale && is_work_dir(&entry.file_name().to_string_lossy()) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    fn temp_root(name: &str) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("klein-work-dir-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        root
    }

    #[test]
    fn an_interrupt_removes_the_working_directories_and_a_drop_its_own() {
        let root = temp_root("pending");
        let (a, b) = (root.join("a"), root.join("b"));
        let first = WorkDir::create(a.clone()).unwrap();
        std::fs::write(first.path().join("x"), b"x").unwrap();
        let second = WorkDir::create(b.clone()).unwrap();
        drop(first);
        assert!(!a.exists() && b.exists());
        remove_pending();
        assert!(!b.exists(), "the interrupt removed it");
        std::mem::forget(second);
        std::fs::remove_dir_all(root).unwrap();
    }

    /// Unix: a directory's modification time is set through a handle opened read-only, which
    /// Windows refuses for directories.
    #[cfg(unix)]
    #[test]
    fn only_day_old_working_directories_are_stale() {
        let root = temp_root("stale");
        for name in ["old.partial-1", "new.partial-2", "old-other"] {
            std::fs::create_dir(root.join(name)).unwrap();
        }
        let day_ago = std::time::SystemTime::now() - STALE_AFTER - Duration::from_secs(60);
        for name in ["old.partial-1", "old-other"] {
            let dir = std::fs::File::open(root.join(name)).unwrap();
            dir.set_modified(day_ago).unwrap();
        }
        remove_stale(&root, |name| name.contains(".partial-"));
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        left.sort();
        assert_eq!(left, ["new.partial-2", "old-other"]);
        std::fs::remove_dir_all(root).unwrap();
    }
}
