//! The CLI's output files: paths checked before generating (a directory, a path ending in a
//! separator, an unwritable directory, a name too long, numbered files beside a device, an unknown
//! extension, a preview over another file), the
//! format the extension names, and an interrupted run that leaves nothing behind.

use std::path::Path;

use crate::cli::{files_in, generate, path_str, FAST};
use crate::util::temp_dir;

/// `-o DIR --num-images 2` and `-o newdir/` are refused before generating, and nothing is
/// written beside the directory.
#[test]
fn a_directory_as_output_is_refused_before_generating() {
    let parent = temp_dir("outputs-dir");
    let dir = parent.join("pictures");
    std::fs::create_dir(&dir).unwrap();
    let run = generate("a cat", &dir, &[&FAST[..], &["--num-images", "2"]].concat());
    run.assert_user_error(&[path_str(&dir), "is a directory"]);
    assert_eq!(files_in(&parent), ["pictures"], "{}", run.describe());
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());

    let new_dir = format!("{}/", parent.join("newdir").display());
    let run = generate("a cat", Path::new(&new_dir), &FAST);
    run.assert_user_error(&["newdir/", "names a directory"]);
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());
    assert_eq!(files_in(&parent), ["pictures"], "{}", run.describe());
}

/// An output in a directory that cannot be written (sysfs: no new files, also for root) is
/// refused before generating, naming the directory.
#[cfg(target_os = "linux")]
#[test]
fn an_unwritable_directory_is_refused_before_generating() {
    let run = generate("a cat", Path::new("/sys/klein.png"), &FAST);
    run.assert_user_error(&[
        "/sys/klein.png",
        "/sys: create a file",
        "a directory you can write to",
    ]);
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());
}

/// A file name too long for its temporary file, and numbered outputs asked of a device path, are
/// refused before generating; nothing is written (before, `/dev/null --num-images 2` wrote the
/// files `/dev/null-1` and `/dev/null-2`).
#[test]
fn long_names_and_numbered_device_outputs_are_refused() {
    let dir = temp_dir("outputs-long-name");
    let long = dir.join(format!("{}.png", "n".repeat(230)));
    let run = generate("a cat", &long, &FAST);
    run.assert_user_error(&["the file name is 234 bytes long", "at most 220"]);
    assert!(files_in(&dir).is_empty(), "{}", run.describe());
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());

    #[cfg(unix)]
    {
        // A short name whose symbolic link leads to a long one: the file written is the target,
        // with its temporary file beside it, so the target's name is measured.
        let link = dir.join("short.png");
        std::os::unix::fs::symlink(&long, &link).unwrap();
        let run = generate("a cat", &link, &FAST);
        run.assert_user_error(&[
            "short.png (the file its link leads to,",
            "the file name is 234 bytes long",
        ]);
        assert_eq!(files_in(&dir), ["short.png"], "{}", run.describe());
        std::fs::remove_file(&link).unwrap();

        let device = Path::new("/dev/null");
        let run = generate(
            "a cat",
            device,
            &[&FAST[..], &["--num-images", "2"]].concat(),
        );
        run.assert_user_error(&["/dev/null is not a file", "numbered files"]);
        assert!(!Path::new("/dev/null-1").exists(), "{}", run.describe());
    }
}

/// The extension names the format: JPEG and WebP are written as such, an unknown one is refused
/// with the list of formats.
#[test]
fn the_extension_names_the_format() {
    let dir = temp_dir("outputs-format");
    let jpeg = dir.join("out.JPG");
    generate("a cat", &jpeg, &[&FAST[..], &["--seed", "1"]].concat()).assert_success(&[&jpeg]);
    let bytes = std::fs::read(&jpeg).unwrap();
    assert_eq!(&bytes[..3], &[0xFF, 0xD8, 0xFF], "a JPEG");
    assert_eq!(&bytes[2..4], &[0xFF, 0xFE], "a comment segment first");
    let length = usize::from(u16::from_be_bytes([bytes[4], bytes[5]]));
    let comment = String::from_utf8_lossy(&bytes[6..4 + length]);
    assert!(
        comment.contains("\"seed\":\"1\""),
        "settings in the comment: {comment}"
    );

    let webp = dir.join("out.webp");
    generate("a cat", &webp, &FAST).assert_success(&[&webp]);
    let bytes = std::fs::read(&webp).unwrap();
    assert_eq!((&bytes[..4], &bytes[8..12]), (&b"RIFF"[..], &b"WEBP"[..]));

    let gif = dir.join("out.gif");
    let run = generate("a cat", &gif, &FAST);
    run.assert_user_error(&["not .gif", ".png, .jpg, .jpeg or .webp"]);
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());
    assert_eq!(files_in(&dir), ["out.JPG", "out.webp"]);
}

