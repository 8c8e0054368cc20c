//! The int8 products on an AVX2-only host, made of this one by `benches/avx2-host.sh` in its
//! patched-copies mode (every x86-64 Linux host can run it): this test binary's own `runtime`
//! products tests run again in a copy of it whose `cpuid` instructions answer "AVX2 and FMA, no
//! VNNI", against a copy of ONNX Runtime that does the same. There klein must set
//! `session.x64quantprecision` for 8-bit codes (ONNX Runtime's AVX2 u8 x s8 kernels saturate) and
//! must not need it for 7-bit codes; on the hosts CI runs on (all with VNNI) this path is not taken
//! otherwise. Needs `python3`, `objdump`, `readelf` and `cc`, as the bench script does.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use std::path::Path;
use std::process::{Command, Output};

use crate::util::{ort_library, repo};

const INT8: &str = "runtime::int8_products_do_not_saturate";
const SEVEN_BIT: &str = "runtime::seven_bit_int8_products_do_not_saturate";

/// Runs the two products tests of `binary` under `benches/avx2-host.sh` (patched-copies mode).
fn products_tests_under_the_mask(binary: &Path) -> Output {
    Command::new(repo().join("benches/avx2-host.sh"))
        .env("AVX2_HOST_MODE", "patched")
        .env("ORT_DYLIB_PATH", ort_library())
        .arg(binary)
        .args(["--exact", INT8, SEVEN_BIT, "--test-threads", "1"])
        .output()
        .unwrap()
}

fn result_line<'a>(stdout: &'a str, test: &str) -> &'a str {
    let prefix = format!("test {test} ... ");
    stdout
        .lines()
        .find_map(|line| line.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no result for {test} in:\n{stdout}"))
}

#[test]
fn int8_products_do_not_saturate_on_an_avx2_host() {
    let me = std::env::current_exe().unwrap();
    // avx2_host.c answers only the `ud2`s of files under a directory named avx2-host.
    let masked = me
        .parent()
        .unwrap()
        .join("avx2-host")
        .join(me.file_name().unwrap());
    let patch = Command::new("python3")
        .arg(repo().join("benches/avx2_patch.py"))
        .args([&me, &masked])
        .output()
        .unwrap();
    assert!(
        patch.status.success(),
        "avx2_patch.py: {}",
        String::from_utf8_lossy(&patch.stderr)
    );

    // klein and ONNX Runtime both see an AVX2 host: klein converts the 8-bit weights to uint8,
    // and the 7-bit ones keep the u8 x s8 kernels; both exact.
    let out = products_tests_under_the_mask(&masked);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(result_line(&stdout, INT8), "ok");
    assert_eq!(result_line(&stdout, SEVEN_BIT), "ok");

    // The control: only ONNX Runtime masked. klein then sees this host's CPU; where that has VNNI
    // it keeps the 8-bit codes, and ONNX Runtime's AVX2 kernels saturate (the product comes out
    // about half), which shows the mask reached them. The 7-bit codes are exact either way.
    let vnni = std::arch::is_x86_feature_detected!("avx512vnni")
        || std::arch::is_x86_feature_detected!("avxvnni");
    let out = products_tests_under_the_mask(&me);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.success(), !vnni, "{stdout}");
    assert_eq!(
        result_line(&stdout, INT8),
        if vnni { "FAILED" } else { "ok" },
        "{stdout}"
    );
    assert_eq!(result_line(&stdout, SEVEN_BIT), "ok");
}
