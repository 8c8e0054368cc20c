//! The C API (`src/capi/`): `examples/c/generate.c` compiled with the system C compiler against
//! the `libklein` and `klein.h` of this very build, run on the tiny bundle; and the argument checks
//! of the entry points, called directly.

use std::ffi::{c_char, CStr, CString};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::ptr;

use klein::capi::{
    klein_generate, klein_output_size, klein_pipeline_free, klein_pipeline_load, klein_string_free,
    klein_take_warnings, KleinOptions, KleinPipeline, KleinRequest, KleinStatus,
};
use klein::pipeline::{ImageInput, Inpaint, MaskKind, Request};

use crate::util::{assert_mentions, ort_library, repo, temp_dir, tiny_pipeline};

/// `target/<profile>/`, where Cargo puts `libklein.so` and build.rs `include/klein.h`: the test
/// executable is `target/<profile>/deps/it-<hash>`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap();
    assert!(
        deps.ends_with("deps"),
        "unexpected test executable location {}",
        exe.display()
    );
    deps.parent().unwrap().to_path_buf()
}

/// Compiles `examples/c/generate.c` into `dir` and returns the executable.
fn compile_c_example(dir: &Path) -> PathBuf {
    compile_c(&repo().join("examples/c/generate.c"), dir)
}

