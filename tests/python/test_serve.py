"""`klein serve` against the CLI: the official `openai` client, curl and plain HTTP get the bytes
`klein generate` writes for the same options; progress streams, cancellation, the queue's 429,
timeouts, auth, metrics, graceful shutdown; and every kind of bad request gets a 400 (or 401,
404, 413) whose JSON body names the field, without harming the server."""

from __future__ import annotations

import base64
import gzip
import io
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest
from PIL import Image

PROMPT = "a red fox in the snow"
# A long job on the tiny model (~10-20 s at 128x128, 1000 steps), cut short by the tests that use it.
LONG = {"prompt": "a long one", "width": 128, "height": 128, "steps": 1000, "seed": 1}


class Server:
    """A `klein serve` process on a free port of 127.0.0.1, stopped with the fixture."""

    def __init__(self, klein_bin: Path, bundle: Path, *args: str, env: dict[str, str] | None = None):
        self.process = subprocess.Popen(
            [str(klein_bin), "serve", "--model", str(bundle), "--port", "0", *args],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: list[str] = []
        deadline = time.monotonic() + 60
        assert self.process.stderr is not None
        while True:
            line = self.process.stderr.readline()
            assert line, f"klein serve exited: {''.join(self.log)}"
            self.log.append(line)
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match:
                self.url = match.group(1)
                break
            assert time.monotonic() < deadline, "klein serve did not start"
        threading.Thread(target=self._drain, daemon=True).start()
        self.wait_ready()

    def _drain(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while httpx.get(f"{self.url}/readyz").status_code != 200:
            assert time.monotonic() < deadline, "klein serve did not get ready"
            time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def metric(self, line_start: str, headers: dict[str, str] | None = None) -> float:
        text = httpx.get(f"{self.url}/metrics", headers=headers).text
        for line in text.splitlines():
            if line.startswith(line_start + " "):
                return float(line.split()[-1])
        return 0.0


@pytest.fixture(scope="module")
def server(klein_bin: Path, tiny_bundle: Path) -> Iterator[Server]:
    s = Server(klein_bin, tiny_bundle, "--queue", "2")
    yield s
    assert s.stop() == 0


def cli_png(klein_bin: Path, bundle: Path, tmp_path: Path, *args: str, cwd: Path | None = None) -> list[bytes]:
    """The files `klein generate` writes for these options (one, or `--num-images N` of them)."""
    out = tmp_path / "cli.png"
    subprocess.run(
        [str(klein_bin), "generate", "--model", str(bundle), "-q", "-o", str(out), *args],
        check=True,
        cwd=cwd,
    )
    if out.exists():
        return [out.read_bytes()]
    return [p.read_bytes() for p in sorted(tmp_path.glob("cli-*.png"))]


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_openai_client_gets_the_cli_images(server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    # OpenAI's settings that ask for what klein does anyway, as clients send them.
    result = client.images.generate(
        model="klein",
        prompt=PROMPT,
        n=2,
        size="64x80",
        response_format="b64_json",
        background="opaque",
        moderation="low",
        quality="auto",
        stream=False,
        safety_identifier="user-7",
        extra_body={"seed": 11},
    )
    got = [base64.b64decode(d.b64_json) for d in result.data]
    want = cli_png(
        klein_bin, tiny_bundle, tmp_path, PROMPT, "--num-images", "2", "--width", "64", "--height", "80", "--seed", "11"
    )
    assert len(got) == len(want) == 2
    assert got == want
    assert result.model_extra["seed"] == 11
    # moderation changes nothing, and the answer says so.
    assert any("moderation `low`" in w for w in result.model_extra["warnings"]), result.model_extra["warnings"]


def test_openai_edits_with_references(server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path, repo: Path):
    refs = repo / "tests" / "fixtures" / "reference"
    for name in ("gray.png", "orient6.jpg"):
        shutil.copy(refs / name, tmp_path / name)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with open(tmp_path / "gray.png", "rb") as a, open(tmp_path / "orient6.jpg", "rb") as b:
        result = client.images.edit(
            image=[a, b],
            prompt="put them together",
            size="64x64",
            background="auto",
            stream=False,
            extra_body={"seed": 5, "steps": 3},
        )
    got = base64.b64decode(result.data[0].b64_json)
    # The server labels references by upload name; the CLI by the path it is given.
    (want,) = cli_png(
        klein_bin,
        tiny_bundle,
        tmp_path,
        "put them together",
        "--ref",
        "gray.png",
        "--ref",
        "orient6.jpg",
        "--width",
        "64",
        "--height",
        "64",
        "--seed",
        "5",
        "--steps",
        "3",
        cwd=tmp_path,
    )
    assert got == want


def test_inpainting_on_both_apis_gives_the_cli_file(
    server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path, inpaint_inputs
):
    """OpenAI's edits with a mask (transparent where to edit) and the native route's image, mask
    (white repaints) and strength both give `klein generate --image --mask --strength`'s file."""
    cli_dir = tmp_path / "cli"
    cli_dir.mkdir()
    inpaint_inputs.source.save(cli_dir / "source.png")
    inpaint_inputs.white.save(cli_dir / "mask.png")
    inpaint_inputs.transparent.save(tmp_path / "mask.png")
    args = ("a hat", "--image", "source.png", "--mask", "mask.png", "--seed", "4", "--strength", "0.75")
    (want,) = cli_png(klein_bin, tiny_bundle, cli_dir, *args, cwd=cli_dir)
    assert Image.open(io.BytesIO(want)).size == (96, 64)

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    with open(cli_dir / "source.png", "rb") as image, open(tmp_path / "mask.png", "rb") as mask:
        result = client.images.edit(image=image, mask=mask, prompt="a hat", extra_body={"seed": 4, "strength": 0.75})
    assert base64.b64decode(result.data[0].b64_json) == want

    def b64(path: Path) -> str:
        return base64.b64encode(path.read_bytes()).decode()

    body = {
        "prompt": "a hat",
        "seed": 4,
        "strength": 0.75,
        "image": {"name": "source.png", "data": b64(cli_dir / "source.png")},
        "mask": {"name": "mask.png", "data": b64(cli_dir / "mask.png")},
    }
    r = httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["images"][0]) == want
    assert (r.json()["metadata"]["strength"], r.json()["metadata"]["mask"]) == ("0.75", "yes")

    # padding_mask_crop: the native route gives `--mask-crop`'s file, at the whole source's size.
    full = Image.new("RGB", (100, 72), "black")
    full.paste((255, 255, 255), (30, 20, 60, 44))
    full.save(cli_dir / "full.png")
    crop_args = ("a hat", "--image", "source.png", "--mask", "full.png", "--mask-crop", "6", "--seed", "4")
    (want,) = cli_png(klein_bin, tiny_bundle, cli_dir, *crop_args, cwd=cli_dir)
    body = {key: body[key] for key in ("prompt", "seed", "image")}
    body |= {"mask": {"name": "full.png", "data": b64(cli_dir / "full.png")}, "padding_mask_crop": 6}
    r = httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["images"][0]) == want
    assert Image.open(io.BytesIO(want)).size == (100, 72)
    assert r.json()["metadata"]["mask_crop"] == "6"


def test_a_floored_size_is_a_warning(server: Server):
    """A size that is not a multiple of 16 is floored, as diffusers floors it, and the answer says so."""
    body = {"prompt": PROMPT, "size": "100x72", "seed": 3, "steps": 1}
    response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
    assert response.status_code == 200, response.text
    warnings = response.json()["warnings"]
    assert any("width 100 is floored to 96, height 72 is floored to 64" in w for w in warnings), warnings


def test_curl_gets_the_cli_image(server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    body = json.dumps({"prompt": PROMPT, "size": "48x64", "seed": 3})
    out = subprocess.run(
        [
            "curl",
            "-sS",
            "--fail-with-body",
            f"{server.url}/v1/images/generations",
            "-H",
            "Content-Type: application/json",
            "-d",
            body,
        ],
        check=True,
        capture_output=True,
    ).stdout
    got = base64.b64decode(json.loads(out)["data"][0]["b64_json"])
    assert [got] == cli_png(klein_bin, tiny_bundle, tmp_path, PROMPT, "--width", "48", "--height", "64", "--seed", "3")


def test_native_route_returns_metadata_and_other_formats(
    server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path
):
    ref = base64.b64encode((Path(__file__).parents[1] / "fixtures" / "reference" / "gray.png").read_bytes()).decode()
    body = {
        "prompt": PROMPT,
        "seed": 9,
        "steps": 2,
        "refs": [{"name": "gray.png", "data": ref}],
        "format": "jpeg",
        "quality": 80,
    }
    r = httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert (answer["seed"], answer["steps"], answer["format"]) == (9, 2, "jpeg")
    assert answer["metadata"]["references"] == '["gray.png"]'
    assert answer["metadata"]["prompt"] == PROMPT
    assert set(answer["timings"]) >= {"encode prompt", "encode references", "denoise", "decode"}
    shutil.copy(Path(__file__).parents[1] / "fixtures" / "reference" / "gray.png", tmp_path / "gray.png")
    out = tmp_path / "cli.jpg"
    subprocess.run(
        [
            str(klein_bin),
            "generate",
            "--model",
            str(tiny_bundle),
            "-q",
            PROMPT,
            "--ref",
            "gray.png",
            "--seed",
            "9",
            "--steps",
            "2",
            "--quality",
            "80",
            "-o",
            str(out),
        ],
        check=True,
        cwd=tmp_path,
    )
    assert base64.b64decode(answer["images"][0]) == out.read_bytes()


def stream(server: Server, body: dict, headers: dict[str, str] | None = None) -> Iterator[tuple[str, dict]]:
    """The events of `POST /v1/klein/generate/stream`, parsed."""
    with httpx.stream("POST", f"{server.url}/v1/klein/generate/stream", json=body, headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                yield name, json.loads(line[len("data: ") :])


def test_stream_reports_every_step_then_the_cli_image(
    server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path
):
    events = list(stream(server, {"prompt": PROMPT, "width": 64, "height": 64, "seed": 21, "steps": 3}))
    names = [n for n, _ in events]
    assert names[0] == "queued" and names[1] == "started" and names[-1] == "done"
    assert [d["step"] for n, d in events if n == "step"] == [1, 2, 3]
    finished = [d["stage"] for n, d in events if n == "stage" and d["state"] == "finished"]
    assert finished == ["encode prompt", "denoise", "decode"]
    done = events[-1][1]
    assert done["id"] == events[0][1]["id"] and done["id"].startswith("klein-")
    # The server's ids are its own: a client may not take one, nor send a malformed one.
    for bad in ("klein-0000000000000001", "has space", "x" * 129):
        r = httpx.post(f"{server.url}/v1/klein/generate", json={"prompt": "x"}, headers={"X-Request-Id": bad})
        assert error_of(r, 400)["param"] == "X-Request-Id"
    got = base64.b64decode(done["images"][0])
    assert [got] == cli_png(
        klein_bin, tiny_bundle, tmp_path, PROMPT, "--width", "64", "--height", "64", "--seed", "21", "--steps", "3"
    )


def test_stream_sends_step_previews(server: Server, klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    """`preview_every` 2 of 5 steps: `preview` events after steps 2, 4 and 5, each a 1/8-size PNG
    of both images, byte-equal to what `klein generate --preview` writes after the last step; the
    images themselves are unchanged."""
    body = {"prompt": PROMPT, "width": 64, "height": 48, "seed": 3, "steps": 5, "num_images": 2, "preview_every": 2}
    events = list(stream(server, body))
    previews = [d for n, d in events if n == "preview"]
    assert [(p["step"], p["total"]) for p in previews] == [(2, 5), (4, 5), (5, 5)]
    for p in previews:
        assert [Image.open(io.BytesIO(base64.b64decode(i))).size for i in p["images"]] == [(8, 6), (8, 6)]
    args = ("--width", "64", "--height", "48", "--seed", "3", "--steps", "5", "--num-images", "2")
    subprocess.run(
        [str(klein_bin), "generate", "--model", str(tiny_bundle), "-q", "-o", str(tmp_path / "o.png"), PROMPT, *args]
        + ["--preview", str(tmp_path / "p.png"), "--preview-every", "2"],
        check=True,
    )
    for i, image in enumerate(previews[-1]["images"]):
        got = np.asarray(Image.open(io.BytesIO(base64.b64decode(image))))
        assert np.array_equal(got, np.asarray(Image.open(tmp_path / f"p-{i + 1}.png")))
    done = events[-1][1]
    assert [base64.b64decode(i) for i in done["images"]] == [(tmp_path / f"o-{i}.png").read_bytes() for i in (1, 2)]


def test_a_client_that_goes_away_cancels_its_generation(server: Server):
    before = server.metric("klein_abandoned_total")
    start = time.monotonic()
    # Guidance on the distilled tiny model warns: that warning is the abandoned job's, not the next one's.
    for name, data in stream(server, LONG | {"guidance": 5}):
        if name == "step" and data["step"] == 2:
            break  # closes the connection
    # The worker stops at the next step: a short request right after runs at once.
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "next", "size": "64x64"}, timeout=60)
    assert r.status_code == 200
    assert r.json()["warnings"] == [], r.json()["warnings"]
    assert time.monotonic() - start < 8, "the abandoned generation kept running"
    assert server.metric("klein_abandoned_total") == before + 1

    # Also for the plain JSON routes: a client timeout closes the connection.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/klein/generate", json=LONG, timeout=1.5)
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "next", "size": "64x64"}, timeout=60)
    assert r.status_code == 200
    assert server.metric("klein_abandoned_total") == before + 2


