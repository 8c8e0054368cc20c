"""The web page of `klein serve` in a real browser: Debian's Chromium driven by Playwright. What a
person does on the page (type, pick files, paint a mask, cancel, reuse a result) gives the file
`klein generate` writes for the same settings, byte for byte. Screenshots of each state are left in
target/test-output/web/."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from PIL import Image
from playwright.sync_api import Browser, Page, expect, sync_playwright
from test_serve import LONG, Server, cli_png

PROMPT = "a red fox in the snow"
REFS = Path(__file__).parents[1] / "fixtures" / "reference"
SHOTS = Path(__file__).parents[2] / "target" / "test-output" / "web"
# Steps of the tiny model take milliseconds; a page step (a click after an event) takes tens.
TIMEOUT_MS = 60_000


def chromium() -> str:
    """Debian's Chromium (scripts/test.sh installs the `chromium` package); Playwright's own browser
    download needs a host this project cannot reach."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    pytest.fail("no Chromium on PATH: install Debian's chromium package (scripts/test.sh does, as root)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium())
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def server(klein_bin: Path, tiny_bundle: Path) -> Iterator[Server]:
    s = Server(klein_bin, tiny_bundle)
    yield s
    assert s.stop() == 0


def open_page(browser: Browser, url: str, **context) -> tuple[Page, list[str]]:
    """The page, loaded; the list collects its script errors and any request to another origin."""
    page = browser.new_context(accept_downloads=True, **context).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"script error: {error}"))
    page.on(
        "request",
        lambda request: None if request.url.startswith((url, "data:", "blob:")) else problems.append(request.url),
    )
    page.goto(f"{url}/")
    return page, problems


@pytest.fixture
def page(browser: Browser, server: Server) -> Iterator[Page]:
    page, problems = open_page(browser, server.url, viewport={"width": 1280, "height": 900})
    expect(page.locator("#server-status")).to_have_text("ready")
    yield page
    page.context.close()
    assert not problems


def settings(page: Page, *, width: int, height: int, steps: int, seed: int | None = None) -> None:
    page.select_option("#size-preset", "custom")
    page.fill("#width", str(width))
    page.fill("#height", str(height))
    page.fill("#steps", str(steps))
    if seed is not None:
        page.fill("#seed", str(seed))
        page.check("#seed-lock")


def download(page: Page, card_index: int = 0) -> bytes:
    with page.expect_download() as info:
        page.locator("#gallery .card").nth(card_index).locator("a.download").first.click()
    return Path(info.value.path()).read_bytes()


def set_range(page: Page, selector: str, value: float) -> None:
    """A slider moved to `value`, as a drag ends: the value set, then its input event."""
    page.eval_on_selector(
        selector, "(e, v) => { e.value = v; e.dispatchEvent(new Event('input', {bubbles: true})); }", str(value)
    )


def shot(page: Page, name: str) -> None:
    page.screenshot(path=SHOTS / f"{name}.png", full_page=True)


def test_generate_streams_previews_and_downloads_the_cli_png(
    page: Page, klein_bin: Path, tiny_bundle: Path, tmp_path: Path
):
    shot(page, "01-empty")
    page.fill("#prompt", PROMPT)
    settings(page, width=64, height=64, steps=3, seed=21)
    page.evaluate(
        """window.previews = [];
        new MutationObserver(() => window.previews.push(document.getElementById('preview').src))
            .observe(document.getElementById('preview'), {attributes: true, attributeFilter: ['src']});"""
    )
    page.focus("#prompt")
    page.keyboard.press("Control+Enter")
    expect(page.locator("#gallery .card")).to_have_count(1)
    # One preview a step, each a PNG the stream sent.
    previews = page.evaluate("window.previews")
    assert len(previews) == 3 and all(p.startswith("data:image/png;base64,") for p in previews)
    expect(page.locator("#progress-text")).to_contain_text("done")
    expect(page.locator("#seed")).to_have_value("21")
    shot(page, "02-generated")
    args = (PROMPT, "--width", "64", "--height", "64", "--steps", "3", "--seed", "21")
    want = cli_png(klein_bin, tiny_bundle, tmp_path, *args)
    assert [download(page)] == want