/// Compiles the C program `source` (warnings are errors) into `dir`, against the generated header
/// and the cdylib; returns the executable.
fn compile_c(source: &Path, dir: &Path) -> PathBuf {
    let lib_dir = profile_dir();
    let library = lib_dir.join(format!(
        "{}klein{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    let include = lib_dir.join("include");
    // `cargo test` links integration tests against the rlib only: the cdylib and the header come from
    // `cargo build` of the same profile, which scripts/test.sh runs first.
    for file in [&library, &include.join("klein.h")] {
        assert!(
            file.is_file(),
            "{} is missing: run `cargo build --release` (or without --release for a debug test run) \
             before the tests; scripts/test.sh does",
            file.display()
        );
    }
    let exe = dir.join(source.file_stem().unwrap());
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let output = Command::new(&cc)
        .arg(source)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(&include)
        .arg("-L")
        .arg(&lib_dir)
        .arg("-lklein")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("could not run the C compiler `{cc}` (set CC to another): {e}"));
    assert!(
        output.status.success(),
        "{cc} failed:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// The README's C snippet, as a user copies it: it compiles warning-free and, run from the
/// repository (its bundle path is relative), generates its 64x64 image.
#[test]
#[cfg(unix)]
fn readme_c_snippet_compiles_and_runs() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let section = &readme[readme.find("## Embedding: the C API").unwrap()..];
    let start = section.find("```c\n").unwrap() + "```c\n".len();
    let snippet = &section[start..start + section[start..].find("```").unwrap()];
    let dir = temp_dir("capi-readme");
    let source = dir.join("readme.c");
    std::fs::write(&source, snippet).unwrap();
    let exe = compile_c(&source, &dir);
    let (stdout, stderr) = run_c(Command::new(&exe).current_dir(repo()));
    assert_eq!(stdout, "64x64 RGBA\n");
    assert!(stderr.contains("step 4/4"), "{stderr}");
}

/// Runs a compiled C program with the tests' ONNX Runtime library; it must exit 0. Its stdout
/// and stderr.
fn run_c(command: &mut Command) -> (String, String) {
    let output = command
        .env("ORT_DYLIB_PATH", ort_library())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert!(
        output.status.success(),
        "{command:?} exited with {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    (stdout, stderr)
}

/// The same request as the C example, through the Rust API: RGB `[64, 64, 3]`.
fn rust_api_image() -> Vec<u8> {
    let mut pipeline = tiny_pipeline();
    let request = Request::new("a red fox in the snow")
        .with_seed(42)
        .with_size(64, 64)
        .with_steps(2);
    pipeline
        .generate(&request, None)
        .unwrap()
        .images
        .remove(0)
        .pixels
}

/// Checks: the example compiles warning-free against the generated header and links against the
/// cdylib; it exits 0 after its own checks (short buffer and bad size refused, progress at steps
/// 1 and 2, a callback cancelling at step 1 gives KLEIN_CANCELLED with no step 2 and the buffer
/// untouched, the next generation equals the first byte for byte); its image equals the Rust
/// API's for the same request, exactly.
#[test]
#[cfg(unix)]
fn c_example_generates_cancels_and_repeats() {
    let dir = temp_dir("capi-c");
    let exe = compile_c_example(&dir);
    let ppm = dir.join("out.ppm");
    let (stdout, _) = run_c(
        Command::new(&exe)
            .arg(repo().join("onnx/klein-tiny"))
            .arg(&ppm),
    );
    assert_mentions(
        &stdout,
        &[
            "short buffer: KLEIN_ERROR_BUFFER_TOO_SMALL: rgba_out holds 16 bytes; 1 64x64 image(s) need 16384",
            "short buffer reports the size needed: yes",
            "width 8: KLEIN_ERROR_USER: invalid request: width 8 is out of range",
            "first: step 1/2\nfirst: step 2/2\nfirst generation: KLEIN_OK\n",
            "first image is non-trivial: yes",
            "cancelled: step 1/2\ncancelled generation: KLEIN_CANCELLED: cancelled\n",
            "cancelled generation left the buffer untouched: yes",
            "third: step 1/2\nthird: step 2/2\nthird generation: KLEIN_OK\n",
            "third image equals the first byte for byte: yes",
            "all checks passed",
        ],
    );
    assert!(
        !stdout.contains("cancelled: step 2/2"),
        "the cancelled generation went on:\n{stdout}"
    );

    // P6 header, then RGB [64, 64, 3].
    let bytes = std::fs::read(&ppm).unwrap();
    let header = b"P6\n64 64\n255\n";
    assert_eq!(&bytes[..header.len()], header);
    let pixels = &bytes[header.len()..];
    let want = rust_api_image();
    assert_eq!(
        pixels.len(),
        want.len(),
        "pixel bytes: C {} vs Rust {}",
        pixels.len(),
        want.len()
    );
    let differing = pixels.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(
        differing,
        0,
        "{differing} of {} bytes differ between the C and the Rust API",
        want.len()
    );
}

/// Calls `f` with an error-message slot; returns the status and the message (freed).
pub(crate) fn call(f: impl FnOnce(*mut *mut c_char) -> KleinStatus) -> (KleinStatus, String) {
    let mut message: *mut c_char = ptr::null_mut();
    let status = f(&mut message);
    let text = if message.is_null() {
        String::new()
    } else {
        // SAFETY: a message from the library, freed once.
        let text = unsafe { CStr::from_ptr(message) }
            .to_string_lossy()
            .into_owned();
        unsafe { klein_string_free(message) };
        text
    };
    (status, text)
}

/// The tiny bundle's path and the tests' ONNX Runtime library, as C strings.
pub(crate) fn c_paths() -> (CString, CString) {
    let bundle = CString::new(repo().join("onnx/klein-tiny").to_str().unwrap()).unwrap();
    let library = CString::new(ort_library().to_str().unwrap()).unwrap();
    (bundle, library)
}

/// Options for the CPU with `threads` threads and `library`; the rest default.
pub(crate) fn cpu_options(library: &CStr, threads: u32) -> KleinOptions {
    KleinOptions {
        device: c"cpu".as_ptr(),
        threads,
        ort_library: library.as_ptr(),
        coreml_units: ptr::null(),
        coreml_cache_dir: ptr::null(),
        cuda_memory_limit: 0,
        vae_tiling: ptr::null(),
        cpu_cache_dir: ptr::null(),
        vae_tile_size: 0,
        release_transformer: false,
        prompt_cache_dir: ptr::null(),
        prompt_cache_max_mib: 0,
        cpu_cache_max_gib: 0,
    }
}

/// The bundle loaded through the C API with `options` (asserted to succeed).
pub(crate) fn load(bundle: &CStr, options: &KleinOptions) -> *mut KleinPipeline {
    let mut pipeline: *mut KleinPipeline = ptr::null_mut();
    // SAFETY: valid pointers and NUL-terminated strings.
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), options, &mut pipeline, m) });
    assert_eq!((status, message.as_str()), (KleinStatus::KLEIN_OK, ""));
    pipeline
}