/// A `--preview` that names the output or an input image is refused before generating, and the
/// files are left as they were.
#[test]
fn a_preview_over_an_output_or_an_input_is_refused() {
    let dir = temp_dir("outputs-preview");
    let out = dir.join("out.png");
    let run = generate(
        "a cat",
        &out,
        &[&FAST[..], &["--preview", path_str(&out)]].concat(),
    );
    run.assert_user_error(&["--preview", "is also an output (-o)"]);
    assert!(!run.stderr.contains("seed:"), "{}", run.describe());
    assert!(files_in(&dir).is_empty(), "{:?}", files_in(&dir));

    let source = dir.join("source.png");
    image::RgbImage::from_pixel(64, 64, image::Rgb([200, 30, 30]))
        .save(&source)
        .unwrap();
    let before = std::fs::read(&source).unwrap();
    // The same file by another spelling.
    let spelled = dir.join(".").join("source.png");
    let extra = [
        "--image",
        path_str(&source),
        "--strength",
        "0.5",
        "--preview",
    ];
    let run = generate(
        "a cat",
        &out,
        &[&FAST[..], &extra, &[path_str(&spelled)]].concat(),
    );
    run.assert_user_error(&["--preview", "is also the source image (--image)"]);
    assert_eq!(std::fs::read(&source).unwrap(), before);
    assert_eq!(files_in(&dir), ["source.png"]);

    // An output not yet written, spelled with `..`.
    let sub = dir.join("sub");
    std::fs::create_dir(&sub).unwrap();
    let roundabout = sub.join("..").join("sub").join("new.png");
    let run = generate(
        "a cat",
        &sub.join("new.png"),
        &[&FAST[..], &["--preview", path_str(&roundabout)]].concat(),
    );
    run.assert_user_error(&["--preview", "is also an output (-o)"]);

    // An output over the mask or a reference: refused, the input kept (in-place edits of the
    // source image stay allowed).
    for flag in ["--mask", "--ref"] {
        let mut args = vec!["--image", path_str(&source), "--strength", "0.5"];
        args.extend([flag, path_str(&spelled)]);
        let run = generate("a cat", &source, &[&FAST[..], &args].concat());
        run.assert_user_error(&["is also", flag, "another file name"]);
        assert_eq!(std::fs::read(&source).unwrap(), before);
    }
}

/// `klein ARGS OUT` interrupted (SIGINT) 1.5 s after it started.
#[cfg(unix)]
fn interrupted_after(args: &[&str], out: &Path) -> std::process::Output {
    let started = std::time::Instant::now();
    crate::cli::interrupted_klein(
        args.iter()
            .map(std::ffi::OsStr::new)
            .chain([out.as_os_str()]),
        || started.elapsed() > std::time::Duration::from_millis(1500),
    )
}

/// SIGINT while generating: exit 130, no output and no temporary file.
#[cfg(unix)]
#[test]
fn an_interrupted_run_leaves_nothing() {
    let dir = temp_dir("outputs-interrupt");
    let out = dir.join("out.png");
    // The bundle's default 1024x1024 with many steps: long enough to be interrupted.
    let args = [
        "generate",
        "a cat",
        "--steps",
        "50",
        "--num-images",
        "2",
        "-o",
    ];
    let output = interrupted_after(&args, &out);
    assert_eq!(output.status.code(), Some(130), "{:?}", output.status);
    assert!(
        files_in(&dir).is_empty(),
        "left behind: {:?}",
        files_in(&dir)
    );
}

/// Ctrl-C says where it stopped: `interrupted at step k/N` while denoising (1,000 steps of a 64x64
/// image from the tiny model: 1.5 s in, it is denoising), and exits 130.
#[cfg(unix)]
#[test]
fn an_interrupt_says_at_which_step_it_stopped() {
    let dir = temp_dir("interrupted-step");
    let out = dir.join("fox.png");
    let args = [
        "generate", "a fox", "--steps", "1000", "--width", "64", "--height", "64", "-o",
    ];
    let output = interrupted_after(&args, &out);
    assert_eq!(output.status.code(), Some(130), "{:?}", output.status);
    let stderr = String::from_utf8_lossy(&output.stderr);
    let at = stderr
        .lines()
        .find_map(|l| l.strip_prefix("klein: interrupted at step "))
        .unwrap_or_else(|| panic!("no step named: {stderr}"));
    let (step, total) = at.split_once('/').unwrap();
    assert_eq!(total, "1000", "{stderr}");
    assert!(step.parse::<usize>().unwrap() < 1000, "{stderr}");
    assert!(!out.exists());
}