def test_references_are_uploaded_and_composed(page: Page, klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    page.set_input_files("#refs-input", [str(REFS / "gray.png")])
    # The second dropped on the box, as a file dragged from the desktop.
    dropped = page.evaluate_handle(
        """(b64) => {
            const data = new DataTransfer();
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            data.items.add(new File([bytes], 'wide.png', {type: 'image/png'}));
            return data;
        }""",
        base64.b64encode((REFS / "wide.png").read_bytes()).decode(),
    )
    page.dispatch_event("#refs-drop", "drop", {"dataTransfer": dropped})
    expect(page.locator("#refs-list img")).to_have_count(2)
    expect(page.locator("#refs-count")).to_contain_text("2 of up to 10")
    page.get_by_role("button", name="Remove reference wide.png").click()
    expect(page.locator("#refs-list img")).to_have_count(1)
    page.fill("#prompt", "the same in red")
    settings(page, width=64, height=64, steps=2, seed=5)
    shot(page, "03-reference")
    page.click("#generate")
    expect(page.locator("#gallery .card")).to_have_count(1)
    shutil.copy(REFS / "gray.png", tmp_path / "gray.png")
    args = ("the same in red", "--ref", "gray.png", "--width", "64", "--height", "64", "--steps", "2", "--seed", "5")
    assert [download(page)] == cli_png(klein_bin, tiny_bundle, tmp_path, *args, cwd=tmp_path)
    shot(page, "04-composed")


def test_a_painted_mask_inpaints_as_the_cli_does(
    page: Page, klein_bin: Path, tiny_bundle: Path, tmp_path: Path, inpaint_inputs
):
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    inpaint_inputs.source.save(cli_dir / "source.png")
    page.check("input[name=mode][value=inpaint]")
    expect(page.locator("#refs-field")).to_be_hidden()
    page.set_input_files("#source-input", str(cli_dir / "source.png"))
    canvas = page.locator("#mask-canvas")
    expect(canvas).to_be_visible()

    def at(fx: float, fy: float) -> tuple[float, float]:
        """The point at (fx, fy) of the canvas's width and height, on screen now."""
        canvas.scroll_into_view_if_needed()
        box = canvas.bounding_box()
        assert box is not None
        return box["x"] + box["width"] * fx, box["y"] + box["height"] * fy

    # A stroke across the middle, then part of it erased at its right end.
    set_range(page, "#brush-size", 40)
    page.mouse.move(*at(0.2, 0.5))
    page.mouse.down()
    page.mouse.move(*at(0.8, 0.5), steps=10)
    page.mouse.up()
    page.check("input[name=tool][value=eraser]")
    page.mouse.click(*at(0.8, 0.5))
    set_range(page, "#strength", 0.8)
    expect(page.locator("#strength-value")).to_have_text("0.80")
    page.fill("#prompt", "a hat")
    page.fill("#steps", "3")
    page.fill("#seed", "4")
    page.check("#seed-lock")  # the size: the source's, floored (96x64)
    shot(page, "05-mask-painted")
    with page.expect_request("**/v1/klein/generate/stream") as request:
        page.click("#generate")
    body = json.loads(request.value.post_data or "{}")
    expect(page.locator("#gallery .card")).to_have_count(1)
    shot(page, "06-inpainted")

    assert (body["image"]["name"], body["mask"]["name"], body["strength"]) == ("source.png", "mask.png", 0.8)
    (cli_dir / "mask.png").write_bytes(base64.b64decode(body["mask"]["data"]))
    mask = np.asarray(Image.open(cli_dir / "mask.png").convert("L"))
    assert mask.shape == (72, 100)
    # White where painted (the stroke's middle), black where not (the corners) and where erased.
    assert mask[36, 50] == 255 and mask[2, 2] == 0 and mask[70, 98] == 0 and mask[36, 80] == 0
    args = ("a hat", "--image", "source.png", "--mask", "mask.png", "--strength", "0.8", "--steps", "3", "--seed", "4")
    (want,) = cli_png(klein_bin, tiny_bundle, cli_dir, *args, cwd=cli_dir)
    assert download(page) == want
    assert Image.open(cli_dir / "cli.png").size == (96, 64)


def test_cancel_stops_a_50_step_run_midway(page: Page):
    page.fill("#prompt", "a long one")
    settings(page, width=256, height=256, steps=50, seed=1)
    page.click("#generate")
    expect(page.locator("#progress-text")).to_have_text(re.compile(r"step ([3-9]|[1-4]\d)/50"))
    shot(page, "07-running")
    page.click("#cancel")
    expect(page.locator("#progress-text")).to_contain_text("cancelled at step")
    step = int(re.search(r"cancelled at step (\d+)/50", page.inner_text("#progress-text")).group(1))
    assert 3 <= step < 50
    expect(page.locator("#generate")).to_be_enabled()
    expect(page.locator("#gallery .card")).to_have_count(0)
    shot(page, "08-cancelled")


def test_the_queue_position_shows_while_another_request_runs(page: Page, server: Server):
    other = threading.Thread(
        target=lambda: httpx.post(
            f"{server.url}/v1/klein/generate", json=LONG, headers={"X-Request-Id": "web-long"}, timeout=120
        )
    )
    other.start()
    try:
        deadline = time.monotonic() + 30
        while server.metric("klein_jobs_running") < 1:
            assert time.monotonic() < deadline, "the other request never ran"
            time.sleep(0.05)
        page.fill("#prompt", "after the other one")
        settings(page, width=32, height=32, steps=1, seed=2)
        page.click("#generate")
        expect(page.locator("#progress-text")).to_have_text("waiting: 1 ahead in the queue")
        shot(page, "09-queued")
    finally:
        httpx.delete(f"{server.url}/v1/klein/jobs/web-long")
        other.join()
    expect(page.locator("#gallery .card")).to_have_count(1)


def test_loras_are_picked_with_their_scales(
    browser: Browser, klein_bin: Path, tiny_bundle: Path, tiny_lora: Path, tmp_path: Path
):
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(tiny_lora, loras / "style.safetensors")
    server = Server(klein_bin, tiny_bundle, "--lora-dir", str(loras))
    try:
        page, problems = open_page(browser, server.url)
        expect(page.locator("#loras-field")).to_be_visible()
        page.get_by_label("style").check()
        page.fill("#lora-scale-0", "0.8")
        page.fill("#prompt", PROMPT)
        settings(page, width=64, height=64, steps=2, seed=3)
        page.click("#generate")
        expect(page.locator("#gallery .card")).to_have_count(1)
        expect(page.locator("#gallery .card .params")).to_contain_text("LoRAs style:0.8")
        shot(page, "10-lora")
        png = download(page)
        args = ["--width", "64", "--height", "64", "--steps", "2", "--seed", "3"]
        (cli,) = cli_png(
            klein_bin, tiny_bundle, tmp_path, PROMPT, *args, "--lora", f"{loras / 'style.safetensors'}:0.8"
        )
        # The pixels of the CLI's file; the server names the LoRA, the CLI its path.
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(Image.open(io.BytesIO(cli))))
        assert Image.open(io.BytesIO(png)).text["loras"] == '["style:0.8"]'
        page.context.close()
        assert not problems
    finally:
        assert server.stop() == 0