/// `klein_generate` into `buffer`, without progress or size outputs.
///
/// # Safety
/// `pipeline` is live and `request`'s strings and arrays are valid.
pub(crate) unsafe fn generate_into(
    pipeline: *mut KleinPipeline,
    request: &KleinRequest,
    buffer: &mut [u8],
    message: *mut *mut c_char,
) -> KleinStatus {
    // SAFETY: the caller's guarantee; `buffer` is writable for its length.
    unsafe {
        klein_generate(
            pipeline,
            request,
            buffer.as_mut_ptr(),
            buffer.len(),
            ptr::null_mut(),
            ptr::null_mut(),
            None,
            ptr::null_mut(),
            message,
        )
    }
}

/// Checks the entry points' own argument handling, status by status, with the message of each:
/// NULL pointers and non-UTF-8 strings are KLEIN_ERROR_INVALID_ARGUMENT, an unknown device or
/// tiling, a device this build lacks and a missing bundle are KLEIN_ERROR_USER, a NULL reference array with a count is refused, a short
/// buffer reports the size, and success clears the message. No generation runs.
#[test]
fn entry_points_check_their_arguments() {
    use KleinStatus::*;
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 1);
    let mut pipeline: *mut KleinPipeline = ptr::null_mut();

    // SAFETY (every call below): valid or NULL pointers, NUL-terminated strings, a live pipeline.
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(ptr::null(), &options, &mut pipeline, m) });
    assert_eq!(
        (status, message.as_str()),
        (KLEIN_ERROR_INVALID_ARGUMENT, "bundle_dir is NULL")
    );
    assert!(pipeline.is_null());

    let not_utf8 = [0xffu8, 0xfe, 0];
    let (status, message) = call(|m| unsafe {
        klein_pipeline_load(not_utf8.as_ptr().cast(), &options, &mut pipeline, m)
    });
    assert_eq!(status, KLEIN_ERROR_INVALID_ARGUMENT, "{message}");
    assert_mentions(&message, &["bundle_dir is not UTF-8"]);

    // Options that cannot be used; a device this build lacks is refused at load, not at the
    // first generation.
    let refused: Vec<(KleinOptions, &[&str])> = vec![
        (
            KleinOptions {
                device: c"tpu".as_ptr(),
                ..options
            },
            &["unknown device `tpu`", "cpu, cuda, cuda:N, coreml or auto"],
        ),
        (
            KleinOptions {
                vae_tiling: c"sometimes".as_ptr(),
                ..options
            },
            &["options.vae_tiling", "on, off or auto"],
        ),
        #[cfg(not(feature = "cuda"))]
        (
            KleinOptions {
                device: c"cuda:1".as_ptr(),
                ..options
            },
            &["built without CUDA support", "--features cuda"],
        ),
        (
            KleinOptions {
                coreml_units: c"gpu".as_ptr(),
                ..options
            },
            &["unknown CoreML compute units `gpu`", "cpu-ane"],
        ),
        (
            KleinOptions {
                prompt_cache_dir: c"/no/such/cache".as_ptr(),
                prompt_cache_max_mib: u64::MAX,
                ..options
            },
            &[
                "prompt_cache_max_mib is 18446744073709551615",
                "between 1 and 16777216",
            ],
        ),
        (
            KleinOptions {
                prompt_cache_max_mib: 64,
                ..options
            },
            &[
                "prompt_cache_max_mib needs the directory it limits",
                "prompt_cache_dir",
            ],
        ),
        (
            KleinOptions {
                cpu_cache_max_gib: 1,
                ..options
            },
            &[
                "cpu_cache_max_gib needs the directory it limits",
                "cpu_cache_dir",
            ],
        ),
    ];
    for (bad, needles) in refused {
        let (status, message) =
            call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &bad, &mut pipeline, m) });
        assert_eq!(status, KLEIN_ERROR_USER, "{message}");
        assert_mentions(&message, needles);
        assert!(pipeline.is_null());
    }

    // The CoreML, CPU and prompt cache directories are created at load, whatever the device.
    let cache = crate::util::temp_dir("capi-coreml-cache").join("compiled");
    let cache_c = CString::new(cache.to_str().unwrap()).unwrap();
    let cpu_cache = crate::util::temp_dir("capi-cpu-cache").join("graphs");
    let cpu_cache_c = CString::new(cpu_cache.to_str().unwrap()).unwrap();
    let prompt_cache = crate::util::temp_dir("capi-prompt-cache").join("prompts");
    let prompt_cache_c = CString::new(prompt_cache.to_str().unwrap()).unwrap();
    let with_cache = KleinOptions {
        coreml_units: c"cpu-gpu".as_ptr(),
        coreml_cache_dir: cache_c.as_ptr(),
        cuda_memory_limit: 1 << 30,
        vae_tiling: c"on".as_ptr(),
        cpu_cache_dir: cpu_cache_c.as_ptr(),
        prompt_cache_dir: prompt_cache_c.as_ptr(),
        prompt_cache_max_mib: 1,
        cpu_cache_max_gib: 64,
        ..options
    };
    let mut other: *mut KleinPipeline = ptr::null_mut();
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &with_cache, &mut other, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    assert!(cache.is_dir() && cpu_cache.is_dir() && prompt_cache.is_dir());
    unsafe { klein_pipeline_free(other) };
    // A VAE tile size that does not fall on whole latent patches is refused at load.
    let odd_tiles = KleinOptions {
        vae_tile_size: 100,
        ..options
    };
    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &odd_tiles, &mut other, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["VAE tile size 100", "multiple of 64"]);
    assert!(other.is_null());

    let (status, message) = call(|m| unsafe {
        klein_pipeline_load(c"/no/such/bundle".as_ptr(), &options, &mut pipeline, m)
    });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["/no/such/bundle"]);
    assert!(pipeline.is_null());

    let (status, message) =
        call(|m| unsafe { klein_pipeline_load(bundle.as_ptr(), &options, &mut pipeline, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    assert!(!pipeline.is_null());

    let mut request = KleinRequest {
        prompt: c"a cat".as_ptr(),
        seed: 1,
        width: 64,
        height: 48,
        steps: 2,
        guidance: 0.0,
        num_images: 0,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: std::ptr::null(),
        image_path: std::ptr::null(),
        mask_path: std::ptr::null(),
        strength: 0.0,
        preview_every: 0,
        preview: None,
        preview_user_data: std::ptr::null_mut(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let (mut width, mut height) = (0u32, 0u32);
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &request, &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str(), width, height),
        (KLEIN_OK, "", 64, 48)
    );

    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, ptr::null(), &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str()),
        (KLEIN_ERROR_INVALID_ARGUMENT, "request is NULL")
    );

    let (status, message) =
        call(|m| unsafe { klein_output_size(ptr::null(), &request, &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str()),
        (KLEIN_ERROR_INVALID_ARGUMENT, "pipeline is NULL")
    );

    request.reference_count = 2;
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &request, &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str()),
        (
            KLEIN_ERROR_INVALID_ARGUMENT,
            "request.reference_paths is NULL but reference_count is 2"
        )
    );
    request.reference_count = 0;

    let mut small = [0u8; 8];
    let (mut w, mut h) = (0u32, 0u32);
    let generate = |request: &KleinRequest, buffer: &mut [u8], w: &mut u32, h: &mut u32, m| unsafe {
        klein_generate(
            pipeline,
            request,
            buffer.as_mut_ptr(),
            buffer.len(),
            w,
            h,
            None,
            ptr::null_mut(),
            m,
        )
    };
    let (status, message) = call(|m| generate(&request, &mut small, &mut w, &mut h, m));
    assert_eq!(status, KLEIN_ERROR_BUFFER_TOO_SMALL, "{message}");
    assert_eq!((w, h), (64, 48), "the size needed is reported");
    assert_mentions(
        &message,
        &["rgba_out holds 8 bytes", "64x48 image(s) need 12288"],
    );

    let no_prompt = KleinRequest {
        prompt: ptr::null(),
        ..request
    };
    let (status, message) = call(|m| generate(&no_prompt, &mut small, &mut w, &mut h, m));
    assert_eq!(
        (status, message.as_str()),
        (KLEIN_ERROR_INVALID_ARGUMENT, "request.prompt is NULL")
    );

    let missing = [c"/no/such/ref.png".as_ptr()];
    let with_missing_ref = KleinRequest {
        reference_paths: missing.as_ptr(),
        reference_count: 1,
        negative_prompt: std::ptr::null(),
        image_path: std::ptr::null(),
        mask_path: std::ptr::null(),
        strength: 0.0,
        ..request
    };
    let (status, message) = call(|m| generate(&with_missing_ref, &mut small, &mut w, &mut h, m));
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["/no/such/ref.png"]);

    // SAFETY: a pipeline from klein_pipeline_load, freed once; NULL is a no-op.
    unsafe {
        klein_pipeline_free(pipeline);
        klein_pipeline_free(ptr::null_mut());
        klein_string_free(ptr::null_mut());
    }
}

