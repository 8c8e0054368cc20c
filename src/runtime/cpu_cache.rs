//! The CPU load cache ([`SessionConfig::with_cpu_cache_dir`]): each graph as ONNX Runtime optimised
//! it for this CPU, with its prepacked weights, saved by the first load and memory-mapped by the
//! later ones.
//!
//! An entry is `<dir>/<key>/<component>.onnx` and its `.data` file. The key is a SHA-256 of what
//! the saved graph depends on: the graph's own identity (the caller's tag: the sha256s the bundle
//! manifest records for its files), the ONNX Runtime build, the CPU's instruction sets (prepacked
//! layouts are chosen per instruction set, and hosts without VNNI store int8 weights as uint8), the
//! optimisation level, whether weights are prepacked, and whether the session converted the int8
//! weights to uint8 ([`super::cpu_features::converts_int8_weights`]). Anything else changed means another key;
//! nothing is ever overwritten in place.
//! An entry is written into `<key>.partial-<pid>-<n>` and renamed when complete, so a process stopped
//! midway leaves no entry that looks whole. Its last file, `files`, records the size,
//! modification time and file identity (inode) of the others: an entry whose files changed since (zeroed or rewritten by
//! something else, which ONNX Runtime would load without a word and run with the wrong weights)
//! is not used but saved again, as the bundle's stamps do for its hashes.
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use super::cpu_features::detected_features;
use super::device::OptimizationLevel;
use crate::fsutil::{file_id, hex, remove_least_recent, remove_stale, touch, WorkDir};

/// Bumped when the layout of an entry changes.
const CACHE_FORMAT: &str = "klein-cpu-cache-1";
/// The file of an entry that lists its other files' sizes and modification times.
const STAMP_FILE: &str = "files";
/// An entry being saved is `<key>.partial-<pid>-<n>` (`n` counts this process's saves).
const PARTIAL: &str = "partial-";
/// An entry an eviction removes within this many seconds of its last use says that the limit is
/// smaller than the graphs in use.
const RECENT_SECS: u64 = 600;

/// What the cache holds for one graph.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Saved {
    /// Nothing.
    Missing,
    /// The saved graph, its files as they were saved.
    Intact(PathBuf),
    /// An entry whose files are not those it saved (changed since, or an entry without the list
    /// of its files).
    Changed,
}

/// Where one graph's optimised copy lives (or will).
#[derive(Debug)]
pub(super) struct CacheEntry {
    /// `<dir>/<key>`.
    dir: PathBuf,
    /// `<component>.onnx`.
    file: String,
}

impl CacheEntry {
    /// The entry of the graph `component` tagged `tag`, under `root`.
    pub(super) fn new(
        root: &Path,
        component: &str,
        tag: &str,
        runtime_build: &str,
        optimization: OptimizationLevel,
        prepack: bool,
        uint8_weights: bool,
    ) -> CacheEntry {
        let material = format!(
            "{CACHE_FORMAT}\n{runtime_build}\n{}\n{optimization:?}\nprepack={prepack}\n\
             uint8 weights={uint8_weights}\n{component}\n{tag}",
            cpu_identity(),
        );
        let key = hex(&Sha256::digest(material.as_bytes())[..16]);
        CacheEntry {
            dir: root.join(key),
            file: format!("{component}.onnx"),
        }
    }

    /// `<dir>/<key>`.
    pub(super) fn dir(&self) -> &Path {
        &self.dir
    }

    /// What the entry holds: the saved graph when its files are those it saved.
    pub(super) fn saved(&self) -> Saved {
        if !self.dir.exists() {
            return Saved::Missing;
        }
        let path = self.dir.join(&self.file);
        let stamp = std::fs::read_to_string(self.dir.join(STAMP_FILE)).ok();
        match (path.is_file(), stamp, files_stamp(&self.dir)) {
            (true, Some(stamp), Some(now)) if stamp == now => Saved::Intact(path),
            _ => Saved::Changed,
        }
    }

    /// The saved graph, when the entry is intact.
    pub(super) fn intact(&self) -> Option<PathBuf> {
        match self.saved() {
            Saved::Intact(path) => Some(path),
            Saved::Missing | Saved::Changed => None,
        }
    }

    /// A fresh folder to save into (removed unless [`CacheEntry::finish`] makes it the entry), and
    /// the graph file to save there. Folders that processes killed while saving left in the cache
    /// are removed once a day old.
    pub(super) fn start(&self) -> std::io::Result<(WorkDir, PathBuf)> {
        static SAVES: AtomicUsize = AtomicUsize::new(0);
        if let Some(root) = self.dir.parent() {
            remove_stale(root, is_partial);
        }
        let partial = WorkDir::create(self.dir.with_extension(format!(
            "{PARTIAL}{}-{}",
            std::process::id(),
            SAVES.fetch_add(1, Ordering::Relaxed)
        )))?;
        let file = partial.path().join(&self.file);
        Ok((partial, file))
    }