def test_a_result_is_reused_and_kept_across_a_reload(page: Page):
    page.fill("#prompt", "a lighthouse")
    settings(page, width=64, height=48, steps=2)
    page.uncheck("#seed-lock")
    page.click("#generate")
    expect(page.locator("#gallery .card")).to_have_count(1)
    seed = page.input_value("#seed")  # the random seed the server chose, shown
    assert seed.isdigit()
    first = download(page)
    assert page.inner_text("#gallery .card .params").endswith(f"seed {seed}")

    page.reload()
    expect(page.locator("#gallery .card")).to_have_count(1)
    page.fill("#prompt", "something else")
    page.fill("#steps", "4")
    page.select_option("#size-preset", "512x512")
    page.click("#gallery .card button.reuse")
    assert (page.input_value("#prompt"), page.input_value("#steps")) == ("a lighthouse", "2")
    assert (page.input_value("#width"), page.input_value("#height"), page.input_value("#seed")) == ("64", "48", seed)
    assert page.is_checked("#seed-lock")
    shot(page, "11-reused")
    page.click("#generate")
    expect(page.locator("#gallery .card")).to_have_count(2)
    assert download(page, 0) == first


def test_errors_show_next_to_their_field(page: Page):
    page.fill("#prompt", "x")
    page.select_option("#size-preset", "custom")
    page.fill("#width", "100")
    page.fill("#height", "64")
    expect(page.locator("#size-note")).to_contain_text("100 × 64 gives 96 × 64")
    page.click("#generate")
    expect(page.locator("#gallery .card")).to_have_count(1)
    expect(page.locator("#warnings")).to_contain_text("96")
    page.fill("#width", "5000")
    page.click("#generate")
    error = page.locator("#err-size")
    expect(error).to_be_visible()
    expect(error).to_contain_text("4096")
    expect(page.locator("#width")).to_have_attribute("aria-invalid", "true")
    expect(page.locator("#run-error")).to_be_hidden()
    shot(page, "12-bad-size")
    page.fill("#width", "64")
    page.fill("#steps", "0")
    page.click("#generate")
    expect(page.locator("#err-steps")).to_be_visible()
    expect(page.locator("#err-size")).to_be_hidden()


