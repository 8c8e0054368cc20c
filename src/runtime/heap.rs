//! glibc's heap told to keep the memory that runs free, for the next run to reuse (Linux, glibc).
//!
//! The transformer runs without ONNX Runtime's memory arena (see
//! `SessionConfig::without_cpu_arena`: the arena kept up to 2.4 GiB more at 1024x1024). Its
//! activations then come from `malloc`, and glibc serves every block over 32 MB with a fresh
//! `mmap`, which the kernel faults in and zeroes page by page, and unmaps again when it is freed:
//! every step pays for its memory anew. [`retain_freed_memory`] makes glibc serve those blocks from
//! its heap and never give the heap back, so later steps reuse pages that are already mapped
//! (the VAE decoder runs with the heap given back, below). Measured on the wide checkpoint, int8 bundle, 2 threads, AMX host (benches/RESULTS.md,
//! "Heap: freed memory kept"): 512x512 end to end 14.9 -> 13.8 s, peak RSS 3.04 -> 3.06 GB;
//! 1024x1024 52.8 -> 47.0 s, peak 6.36 -> 6.56 GB; with 512-pixel VAE tiles 55.5 -> 49.8 s, but
//! 3.55 -> 4.62 GB.
//!
//! [`start_tunables`] adds transparent huge pages, which glibc takes only from `GLIBC_TUNABLES`
//! at a process's start.
//!
//! Both change the whole process's allocator, so the library never applies them by itself: the
//! `klein` CLI and server do, at start (they start again with [`start_tunables`]' value set where
//! the transformer is float and no VAE tiles were asked for, or call [`retain_freed_memory`]).
//! A heap kept by [`retain_freed_memory`] serves the steps and is given back for the VAE decoder
//! ([`give_back_freed_memory`], which the pipeline holds through every decode and through tiled
//! VAE encodes; kept through the decoder, the steps' freed activations stayed under its own:
//! wide dds at 1024x1024 peaked at 4.50-4.52 GiB instead of 3.78-3.80, and with 512-pixel tiles
//! at 4.1-8.9 GB instead of 3.4 GB). A float transformer started with huge pages keeps the heap
//! through every decode, auto's tiles included (the give-back cannot undo `GLIBC_TUNABLES`; wide
//! fp32 at 1536x1536: decode 8-12% faster, peak 11.3-12.1 against 10.9 GiB, measured while the
//! transformer still had ONNX Runtime's memory pattern; without it, 4 steps peak at 11.6 GiB and
//! the decode gains less). A process
//! started with `GLIBC_TUNABLES` set keeps glibc's settings as the user tuned them (that is also
//! the way to opt out: `GLIBC_TUNABLES=glibc.malloc.hugetlb=0`). Elsewhere (macOS, Windows, musl)
//! both do nothing.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// The environment variable through which glibc reads its allocator's settings, once, at start.
pub const GLIBC_TUNABLES: &str = "GLIBC_TUNABLES";

/// The `GLIBC_TUNABLES` value that sets klein's heap at a process's start: transparent huge pages
/// for the heap and its large blocks where the kernel gives them on request, and the two settings
/// of [`retain_freed_memory`] (huge pages gained nothing without them: the float step's
/// activations are then mapped afresh every step). `None` where nothing would change:
/// `GLIBC_TUNABLES` already set (the user's settings stand), not glibc's Linux, or the kernel's
/// huge pages off (then [`retain_freed_memory`] alone keeps the heap, without starting again).
///
/// glibc reads tunables only at start (huge pages have no `mallopt`), so a program applies this by
/// starting itself again with the variable set, before it does any work: the `klein` CLI does.
/// Huge pages cut the page faults and TLB misses of the float graphs' large activations: the
/// wide checkpoint's fp32 transformer step, 2 threads, Xeon without AMX, took 5-15% less
/// (benches/RESULTS.md, "Heap").
pub fn start_tunables() -> Option<&'static str> {
    if std::env::var_os(GLIBC_TUNABLES).is_some() || !glibc::IS_GLIBC {
        return None;
    }
    let mode = std::fs::read_to_string(THP_MODE_FILE).unwrap_or_default();
    tunables_for(&mode)
}

/// The kernel's transparent huge page mode: `always [madvise] never`, the one in brackets in use.
const THP_MODE_FILE: &str = "/sys/kernel/mm/transparent_hugepage/enabled";

/// [`start_tunables`] for the kernel's huge page mode `mode` (the text of [`THP_MODE_FILE`];
/// empty where there is none). The kept heap: `M_MMAP_MAX` 0 and a trim threshold no heap
/// reaches (16 GiB: the tunable is a size).
fn tunables_for(mode: &str) -> Option<&'static str> {
    let huge_pages = mode.contains("[always]") || mode.contains("[madvise]");
    huge_pages.then_some(
        "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184",
    )
}

/// Keeps freed memory in glibc's heap for reuse (see the module documentation). Returns whether
/// the setting was applied: false where `GLIBC_TUNABLES` is set or the platform is not glibc's.
pub fn retain_freed_memory() -> bool {
    let mut kept = kept();
    kept.applied = std::env::var_os(GLIBC_TUNABLES).is_none() && glibc::keep_freed();
    kept.applied
}