def test_queued_requests_can_be_cancelled_and_a_full_queue_answers_429(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle, "--queue", "1")
    try:
        running = stream(s, LONG, headers={"X-Request-Id": "long-1"})
        assert next(running)[0] == "queued"
        assert next(running)[0] == "started"
        queued = stream(s, {"prompt": "waits", "width": 64, "height": 64}, headers={"X-Request-Id": "q-1"})
        name, data = next(queued)
        assert (name, data["id"], data["position"]) == ("queued", "q-1", 1)
        # The pipeline is busy and the one queue slot is taken.
        r = httpx.post(f"{s.url}/v1/images/generations", json={"prompt": "one too many"}, timeout=10)
        err = error_of(r, 429)
        assert err["type"] == "queue_full"
        assert int(r.headers["retry-after"]) >= 1
        # The same id twice is refused while the first runs.
        err = error_of(
            httpx.post(f"{s.url}/v1/klein/generate", json={"prompt": "x"}, headers={"X-Request-Id": "long-1"}), 400
        )
        assert err["param"] == "X-Request-Id"
        # Cancel the queued one, then the running one.
        assert httpx.delete(f"{s.url}/v1/klein/jobs/q-1").status_code == 204
        assert httpx.delete(f"{s.url}/v1/klein/jobs/long-1").status_code == 204
        rest = list(running)
        assert rest[-1][0] == "error" and rest[-1][1]["error"]["type"] == "cancelled"
        rest = list(queued)
        assert [n for n, _ in rest] == ["error"] and rest[0][1]["error"]["type"] == "cancelled"
        assert httpx.delete(f"{s.url}/v1/klein/jobs/q-1").status_code == 404
        assert s.metric('klein_errors_total{kind="queue_full"}') == 1
    finally:
        assert s.stop() == 0