/// `num_images` fills the buffer with that many images, equal to the Rust API's batch; `guidance`
/// is read (past its bound it is refused).
#[test]
fn c_requests_carry_num_images_and_guidance() {
    use KleinStatus::*;
    let (bundle, library) = c_paths();
    // Released before each decode: the images are still the Rust API's (which keeps it).
    let options = KleinOptions {
        release_transformer: true,
        ..cpu_options(&library, 1)
    };
    let pipeline = load(&bundle, &options);
    // SAFETY (every call): valid pointers, NUL-terminated strings, a live pipeline.
    let request = KleinRequest {
        prompt: c"a red fox in the snow".as_ptr(),
        seed: 42,
        width: 64,
        height: 48,
        steps: 2,
        guidance: 0.0,
        num_images: 2,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: std::ptr::null(),
        image_path: std::ptr::null(),
        mask_path: std::ptr::null(),
        strength: 0.0,
        preview_every: 0,
        preview: None,
        preview_user_data: std::ptr::null_mut(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let generate = |request: &KleinRequest, buffer: &mut [u8], m| unsafe {
        generate_into(pipeline, request, buffer, m)
    };
    let mut one = vec![0u8; 64 * 48 * 4];
    let (status, message) = call(|m| generate(&request, &mut one, m));
    assert_eq!(status, KLEIN_ERROR_BUFFER_TOO_SMALL, "{message}");
    assert_mentions(&message, &["2 64x48 image(s) need 24576"]);

    let mut two = vec![0u8; 2 * 64 * 48 * 4];
    let (status, message) = call(|m| generate(&request, &mut two, m));
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let expected = tiny_pipeline()
        .generate(
            &Request::new("a red fox in the snow")
                .with_seed(42)
                .with_size(64, 48)
                .with_steps(2)
                .with_num_images(2),
            None,
        )
        .unwrap();
    let rgb: Vec<u8> = two.chunks_exact(4).flat_map(|p| p[..3].to_vec()).collect();
    let want: Vec<u8> = expected
        .images
        .iter()
        .flat_map(|i| i.pixels.clone())
        .collect();
    assert_eq!(
        rgb, want,
        "the two images, in order, as the Rust API makes them"
    );

    let strong = KleinRequest {
        guidance: 1e9,
        ..request
    };
    let (status, message) = call(|m| generate(&strong, &mut two, m));
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(
        &message,
        &["guidance 1000000000 must be a number between 0 and 100"],
    );
    unsafe { klein_pipeline_free(pipeline) };
}

/// `klein_take_warnings` returns what the CLI prints as warnings (guidance on a distilled model,
/// a truncated prompt), one per line, once: the next call gives NULL; a repeated truncation is one
/// line.
#[test]
fn c_warnings_are_taken_once() {
    use KleinStatus::*;
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 1);
    let pipeline = load(&bundle, &options);
    // SAFETY (every call): valid pointers, NUL-terminated strings, a live pipeline.
    let take = || {
        let mut warnings: *mut c_char = ptr::null_mut();
        let (status, message) =
            call(|m| unsafe { klein_take_warnings(pipeline, &mut warnings, m) });
        assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
        if warnings.is_null() {
            return None;
        }
        let text = unsafe { CStr::from_ptr(warnings) }
            .to_str()
            .unwrap()
            .to_string();
        unsafe { klein_string_free(warnings) };
        Some(text)
    };
    assert_eq!(take(), None, "nothing to warn of after a load");
    // The tiny model is distilled; the prompt is longer than its 512 tokens.
    let prompt = CString::new("a red fox in the snow ".repeat(200)).unwrap();
    let request = KleinRequest {
        prompt: prompt.as_ptr(),
        width: 32,
        height: 32,
        steps: 1,
        guidance: 3.0,
        ..unsafe { std::mem::zeroed() }
    };
    let mut buffer = vec![0u8; 32 * 32 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &request, &mut buffer, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let text = take().expect("two warnings");
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_mentions(lines[0], &["guidance 3 is ignored", "distilled"]);
    assert_mentions(lines[1], &["longer than 512 tokens", "truncated"]);
    assert_eq!(take(), None, "taken once");
    // Two truncated prompts before the next take: one line.
    let plain = KleinRequest {
        guidance: 0.0,
        ..request
    };
    for _ in 0..2 {
        let (status, message) =
            call(|m| unsafe { generate_into(pipeline, &plain, &mut buffer, m) });
        assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    }
    let text = take().expect("the truncation");
    assert_eq!(text.lines().count(), 1, "{text}");
    let (status, message) = call(|m| unsafe { klein_take_warnings(pipeline, ptr::null_mut(), m) });
    assert_eq!(status, KLEIN_ERROR_INVALID_ARGUMENT, "{message}");
    assert_mentions(&message, &["warnings is NULL"]);
    unsafe { klein_pipeline_free(pipeline) };
}

/// An inpainting request (`image_path`, `mask_path`, `strength`) gives the Rust API's image; the
/// output size is the source's; a mask without an image and a strength above 1 are refused.
#[test]
fn c_requests_inpaint_as_the_rust_api() {
    use KleinStatus::*;
    let dir = temp_dir("capi-inpaint");
    let source = dir.join("source.png");
    let mask = dir.join("mask.png");
    image::RgbImage::from_fn(72, 52, |x, y| {
        image::Rgb([(x * 3) as u8, (y * 4) as u8, 90])
    })
    .save(&source)
    .unwrap();
    image::RgbImage::from_fn(30, 20, |x, _| image::Rgb([if x < 15 { 255 } else { 0 }; 3]))
        .save(&mask)
        .unwrap();
    let (c_source, c_mask) = (
        CString::new(source.to_str().unwrap()).unwrap(),
        CString::new(mask.to_str().unwrap()).unwrap(),
    );
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 1);
    let pipeline = load(&bundle, &options);
    // SAFETY (every call): valid pointers, NUL-terminated strings, a live pipeline.
    let request = KleinRequest {
        prompt: c"a hat".as_ptr(),
        seed: 3,
        width: 0,
        height: 0,
        steps: 4,
        guidance: 0.0,
        num_images: 1,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: ptr::null(),
        image_path: c_source.as_ptr(),
        mask_path: c_mask.as_ptr(),
        strength: 0.75,
        preview_every: 0,
        preview: None,
        preview_user_data: std::ptr::null_mut(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let (mut width, mut height) = (0u32, 0u32);
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &request, &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str(), width, height),
        (KLEIN_OK, "", 64, 48)
    );
    let mut rgba = vec![0u8; 64 * 48 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &request, &mut rgba, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));

    let mut rust = tiny_pipeline();
    let src = rust.load_source(&ImageInput::file(&source)).unwrap();
    let mask_image = rust
        .load_mask(&ImageInput::file(&mask), MaskKind::White, &src)
        .unwrap();
    let want = rust
        .generate(
            &Request::new("a hat")
                .with_seed(3)
                .with_steps(4)
                .with_inpaint(Inpaint::new(src, Some(mask_image), 0.75)),
            None,
        )
        .unwrap();
    let rgb: Vec<u8> = rgba.chunks_exact(4).flat_map(|p| p[..3].to_vec()).collect();
    assert_eq!(rgb, want.images[0].pixels, "the Rust API's inpainted image");
    assert_eq!((want.strength, want.masked), (Some(0.75), true));

    let no_image = KleinRequest {
        image_path: ptr::null(),
        ..request
    };
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &no_image, &mut rgba, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["request.image_path"]);
    let too_strong = KleinRequest {
        strength: 1.5,
        ..request
    };
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &too_strong, &mut rgba, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["strength 1.5 must be above 0 and at most 1"]);
    // Numbers before files: the strength is refused before a missing source is looked for; so
    // is a crop padding past 4096, crop or not.
    let missing = c"/nonexistent/source.png";
    for bad in [
        KleinRequest {
            image_path: missing.as_ptr(),
            ..too_strong
        },
        KleinRequest {
            image_path: missing.as_ptr(),
            mask_crop_padding: 5000,
            ..request
        },
    ] {
        let (status, message) = call(|m| unsafe { generate_into(pipeline, &bad, &mut rgba, m) });
        assert_eq!(status, KLEIN_ERROR_USER, "{message}");
        assert!(!message.contains("nonexistent"), "{message}");
    }
    // `klein_output_size` says what `klein_generate` makes: the source's size (72x52 floored),
    // whatever size is given, as diffusers' inpaint pipeline (the generation warns).
    let other_size = KleinRequest {
        width: 96,
        height: 96,
        ..request
    };
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &other_size, &mut width, &mut height, m) });
    assert_eq!((status, width, height), (KLEIN_OK, 64, 48), "{message}");
    // The source's own size, given: floored as the output is (72x52 gives 64x48), so taken.
    let own_size = KleinRequest {
        width: 72,
        height: 52,
        ..request
    };
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &own_size, &mut width, &mut height, m) });
    assert_eq!((status, width, height), (KLEIN_OK, 64, 48), "{message}");

    // `mask_crop`: a mask of the source's size; the output is the whole source (72x52).
    let full_mask = dir.join("full-mask.png");
    image::RgbImage::from_fn(72, 52, |x, y| {
        let inside = (20..40).contains(&x) && (10..30).contains(&y);
        image::Rgb([if inside { 255 } else { 0 }; 3])
    })
    .save(&full_mask)
    .unwrap();
    let c_full_mask = CString::new(full_mask.to_str().unwrap()).unwrap();
    let cropped = KleinRequest {
        mask_path: c_full_mask.as_ptr(),
        mask_crop: 1,
        mask_crop_padding: 4,
        ..request
    };
    let (status, message) =
        call(|m| unsafe { klein_output_size(pipeline, &cropped, &mut width, &mut height, m) });
    assert_eq!(
        (status, message.as_str(), width, height),
        (KLEIN_OK, "", 72, 52)
    );
    let mut rgba = vec![0u8; 72 * 52 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &cropped, &mut rgba, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    let decode = |path: &Path| klein::stages::reference::decode_image(path).unwrap();
    let inpaint = rust
        .crop_to_mask(
            decode(&source),
            decode(&full_mask),
            4,
            0.75,
            (&source, &full_mask),
        )
        .unwrap();
    let want = rust
        .generate(
            &Request::new("a hat")
                .with_seed(3)
                .with_steps(4)
                .with_inpaint(inpaint),
            None,
        )
        .unwrap();
    let rgb: Vec<u8> = rgba.chunks_exact(4).flat_map(|p| p[..3].to_vec()).collect();
    assert_eq!((want.width, want.height, want.mask_crop), (72, 52, Some(4)));
    assert_eq!(
        rgb, want.images[0].pixels,
        "the Rust API's cropped inpainting"
    );
    let no_mask = KleinRequest {
        mask_path: ptr::null(),
        ..cropped
    };
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &no_mask, &mut rgba, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["request.mask_crop needs request.mask_path"]);
    // The padding has the CLI's bound (--mask-crop 0 to 4096).
    let wide = KleinRequest {
        mask_crop_padding: 4097,
        ..cropped
    };
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &wide, &mut rgba, m) });
    assert_eq!(status, KLEIN_ERROR_USER, "{message}");
    assert_mentions(&message, &["mask_crop_padding 4097", "0 to 4096"]);
    unsafe { klein_pipeline_free(pipeline) };
}