    /// Makes the saved `partial` folder the entry. Another process that finished first wins; this
    /// copy is then removed, as it is when this fails.
    pub(super) fn finish(&self, partial: WorkDir) -> std::io::Result<()> {
        let stamp = files_stamp(partial.path())
            .ok_or_else(|| std::io::Error::other("its files' sizes and times cannot be read"))?;
        std::fs::write(partial.path().join(STAMP_FILE), stamp)?;
        if self.dir.exists() {
            return Ok(());
        }
        match std::fs::rename(partial.path(), &self.dir) {
            Err(_) if self.dir.exists() => Ok(()),
            renamed => renamed,
        }
    }

    /// Marks the entry used now (its list of files' modification time, which the list leaves out
    /// of itself), for [`CacheEntry::evict_others`]; a read-only cache is still used.
    pub(super) fn used(&self) {
        let _ = touch(&self.dir.join(STAMP_FILE));
    }

    /// Removes the least recently used entries of the cache directory (by when each was saved or
    /// last used) until they take at most `limit` bytes with this one, which stays. Only entries
    /// are counted and removed (folders named `<32 hex digits>` holding a list of files and a
    /// graph): nothing else of the directory, which may be any the user named, nor entries being
    /// saved (`<key>.partial-...`). An entry that cannot be removed (another user's) is passed
    /// over, the next ones removed, and the first error returned. Returns how many of those
    /// removed were used in the last [`RECENT_SECS`] seconds (a limit too small for the graphs in
    /// use).
    pub(super) fn evict_others(&self, limit: u64) -> std::io::Result<usize> {
        let Some(root) = self.dir.parent() else {
            return Ok(0);
        };
        let mut total = 0u64;
        let mut others = Vec::new(); // (last used, folder, bytes)
        for item in std::fs::read_dir(root)?.flatten() {
            let name = item.file_name();
            let is_key = name
                .to_str()
                .is_some_and(|n| n.len() == 32 && n.bytes().all(|b| b.is_ascii_hexdigit()));
            if !is_key || !item.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let dir = item.path();
            let Ok(stamp) = std::fs::metadata(dir.join(STAMP_FILE)) else {
                continue;
            };
            let files: Vec<(String, u64)> = std::fs::read_dir(&dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|file| {
                    let name = file.file_name().into_string().ok()?;
                    Some((name, file.metadata().ok()?.len()))
                })
                .collect();
            if !files.iter().any(|(name, _)| name.ends_with(".onnx")) {
                continue;
            }
            let bytes: u64 = files.iter().map(|(_, bytes)| bytes).sum();
            total += bytes;
            if dir != self.dir {
                let used = stamp.modified().unwrap_or(UNIX_EPOCH);
                others.push((used, dir, bytes));
            }
        }
        let recently = SystemTime::now() - Duration::from_secs(RECENT_SECS);
        match remove_least_recent(others, total, limit, |dir| std::fs::remove_dir_all(dir)) {
            (_, Some((dir, e))) => Err(std::io::Error::new(
                e.kind(),
                format!("{}: {e}", dir.display()),
            )),
            (removed, None) => Ok(removed.iter().filter(|&&used| used > recently).count()),
        }
    }

    /// Removes an entry ONNX Runtime could not load (truncated by a full disk, say), or one whose
    /// files changed; an error when it is still there (another user's, a read-only cache).
    pub(super) fn discard(&self) -> std::io::Result<()> {
        let removed = match std::fs::symlink_metadata(&self.dir) {
            Ok(found) if found.is_dir() => std::fs::remove_dir_all(&self.dir),
            Ok(_) => std::fs::remove_file(&self.dir),
            Err(_) => Ok(()),
        };
        match removed {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error),
            _ => Ok(()),
        }
    }
}

