//! Reading a graph's files into the page cache ahead of the stage that needs them, so that it finds
//! them in memory instead of waiting for the disk.
//!
//! On a machine whose memory cannot also hold the bundle (a 24 GB machine with the full-size 4B and
//! its CPU cache, or any run after other work pushed the files out), two waits add up. The
//! transformer's load reads gigabytes from disk while the CPU idles, right after the text encoder
//! computed while the disk idled. And a graph whose weights are mapped and not prepacked (the float
//! text encoder, the dynamic-int8 one) reads nothing at load: each product page-faults its weights
//! in from disk when it first runs, so the disk and the cores take turns. [`prefetch_in_turn`]
//! overlaps them: on Linux a background thread reads the running graph's files ahead of its page
//! faults, then the next stage's, through a small buffer, which leaves their pages in the page cache
//! (page-cache pages are not counted in the process's resident memory). The running graph's files
//! are read when they fit in the memory the kernel reports available (the stage reads them all
//! anyway; ahead of it, they must not push each other out), the next stage's when they are at most
//! half of it, so that they never push out pages the process is using. Elsewhere it does nothing.
#[cfg(target_os = "linux")]
use std::path::Path;
use std::path::PathBuf;

/// Starts reading a later stage's `files` into the page cache in the background (see the module).
/// Files that do not exist are left out; nothing is reported: a prefetch that cannot be made only
/// leaves the load as it was.
pub fn prefetch(files: Vec<PathBuf>) {
    prefetch_in_turn(Vec::new(), files);
}

/// Starts reading, on one background thread, the files of the graph about to run (`running`), then
/// those of a later stage (`later`), into the page cache (see the module for when each is read).
/// Files that do not exist are left out; nothing is reported.
#[cfg(target_os = "linux")]
pub fn prefetch_in_turn(running: Vec<PathBuf>, later: Vec<PathBuf>) {
    let Some(available) = available_bytes() else {
        return;
    };
    let files: Vec<PathBuf> = existing_within(running, available)
        .into_iter()
        .chain(existing_within(later, available / 2))
        .collect();
    if files.is_empty() {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("klein-prefetch".into())
        .spawn(move || {
            for path in &files {
                read_through(path, &tables_of(path));
            }
        });
}

/// Does nothing: only Linux is asked to read ahead.
#[cfg(not(target_os = "linux"))]
pub fn prefetch_in_turn(_running: Vec<PathBuf>, _later: Vec<PathBuf>) {}

/// Those of `files` that are files, when their sizes add up to at most `limit` bytes; else none.
#[cfg(target_os = "linux")]
fn existing_within(files: Vec<PathBuf>, limit: u64) -> Vec<PathBuf> {
    let files: Vec<(PathBuf, u64)> = files
        .into_iter()
        .filter_map(|path| {
            let len = std::fs::metadata(&path).ok().filter(|m| m.is_file())?.len();
            Some((path, len))
        })
        .collect();
    if files.iter().map(|(_, len)| len).sum::<u64>() > limit {
        return Vec::new();
    }
    files.into_iter().map(|(path, _)| path).collect()
}

/// Whether `bytes` are at most half of `MemAvailable` (`/proc/meminfo`).
#[cfg(target_os = "linux")]
pub fn fits_in_memory(bytes: u64) -> bool {
    available_bytes().is_some_and(|available| bytes <= available / 2)
}

/// `MemAvailable` in bytes (`/proc/meminfo`).
#[cfg(target_os = "linux")]
fn available_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    Some(mem_available_kib(&info)?.saturating_mul(1024))
}

/// False: the memory available is only read on Linux.
#[cfg(not(target_os = "linux"))]
pub fn fits_in_memory(_bytes: u64) -> bool {
    false
}

/// `MemAvailable` in KiB from the text of `/proc/meminfo`.
#[cfg(target_os = "linux")]
fn mem_available_kib(meminfo: &str) -> Option<u64> {
    meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemAvailable:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|kib| kib.parse().ok())
}

/// What [`read_through`] did with a file's bytes.
#[cfg(target_os = "linux")]
#[derive(Debug, Default, PartialEq, Eq)]
struct Covered {
    /// Bytes read from the file.
    read: u64,
    /// Bytes left alone because the page cache held them already.
    cached: u64,
}

