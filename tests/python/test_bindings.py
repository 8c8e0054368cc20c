"""The Python bindings (python/): the same files as the CLI, output types, the GIL, the callback,
errors, and the type stubs. scripts/test.sh builds the CLI and installs the wheel first."""

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import klein_runtime as klein
import numpy as np
import pytest
from PIL import Image

SIZE = ["--width", "64", "--height", "64"]


@pytest.fixture(scope="module")
def pipe(tiny_bundle: Path) -> klein.Pipeline:
    return klein.Pipeline(tiny_bundle)


def cli(klein_bin: Path, tiny_bundle: Path, out: Path, prompt: str, *args: str) -> None:
    """`klein generate` with the same options the bindings get."""
    command = [str(klein_bin), "generate", prompt, "--model", str(tiny_bundle), "-o", str(out), "-q", *args]
    subprocess.run(command, check=True, timeout=120, capture_output=True)


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


def test_no_model_is_the_bundled_tiny_model(klein_bin, tmp_path, monkeypatch):
    """`klein.Pipeline()` with no model named and no KLEIN_MODEL runs the bundled tiny model, as
    `klein generate` does without --model: the same directory in the cache, the same PNG."""
    monkeypatch.delenv("KLEIN_MODEL", raising=False)
    monkeypatch.setenv("KLEIN_CACHE_DIR", str(tmp_path / "cache"))
    pipe = klein.Pipeline()
    assert pipe.bundle_dir.parent == tmp_path / "cache" / "bundled"
    assert pipe.bundle_dir == klein.tiny_model_dir()
    out = pipe("a fox", width=64, height=64, generator=7, output_type="png")
    command = [str(klein_bin), "generate", "a fox", "-o", str(tmp_path / "a.png"), "-q", *SIZE, "--seed", "7"]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    assert out.images == [(tmp_path / "a.png").read_bytes()]


def test_png_is_the_cli_file(pipe, klein_bin, tiny_bundle, tmp_path):
    cli(klein_bin, tiny_bundle, tmp_path / "a.png", "a fox", *SIZE, "--seed", "7")
    out = pipe(prompt="a fox", width=64, height=64, generator=7, output_type="png")
    assert out.images == [(tmp_path / "a.png").read_bytes()]
    assert (out.seed, out.width, out.height, out.steps) == (7, 64, 64, 4)
    assert out.device == "cpu"
    assert {"encode prompt", "denoise", "decode"} <= set(out.timings)
    assert all(seconds >= 0 for seconds in out.timings.values())


def test_two_images_are_the_cli_files(pipe, klein_bin, tiny_bundle, tmp_path):
    cli(klein_bin, tiny_bundle, tmp_path / "out.png", "two owls", *SIZE, "--seed", "11", "--num-images", "2")
    out = pipe("two owls", width=64, height=64, generator=11, num_images_per_prompt=2, output_type="png")
    assert out.images == [(tmp_path / f"out-{i}.png").read_bytes() for i in (1, 2)]
    assert out.images[0] != out.images[1]


def test_reference_path_is_the_cli_file(pipe, klein_bin, tiny_bundle, repo, tmp_path):
    # A JPEG with an EXIF rotation; the output size comes from it (96x72 -> 96x64).
    reference = str(repo / "tests" / "fixtures" / "reference" / "orient6.jpg")
    cli(klein_bin, tiny_bundle, tmp_path / "r.png", "make it snow", "--seed", "5", "--ref", reference)
    out = pipe("make it snow", image=reference, generator=5, output_type="png")
    assert out.images == [(tmp_path / "r.png").read_bytes()]
    assert out.references == [reference]
    assert Image.open(io.BytesIO(out.images[0])).text["references"] == f'["{reference}"]'
    # The file's bytes, named as the path: decoded as the file is (EXIF rotation included).
    encoded = klein.EncodedImage(Path(reference).read_bytes(), reference)
    assert pipe("make it snow", image=encoded, generator=5, output_type="png").images == out.images


def test_a_reference_read_once_from_a_pipe(pipe, repo, tmp_path):
    # A FIFO can be read once: the header check and the decode share one read.
    reference = repo / "tests" / "fixtures" / "reference" / "orient6.jpg"
    fifo = tmp_path / "ref.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(reference.read_bytes()))
    writer.start()
    out = pipe("make it snow", image=str(fifo), generator=5, output_type="png")
    writer.join(timeout=60)
    expected = pipe("make it snow", image=str(reference), generator=5, output_type="png")
    assert np.array_equal(pixels(out.images[0]), pixels(expected.images[0]))


def test_a_premultiplied_image_is_its_straight_alpha_image(pipe):
    # PIL converts "La" only to "LA"; klein takes it as that image.
    straight = Image.fromarray(np.random.default_rng(4).integers(0, 256, (72, 96, 2), dtype=np.uint8), "LA")
    premultiplied = straight.convert("La")
    got = pipe("a fox", image=premultiplied, width=64, height=64, generator=2, output_type="png")
    want = pipe("a fox", image=premultiplied.convert("LA"), width=64, height=64, generator=2, output_type="png")
    assert np.array_equal(pixels(got.images[0]), pixels(want.images[0]))


