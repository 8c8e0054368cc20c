//! `klein::runtime::retain_freed_memory`: a freed large block is reused without the kernel
//! faulting its pages in again; `give_back_freed_memory` (VAE decodes, tiled passes) returns the
//! kept memory and maps large blocks afresh until its guard drops, then the heap is kept again; a
//! VAE decode runs with it given back, and frees ONNX Runtime's arena when it is done. It runs
//! on the main thread, as the CLI's generations do (glibc's heaps for other threads serve blocks
//! over 64 MB by `mmap` regardless), so this test has no harness: its own process, `main`
//! (Cargo.toml: `harness = false`).

#[path = "it/util.rs"]
#[allow(dead_code)] // the integration tests' helpers, of which this test needs one
mod util;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn main() {
    /// Minor page faults of this thread so far (`/proc/thread-self/stat`, field 10).
    fn minor_faults() -> u64 {
        let stat =
            std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
        let after_name = &stat[stat.rfind(')').expect("stat has (comm)") + 2..];
        after_name
            .split(' ')
            .nth(7)
            .expect("minflt")
            .parse()
            .expect("a number")
    }

    /// Touches every page of a new 64 MB block and frees it; the page faults that took.
    fn faults_of_a_large_block() -> u64 {
        let before = minor_faults();
        drop(std::hint::black_box(vec![1u8; 64 << 20]));
        minor_faults() - before
    }

    // glibc's default: each 64 MB block is a new mapping, faulted in page by page (16384 pages of
    // 4 KiB; 32 of 2 MiB where transparent huge pages are always on).
    let default = faults_of_a_large_block();

    std::env::set_var("GLIBC_TUNABLES", "glibc.malloc.mmap_max=65536");
    assert!(
        !klein::runtime::retain_freed_memory(),
        "GLIBC_TUNABLES set: the user's settings stand"
    );
    std::env::remove_var("GLIBC_TUNABLES");
    assert!(klein::runtime::retain_freed_memory());

    // The page faults of a large block once a first one has set the heap (or mapping) up.
    let settled_faults = || {
        faults_of_a_large_block();
        faults_of_a_large_block()
    };
    // Asserts that a large block took `faults` page faults: few, from a kept heap.
    let assert_kept = |faults: u64, when: &str| {
        assert!(
            faults < 200 && faults * 4 < default,
            "{faults} page faults {when}: the heap should be kept ({default} for a new mapping)"
        );
    };

    let again = settled_faults(); // the first grows the heap once
    assert_kept(again, "for a block the heap already holds");
    println!("heap: a freed 64 MB block came back with {again} page faults ({default} for a new mapping)");

    /// A size of this process in MiB from `/proc/self/status` (`field`: `VmRSS`, resident now;
    /// `VmHWM`, the peak).
    fn status_mib(field: &str) -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let line = status
            .lines()
            .find(|l| {
                l.strip_prefix(field)
                    .is_some_and(|rest| rest.starts_with(':'))
            })
            .expect(field);
        let kb: u64 = line
            .split_whitespace()
            .nth(1)
            .expect("a size")
            .parse()
            .expect("a number");
        kb / 1024
    }

    // 256 MB freed into the kept heap stay resident until they are given back.
    drop(std::hint::black_box(vec![1u8; 256 << 20]));
    let kept = status_mib("VmRSS");
    let given_back = klein::runtime::give_back_freed_memory();
    let trimmed = status_mib("VmRSS");
    assert!(
        kept >= trimmed + 200,
        "giving back a heap holding 256 MB free: resident {kept} MiB -> {trimmed} MiB"
    );
    // Until the guard drops, each large block is a new mapping again (glibc's default).
    let given = settled_faults();
    assert!(
        given * 2 > default,
        "{given} page faults for a large block with the heap given back, {default} by default"
    );
    drop(given_back);
    let kept_again = settled_faults();
    assert_kept(kept_again, "once the guard dropped");
    println!(
        "heap: given back {} MiB; a large block then took {given} page faults, {kept_again} once kept again",
        kept - trimmed
    );

    // A VAE decode, whole as well as tiled, runs with the kept heap given back: the steps' freed
    // activations would otherwise stay resident under the decoder's (wide dds, 1024x1024: 4.5
    // against 3.8 GiB). Here 512 MB freed into the heap are gone when the tiny decoder starts.
    let mut pipeline = util::tiny_pipeline();
    // Every graph loaded and the tokenizer parsed first, so that nothing else grows meanwhile.
    pipeline
        .load_all_graphs()
        .expect("the tiny bundle's graphs load");
    let latents = ndarray::Array3::<f32>::zeros((1, 16 * 16, 128)); // [1, h*w, 128]: 256x256 pixels
    drop(std::hint::black_box(vec![1u8; 512 << 20]));
    let before = status_mib("VmRSS");
    let mut at_decode = None;
    let mut progress = |event| {
        if event == klein::pipeline::Progress::StageStarted(klein::pipeline::Stage::Decode) {
            at_decode = Some(status_mib("VmRSS"));
        }
        std::ops::ControlFlow::Continue(())
    };
    let images = pipeline
        .decode(latents.view(), 16, 16, Some(&mut progress))
        .expect("the tiny decoder runs");
    assert_eq!((images.len(), images[0].width), (1, 256));
    let at_decode = at_decode.expect("the decode stage was reported");
    assert!(
        before >= at_decode + 400,
        "a decode with 512 MB free in the kept heap: resident {before} MiB -> {at_decode} MiB as it started"
    );
    let after_decode = settled_faults();
    assert_kept(after_decode, "after the decode");
    println!(
        "heap: the VAE decode started with {} MiB given back; {after_decode} page faults after it",
        before - at_decode
    );

    // ONNX Runtime's arena gives back what a VAE pass needed once it is done, the output written
    // outside it (`Graph::run_then_free_arena`); kept, it stayed under the next image's steps.
    // The tiny decoder at 1024x1024: what it grew by against what stays resident after. Without
    // the setting the second decode grows nothing (the first one's arena is kept); with the
    // output in the arena, half of it stayed. The peak: `VmHWM` since `clear_refs` reset it.
    let latents = ndarray::Array3::<f32>::zeros((1, 64 * 64, 128)); // 1024x1024 pixels
    drop(
        pipeline
            .decode(latents.view(), 64, 64, None)
            .expect("a first decode"),
    );
    std::fs::write("/proc/self/clear_refs", "5").expect("resetting the peak (clear_refs)");
    let before = status_mib("VmRSS");
    drop(
        pipeline
            .decode(latents.view(), 64, 64, None)
            .expect("a second decode"),
    );
    let (peak, after) = (status_mib("VmHWM"), status_mib("VmRSS"));
    let grown = peak.saturating_sub(before);
    assert!(
        grown >= 256,
        "a second decode grew nothing ({before} MiB, peak {peak} MiB): the first one's arena kept"
    );
    assert!(
        after.saturating_sub(before) * 8 < grown,
        "the decoder's arena kept: {before} MiB before, {peak} MiB at the peak, {after} MiB after"
    );
    println!(
        "arena: a 1024x1024 decode grew the process by {grown} MiB and kept {} MiB of it",
        after.saturating_sub(before)
    );
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {}