def test_over_max_pixels_is_refused_before_the_queue(klein_bin: Path, tiny_bundle: Path):
    """A request whose body alone is over `--max-pixels` gets its 400 while the pipeline is busy
    and the queue full, not a 429 that says to retry it (nor a wait in the queue); OpenAI's
    `output_compression` takes 0 (its range is 0 to 100)."""
    s = Server(klein_bin, tiny_bundle, "--queue", "1", "--max-pixels", "16384")
    try:
        running = stream(s, LONG, headers={"X-Request-Id": "long-2"})
        assert [next(running)[0], next(running)[0]] == ["queued", "started"]
        queued = stream(s, {"prompt": "waits", "width": 64, "height": 64}, headers={"X-Request-Id": "q-2"})
        assert next(queued)[0] == "queued"
        body = {"prompt": "x", "size": "128x128", "n": 2}  # 32768 pixels
        err = error_of(httpx.post(f"{s.url}/v1/images/generations", json=body, timeout=10), 400)
        assert err["param"] == "size" and "--max-pixels" in err["message"], err
        assert httpx.delete(f"{s.url}/v1/klein/jobs/long-2").status_code == 204
        list(running)
        list(queued)
        body = {"prompt": "x", "size": "64x64", "steps": 1, "output_format": "jpeg", "output_compression": 0}
        r = httpx.post(f"{s.url}/v1/images/generations", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert base64.b64decode(r.json()["data"][0]["b64_json"])[:2] == b"\xff\xd8"
    finally:
        assert s.stop() == 0


def test_timeout_cancels_with_504(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle, "--timeout", "1")
    try:
        start = time.monotonic()
        err = error_of(httpx.post(f"{s.url}/v1/klein/generate", json=LONG, timeout=30), 504)
        assert err["type"] == "timeout"
        assert time.monotonic() - start < 5
        events = list(stream(s, LONG))
        assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "timeout"
    finally:
        assert s.stop() == 0


def test_bearer_token(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle, env={"KLEIN_API_KEY": "s3cret"})
    try:
        body = {"prompt": PROMPT, "size": "64x64"}
        url = f"{s.url}/v1/images/generations"
        assert error_of(httpx.post(url, json=body), 401)["type"] == "authentication_error"
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert httpx.post(url, json=body, headers={"Authorization": "Bearer s3cret!"}).status_code == 401
        assert httpx.get(f"{s.url}/metrics").status_code == 401
        assert httpx.get(f"{s.url}/healthz").status_code == 200  # probes need no token
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret")
        assert client.images.generate(prompt=PROMPT, size="64x64").data[0].b64_json
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="nope").images.generate(prompt=PROMPT)
    finally:
        assert s.stop() == 0