def synthetic() -> Image.Image:
    rng = np.random.default_rng(3)
    return Image.fromarray(rng.integers(0, 256, (72, 96, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize("source", ["rgba.png", "palette.png", "gray16.png", "synthetic"])
def test_pil_reference_has_the_cli_pixels(pipe, klein_bin, tiny_bundle, repo, tmp_path, source):
    if source == "synthetic":
        image = synthetic()
    else:
        image = Image.open(repo / "tests" / "fixtures" / "reference" / source)
        image.load()
    mode = image.mode
    saved = tmp_path / "ref.png"
    image.save(saved)
    cli(klein_bin, tiny_bundle, tmp_path / "p.png", "a painting", *SIZE, "--seed", "9", "--ref", str(saved))
    out = pipe("a painting", image=[image], width=64, height=64, generator=9, output_type="png")
    assert image.mode == mode  # the caller's image is not converted
    expected = (tmp_path / "p.png").read_bytes()
    assert np.array_equal(pixels(out.images[0]), pixels(expected))
    ours, theirs = Image.open(io.BytesIO(out.images[0])).text, Image.open(io.BytesIO(expected)).text
    assert ours.pop("references") == '["image-0"]'
    assert theirs.pop("references") == f'["{saved}"]'
    assert ours == theirs


def test_pil_and_np_outputs(pipe):
    pil = pipe("a lighthouse", width=64, height=64, generator=4, num_images_per_prompt=2)
    array = pipe("a lighthouse", width=64, height=64, generator=4, num_images_per_prompt=2, output_type="np")
    png = pipe("a lighthouse", width=64, height=64, generator=4, num_images_per_prompt=2, output_type="png")
    assert [image.mode for image in pil.images] == ["RGB", "RGB"]
    assert [image.size for image in pil.images] == [(64, 64), (64, 64)]
    assert array.images.dtype == np.float32 and array.images.shape == (2, 64, 64, 3)
    expected = np.stack([np.asarray(image, dtype=np.float32) / 255 for image in pil.images])
    assert np.array_equal(array.images, expected)
    assert array.images.min() >= 0.0 and array.images.max() <= 1.0
    assert all(np.array_equal(np.asarray(a), pixels(b)) for a, b in zip(pil.images, png.images, strict=True))
    (images,) = pipe("a lighthouse", width=64, height=64, generator=4, return_dict=False)
    assert np.array_equal(np.asarray(images[0]), np.asarray(pil.images[0]))


def test_generators_and_random_seeds(pipe):
    class Generator:  # torch.Generator's interface
        def initial_seed(self) -> int:
            return 4

    a = pipe("a lighthouse", width=64, height=64, generator=Generator(), output_type="np")
    b = pipe("a lighthouse", width=64, height=64, generator=[4], output_type="np")
    assert a.seed == b.seed == 4 and np.array_equal(a.images, b.images)
    random = pipe("a lighthouse", width=64, height=64, output_type="np")
    again = pipe("a lighthouse", width=64, height=64, generator=random.seed, output_type="np")
    assert np.array_equal(random.images, again.images)
    # Random seeds are drawn as the CLI and the server draw them: below 2^53 (JSON clients keep them
    # exact), from the whole range (1,000 draws all below 2^52 would have odds of 2^-1000).
    seeds = {klein.random_seed() for _ in range(1000)} | {random.seed}
    assert max(seeds) < 2**53 and max(seeds) >= 2**52 and len(seeds) > 990


def test_generation_releases_the_gil(pipe):
    pipe("warm up", width=64, height=64, generator=1, num_inference_steps=1)
    counter = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before = counter
        start = time.monotonic()
        pipe("a fox", width=64, height=64, generator=1, num_inference_steps=30)
        elapsed = time.monotonic() - start
        moved = counter - before
    finally:
        stop.set()
        spinner.join(timeout=10)
    # Held for the whole call, the counter could not have moved at all.
    assert moved > 10_000, (moved, elapsed)


def test_devices_this_build_lacks_are_refused_at_construction(tiny_bundle):
    # klein.DEVICES: this build's kinds in auto's order, the CPU last.
    assert klein.DEVICES[-1] == "cpu" and set(klein.DEVICES) <= {"cuda", "coreml", "cpu"}, klein.DEVICES
    missing = [kind for kind in ("cuda", "coreml") if kind not in klein.DEVICES]
    # The test command's wheel has neither (python/Cargo.toml's features): both are checked there.
    for kind in missing:
        with pytest.raises(klein.InvalidInputError, match="rebuild with `--features") as error:
            klein.Pipeline(tiny_bundle, device=kind)
        assert error.value.param == "device", error.value


def test_callback_steps_and_cancel(pipe):
    steps: list[tuple[int, int]] = []
    done = pipe("a fox", width=64, height=64, generator=2, callback=lambda s, t: steps.append((s, t)), output_type="np")
    assert steps == [(1, 4), (2, 4), (3, 4), (4, 4)]

    seen: list[int] = []

    def stop_at_two(step: int, total: int) -> bool:
        seen.append(step)
        return step < 2

    with pytest.raises(klein.CancelledError, match="cancelled"):
        # Guidance on the distilled tiny model warns: a warning of this call, not of the next.
        pipe("a fox", width=64, height=64, generator=2, guidance_scale=5, callback=stop_at_two)
    assert seen == [1, 2]

    def boom(step: int, total: int) -> None:
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        pipe("a fox", width=64, height=64, generator=2, callback=boom)
    # The pipeline is still usable, and gives the same image, with no warning of the failed calls.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again = pipe("a fox", width=64, height=64, generator=2, output_type="np")
    assert np.array_equal(done.images, again.images)
    assert not [str(w.message) for w in caught if issubclass(w.category, klein.KleinWarning)]


def test_a_callback_calling_its_own_pipeline_is_refused(pipe):
    # It would wait for its own generation forever; the error comes out of the outer call.
    def again(step: int, total: int) -> None:
        pipe("a hen", width=64, height=64, num_inference_steps=1)

    with pytest.raises(klein.InvalidInputError, match="running the generation whose callback"):
        pipe("a fox", width=64, height=64, num_inference_steps=2, callback=again)
    with pytest.raises(klein.InvalidInputError, match="running the generation whose callback"):
        pipe("a fox", width=64, height=64, num_inference_steps=2, callback=lambda s, t: pipe.set_loras([]))
    assert pipe("a fox", width=64, height=64, num_inference_steps=1).images  # still usable


def test_getters_answer_during_a_generation(pipe):
    pipe("a fox", width=64, height=64, num_inference_steps=1)  # the graphs loaded
    # From the generation's own callback: no refusal (they lock nothing)...
    seen: list[tuple[str, str]] = []
    pipe(
        "a fox",
        width=64,
        height=64,
        num_inference_steps=2,
        callback=lambda s, t: seen.append((pipe.device_used, pipe.bundle_sha256())),
    )
    assert seen and all(used == "cpu" and len(sha) == 64 for used, sha in seen), seen
    # ... and from another thread at once, not after the generation.
    started, release = threading.Event(), threading.Event()

    def hold(step: int, total: int) -> None:
        started.set()
        release.wait(timeout=60)

    worker = threading.Thread(target=lambda: pipe("a fox", width=64, height=64, num_inference_steps=2, callback=hold))
    worker.start()
    try:
        assert started.wait(timeout=60)
        answered = threading.Event()
        reader = threading.Thread(target=lambda: (pipe.device_used, pipe.bundle_sha256(), answered.set()))
        reader.start()
        assert answered.wait(timeout=10), "the getters waited for the generation"
        reader.join()
    finally:
        release.set()
        worker.join(timeout=60)


def test_ctrl_c_cancels(tiny_bundle):
    """A SIGINT while Rust runs is seen at the next step: KeyboardInterrupt, long before the end.

    The interrupt is sent from another thread once step 1 is reported (a timer started before the
    call raced the 1000 tiny steps, which take under a second when the machine is idle). The child
    installs Python's SIGINT handler itself: started from a background job, it inherits SIGINT
    ignored, and Python then leaves it ignored (a terminal user has the handler)."""
    script = textwrap.dedent(
        f"""
        import _thread, signal, threading
        import klein_runtime as klein
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pipe = klein.Pipeline({str(tiny_bundle)!r})
        seen = []
        def on_step(step, total):
            seen.append(step)
            if step == 1:
                threading.Thread(target=_thread.interrupt_main).start()
        try:
            pipe("a fox", width=64, height=64, generator=1, num_inference_steps=1000, callback=on_step)
            print("finished", len(seen))
        except KeyboardInterrupt:
            print("interrupted", len(seen))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    word, steps = result.stdout.split()
    assert word == "interrupted", result.stdout
    assert int(steps) < 1000


def test_invalid_input(pipe, tiny_bundle, tmp_path):
    # The library's words, as the CLI and the C API say it: the wrapper no longer checks bounds itself.
    bound = "width 8000 is out of range: it must be between 16 and 4096"
    with pytest.raises(klein.InvalidInputError, match=bound) as error:
        pipe("a fox", width=8000, height=64)
    assert isinstance(error.value, ValueError) and isinstance(error.value, klein.KleinError)
    missing = tmp_path / "missing.png"
    with pytest.raises(klein.InvalidInputError, match=re.escape(str(missing))):
        pipe("a fox", image=str(missing), width=64, height=64)
    unreadable = tmp_path / "notes.png"
    unreadable.write_bytes(b"these are not the pixels you are looking for")
    with pytest.raises(klein.InvalidInputError, match=re.escape(str(unreadable))):
        pipe("a fox", image=unreadable, width=64, height=64)
    nowhere = tmp_path / "no-bundle-here"
    with pytest.raises(klein.InvalidInputError, match=re.escape(str(nowhere))):
        klein.Pipeline(nowhere)
    for count in (0, -1, 17):
        with pytest.raises(
            klein.InvalidInputError, match=f"num_images_per_prompt is {count}: it must be between 1 and 16"
        ):
            pipe("a fox", width=64, height=64, num_images_per_prompt=count)
    with pytest.raises(klein.InvalidInputError, match="model must be a bundle directory's path"):
        klein.Pipeline(123)
    for field, arguments in (("prompt", ("a \ud800 fox",)), ("negative_prompt", ("a fox",))):
        kwargs = {"negative_prompt": "\udfff"} if field == "negative_prompt" else {}
        with pytest.raises(
            klein.InvalidInputError, match=f"{field} is not valid text: character [0-9]+ is a lone surrogate"
        ):
            pipe(*arguments, width=64, height=64, **kwargs)
    with pytest.raises(klein.InvalidInputError, match=re.escape("image[0] is an empty image (0x0)")):
        pipe("a fox", image=Image.new("RGB", (0, 0)), width=64, height=64)
    with pytest.raises(klein.InvalidInputError, match="num_inference_steps"):
        pipe("a fox", width=64, height=64, num_inference_steps=-1)
    # Out of range says the range.
    with pytest.raises(klein.InvalidInputError, match="generator is -1: it must be between 0 and 18446744073709551615"):
        pipe("a fox", width=64, height=64, generator=-1)
    with pytest.raises(klein.InvalidInputError, match="output_type"):
        pipe("a fox", output_type="latent")
    with pytest.raises(klein.InvalidInputError, match=r"image\[1\]"):
        pipe("a fox", image=[synthetic(), 3])
    with pytest.raises(klein.InvalidInputError, match="device"):
        klein.Pipeline(tiny_bundle, device="tpu")
    with pytest.raises(klein.InvalidInputError, match="nothing.safetensors"):
        pipe.set_loras([("nothing.safetensors", 0.5)])
    assert pipe.loras == []
    # Wrong types name their argument, as the native checks do.
    for call, param in [
        (lambda: pipe.set_loras(5), "loras"),
        (lambda: pipe.set_loras({"a.safetensors"}), "loras"),
        (lambda: klein.Pipeline(tiny_bundle, cpu_cache=5), "cpu_cache"),
        (lambda: klein.Pipeline(tiny_bundle, prompt_cache=5), "prompt_cache"),
        (lambda: klein.Pipeline(tiny_bundle, prompt_cache=".", prompt_cache_max_mib="1"), "prompt_cache_max_mib"),
        (lambda: klein.Pipeline(tiny_bundle, prompt_cache=".", prompt_cache_max_mib=0), "prompt_cache_max_mib"),
        (lambda: klein.Pipeline(tiny_bundle, prompt_cache_max_mib=5), "prompt_cache_max_mib"),  # no directory
        (lambda: klein.Pipeline(tiny_bundle, cpu_cache_max_gib=5), "cpu_cache_max_gib"),  # no directory
        (lambda: klein.Pipeline(tiny_bundle, cpu_cache=".", cpu_cache_max_gib=0), "cpu_cache_max_gib"),
        (
            lambda: klein.Pipeline(tiny_bundle, prompt_cache=".", prompt_cache_max_mib=klein.MAX_PROMPT_CACHE_MIB + 1),
            "prompt_cache_max_mib",
        ),
        (lambda: klein.Pipeline(tiny_bundle, ort_lib=5), "ort_lib"),
        (lambda: klein.Pipeline(tiny_bundle, vae_tiling=2), "vae_tiling"),
        (lambda: klein.Pipeline(tiny_bundle, threads=-1), "threads"),
        (lambda: klein.EncodedImage("not bytes"), "image"),
        (lambda: pipe("a fox", num_inference_steps=0), "num_inference_steps"),
        (lambda: pipe("a fox", guidance_scale=float("nan")), "guidance_scale"),
        (lambda: pipe("a fox", width=-64), "width"),
        (lambda: pipe(["a fox"]), "prompt"),
        (lambda: pipe("a fox", image=Image.new("RGB", (0, 0))), "image"),
        (lambda: pipe.inpaint("a fox", image=synthetic(), padding_mask_crop=10**6), "padding_mask_crop"),
    ]:
        with pytest.raises(klein.InvalidInputError) as error:
            call()
        assert error.value.param == param, (param, error.value)
        assert param.split("_")[0] in str(error.value), error.value
    # klein's own bounds (the token budget, the reference count, the prompt's bytes), named as
    # the caller's argument too.
    for call, param in [
        (lambda: pipe("a fox", width=2304, height=2304), "width"),
        (lambda: pipe.inpaint("a fox", image=synthetic(), image_reference=[synthetic()] * 11), "image_reference"),
        (lambda: pipe("a" * (klein.MAX_PROMPT_BYTES + 1)), "prompt"),
        (lambda: pipe("a fox", negative_prompt="a" * (klein.MAX_PROMPT_BYTES + 1)), "negative_prompt"),
        # Errors of klein's own checks, named by the argument their message is about.
        (lambda: pipe.set_loras([("nothing.safetensors", 0.5)]), "loras"),
        (lambda: klein.Pipeline(tiny_bundle, loras=[("nothing.safetensors", 0.5)]), "loras"),
        (lambda: pipe.set_loras([("x.safetensors", "a")]), "loras"),
        (lambda: pipe("a fox", generator=-1), "generator"),
        (lambda: pipe("a fox", generator=[1, 2]), "generator"),
        (lambda: pipe.inpaint("a fox", image=synthetic(), strength=0), "strength"),
        (lambda: pipe("a fox", width=64, height=64, negative_prompt="blurry"), "negative_prompt"),
        (lambda: pipe("a fox", output_type="pt"), "output_type"),
        (lambda: pipe("a fox", callback=5), "callback"),
        (lambda: pipe.inpaint("a fox", image=synthetic(), padding_mask_crop=8), "padding_mask_crop"),
        (lambda: pipe.inpaint("a fox", image=[synthetic(), synthetic()]), "image"),
        (lambda: klein.Pipeline(tiny_bundle, vae_tiling="maybe"), "vae_tiling"),
        (lambda: klein.Pipeline(tiny_bundle, vae_tile_size=100), "vae_tile_size"),
        (lambda: klein.Pipeline(tiny_bundle, device="tpu"), "device"),
        (lambda: klein.Pipeline(tiny_bundle, vae_tiling="off", vae_tile_size=512), "vae_tile_size"),
    ]:
        with pytest.raises(klein.InvalidInputError) as error:
            call()
        assert error.value.param == param, (param, error.value)
    closed = synthetic()
    closed.close()
    with pytest.raises(klein.InvalidInputError, match=r"image\[0\]"):
        pipe("a fox", image=closed, width=64, height=64)


def test_loras_tiling_and_an_empty_negative_prompt_as_diffusers_users_give_them(pipe, tiny_bundle, tiny_lora):
    # A dict of path: scale keeps its scales; scales read back as given.
    pipe.set_loras({tiny_lora: 0.8})
    try:
        assert pipe.loras == [(tiny_lora, 0.8)]
        by_dict = pipe("a fox", width=64, height=64, generator=1, num_inference_steps=1, output_type="np")
        pipe.set_loras([(tiny_lora, 0.8)])
        by_pair = pipe("a fox", width=64, height=64, generator=1, num_inference_steps=1, output_type="np")
        assert np.array_equal(by_dict.images, by_pair.images)
    finally:
        pipe.set_loras(None)
    # diffusers' default negative prompt, "", is no negative prompt: accepted on a distilled model.
    plain = pipe("a fox", width=64, height=64, generator=1, num_inference_steps=1, output_type="np")
    empty = pipe("a fox", width=64, height=64, generator=1, num_inference_steps=1, output_type="np", negative_prompt="")
    assert np.array_equal(plain.images, empty.images)
    # Booleans turn tiling on or off (False was read as "auto").
    images = {}
    for tiling in (True, "on", False, "off"):
        tiled = klein.Pipeline(tiny_bundle, vae_tiling=tiling)
        images[tiling] = tiled("a harbour", width=176, height=112, generator=2, num_inference_steps=1, output_type="np")
    assert np.array_equal(images[True].images, images["on"].images)
    assert np.array_equal(images[False].images, images["off"].images)
    assert not np.array_equal(images["on"].images, images["off"].images)


def test_bundle_properties(pipe, tiny_bundle):
    assert (pipe.model_name, pipe.variant) == ("klein-tiny", "tiny")
    assert pipe.default_steps == 4 and pipe.is_distilled
    assert (pipe.default_width, pipe.default_height) == (1024, 1024)
    assert pipe.bundle_dir == tiny_bundle
    assert pipe.device == "cpu"
    assert len(pipe.bundle_sha256()) == 64
    assert klein.find_ort_library().name.startswith(("libonnxruntime", "onnxruntime"))
    assert (klein.MAX_SIDE, klein.MAX_BATCH, klein.MAX_REFERENCES) == (4096, 16, 10)


def stub_names(node: ast.AST) -> set[str]:
    """The public classes, functions and annotated constants a stub defines."""
    names = set()
    for item in getattr(node, "body", []):
        if isinstance(item, (ast.ClassDef, ast.FunctionDef)):
            names.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            names.add(item.target.id)
    return {name for name in names if not name.startswith("_")}


def test_type_stubs_match_the_native_module():
    native = klein._klein
    stubs = ast.parse((Path(klein.__file__).parent / "_klein.pyi").read_text())
    public = {name for name in dir(native) if not name.startswith("_")}
    assert stub_names(stubs) == public
    for cls in stubs.body:
        if isinstance(cls, ast.ClassDef):
            members = {name for name in dir(getattr(native, cls.name)) if not name.startswith("_")}
            if issubclass(getattr(native, cls.name), BaseException):
                members -= {"args", "with_traceback", "add_note"}
                if cls.name != "KleinError":  # what KleinError's stub declares is inherited
                    members -= set(dir(native.KleinError))
            assert stub_names(cls) == members, cls.name
    assert (Path(klein.__file__).parent / "py.typed").is_file()


def test_negative_prompt_needs_a_base_model(pipe):
    # The tiny model is distilled: no guidance, so a negative prompt would change nothing.
    with pytest.raises(klein.InvalidInputError, match="distilled"):
        pipe("a fox", width=64, height=64, generator=1, negative_prompt="blurry")
    # Guidance changes nothing there: run, with a warning (as the CLI and the server say).
    with pytest.warns(klein.KleinWarning, match="guidance 3.5 is ignored: klein-tiny is a distilled model"):
        pipe("a fox", width=64, height=64, generator=1, guidance_scale=3.5, num_inference_steps=1)


def test_vae_tiling_is_the_cli_file(tiny_bundle, klein_bin, tmp_path):
    cli(klein_bin, tiny_bundle, tmp_path / "t.png", "a harbour", "--width", "176", "--height", "112", "--seed", "2",
        "--vae-tiling", "on")  # fmt: skip
    tiled = klein.Pipeline(tiny_bundle, vae_tiling="on")
    out = tiled("a harbour", width=176, height=112, generator=2, output_type="png")
    assert out.images == [(tmp_path / "t.png").read_bytes()]
    with pytest.raises(klein.InvalidInputError, match="vae_tiling"):
        klein.Pipeline(tiny_bundle, vae_tiling="sometimes")
    # A tile size turns tiling on, as --vae-tile-size does.
    cli(klein_bin, tiny_bundle, tmp_path / "s.png", "a harbour", "--width", "176", "--height", "112", "--seed", "2",
        "--vae-tile-size", "128")  # fmt: skip
    sized = klein.Pipeline(tiny_bundle, vae_tile_size=128)
    out = sized("a harbour", width=176, height=112, generator=2, output_type="png")
    assert out.images == [(tmp_path / "s.png").read_bytes()]
    with pytest.raises(klein.InvalidInputError, match="VAE tile size 100"):
        klein.Pipeline(tiny_bundle, vae_tile_size=100)


def test_release_transformer_is_the_cli_file(tiny_bundle, klein_bin, tmp_path):
    # The CLI releases the transformer before its decode; the bindings keep it unless asked.
    cli(klein_bin, tiny_bundle, tmp_path / "r.png", "a lighthouse", *SIZE, "--seed", "4")
    released = klein.Pipeline(tiny_bundle, release_transformer=True)
    for call in range(2):  # the second call loads the transformer again
        out = released("a lighthouse", width=64, height=64, generator=4, output_type="png")
        assert out.images == [(tmp_path / "r.png").read_bytes()], call
        assert "load transformer" in out.timings, call
    kept = klein.Pipeline(tiny_bundle)
    kept("a lighthouse", width=64, height=64, generator=4)
    assert "load transformer" not in kept("a lighthouse", width=64, height=64, generator=4).timings


def test_an_input_image_error_names_its_argument(pipe, tmp_path):
    """`error.param` names the argument whose image klein could not use (as an API's 400 names the
    field), or whose number or length is out of range."""
    source, unreadable = tmp_path / "source.png", tmp_path / "notes.png"
    synthetic().resize((100, 72)).save(source)
    unreadable.write_bytes(b"these are not the pixels you are looking for")
    cases = [
        ("image", lambda: pipe("a fox", image=[str(source), unreadable], width=64, height=64)),
        ("image", lambda: pipe.inpaint("a fox", image=unreadable)),
        ("mask_image", lambda: pipe.inpaint("a fox", image=str(source), mask_image=unreadable)),
        ("image_reference", lambda: pipe.inpaint("a fox", image=str(source), image_reference=unreadable)),
        # With padding_mask_crop: the mask's size against the source's is the mask's fault...
        ("mask_image", lambda: pipe.inpaint("a fox", image=synthetic().resize((100, 72)),
                                            mask_image=Image.new("RGB", (50, 36), "white"), padding_mask_crop=8)),
        # ... a source too small to generate from is the source's.
        ("image", lambda: pipe.inpaint("a fox", image=Image.new("RGB", (8, 8)),
                                       mask_image=Image.new("RGB", (8, 8), "white"), padding_mask_crop=8)),
        ("width", lambda: pipe("a fox", width=8000, height=64)),
        ("image", lambda: pipe("a fox", image=[str(source)] * 11, width=64, height=64)),  # the list's length
    ]  # fmt: skip
    for param, call in cases:
        with pytest.raises(klein.InvalidInputError) as error:
            call()
        assert error.value.param == param, (param, str(error.value))
    with pytest.raises(klein.InvalidInputError, match="mask_image-0"):  # a PIL mask, labelled as such
        pipe.inpaint("a fox", image=str(source), mask_image=Image.new("RGB", (50, 36)), padding_mask_crop=8)


def test_inpaint_is_the_cli_file(pipe, klein_bin, tiny_bundle, tmp_path):
    """`pipe.inpaint` (source and mask as paths, then as PIL images) gives `klein generate --image
    --mask --strength`'s file; without a mask it is img2img."""
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    synthetic().resize((100, 72)).save(source)
    black_left = Image.new("RGB", (50, 36), "white")
    black_left.paste((0, 0, 0), (0, 0, 20, 36))
    black_left.save(mask)
    args = ["--image", str(source), "--mask", str(mask), "--strength", "0.75", "--seed", "9"]
    cli(klein_bin, tiny_bundle, tmp_path / "k.png", "a hat", *args)
    out = pipe.inpaint("a hat", image=str(source), mask_image=str(mask), strength=0.75, generator=9, output_type="png")
    assert out.images == [(tmp_path / "k.png").read_bytes()]
    assert (out.width, out.height) == (96, 64)
    text = Image.open(io.BytesIO(out.images[0])).text
    assert (text["strength"], text["mask"], text["image"]) == ("0.75", "yes", str(source))
    pil = pipe.inpaint("a hat", image=Image.open(source), mask_image=black_left, strength=0.75, generator=9)
    assert np.array_equal(np.asarray(pil.images[0]), pixels(out.images[0]))

    cli(klein_bin, tiny_bundle, tmp_path / "i.png", "a hat", "--image", str(source), "--seed", "9")
    img2img = pipe.inpaint("a hat", image=str(source), generator=9, output_type="png")
    assert img2img.images == [(tmp_path / "i.png").read_bytes()]
    assert img2img.images != out.images
    # height/width: ignored, as diffusers ignores them here: the source's size, with a warning when
    # another size is given.
    sized = pipe.inpaint("a hat", image=str(source), mask_image=str(mask), strength=0.75, generator=9,
                         width=96, height=64, output_type="png")  # fmt: skip
    assert sized.images == out.images
    with pytest.warns(klein.KleinWarning, match="width 64 and height 48 are ignored"):
        other = pipe.inpaint("a hat", image=str(source), mask_image=str(mask), strength=0.75, generator=9,
                             width=64, height=48, output_type="png")  # fmt: skip
    assert other.images == out.images
    with pytest.raises(klein.InvalidInputError, match="strength 2 must be above 0"):
        pipe.inpaint("a hat", image=str(source), strength=2, generator=9)
    with pytest.raises(klein.InvalidInputError, match="one source image"):
        pipe.inpaint("a hat", image=[str(source), str(source)])


def test_a_transparent_mask_is_the_white_one(pipe, klein_bin, tiny_bundle, tmp_path, inpaint_inputs):
    """`mask_transparent=True` (OpenAI's edits) repaints the mask's fully transparent pixels: the
    image of `--mask` with those pixels white, the others black, for a PIL mask and for a file (also
    with `padding_mask_crop`); a mask without an alpha channel is refused."""
    source, white, transparent = tmp_path / "source.png", tmp_path / "white.png", tmp_path / "transparent.png"
    inpaint_inputs.source.save(source)
    inpaint_inputs.white.save(white)
    inpaint_inputs.transparent.save(transparent)
    cli(
        klein_bin, tiny_bundle, tmp_path / "k.png", "a hat", "--image", str(source), "--mask", str(white), "--seed", "3"
    )
    want = pixels((tmp_path / "k.png").read_bytes())
    for mask in (inpaint_inputs.transparent, str(transparent)):
        out = pipe.inpaint("a hat", image=str(source), mask_image=mask, mask_transparent=True, generator=3,
                           output_type="png")  # fmt: skip
        assert np.array_equal(pixels(out.images[0]), want)
    plain = pipe.inpaint("a hat", image=str(source), mask_image=str(transparent), generator=3, output_type="png")
    assert not np.array_equal(pixels(plain.images[0]), want)  # the same file read as white-repaints

    full = inpaint_inputs.transparent.resize((100, 72), Image.NEAREST)
    full_white = inpaint_inputs.white.resize((100, 72), Image.NEAREST)
    full_white.save(tmp_path / "full.png")
    crop = ["--image", str(source), "--mask", str(tmp_path / "full.png"), "--mask-crop", "8", "--seed", "3"]
    cli(klein_bin, tiny_bundle, tmp_path / "c.png", "a hat", *crop)
    out = pipe.inpaint("a hat", image=str(source), mask_image=full, mask_transparent=True, padding_mask_crop=8,
                       generator=3, output_type="png")  # fmt: skip
    assert np.array_equal(pixels(out.images[0]), pixels((tmp_path / "c.png").read_bytes()))
    with pytest.raises(klein.InvalidInputError, match="white.png: OpenAI's mask is a PNG with an alpha channel"):
        pipe.inpaint("a hat", image=str(source), mask_image=str(white), mask_transparent=True)


def test_padding_mask_crop_is_the_cli_file(pipe, klein_bin, tiny_bundle, tmp_path):
    """`pipe.inpaint(padding_mask_crop=)` (paths, then PIL images) gives `klein generate --mask-crop`'s
    file, at the whole source's size; a crop without a mask is refused."""
    source, mask = tmp_path / "source.png", tmp_path / "mask.png"
    synthetic().resize((100, 72)).save(source)
    box = Image.new("RGB", (100, 72))
    box.paste((255, 255, 255), (40, 20, 64, 44))
    box.save(mask)
    args = ["--image", str(source), "--mask", str(mask), "--mask-crop", "8", "--seed", "9"]
    cli(klein_bin, tiny_bundle, tmp_path / "c.png", "a hat", *args)
    out = pipe.inpaint("a hat", image=str(source), mask_image=str(mask), padding_mask_crop=8, generator=9,
                       output_type="png")  # fmt: skip
    assert out.images == [(tmp_path / "c.png").read_bytes()]
    assert (out.width, out.height) == (100, 72)
    assert Image.open(io.BytesIO(out.images[0])).text["mask_crop"] == "8"
    pil = pipe.inpaint("a hat", image=Image.open(source), mask_image=box, padding_mask_crop=8, generator=9)
    assert np.array_equal(np.asarray(pil.images[0]), pixels(out.images[0]))
    with pytest.raises(klein.InvalidInputError, match="padding_mask_crop needs a mask_image"):
        pipe.inpaint("a hat", image=str(source), padding_mask_crop=8)


def test_previews_are_the_cli_preview_files(pipe, klein_bin, tiny_bundle, tmp_path):
    """`preview=` gets PIL previews every `preview_every` steps and after the last, the last one
    equal to the file `klein generate --preview` leaves; returning False cancels."""
    seen = []
    out = pipe(
        "an owl",
        width=64,
        height=48,
        generator=6,
        num_inference_steps=5,
        preview_every=2,
        preview=lambda step, total, images: seen.append((step, total, images)),
    )
    assert [(s, t) for s, t, _ in seen] == [(2, 5), (4, 5), (5, 5)]
    assert all(len(images) == 1 and images[0].size == (8, 6) for _, _, images in seen)
    cli(
        klein_bin,
        tiny_bundle,
        tmp_path / "o.png",
        "an owl",
        "--width",
        "64",
        "--height",
        "48",
        "--seed",
        "6",
        "--steps",
        "5",
        "--preview",
        str(tmp_path / "p.png"),
        "--preview-every",
        "2",
    )
    assert np.array_equal(np.asarray(seen[-1][2][0]), np.asarray(Image.open(tmp_path / "p.png")))
    assert np.array_equal(np.asarray(out.images[0]), np.asarray(Image.open(tmp_path / "o.png")))
    with pytest.raises(klein.CancelledError):
        pipe("an owl", width=64, height=48, generator=6, preview=lambda *_: False)


def test_cpu_cache_is_the_cli_file(tiny_bundle, klein_bin, tmp_path):
    """A pipeline with `cpu_cache` saves the graphs on its first load and reads them on the next;
    both give `klein generate`'s file (made without the cache)."""
    cli(klein_bin, tiny_bundle, tmp_path / "c.png", "a quay", "--width", "64", "--height", "48", "--seed", "4")
    cache = tmp_path / "cpu-cache"
    for _ in range(2):
        pipe = klein.Pipeline(tiny_bundle, cpu_cache=cache)
        out = pipe("a quay", width=64, height=48, generator=4, output_type="png")
        assert out.images == [(tmp_path / "c.png").read_bytes()]
    saved = sorted(p.name for p in cache.glob("*/*.onnx"))
    assert saved == ["text_encoder.onnx", "transformer.onnx", "vae_decoder.onnx"]


def test_prompt_cache_is_the_cli_file(tiny_bundle, klein_bin, tmp_path):
    """A pipeline with `prompt_cache` writes one entry per prompt, and a later pipeline reads it
    instead of encoding (an entry rewritten with other values is what comes back); with and
    without the entry the image is `klein generate`'s."""
    cli(klein_bin, tiny_bundle, tmp_path / "c.png", "a quay", "--width", "64", "--height", "48", "--seed", "4")
    cache = tmp_path / "prompts"
    for _ in range(2):
        pipe = klein.Pipeline(tiny_bundle, prompt_cache=cache, prompt_cache_max_mib=64)
        out = pipe("a quay", width=64, height=48, generator=4, output_type="png")
        assert out.images == [(tmp_path / "c.png").read_bytes()]
    (entry,) = cache.glob("*.safetensors")
    data = bytearray(entry.read_bytes())
    data[-4:] = np.float32(1e3).tobytes()  # the last embedding value, in the entry's data
    entry.write_bytes(bytes(data))
    pipe = klein.Pipeline(tiny_bundle, prompt_cache=cache)
    out = pipe("a quay", width=64, height=48, generator=4, output_type="png")
    assert out.images != [(tmp_path / "c.png").read_bytes()], "the entry was not read"


def test_an_inpainting_reference_is_labelled_as_its_argument(pipe, inpaint_inputs):
    out = pipe.inpaint("a hat", image=inpaint_inputs.source, image_reference=synthetic(), num_inference_steps=1)
    assert out.references == ["image_reference-0"]
    png = pipe.inpaint(
        "a hat", image=inpaint_inputs.source, image_reference=synthetic(), num_inference_steps=1, output_type="png"
    )
    assert Image.open(io.BytesIO(png.images[0])).text["references"] == '["image_reference-0"]'


def test_names_that_are_not_utf8_tuples_of_loras_and_arguments_named(
    pipe, tiny_bundle, tiny_lora, tmp_path, monkeypatch
):
    """A file whose name is not UTF-8 (``os.fsdecode``'s surrogates) is read as ``model=`` is;
    a tuple of LoRAs is a sequence of LoRAs, not one pair; errors about one argument name it."""
    source = tmp_path / "source.png"
    synthetic().resize((80, 72)).save(source)
    odd = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xff.png")
    shutil.copy(source, odd)

    def images(image):
        return pipe("a fox", image=image, generator=3, num_inference_steps=1, output_type="np").images

    want = images(str(source))
    assert np.array_equal(images(odd), want)
    assert np.array_equal(images(klein.EncodedImage(source.read_bytes(), "a\udcff")), want)
    # The source's own size, given: floored as the output is (80x72 generates 80x64).
    out = pipe.inpaint("a fox", image=odd, width=80, height=72, generator=3, num_inference_steps=1)
    assert out.images[0].size == (80, 64)

    lora = Path(tiny_lora)
    odd_lora = os.fsdecode(os.fsencode(str(tmp_path)) + b"/\xfe.safetensors")
    shutil.copy(lora, odd_lora)
    try:
        pipe.set_loras((str(lora), odd_lora + ":0.5"))  # a tuple of two LoRAs, one "FILE:SCALE"
        assert pipe.loras == [(lora, 1.0), (Path(odd_lora), 0.5)]
        pipe.set_loras((str(lora), 0.25))  # one (path, scale) pair
        assert pipe.loras == [(lora, 0.25)]
        pipe.set_loras(((str(lora), 0.5), (odd_lora, 0.25)))
        assert pipe.loras == [(lora, 0.5), (Path(odd_lora), 0.25)]
    finally:
        pipe.set_loras(None)

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for param, call in [
        ("cpu_cache", lambda: klein.Pipeline(tiny_bundle, cpu_cache=not_a_dir)),
        ("prompt_cache", lambda: klein.Pipeline(tiny_bundle, prompt_cache=not_a_dir)),
        ("ort_lib", lambda: klein.Pipeline(tiny_bundle, ort_lib=tmp_path / "missing.so")),
    ]:
        monkeypatch.delenv("KLEIN_MODEL", raising=False)
        with pytest.raises(klein.InvalidInputError) as error:
            call()
        assert error.value.param == param, str(error.value)
    # No model named: the bundled tiny model, written to the cache directory; one that cannot be
    # made is named, with how to choose another.
    monkeypatch.setenv("KLEIN_CACHE_DIR", str(not_a_dir / "cache"))
    with pytest.raises(klein.InvalidInputError) as error:
        klein.Pipeline()
    assert error.value.param == "model" and "KLEIN_CACHE_DIR" in str(error.value), str(error.value)