def test_the_page_asks_for_the_api_key_and_sends_it(browser: Browser, klein_bin: Path, tiny_bundle: Path):
    server = Server(klein_bin, tiny_bundle, "--api-key", "s3cret")
    try:
        page, problems = open_page(browser, server.url)
        dialog = page.locator("#key-dialog")
        expect(dialog).to_be_visible()
        page.fill("#api-key", "wrong")
        page.click("#key-save")
        expect(page.locator("#key-message")).to_contain_text("refused")
        shot(page, "13-api-key")
        page.fill("#api-key", "s3cret")
        page.click("#key-save")
        expect(page.locator("#server-status")).to_have_text("ready")
        page.fill("#prompt", "x")
        settings(page, width=32, height=32, steps=1)
        page.click("#generate")
        expect(page.locator("#gallery .card")).to_have_count(1)
        page.context.close()
        assert not problems
    finally:
        assert server.stop() == 0


def test_base_model_controls_follow_the_model(
    browser: Browser, page: Page, klein_bin: Path, tiny_bundle: Path, tmp_path: Path
):
    """A distilled model shows no guidance or negative prompt; a base model shows both and sends them.
    The base bundle is the tiny bundle with `is_distilled` false: the same graphs, run as diffusers
    runs a base model (guidance above 1 runs the negative prompt's pass)."""
    expect(page.locator("#guidance")).to_be_hidden()
    expect(page.locator("#negative")).to_be_hidden()
    base = tmp_path / "klein-tiny-base"
    shutil.copytree(tiny_bundle, base)
    manifest = json.loads((base / "manifest.json").read_text())
    manifest["model"]["is_distilled"] = False
    (base / "manifest.json").write_text(json.dumps(manifest))
    server = Server(klein_bin, base)
    try:
        base_page, problems = open_page(browser, server.url)
        expect(base_page.locator("#guidance")).to_be_visible()
        base_page.fill("#prompt", PROMPT)
        base_page.fill("#negative", "blurry")
        base_page.fill("#guidance", "2.5")
        settings(base_page, width=64, height=64, steps=2, seed=3)
        base_page.click("#generate")
        expect(base_page.locator("#gallery .card")).to_have_count(1)
        shot(base_page, "14-base-model")
        args = (PROMPT, "--negative-prompt", "blurry", "--guidance", "2.5", "--width", "64", "--height", "64")
        assert [download(base_page)] == cli_png(klein_bin, base, tmp_path, *args, "--steps", "2", "--seed", "3")
        base_page.context.close()
        assert not problems
    finally:
        assert server.stop() == 0


def test_phone_width_labels_focus_and_weight(browser: Browser, server: Server):
    page, problems = open_page(browser, server.url, viewport={"width": 390, "height": 844}, is_mobile=True)
    expect(page.locator("#server-status")).to_have_text("ready")
    # Nothing wider than the phone's screen.
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    # Every control has a label a screen reader reads.
    unlabelled = page.evaluate(
        """[...document.querySelectorAll('input, select, textarea')]
            .filter((e) => e.labels.length === 0 && !e.getAttribute('aria-label')).map((e) => e.id)"""
    )
    assert unlabelled == []
    # Focus follows the form: the prompt first, then the settings, Generate before the results.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.id") == "prompt"
    order = []
    for _ in range(30):
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id || document.activeElement.name"))
    assert order.index("size-preset") < order.index("steps") < order.index("seed") < order.index("generate")
    shot(page, "15-phone")
    page.context.close()
    assert not problems
    # The page with all its assets, as sent.
    sizes = [len(httpx.get(f"{server.url}{path}").content) for path in ("/", "/web/app.js", "/web/app.css")]
    assert sum(sizes) < 200_000, sizes


def test_no_web_serves_the_api_only(klein_bin: Path, tiny_bundle: Path):
    server = Server(klein_bin, tiny_bundle, "--no-web")
    try:
        assert httpx.get(f"{server.url}/").status_code == 404
        assert httpx.get(f"{server.url}/v1/models").status_code == 200
        assert not any("web page" in line for line in server.log)
    finally:
        assert server.stop() == 0