def test_health_readiness_and_metrics(server: Server):
    assert httpx.get(f"{server.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server.url}/readyz").json()
    assert ready["status"] == "ready" and ready["model"] == "klein-tiny"
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"] == "klein-tiny"
    httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "m", "size": "64x64"}, timeout=60)
    text = httpx.get(f"{server.url}/metrics").text
    for needle in (
        "klein_queue_depth 0",
        'klein_requests_total{route="/v1/images/generations",status="200"}',
        'klein_stage_seconds_bucket{stage="denoise",le="+Inf"}',
        "klein_queue_wait_seconds_count",
        'klein_request_seconds_count{route="/v1/images/generations"}',
    ):
        assert needle in text, needle
    assert "listening on http://127.0.0.1:" in "".join(server.log)  # loopback unless told otherwise


BAD_JSON = [
    # (body, field the error must name, status)
    (b'{"prompt": "x", "size": ', None, 400),  # not JSON
    (b'["a list"]', None, 400),
    (b'{"prompt": "x", "guidance": 1e309}', "guidance", 400),  # JSON, but no double holds it
    # Values in a list, as serde would read a struct's fields from an array: still not an object.
    (b'["fox", null, null, "64x64", null, null, null, null, null, 7, 1, null, null, null]', None, 400),
    ({"size": "64x64"}, "prompt", 400),
    ({"prompt": "x", "stepz": 3}, "stepz", 400),
    ({"prompt": "x", "steps": "four"}, "steps", 400),
    ({"prompt": "x", "steps": 0}, "steps", 400),
    ({"prompt": "x", "steps": 100000}, "steps", 400),
    ({"prompt": "x", "n": 0}, "n", 400),
    ({"prompt": "x", "n": 17}, "n", 400),
    ({"prompt": "x", "size": "99999x64"}, "size", 400),
    ({"prompt": "x", "size": "big"}, "size", 400),
    ({"prompt": "x", "seed": -1}, "seed", 400),
    ({"prompt": "x", "guidance": -1}, "guidance", 400),
    ({"prompt": "x", "response_format": "url"}, "response_format", 400),
    ({"prompt": "x", "output_format": "gif"}, "output_format", 400),
    ({"prompt": "x", "output_compression": 101}, "output_compression", 400),
    ({"prompt": "x", "quality": "hd"}, "quality", 400),
    ({"prompt": "x", "negative_prompt": "blurry"}, "negative_prompt", 400),
    ({"prompt": "x", "loras": ["../../etc/passwd"]}, "loras", 400),
    ({"prompt": "x", "loras": ["/abs/style.safetensors:0.5"]}, "loras", 400),
    ({"prompt": "x" * 70000}, "prompt", 400),  # over the prompt bound
    ({"prompt": "x", "size": "2304x2304"}, "size", 400),  # over the token budget
    # Only whitespace may follow the object: a second one (and its n) is not ignored.
    (b'{"prompt": "x", "size": "64x64"}{"prompt": "y", "n": 99}', None, 400),
    (b'{"prompt": "x", "size": "64x64"} trailing', None, 400),
    ({"prompt": "x", "loras": ["a"] * 17}, "loras", 400),  # refused at the 17th, before any is resolved
]


@pytest.mark.parametrize(("body", "param", "status"), BAD_JSON)
def test_bad_generation_requests(server: Server, body, param, status):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(
        f"{server.url}/v1/images/generations", content=content, headers={"Content-Type": "application/json"}, timeout=60
    )
    err = error_of(r, status)
    assert err["param"] == param, err
    assert err["message"]


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG file that claims `width` x `height` pixels (no pixel data)."""
    import struct
    import zlib

    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))


BAD_NATIVE = [
    # A decompression bomb: refused from its header, before any pixel is allocated.
    ({"prompt": "x", "refs": [{"data": base64.b64encode(png_header(40000, 40000)).decode()}]}, "refs[0]"),
    ({"prompt": "x", "refs": [{"data": "not base64!"}]}, "refs[0].data"),
    ({"prompt": "x", "refs": [{"data": base64.b64encode(b"GIF89a not an image").decode()}]}, "refs[0]"),
    ({"prompt": "x", "refs": [{"data": base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()}]}, "refs[0]"),
    ({"prompt": "x", "refs": [{"data": ""}] * 11}, "refs"),
    ({"prompt": "x", "strength": 0.5}, "image"),
    ({"prompt": "x", "preview_every": 0}, "preview_every"),
    ({"prompt": "x", "image": {"data": "AAAA"}, "strength": 0}, "strength"),
    ({"prompt": "x", "image": {"data": "AAAA"}, "padding_mask_crop": 4}, "padding_mask_crop"),
    ({"prompt": "x", "image": {"data": "not base64!"}}, "image.data"),
    ({"prompt": "x", "image": {"data": base64.b64encode(b"GIF89a not an image").decode()}}, "image"),
    ({"prompt": "x", "width": 8}, "width"),
    ({"prompt": "x", "height": 5000}, "height"),
    ({"prompt": "x", "width": 2304, "height": 2304}, "width"),  # over the token budget
    ({"prompt": "x", "negative_prompt": "x" * 70000}, "negative_prompt"),
    ({"prompt": "x", "num_images": 99}, "num_images"),
    ({"prompt": "x", "format": "bmp"}, "format"),
    ({"prompt": "x", "quality": 50}, "quality"),  # a JPEG quality for a PNG
    ({"prompt": "x", "format": "webp", "quality": 50}, "quality"),
    (
        {"prompt": "x", "image": {"data": "AAAA"}, "mask": {"data": "AAAA"}, "padding_mask_crop": 99999},
        "padding_mask_crop",
    ),
    ({"prompt": "x", "refs": [{"data": "data:image/png;base64,AAAA"}]}, "refs[0].data"),
]


@pytest.mark.parametrize(("body", "param"), BAD_NATIVE)
def test_bad_native_requests(server: Server, body, param):
    err = error_of(httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60), 400)
    assert err["param"] == param, err


def test_uploads_are_checked_from_their_headers_before_any_is_decoded(server: Server):
    """As every front end (the library's `Pipeline::prepare`): two files that declare 2048x2048 and
    hold no pixels overflow the token budget of a 2048x2048 output (16,384 + 2 x 4,096 tokens once
    downscaled to 1 MP; at most 20,480), which is the error, about the size, not their data (the
    server used to decode every upload first). At 64x64 they fit, and the first one's data is what
    fails, named by its field; the OpenAI route answers the same about `size` and `image`."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 2048, 2048, 8, 2, 0, 0, 0)
    no_pixels = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"") + chunk(b"IEND", b"")
    empty = {"data": base64.b64encode(no_pixels).decode()}
    body = {"prompt": "x", "width": 2048, "height": 2048, "refs": [empty, empty]}
    err = error_of(httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60), 400)
    assert err["param"] == "width" and "24576 image tokens" in err["message"], err
    body |= {"width": 64, "height": 64}
    err = error_of(httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60), 400)
    assert err["param"] == "refs[0]", err
    parts = [("prompt", (None, "x")), ("size", (None, "2048x2048"))]
    parts += [("image", (f"{n}.png", no_pixels)) for n in "ab"]
    err = error_of(httpx.post(f"{server.url}/v1/images/edits", files=parts, timeout=60), 400)
    assert err["param"] == "size" and "24576 image tokens" in err["message"], err