/// Whether [`retain_freed_memory`] applied its settings, and how many [`GivenBack`] guards hold
/// them off (VAE decodes and tiled passes; the server may run more than one generation).
struct Kept {
    applied: bool,
    given_back: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    applied: false,
    given_back: 0,
});

/// The heap's state; a panic elsewhere while it was held leaves it usable (plain fields).
fn kept() -> MutexGuard<'static, Kept> {
    KEPT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Gives the memory that [`retain_freed_memory`] kept back to the system (`malloc_trim`) and lets
/// glibc serve large blocks with `mmap` again, as by default, until the guard drops; then the heap
/// is kept again. The pipeline holds it through every VAE decode and tiled VAE pass: the steps
/// gain from the kept heap, but kept through the decoder it holds the steps' freed activations
/// under the decoder's own (wide dds at 1024x1024: 4.50-4.52 GiB against 3.78-3.80 GiB, the
/// decode no slower; with 2x2 tiles at 1536x1536, 10.8-17.8 GiB against 9.6 GiB; benches/RESULTS.md, "Heap").
/// Does nothing where the heap was not kept by [`retain_freed_memory`] (never, in a library
/// whose application did not call it; nor with `GLIBC_TUNABLES`, whose settings stand).
pub fn give_back_freed_memory() -> GivenBack {
    let mut kept = kept();
    let active = kept.applied;
    if active {
        if kept.given_back == 0 {
            glibc::give_back();
        }
        kept.given_back += 1;
    }
    GivenBack { active }
}

/// What [`give_back_freed_memory`] returns: the heap is kept again when the last one drops.
#[must_use = "the heap is kept again when the guard drops"]
pub struct GivenBack {
    active: bool,
}

impl Drop for GivenBack {
    fn drop(&mut self) {
        if !self.active {
            return;
        }
        let mut kept = kept();
        kept.given_back -= 1;
        if kept.given_back == 0 {
            glibc::keep_freed();
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod glibc {
    use std::os::raw::c_int;

    pub(super) const IS_GLIBC: bool = true;

    /// `mallopt` parameters (glibc's malloc.h).
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_THRESHOLD: c_int = -3;
    const M_MMAP_MAX: c_int = -4;

    /// glibc's own `M_MMAP_MAX`, and the thresholds its dynamic ones rise to once blocks of 32 MB
    /// have been freed (`DEFAULT_MMAP_THRESHOLD_MAX` on 64-bit hosts; the trim threshold twice
    /// that): setting one by `mallopt` stops glibc from adjusting them, so [`give_back`] sets the
    /// values a long run reaches by default.
    const DEFAULT_MMAP_MAX: c_int = 65536;
    const MMAP_THRESHOLD: c_int = 32 << 20;
    const TRIM_THRESHOLD: c_int = 64 << 20;

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
        fn malloc_trim(pad: usize) -> c_int;
    }

    /// No block served by `mmap` (every one from the heap) and the heap never trimmed. Threads
    /// other than the main one allocate from heaps of at most 64 MB, and glibc serves their larger
    /// blocks by `mmap` whatever `M_MMAP_MAX` says: the CLI runs generations on its main thread.
    /// One heap for every thread (`M_ARENA_MAX` 1) would cover the server's worker thread too, but
    /// ONNX Runtime's pool threads then share it: the wide checkpoint at 1024x1024 with 512-pixel
    /// tiles peaked at 6.3-7.3 GB with it against 4.6 GB without.
    pub(super) fn keep_freed() -> bool {
        // SAFETY: `mallopt` only sets thresholds of glibc's allocator; it takes the allocator's
        // lock, so any thread may call it at any time, and blocks already allocated stay valid
        // (those mapped before are still unmapped when freed).
        unsafe { mallopt(M_MMAP_MAX, 0) == 1 && mallopt(M_TRIM_THRESHOLD, -1) == 1 }
    }

    /// Blocks of 32 MB and more mapped again and the heap trimmed above 64 MB, as glibc's defaults
    /// settle; then the free memory is given back (`malloc_trim`: the main heap's top, and the
    /// free pages inside every heap; other threads' heaps keep their tops, of at most 64 MB).
    pub(super) fn give_back() {
        // SAFETY: as in `keep_freed`; `malloc_trim` takes each heap's lock in turn and only
        // returns pages that no allocation holds.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            mallopt(M_MMAP_MAX, DEFAULT_MMAP_MAX);
            malloc_trim(0);
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod glibc {
    pub(super) const IS_GLIBC: bool = false;

    pub(super) fn keep_freed() -> bool {
        false
    }

    pub(super) fn give_back() {}
}

#[cfg(test)]
mod tests {
    use super::tunables_for;

    #[test]
    fn huge_pages_are_asked_for_only_where_the_kernel_gives_them() {
        let kept = "glibc.malloc.hugetlb=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184";
        assert_eq!(tunables_for("always [madvise] never\n"), Some(kept));
        assert_eq!(tunables_for("[always] madvise never\n"), Some(kept));
        assert_eq!(tunables_for("always madvise [never]\n"), None);
        assert_eq!(tunables_for(""), None);
    }
}
