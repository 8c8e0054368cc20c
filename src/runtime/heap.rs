//! glibc's heap told to keep the memory that runs free, for the next run to reuse (Linux, glibc).
//!
//! The transformer runs without ONNX Runtime's memory arena (see
//! `SessionConfig::without_cpu_arena`: the arena kept up to 2.4 GiB more at 1024x1024). Its
//! activations then come from `malloc`, and glibc serves every block over 32 MB with a fresh
//! `mmap`, which the kernel faults in and zeroes page by page, and unmaps again when it is freed:
//! every step pays for its memory anew. [`retain_freed_memory`] makes glibc serve those blocks from
//! its heap and never give the heap back, so later steps and the VAE decoder reuse pages that are
//! already mapped. Measured on the wide checkpoint, int8 bundle, 2 threads, AMX host (README,
//! "Heap: freed memory kept"): 512x512 step 1.19 -> 1.00 s, end to end 15.0 -> 13.7 s, peak RSS
//! 3.04 -> 3.06 GB; 1024x1024 end to end 52.8 -> 47.0 s, peak 6.36 -> 6.56 GB (with 512-pixel VAE
//! tiles 51.9 -> 50.1 s, 3.96 -> 4.35 GB).
//!
//! It changes the whole process's allocator, so the library never calls it by itself: the `klein`
//! CLI and server do, at start. A process started with `GLIBC_TUNABLES` set keeps glibc's settings
//! as the user tuned them (that is also the way to opt out: `GLIBC_TUNABLES=glibc.malloc.mmap_max=65536`).
//! Elsewhere (macOS, Windows, musl) it does nothing.

/// Keeps freed memory in glibc's heap for reuse (see the module documentation). Returns whether
/// the setting was applied: false where `GLIBC_TUNABLES` is set or the platform is not glibc's.
pub fn retain_freed_memory() -> bool {
    std::env::var_os("GLIBC_TUNABLES").is_none() && glibc::keep_freed()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[allow(unsafe_code)]
mod glibc {
    use std::os::raw::c_int;

    /// `mallopt` parameters (glibc's malloc.h).
    const M_TRIM_THRESHOLD: c_int = -1;
    const M_MMAP_MAX: c_int = -4;
    const M_ARENA_MAX: c_int = -8;

    extern "C" {
        fn mallopt(param: c_int, value: c_int) -> c_int;
    }

    /// No block served by `mmap` (every one from the heap), the heap never trimmed, and one heap
    /// for every thread: glibc gives other threads heaps of at most 64 MB, and serves larger blocks
    /// of theirs by `mmap` whatever `M_MMAP_MAX` says (the server runs generations on its own thread).
    pub(super) fn keep_freed() -> bool {
        // SAFETY: `mallopt` only sets thresholds of glibc's allocator; it takes the allocator's
        // lock, so any thread may call it at any time, and blocks already allocated stay valid
        // (those mapped before are still unmapped when freed).
        unsafe {
            mallopt(M_MMAP_MAX, 0) == 1
                && mallopt(M_TRIM_THRESHOLD, -1) == 1
                && mallopt(M_ARENA_MAX, 1) == 1
        }
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
mod glibc {
    pub(super) fn keep_freed() -> bool {
        false
    }
}