def test_errors_are_short_json_in_the_api_shape(server: Server):
    """A wrong method gets a JSON error too (405), and an error about a value does not echo it
    whole (a base64 image where an object belongs) nor name the server's types."""
    err = error_of(httpx.get(f"{server.url}/v1/images/generations", timeout=60), 405)
    assert (err["type"], err["param"]) == ("method_not_allowed", None), err
    assert "GET" in err["message"] and "/v1/images/generations" in err["message"], err
    body = {"prompt": "x", "image": base64.b64encode(bytes(300_000)).decode()}
    err = error_of(httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60), 400)
    assert err["param"] == "image", err
    assert len(err["message"]) < 200 and "expected a JSON object" in err["message"], err
    assert "struct" not in err["message"], err


OPENAI_SETTINGS = [
    # (field, value, what the message must say): OpenAI's settings klein cannot honour, refused
    # with the reason (before this, "unknown field" named them too, without one).
    ("background", "transparent", "no alpha"),
    ("style", "vivid", "no style presets"),
    ("stream", True, "/v1/klein/generate/stream"),
    ("partial_images", 2, "/v1/klein/generate/stream"),
    ("moderation", "strict", "auto or low"),
]


@pytest.mark.parametrize(("field", "value", "reason"), OPENAI_SETTINGS)
def test_openai_settings_klein_cannot_honour(server: Server, repo: Path, field, value, reason):
    body = {"prompt": "x", "size": "64x64", field: value}
    err = error_of(httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=60), 400)
    assert err["param"] == field and reason in err["message"], err
    png = (repo / "tests" / "fixtures" / "reference" / "gray.png").read_bytes()
    text = str(value).lower() if isinstance(value, bool) else str(value)
    parts = [("prompt", (None, "x")), (field, (None, text)), ("image", ("a.png", png))]
    err = error_of(httpx.post(f"{server.url}/v1/images/edits", files=parts, timeout=60), 400)
    assert err["param"] == field and reason in err["message"], err


def test_openai_edit_settings_that_change_nothing_are_taken_with_a_warning(server: Server, repo: Path):
    png = (repo / "tests" / "fixtures" / "reference" / "gray.png").read_bytes()
    parts = [("prompt", (None, "x")), ("size", (None, "64x64")), ("steps", (None, "1")), ("image", ("a.png", png))]
    extra = [("input_fidelity", (None, "high")), ("moderation", (None, "auto")), ("partial_images", (None, "0"))]
    r = httpx.post(f"{server.url}/v1/images/edits", files=parts + extra, timeout=120)
    assert r.status_code == 200, r.text
    warnings = r.json()["warnings"]
    assert any("moderation `auto`" in w for w in warnings) and any("input_fidelity `high`" in w for w in warnings)
    for bad, param in (("stream", "maybe"), ("input_fidelity", "max")):
        err = error_of(httpx.post(f"{server.url}/v1/images/edits", files=parts + [(bad, (None, param))]), 400)
        assert err["param"] == bad and "give" in err["message"], err


