//! Reading a graph's files into the page cache while another stage computes, so that its load
//! finds them in memory instead of waiting for the disk.
//!
//! On a machine whose memory cannot also hold the bundle (a 24 GB machine with the full-size 4B and
//! its CPU cache, or any run after other work pushed the files out), the transformer's load reads
//! gigabytes from disk while the CPU idles, right after the text encoder computed while the disk
//! idled. [`prefetch`] overlaps the two: on Linux a background thread reads the files through a
//! small buffer, which leaves their pages in the page cache (page-cache pages are not counted in the
//! process's resident memory). It is skipped when the files are more than half of the memory the
//! kernel reports available, so that it never pushes out pages the process is using. Elsewhere it
//! does nothing.
use std::path::PathBuf;

/// Starts reading `files` into the page cache in the background (see the module). Files that do not
/// exist are left out; nothing is reported: a prefetch that cannot be made only leaves the load as
/// it was.
#[cfg(target_os = "linux")]
pub fn prefetch(files: Vec<PathBuf>) {
    let sizes: Vec<u64> = files
        .iter()
        .filter_map(|path| Some(std::fs::metadata(path).ok().filter(|m| m.is_file())?.len()))
        .collect();
    if sizes.is_empty() || !fits_in_memory(sizes.iter().sum()) {
        return;
    }
    let _ = std::thread::Builder::new()
        .name("klein-prefetch".into())
        .spawn(move || files.iter().for_each(|path| read_through(path)));
}

/// Does nothing: only Linux is asked to read ahead.
#[cfg(not(target_os = "linux"))]
pub fn prefetch(_files: Vec<PathBuf>) {}

/// Whether `bytes` are at most half of `MemAvailable` (`/proc/meminfo`).
#[cfg(target_os = "linux")]
pub fn fits_in_memory(bytes: u64) -> bool {
    let available_kib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|info| mem_available_kib(&info));
    available_kib.is_some_and(|kib| bytes <= kib.saturating_mul(1024) / 2)
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

/// Reads the whole file at `path` through a small buffer, so that its pages stay in the page
/// cache. Sequential reads of a few megabytes at a time keep the disk streaming without queueing
/// ahead of the running stage's own page faults. (`posix_fadvise(WILLNEED)` copies nothing into the
/// process, but Linux caps one call to the readahead window, and chunk by chunk it was slower: on
/// the full-size 4B, cold, 46-52 s end to end against 38 s with these reads.) A file whose first
/// `PROBE_READS` reads come faster than `CACHED_BYTES_PER_SECOND` is taken as cached already and
/// left there: copying gigabytes out of the page cache would only take a core from the running
/// stage.
#[cfg(target_os = "linux")]
fn read_through(path: &std::path::Path) {
    use std::io::Read;
    const BUFFER: usize = 4 << 20;
    const PROBE_READS: usize = 16;
    const CACHED_BYTES_PER_SECOND: f64 = 2e9;
    let Ok(mut file) = std::fs::File::open(path) else {
        return;
    };
    let mut buffer = vec![0u8; BUFFER];
    let start = std::time::Instant::now();
    let mut bytes = 0usize;
    for reads in 1.. {
        match file.read(&mut buffer) {
            Ok(n) if n > 0 => bytes += n,
            _ => return,
        }
        if reads == PROBE_READS
            && bytes as f64 / start.elapsed().as_secs_f64() > CACHED_BYTES_PER_SECOND
        {
            return;
        }
    }
}

#[cfg(all(test, target_os = "linux"))]
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
}
