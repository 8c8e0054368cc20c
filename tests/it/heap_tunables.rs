//! The CLI's heap (src/bin/klein/heap.rs): a generation of a float transformer starts klein again
//! with glibc's huge pages (and its heap kept) where the kernel gives huge pages on request, at
//! sizes where auto tiles too (where the kernel does not, the heap alone is kept, at those sizes
//! too); one with VAE tiles asked for keeps the heap alone (the pipeline gives it back for each
//! decode), a `GLIBC_TUNABLES` the user set stays as it is, and the image does not depend on any of
//! it.
use std::ffi::OsStr;

use crate::cli::{klein_env, read_png, FAST};
use crate::util::{temp_dir, test_cache_dir};

/// The value after `heap:` in `--timings`' report.
fn heap_line(stderr: &str) -> &str {
    stderr
        .lines()
        .find_map(|l| l.trim_start().strip_prefix("heap: "))
        .unwrap_or_else(|| panic!("no heap line in:\n{stderr}"))
}

#[test]
fn generations_start_with_huge_pages_unless_the_user_tuned_glibc() {
    let dir = temp_dir("heap-tunables");
    let cache = test_cache_dir();
    let sized = |name: &str, tunables: Option<&str>, size: &[&str], extra: &[&str]| {
        let out = dir.join(name);
        let args = [
            &["generate", "a fox", "--seed", "7", "--timings", "-o"][..],
            &[out.to_str().unwrap()],
            size,
            extra,
        ]
        .concat();
        let run = klein_env(
            args,
            &[
                ("KLEIN_CACHE_DIR", Some(cache.as_os_str())),
                ("GLIBC_TUNABLES", tunables.map(OsStr::new)),
            ],
        );
        run.assert_success(&[&out]);
        (heap_line(&run.stderr).to_string(), read_png(&out).pixels)
    };
    let run =
        |name: &str, tunables: Option<&str>, extra: &[&str]| sized(name, tunables, &FAST, extra);
    let (default, image) = run("default.png", None, &[]);
    // Above 1024x1024 pixels auto tiles the VAE (the tiny bundle's tiles are 64 px).
    let large = ["--width", "1040", "--height", "1040", "--steps", "1"];
    let (auto_tiled, _) = sized("large.png", None, &large, &[]);
    let (tiled, tiled_image) = run("tiled.png", None, &["--vae-tiling", "on"]);
    let (user, user_image) = run("user.png", Some("glibc.malloc.hugetlb=0"), &[]);

    // The kernel's mode, in brackets: `always [madvise] never`.
    let mode =
        std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap_or_default();
    let glibc = cfg!(all(target_os = "linux", target_env = "gnu"));
    let huge_pages = glibc && (mode.contains("[always]") || mode.contains("[madvise]"));
    // Asked-for tiles save memory: no huge pages (they would keep the heap through the tiles), the
    // heap kept with mallopt, which the pipeline gives back for each decode.
    let kept_alone = if glibc {
        "freed memory kept (mallopt)"
    } else {
        "the allocator's defaults"
    };
    assert_eq!(tiled, kept_alone);
    if huge_pages {
        let kept = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=17179869184";
        let expected = format!("GLIBC_TUNABLES=glibc.malloc.hugetlb=1:{kept}");
        assert_eq!(default, expected);
        assert_eq!(auto_tiled, expected, "auto's tiles keep huge pages");
    } else {
        // Kept through the steps; the pipeline gives it back for each decode (tests/heap.rs).
        assert_eq!(default, kept_alone);
        assert_eq!(auto_tiled, kept_alone);
    }
    assert_eq!(
        user, "GLIBC_TUNABLES=glibc.malloc.hugetlb=0",
        "the user's tunables stand"
    );
    assert!(
        image == user_image && image == tiled_image,
        "the heap changed the image"
    );
}