/// Records each preview call: (step, total, image, width, height, first RGB byte).
unsafe extern "C" fn record_preview(
    user_data: *mut std::ffi::c_void,
    step: u32,
    total: u32,
    image: u32,
    rgb: *const u8,
    width: u32,
    height: u32,
) -> i32 {
    // SAFETY: the test passes a `Vec` as user data and the library `width * height * 3` bytes.
    let calls = unsafe { &mut *user_data.cast::<Vec<(u32, u32, u32, u32, u32, usize)>>() };
    let pixels = unsafe { std::slice::from_raw_parts(rgb, (width * height * 3) as usize) };
    calls.push((step, total, image, width, height, pixels.len()));
    0
}

/// `preview_every` with a preview callback: called every 2 of 4 steps for both images of the
/// batch, with 1/8-size RGB; the images are those made without previews.
#[test]
fn c_requests_get_step_previews() {
    use KleinStatus::*;
    let (bundle, library) = c_paths();
    let options = cpu_options(&library, 1);
    let pipeline = load(&bundle, &options);
    // SAFETY (every call): valid pointers, NUL-terminated strings, a live pipeline.
    let mut calls: Vec<(u32, u32, u32, u32, u32, usize)> = Vec::new();
    let request = KleinRequest {
        prompt: c"an owl".as_ptr(),
        seed: 8,
        width: 64,
        height: 32,
        steps: 4,
        guidance: 0.0,
        num_images: 2,
        reference_paths: ptr::null(),
        reference_count: 0,
        negative_prompt: ptr::null(),
        image_path: ptr::null(),
        mask_path: ptr::null(),
        strength: 0.0,
        preview_every: 2,
        preview: Some(record_preview),
        preview_user_data: (&mut calls as *mut Vec<_>).cast(),
        mask_crop: 0,
        mask_crop_padding: 0,
    };
    let mut with = vec![0u8; 2 * 64 * 32 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &request, &mut with, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    assert_eq!(
        calls,
        vec![
            (2, 4, 0, 8, 4, 96),
            (2, 4, 1, 8, 4, 96),
            (4, 4, 0, 8, 4, 96),
            (4, 4, 1, 8, 4, 96)
        ]
    );
    let plain = KleinRequest {
        preview_every: 0,
        ..request
    };
    let mut without = vec![0u8; 2 * 64 * 32 * 4];
    let (status, message) = call(|m| unsafe { generate_into(pipeline, &plain, &mut without, m) });
    assert_eq!((status, message.as_str()), (KLEIN_OK, ""));
    assert_eq!(with, without);
    unsafe { klein_pipeline_free(pipeline) };
}