/// Reads the file at `path` through a small buffer, so that its pages stay in the page cache,
/// except the byte ranges `skip` (sorted, not overlapping) and the chunks the page cache holds
/// already ([`residency::cached`]: copying gigabytes out of the page cache would only take a core
/// from the running stage). Sequential reads of a few megabytes at a time keep the disk streaming
/// without queueing ahead of the running stage's own page faults. (`posix_fadvise(WILLNEED)`
/// copies nothing into the process, but Linux caps one call to the readahead window, and chunk by
/// chunk it was slower: on the full-size 4B, cold, 46-52 s end to end against 38 s with these
/// reads.) Each chunk is checked, not the file's start: a file whose first layers are cached (the
/// last run's, which other work pushed out only in part) is read where it is not.
#[cfg(target_os = "linux")]
fn read_through(path: &Path, skip: &[(u64, u64)]) -> Covered {
    use std::io::{Read, Seek, SeekFrom};
    const BUFFER: u64 = 4 << 20;
    let mut covered = Covered::default();
    let Ok(mut file) = std::fs::File::open(path) else {
        return covered;
    };
    let size = file.metadata().map_or(0, |m| m.len());
    let mut buffer = vec![0u8; BUFFER as usize];
    let mut pos = 0u64;
    let mut skip = skip.iter().peekable();
    let mut seek_to = None;
    loop {
        while let Some(&&(_, to)) = skip.peek().filter(|(from, _)| *from <= pos) {
            if pos < to {
                pos = to;
                seek_to = Some(pos);
            }
            skip.next();
        }
        let want = skip
            .peek()
            .map_or(BUFFER, |(from, _)| (from - pos).min(BUFFER))
            .min(size.saturating_sub(pos));
        if want == 0 {
            return covered;
        }
        if residency::cached(&file, pos, want) {
            covered.cached += want;
            pos += want;
            seek_to = Some(pos);
            continue;
        }
        if let Some(to) = seek_to.take() {
            if file.seek(SeekFrom::Start(to)).is_err() {
                return covered;
            }
        }
        match file.read(&mut buffer[..want as usize]) {
            Ok(n) if n > 0 => {
                pos += n as u64;
                covered.read += n as u64;
            }
            _ => return covered,
        }
    }
}

/// Whether a file's pages are in the page cache (Linux's `mincore`, on 64-bit targets).
#[cfg(all(target_os = "linux", target_pointer_width = "64"))]
#[allow(unsafe_code)]
mod residency {
    use std::os::fd::AsRawFd;
    use std::os::raw::{c_int, c_long, c_uchar, c_void};

    const PROT_READ: c_int = 1;
    const MAP_SHARED: c_int = 1;
    const SC_PAGESIZE: c_int = 30;

    extern "C" {
        fn mmap(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            off: i64,
        ) -> *mut c_void;
        fn munmap(addr: *mut c_void, len: usize) -> c_int;
        fn mincore(addr: *mut c_void, len: usize, vec: *mut c_uchar) -> c_int;
        fn sysconf(name: c_int) -> c_long;
    }

    /// Whether every page of the `len` bytes at `offset` of `file` is in the page cache (false
    /// when they reach past its end or cannot be checked). A read-only mapping of the range is
    /// asked, which reads nothing from disk.
    pub(super) fn cached(file: &std::fs::File, offset: u64, len: u64) -> bool {
        // SAFETY: sysconf only reads a constant of the system.
        let page = u64::try_from(unsafe { sysconf(SC_PAGESIZE) }).unwrap_or(0);
        let size = file.metadata().map_or(0, |m| m.len());
        if page == 0 || len == 0 || offset.saturating_add(len) > size {
            return false;
        }
        let start = offset - offset % page;
        let (Ok(span), Ok(at)) = (usize::try_from(offset + len - start), i64::try_from(start))
        else {
            return false;
        };
        let mut pages = vec![0u8; span.div_ceil(page as usize)];
        // SAFETY: a fresh shared read-only mapping of `span` bytes of an open file (within its
        // size, from a page-aligned offset); no byte of it is read, `mincore` writes one byte per
        // page into `pages`, which holds that many, and the mapping is removed before returning.
        unsafe {
            let map = mmap(
                std::ptr::null_mut(),
                span,
                PROT_READ,
                MAP_SHARED,
                file.as_raw_fd(),
                at,
            );
            if map as isize == -1 {
                return false;
            }
            let asked = mincore(map, span, pages.as_mut_ptr());
            munmap(map, span);
            asked == 0 && pages.iter().all(|p| p & 1 == 1)
        }
    }
}