/// Whether `name` is that of an entry being saved (`<32 hex digits>.partial-<pid>-<n>`): nothing
/// else in the cache directory (which may be any directory the user named) is ever swept.
fn is_partial(name: &str) -> bool {
    let Some((key, suffix)) = name.split_once('.') else {
        return false;
    };
    let numbers: Vec<&str> = suffix
        .strip_prefix(PARTIAL)
        .unwrap_or("")
        .split('-')
        .collect();
    key.len() == 32
        && key.bytes().all(|b| b.is_ascii_hexdigit())
        && numbers.len() == 2
        && numbers
            .iter()
            .all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Each file of the folder `dir` but the stamp, one line each: name, size, modification time (ns)
/// and [`file_id`], sorted; `None` if one cannot be read.
fn files_stamp(dir: &Path) -> Option<String> {
    let mut lines = Vec::new();
    for entry in std::fs::read_dir(dir).ok()? {
        let entry = entry.ok()?;
        let name = entry.file_name().into_string().ok()?;
        if name == STAMP_FILE {
            continue;
        }
        let metadata = entry.metadata().ok()?;
        let modified = metadata.modified().ok()?.duration_since(UNIX_EPOCH).ok()?;
        lines.push(format!(
            "{name}\t{}\t{}\t{}",
            metadata.len(),
            modified.as_nanos(),
            file_id(&metadata)
        ));
    }
    lines.sort();
    Some(lines.join("\n"))
}

/// The CPU's model and instruction sets: Linux's `/proc/cpuinfo` (model name and flags of the
/// first processor, AMX included) where there is one, the features the standard library detects
/// (CPUID's own answer, which a hypervisor or CPUID faulting can make differ from the kernel's
/// flags).
fn cpu_identity() -> String {
    let mut parts = Vec::new();
    if let Ok(info) = std::fs::read_to_string("/proc/cpuinfo") {
        let wanted = [
            "model name",
            "flags",
            "Features",
            "CPU implementer",
            "CPU part",
        ];
        parts.extend(
            info.lines()
                .take_while(|line| !line.trim().is_empty())
                .filter(|line| wanted.iter().any(|w| line.starts_with(w)))
                .map(str::to_string),
        );
    }
    parts.push(detected_features());
    parts.join("\n")
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn the_key_changes_with_what_the_saved_graph_depends_on() {
        let root = Path::new("/cache");
        // (component, tag, runtime build, level, prepack, uint8 weights) -> the entry's folder.
        let dir = |(component, tag, build, level, prepack, uint8): (&str, &str, &str, _, _, _)| {
            CacheEntry::new(root, component, tag, build, level, prepack, uint8).dir
        };
        let base = (
            "transformer",
            "abc",
            "ort",
            OptimizationLevel::All,
            true,
            false,
        );
        assert_eq!(dir(base), dir(base));
        for other in [
            (
                "transformer",
                "abc",
                "ort2",
                OptimizationLevel::All,
                true,
                false,
            ),
            (
                "transformer",
                "abd",
                "ort",
                OptimizationLevel::All,
                true,
                false,
            ),
            (
                "text_encoder",
                "abc",
                "ort",
                OptimizationLevel::All,
                true,
                false,
            ),
            (
                "transformer",
                "abc",
                "ort",
                OptimizationLevel::Basic,
                true,
                false,
            ),
            (
                "transformer",
                "abc",
                "ort",
                OptimizationLevel::All,
                false,
                false,
            ),
            (
                "transformer",
                "abc",
                "ort",
                OptimizationLevel::All,
                true,
                true,
            ),
        ] {
            assert_ne!(dir(base), dir(other), "{other:?}");
        }
        assert!(!cpu_identity().is_empty());
    }

    /// Past the limit the least recently used entries go (a use renews one), the one just saved
    /// stays, and nothing that is not an entry is counted or removed.
    #[test]
    fn the_least_recently_used_entries_go_past_the_limit() {
        let root = std::env::temp_dir().join(format!("klein-cpu-evict-{}", std::process::id()));
        let entry = |tag: &str| {
            CacheEntry::new(
                &root,
                "text_encoder",
                tag,
                "ort",
                OptimizationLevel::All,
                true,
                false,
            )
        };
        let now = std::time::SystemTime::now();
        // Four entries of 100 bytes, saved 4000, 3000, 2000 and 1000 s ago.
        let entries: Vec<CacheEntry> = ["a", "b", "c", "d"].into_iter().map(entry).collect();
        for (i, e) in entries.iter().enumerate() {
            let (partial, file) = e.start().unwrap();
            std::fs::write(&file, vec![0u8; 100]).unwrap();
            e.finish(partial).unwrap();
            let age = std::time::Duration::from_secs(4000 - 1000 * i as u64);
            std::fs::File::options()
                .write(true)
                .open(e.dir().join(STAMP_FILE))
                .unwrap()
                .set_modified(now - age)
                .unwrap();
        }
        // Not entries: a folder of the user's, a key-named folder without a list of files.
        std::fs::create_dir_all(root.join("photos")).unwrap();
        std::fs::write(root.join("photos/big"), vec![0u8; 10_000]).unwrap();
        let unlisted = root.join("0123456789abcdef0123456789abcdef");
        std::fs::create_dir_all(&unlisted).unwrap();
        std::fs::write(unlisted.join("x.onnx"), vec![0u8; 10_000]).unwrap();
        // Being saved: a folder with its list of files written, not yet renamed into place.
        let (saving, file) = entry("e").start().unwrap();
        std::fs::write(&file, vec![0u8; 10_000]).unwrap();
        std::fs::write(saving.path().join(STAMP_FILE), b"").unwrap();
        // "a" used now; "d", the newest, evicts down to 2 entries (each 100 bytes and its list).
        entries[0].used();
        let size = |e: &CacheEntry| -> u64 {
            std::fs::read_dir(e.dir())
                .unwrap()
                .map(|f| f.unwrap().metadata().unwrap().len())
                .sum()
        };
        let limit = size(&entries[0]) + size(&entries[3]);
        assert_eq!(
            entries[3].evict_others(limit).unwrap(),
            0,
            "none used lately"
        );
        let left: Vec<bool> = entries.iter().map(|e| e.dir().exists()).collect();
        assert_eq!(
            left,
            [true, false, false, true],
            "b and c were the least recently used"
        );
        assert!(root.join("photos/big").exists() && unlisted.join("x.onnx").exists());
        assert!(file.exists(), "an entry being saved is not one yet");
        // A key-named folder with a list of files but no graph is not an entry either.
        std::fs::write(unlisted.join(STAMP_FILE), b"").unwrap();
        std::fs::rename(unlisted.join("x.onnx"), unlisted.join("x.bin")).unwrap();
        // A limit below the newest entry alone keeps it, and says that "a" had just been used.
        assert_eq!(entries[3].evict_others(1).unwrap(), 1);
        assert!(!entries[0].dir().exists() && entries[3].dir().exists());
        assert!(unlisted.join("x.bin").exists());
        drop(saving);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn only_entries_being_saved_are_partial() {
        let key = "0123456789abcdef0123456789abcdef";
        assert!(is_partial(&format!("{key}.partial-12-0")));
        for other in [
            format!("{key}.partial-12"),
            format!("{key}.partial-12-x"),
            key.to_string(),
            "foo.partial-backup".to_string(),
            "0123.partial-1-2".to_string(),
            format!("{key}.partial-1-2-3"),
        ] {
            assert!(!is_partial(&other), "{other}");
        }
    }

    #[test]
    fn a_partial_entry_is_not_saved_until_finished() {
        let root = std::env::temp_dir().join(format!("klein-cpu-cache-{}", std::process::id()));
        let entry = CacheEntry::new(
            &root,
            "vae_decoder",
            "t",
            "ort",
            OptimizationLevel::All,
            false,
            false,
        );
        assert_eq!(entry.saved(), Saved::Missing);
        let (partial, file) = entry.start().unwrap();
        std::fs::write(&file, b"graph").unwrap();
        assert_eq!(
            entry.saved(),
            Saved::Missing,
            "a partial folder is not an entry"
        );
        let folder = partial.path().to_path_buf();
        entry.finish(partial).unwrap();
        assert_eq!(std::fs::read(entry.intact().unwrap()).unwrap(), b"graph");
        assert!(!folder.exists());
        // A second writer that finishes later leaves the first entry and removes its own copy.
        let (partial, file) = entry.start().unwrap();
        std::fs::write(&file, b"other").unwrap();
        entry.finish(partial).unwrap();
        assert_eq!(std::fs::read(entry.intact().unwrap()).unwrap(), b"graph");
        assert!(!folder.exists());
        // A save that fails (its stamp cannot be written: a full disk, say) leaves no folder.
        entry.discard().unwrap();
        let (partial, file) = entry.start().unwrap();
        std::fs::create_dir(partial.path().join(STAMP_FILE)).unwrap();
        std::fs::write(&file, b"graph").unwrap();
        assert!(entry.finish(partial).is_err());
        assert!(!folder.exists() && entry.saved() == Saved::Missing);
        // So does one stopped before it finished.
        let (partial, _) = entry.start().unwrap();
        drop(partial);
        assert!(!folder.exists());
        let (partial, file) = entry.start().unwrap();
        std::fs::write(&file, b"graph").unwrap();
        entry.finish(partial).unwrap();
        // Rewritten in place, same size, a later time: no longer the entry it saved.
        let saved = entry.intact().unwrap();
        let later = std::fs::metadata(&saved).unwrap().modified().unwrap()
            + std::time::Duration::from_secs(1);
        std::fs::write(&saved, b"GRAPH").unwrap();
        std::fs::File::options()
            .write(true)
            .open(&saved)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_eq!(entry.saved(), Saved::Changed);
        entry.discard().unwrap();
        assert_eq!(entry.saved(), Saved::Missing);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