def test_bad_edit_requests(server: Server, repo: Path):
    url = f"{server.url}/v1/images/edits"
    png = (repo / "tests" / "fixtures" / "reference" / "gray.png").read_bytes()
    image = ("image", ("a.png", png))
    cases = [
        # (multipart parts, field the error must name)
        ([("prompt", (None, "x"))], "image"),  # no image
        ([("prompt", (None, "x")), image, ("mask", ("m.png", png))], "mask"),  # no alpha channel
        ([("prompt", (None, "x")), image, ("strength", (None, "1.5"))], "strength"),
        ([("prompt", (None, "x")), image, ("strength", (None, "much"))], "strength"),
        ([("prompt", (None, "x")), ("colour", (None, "red")), image], "colour"),
        ([("prompt", (None, "x")), ("n", (None, "two")), image], "n"),
        ([("prompt", (None, "x")), ("image", ("a.txt", b"plain text"))], "image"),
        ([("prompt", (None, "x"))] + [image] * 11, "image"),  # over 10 references
        ([image], "prompt"),
        # A file, or bytes that are not UTF-8, where text belongs: not read with replacement characters.
        ([("prompt", ("p.png", png)), image], "prompt"),
        ([("prompt", (None, b"\xff\xfe")), image], "prompt"),
    ]
    for parts, param in cases:
        err = error_of(httpx.post(url, files=parts, timeout=60), 400)
        assert err["param"] == param, (param, err)
    rgba = io.BytesIO()
    Image.new("RGBA", (8, 8)).save(rgba, "PNG")  # a usable mask, twice
    two = [("prompt", (None, "x")), image, ("mask", ("m.png", rgba.getvalue())), ("mask", ("n.png", rgba.getvalue()))]
    err = error_of(httpx.post(url, files=two, timeout=60), 400)
    assert (err["param"], err["message"]) == ("mask", "give one mask"), err
    # A text field twice is refused, as in JSON, not the last value taken; a bad number gets its range.
    err = error_of(httpx.post(url, files=[("prompt", (None, "x")), ("prompt", (None, "y")), image], timeout=60), 400)
    assert err["param"] == "prompt" and "duplicate" in err["message"], err
    err = error_of(httpx.post(url, files=[("prompt", (None, "x")), ("steps", (None, "-1")), image], timeout=60), 400)
    assert err["param"] == "steps" and "1 to 1000" in err["message"], err
    # Not multipart at all: the message says what the route takes and where JSON goes.
    err = error_of(httpx.post(url, json={"prompt": "x"}), 400)
    assert err["type"] == "invalid_request_error"
    assert "multipart/form-data" in err["message"] and "application/json" in err["message"], err
    assert "/v1/klein/generate" in err["message"], err


def test_inpainting_sizes_are_ignored_with_a_warning_and_wrapped_base64_is_taken(server: Server, repo: Path):
    """As diffusers' inpaint pipeline: a size with a source image is taken, and the output is the
    source's size (gray.png, 70x100, floored: 64x96); the answer says the size was ignored."""
    png = (repo / "tests" / "fixtures" / "reference" / "gray.png").read_bytes()
    source = {"data": base64.b64encode(png).decode()}
    body = {"prompt": "x", "image": source, "width": 512, "height": 512, "strength": 0.5, "steps": 1}
    answer = httpx.post(f"{server.url}/v1/klein/generate", json=body, timeout=60)
    assert answer.status_code == 200, answer.text
    assert (answer.json()["width"], answer.json()["height"]) == (64, 96)
    assert any("width 512 and height 512 are ignored" in w for w in answer.json()["warnings"]), answer.json()
    parts = [("prompt", (None, "x")), ("image", ("a.png", png)), ("strength", (None, "0.5"))]
    parts.append(("size", (None, "512x512")))
    edited = httpx.post(f"{server.url}/v1/images/edits", files=parts, timeout=60)
    assert edited.status_code == 200, edited.text
    assert any("are ignored" in w for w in edited.json()["warnings"]), edited.json()
    assert Image.open(io.BytesIO(base64.b64decode(edited.json()["data"][0]["b64_json"]))).size == (64, 96)
    wrapped = base64.encodebytes(png).decode()  # MIME: 76 columns
    assert "\n" in wrapped
    ok = httpx.post(
        f"{server.url}/v1/klein/generate",
        json={"prompt": "x", "refs": [{"data": wrapped}], "steps": 1, "width": 64, "height": 64},
        timeout=120,
    )
    assert ok.status_code == 200, ok.text


def test_messages_name_json_types_not_rust_ones(server: Server):
    url = f"{server.url}/v1/images/generations"
    err = error_of(httpx.post(url, json={"prompt": "x", "n": -1}, timeout=60), 400)
    assert err["param"] == "n" and "whole number" in err["message"] and "1 to 16" in err["message"], err
    err = error_of(httpx.post(url, json={"prompt": "x", "seed": 2**64}, timeout=60), 400)
    assert err["param"] == "seed" and "18446744073709551615" in err["message"], err
    assert "u64" not in err["message"] and "line 1 column" not in err["message"], err
    err = error_of(httpx.post(url, json={"prompt": "x", "response_format": "bogus"}, timeout=60), 400)
    assert "give b64_json" in err["message"] and "link" not in err["message"], err