/// Nothing is known to be cached: every chunk is read.
#[cfg(all(target_os = "linux", not(target_pointer_width = "64")))]
mod residency {
    pub(super) fn cached(_file: &std::fs::File, _offset: u64, _len: u64) -> bool {
        false
    }
}

/// The byte ranges of `data`, a graph's external-data file (`<graph file>.data`), that a run does
/// not read whole: the tables its graph only gathers rows from
/// ([`super::onnx_proto::gather_tables`]: a text encoder's embedding table, 1.6 GB of the
/// 4B's float encoder, of which a prompt reads a few rows). Sorted; none when the graph cannot be
/// read or `data` is not such a file.
#[cfg(target_os = "linux")]
fn tables_of(data: &Path) -> Vec<(u64, u64)> {
    let graph = data
        .to_str()
        .and_then(|name| name.strip_suffix(".data"))
        .and_then(|graph| std::fs::read(graph).ok());
    let tables = graph
        .and_then(|model| super::onnx_proto::gather_tables(&model).ok())
        .unwrap_or_default();
    let mut ranges: Vec<(u64, u64)> = tables
        .into_iter()
        .filter(|t| Path::new(&t.location).file_name() == data.file_name())
        .map(|t| (t.offset, t.offset.saturating_add(t.length)))
        .collect();
    ranges.sort_unstable();
    ranges
}

#[cfg(all(test, target_os = "linux"))]
#[allow(clippy::unwrap_used)] // tests may unwrap: a failure is a test failure
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let info =
            "MemTotal:       24576000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(mem_available_kib(info), Some(20_000_000));
        assert_eq!(mem_available_kib("MemTotal: 1 kB\n"), None);
        assert_eq!(mem_available_kib("MemAvailable: lots kB\n"), None);
    }

    #[test]
    fn files_larger_than_half_the_available_memory_are_not_prefetched() {
        assert!(fits_in_memory(1 << 20));
        assert!(!fits_in_memory(u64::MAX / 2));
    }

    #[test]
    fn reads_all_but_the_gathered_tables_and_what_is_cached() {
        use super::super::onnx_proto::fixtures::{model_with_nodes, node};
        let dir = std::env::temp_dir().join(format!("klein-prefetch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let data = dir.join("w.onnx.data");
        let len: u64 = 10 << 20;
        std::fs::write(&data, vec![7u8; len as usize]).unwrap();
        // A file just written is in the page cache: nothing is read, everything is covered.
        let all = read_through(&data, &[]);
        assert_eq!(all.read + all.cached, len);
        assert_eq!(all.read, 0, "a cached file was copied: {all:?}");
        // Without its graph file nothing is skipped.
        assert!(tables_of(&data).is_empty());
        // `a` (bytes 0-63) is an embedding table, `b` a weight.
        let nodes = [node("Gather", &["a", "ids"]), node("MatMul", &["x", "b"])];
        std::fs::write(dir.join("w.onnx"), model_with_nodes(&nodes, "w.onnx.data")).unwrap();
        assert_eq!(tables_of(&data), vec![(0, 64)]);
        let tabled = read_through(&data, &tables_of(&data));
        assert_eq!(tabled.read + tabled.cached, len - 64);
        // Ranges inside, across buffer ends, overlapping the end and past it.
        let skip = [
            (5 << 20, 6 << 20),
            (9 << 20, 11 << 20),
            (12 << 20, 13 << 20),
        ];
        let skipped = read_through(&data, &skip);
        assert_eq!(skipped.read + skipped.cached, len - (2 << 20));
        // A graph naming another data file skips nothing in this one.
        std::fs::write(dir.join("w.onnx"), model_with_nodes(&nodes, "other.data")).unwrap();
        assert!(tables_of(&data).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_range_past_the_end_is_not_cached() {
        let file = std::fs::File::open("/proc/self/exe").unwrap();
        let size = file.metadata().unwrap().len();
        assert!(!residency::cached(&file, size, 4096));
        assert!(!residency::cached(&file, 0, size + 1));
        assert!(!residency::cached(&file, 0, 0));
    }
}
