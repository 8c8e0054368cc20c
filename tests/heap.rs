//! `klein::runtime::retain_freed_memory`: a freed large block is reused without the kernel faulting
//! its pages in again. It runs on the main thread, as the CLI's generations do (glibc's heaps for
//! other threads serve blocks over 64 MB by `mmap` regardless), so this test has no harness: its
//! own process, `main` (Cargo.toml: `harness = false`).

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

    faults_of_a_large_block(); // grows the heap once
    let again = faults_of_a_large_block();
    assert!(
        again < 200 && again * 4 < default,
        "{again} page faults for a block the heap already holds, {default} for a new mapping"
    );
    println!("heap: a freed 64 MB block came back with {again} page faults ({default} for a new mapping)");
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn main() {}