def test_warnings_models_retrieve_and_bearer_case(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle, env={"KLEIN_API_KEY": "s3cret"})
    try:
        # The OpenAI client's models.retrieve, and a lower-case scheme (RFC 9110: case-insensitive).
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret")
        model = client.models.retrieve("klein-tiny")
        assert model.id == "klein-tiny"
        # Typed clients need an integer `created` (the server's start).
        assert isinstance(model.created, int) and abs(model.created - time.time()) < 3600, model
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("gpt-image-1")
        headers = {"Authorization": "bearer s3cret"}
        body = {"prompt": PROMPT, "size": "64x64", "guidance": 3.5}
        answer = httpx.post(f"{s.url}/v1/images/generations", json=body, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        # The tiny model is distilled: guidance changes nothing, and the answer says so.
        assert any("guidance 3.5 is ignored" in w for w in answer.json()["warnings"]), answer.json()["warnings"]
        # No seed: a random one below 2^53, which a JavaScript client can send back exactly.
        assert 0 <= answer.json()["seed"] < 2**53
        body = {"prompt": PROMPT, "width": 64, "height": 64}
        assert httpx.post(f"{s.url}/v1/klein/generate", json=body, headers=headers, timeout=60).json()["warnings"] == []
        # A prompt past the tokenizer's 512 tokens is truncated, and both routes say so.
        long = {"prompt": "red fox " * 600, "size": "64x64", "steps": 1}
        answer = httpx.post(f"{s.url}/v1/images/generations", json=long, headers=headers, timeout=60).json()
        assert any("longer than 512 tokens and was truncated" in w for w in answer["warnings"]), answer["warnings"]
        long = {"prompt": "red fox " * 600, "width": 64, "height": 64, "steps": 1}
        answer = httpx.post(f"{s.url}/v1/klein/generate", json=long, headers=headers, timeout=60).json()
        assert answer["prompt_truncated"] is True
        assert any("was truncated" in w for w in answer["warnings"]), answer["warnings"]
    finally:
        assert s.stop() == 0


def test_loras_by_name_never_by_path(klein_bin: Path, tiny_bundle: Path, tiny_lora: Path, tmp_path: Path):
    loras = tmp_path / "loras"
    loras.mkdir()
    shutil.copy(tiny_lora, loras / "style.safetensors")
    s = Server(klein_bin, tiny_bundle, "--lora-dir", str(loras))
    try:
        assert "klein serve: LoRAs: style" in "".join(s.log)
        body = {"prompt": PROMPT, "size": "64x64", "seed": 3, "loras": ["style:0.8"]}
        answer = httpx.post(f"{s.url}/v1/images/generations", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        png = base64.b64decode(answer.json()["data"][0]["b64_json"])
        args = ["--width", "64", "--height", "64", "--seed", "3", "--lora", f"{loras / 'style.safetensors'}:0.8"]
        cli = cli_png(klein_bin, tiny_bundle, tmp_path, PROMPT, *args)[0]
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(png))), np.asarray(Image.open(io.BytesIO(cli))))
        assert Image.open(io.BytesIO(png)).text["loras"] == '["style:0.8"]'
        err = error_of(httpx.post(f"{s.url}/v1/images/generations", json={**body, "loras": ["style:1000"]}), 400)
        assert err["param"] == "loras" and "style" in err["message"], err
        assert str(loras) not in err["message"], err
    finally:
        assert s.stop() == 0
    # A file that is broken or for another model is skipped when the server starts, with a warning
    # naming it, and never offered; the others are.
    (loras / "bad.safetensors").write_bytes(b"garbage")
    s = Server(klein_bin, tiny_bundle, "--lora-dir", str(loras))
    try:
        log = "".join(s.log)
        assert "LoRA `bad` cannot be offered, skipped" in log and "not a safetensors file" in log, log
        assert "klein serve: LoRAs: style" in log, log
        assert httpx.get(f"{s.url}/v1/klein/loras").json() == {"loras": ["style"]}
        err = error_of(httpx.post(f"{s.url}/v1/images/generations", json={**body, "loras": ["bad"]}), 400)
        assert err["param"] == "loras", err
    finally:
        assert s.stop() == 0


def test_the_log_has_a_ready_line_and_a_line_per_request(server: Server):
    """Operators read the server's stderr: a ready line once every pipeline has loaded, and one
    line per request with its time (UTC), method, route, status, job id and seconds."""
    log = "".join(server.log)
    assert re.search(r"klein serve: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ready: 1 pipeline\(s\) loaded", log), log
    r = httpx.post(f"{server.url}/v1/klein/generate", json={"prompt": "x", "width": 64, "height": 64, "steps": 1})
    assert r.status_code == 200, r.text
    job = r.json()["id"]
    httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "x", "n": 99})
    deadline = time.monotonic() + 10
    pattern = rf"Z POST /v1/klein/generate 200 job {re.escape(job)} [0-9.]+ s"
    while not re.search(pattern, "".join(server.log)):
        assert time.monotonic() < deadline, "".join(server.log)[-2000:]
        time.sleep(0.05)
    while "POST /v1/images/generations 400 job - " not in "".join(server.log):
        assert time.monotonic() < deadline, "".join(server.log)[-2000:]
        time.sleep(0.05)


def test_body_limit_and_unknown_routes(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle, "--max-body-mib", "1", "--max-pixels", str(2 * 64 * 64))
    try:
        # Pixels per request: two 64x64 images fit, three do not; nor does a reference's size.
        ok = httpx.post(f"{s.url}/v1/images/generations", json={"prompt": "x", "size": "64x64", "n": 2}, timeout=60)
        assert ok.status_code == 200, ok.text
        three = {"prompt": "x", "size": "64x64", "n": 3}
        err = error_of(httpx.post(f"{s.url}/v1/images/generations", json=three, timeout=60), 400)
        assert err["param"] == "size" and "--max-pixels" in err["message"]
        buffer = io.BytesIO()
        Image.new("RGB", (128, 96), (200, 30, 30)).save(buffer, format="PNG")
        files = [("prompt", (None, "x")), ("image", ("red.png", buffer.getvalue()))]  # auto size: 128x96
        err = error_of(httpx.post(f"{s.url}/v1/images/edits", files=files, timeout=60), 400)
        assert err["param"] == "size"
        big = {"prompt": "x", "refs": [{"data": "A" * (2 << 20)}]}
        err = error_of(httpx.post(f"{s.url}/v1/klein/generate", json=big), 413)
        assert err["type"] == "payload_too_large" and "--max-body-mib" in err["message"], err
        files = {"image": ("big.png", b"\0" * (2 << 20))}
        err = error_of(httpx.post(f"{s.url}/v1/images/edits", data={"prompt": "x"}, files=files), 413)
        assert "--max-body-mib" in err["message"], err
        assert error_of(httpx.get(f"{s.url}/v1/nothing"), 404)["type"] == "not_found_error"
        assert httpx.get(f"{s.url}/v1/images/generations").status_code == 405
        # A compressed body: 415 naming the encoding, not a JSON error about its bytes.
        packed = gzip.compress(json.dumps({"prompt": "x", "size": "64x64"}).encode())
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        err = error_of(httpx.post(f"{s.url}/v1/images/generations", content=packed, headers=headers), 415)
        assert err["type"] == "unsupported_media_type" and "Content-Encoding gzip" in err["message"], err
        headers["Content-Encoding"] = "identity"
        plain = json.dumps({"prompt": "x", "size": "64x64"}).encode()
        assert (
            httpx.post(f"{s.url}/v1/images/generations", content=plain, headers=headers, timeout=60).status_code == 200
        )
    finally:
        assert s.stop() == 0


def test_garbage_never_brings_the_server_down(server: Server):
    """Random bytes, truncated bodies and wrong content types on every route: each answered with
    a 4xx, and the server still generates afterwards."""
    import random

    rng = random.Random(7)
    routes = ["/v1/images/generations", "/v1/images/edits", "/v1/klein/generate", "/v1/klein/generate/stream"]
    for i in range(120):
        route = routes[i % len(routes)]
        kind = rng.choice(["bytes", "json", "multipart-junk"])
        if kind == "bytes":
            content, ctype = rng.randbytes(rng.randint(0, 300)), "application/json"
        elif kind == "json":
            value = rng.choice(
                [None, 1, "s", [1, 2], {"prompt": rng.randbytes(8).hex(), "size": rng.randbytes(4).hex()}]
            )
            content, ctype = json.dumps(value).encode(), "application/json"
        else:
            content, ctype = (
                b'--xx\r\nContent-Disposition: form-data; name="image"\r\n\r\n' + rng.randbytes(50),
                "multipart/form-data; boundary=xx",
            )
        r = httpx.post(f"{server.url}{route}", content=content, headers={"Content-Type": ctype}, timeout=60)
        assert 400 <= r.status_code < 500, (route, kind, r.status_code, r.text)
    r = httpx.post(f"{server.url}/v1/images/generations", json={"prompt": "still alive", "size": "64x64"}, timeout=60)
    assert r.status_code == 200


def test_sigterm_finishes_accepted_work_and_refuses_new(klein_bin: Path, tiny_bundle: Path):
    s = Server(klein_bin, tiny_bundle)
    results: list[httpx.Response] = []
    body = {"prompt": "finish me", "width": 128, "height": 128, "steps": 150}
    t = threading.Thread(
        target=lambda: results.append(httpx.post(f"{s.url}/v1/klein/generate", json=body, timeout=120))
    )
    t.start()
    deadline = time.monotonic() + 30
    while s.metric("klein_jobs_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    s.process.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    # Draining: still answering, not ready, no new work.
    ready = httpx.get(f"{s.url}/readyz", timeout=5)
    assert ready.status_code == 503 and ready.json()["status"] == "draining", ready.text
    late = error_of(httpx.post(f"{s.url}/v1/klein/generate", json={"prompt": "too late"}, timeout=5), 503)
    assert "shutting down" in late["message"], late
    t.join(timeout=120)
    assert results and results[0].status_code == 200, results
    assert results[0].json()["steps"] == 150
    assert s.process.wait(timeout=60) == 0
    assert "finishing accepted requests" in "".join(s.log)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{s.url}/healthz", timeout=5)


def _reply(url: str, data: bytes, wait: float) -> tuple[bytes, float]:
    """What the server sends back on a raw connection given `data`, within `wait` s (b"": it
    closed the connection), and after how many seconds."""
    host, port = url.removeprefix("http://").split(":")
    start = time.monotonic()
    with socket.create_connection((host, int(port))) as connection:
        connection.sendall(data)
        connection.settimeout(wait)
        return connection.recv(4096), time.monotonic() - start


def test_clients_that_overstate_or_stall_hold_no_connection(klein_bin: Path, tiny_bundle: Path):
    """A body declared over --max-body-mib is refused before it is sent (also to a client that asks
    `Expect: 100-continue`); a body that stops coming gets 408 at --timeout; a request head that
    never ends is dropped after 30 s."""
    s = Server(klein_bin, tiny_bundle, "--timeout", "2", "--max-body-mib", "1")
    try:
        head = b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        for expect in (b"", b"Expect: 100-continue\r\n"):
            reply, seconds = _reply(s.url, head + expect + b"Content-Length: 999999999999\r\n\r\n{}", 10)
            assert reply.startswith(b"HTTP/1.1 413") and b"--max-body-mib" in reply and seconds < 2, reply
        reply, seconds = _reply(s.url, head + b'Content-Length: 100\r\n\r\n{"pro', 10)
        assert reply.startswith(b"HTTP/1.1 408") and b"klein serve --timeout" in reply, reply
        assert 1.5 < seconds < 5, seconds
        reply, seconds = _reply(s.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n", 45)
        assert reply == b"" and 25 < seconds < 40, (reply, seconds)
        assert httpx.get(f"{s.url}/healthz").status_code == 200
    finally:
        assert s.stop() == 0


def test_bad_command_lines_exit_2(klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    for args, needle in [
        (["--model", str(tmp_path / "missing")], "missing"),
        (["--model", str(tiny_bundle), "--lora-dir", str(tmp_path / "no-loras")], "--lora-dir"),
        (["--model", str(tiny_bundle), "--device", "cpu", "--device", "cpu"], "twice"),
        (["--model", str(tiny_bundle), "--queue", "0"], "queue"),
    ]:
        r = subprocess.run([str(klein_bin), "serve", "--port", "0", *args], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr, (args, r.stderr)


def test_one_pipeline_per_device(klein_bin: Path, tiny_bundle: Path, tmp_path: Path):
    """Two pipelines (cpu, and auto, which is the CPU here) share the queue: both run at once, and
    each answer is the CLI's file."""
    s = Server(klein_bin, tiny_bundle, "--device", "cpu", "--device", "auto", "--threads", "1")
    try:
        assert httpx.get(f"{s.url}/readyz").json()["pipelines"] == 2
        bodies = [{"prompt": PROMPT, "size": "64x64", "seed": seed, "steps": 3} for seed in range(4)]
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(lambda b: httpx.post(f"{s.url}/v1/images/generations", json=b, timeout=120), bodies)
            )
        for seed, answer in enumerate(answers):
            assert answer.status_code == 200, answer.text
            got = base64.b64decode(answer.json()["data"][0]["b64_json"])
            args = ["--width", "64", "--height", "64", "--seed", str(seed), "--steps", "3"]
            (tmp_path / str(seed)).mkdir()
            assert [got] == cli_png(klein_bin, tiny_bundle, tmp_path / str(seed), PROMPT, *args)
        # Both pipelines took work.
        jobs = [s.metric(f'klein_pipeline_jobs_total{{pipeline="{i}"}}') for i in (0, 1)]
        assert sum(jobs) == 4 and min(jobs) >= 1, jobs
    finally:
        assert s.stop() == 0
