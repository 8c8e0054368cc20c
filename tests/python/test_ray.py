"""Ray Serve (deploy/ray/klein_serve.py) on a local cluster: two replicas of the tiny model behind
Serve's HTTP proxy, the OpenAI client and multipart edits (references, OpenAI's masks, strength),
every image byte-equal to the CLI's file; then one replica killed while requests are in flight:
each request answers the right image or an HTTP error status, and a retry of the failed ones
succeeds once Serve has replaced it.

Every wait is bounded; the cluster is this process's own (ray.init), shut down at the end."""

import base64
import concurrent.futures
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
from openai import APIStatusError, OpenAI
from PIL import Image

# Requests that must finish (or fail) well within this; the whole test takes about a minute here.
HTTP_TIMEOUT = 60
DEPLOY_TIMEOUT = 150
RECOVERY_TIMEOUT = 120
APP = "klein"
DEPLOYMENT = "KleinDeployment"


@dataclass(frozen=True)
class Job:
    name: str
    prompt: str
    seed: int
    edit: bool = False


# Ten generations and two edits, sent at once.
JOBS = [Job(f"g{i}", f"a lighthouse in a storm, study {i}", 100 + i) for i in range(10)] + [
    Job(f"e{i}", f"make it a winter night, take {i}", 200 + i, edit=True) for i in range(2)
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def expected(klein_bin, tiny_bundle, repo, tmp_path_factory) -> dict[str, bytes]:
    """The CLI's file for every job: the generations in one batch run (the PNGs batch mode writes
    are those of single mode), the edits one by one with `--ref ref.png` (labelled as the upload)."""
    work = tmp_path_factory.mktemp("cli")
    shutil.copy(repo / "tests" / "fixtures" / "reference" / "rgba.png", work / "ref.png")
    lines = [
        json.dumps({"prompt": j.prompt, "seed": j.seed, "width": 64, "height": 64, "name": j.name})
        for j in JOBS
        if not j.edit
    ]
    (work / "jobs.jsonl").write_text("\n".join(lines) + "\n")
    base = [str(klein_bin), "generate", "--model", str(tiny_bundle), "-q"]
    run = {"cwd": work, "check": True, "timeout": 180, "capture_output": True}
    subprocess.run([*base, "--prompts", "jobs.jsonl", "--out-dir", "out"], **run)
    files = {j.name: (work / "out" / f"{j.name}.png").read_bytes() for j in JOBS if not j.edit}
    for j in JOBS:
        if j.edit:
            size = ["--width", "64", "--height", "64", "--seed", str(j.seed)]
            subprocess.run([*base, j.prompt, *size, "--ref", "ref.png", "-o", f"{j.name}.png"], **run)
            files[j.name] = (work / f"{j.name}.png").read_bytes()
    files["ref.png"] = (work / "ref.png").read_bytes()
    return files


@pytest.fixture(scope="module")
def ray_caches(tmp_path_factory) -> dict[str, Path]:
    """The CPU cache and prompt cache directories the replicas share."""
    root = tmp_path_factory.mktemp("ray-caches")
    return {"cpu_cache": root / "cpu", "prompt_cache": root / "prompts"}


@pytest.fixture(scope="module")
def serve_url(repo, tiny_bundle, ray_caches):
    """A local Ray cluster with the deployment at 2 replicas sharing a CPU cache and a prompt
    cache; its base URL."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    import ray
    from ray import serve

    from deploy.ray import klein_serve

    port = free_port()
    # Four logical CPUs: two replicas of one CPU each, and room for a replacement to start
    # before the dead replica's CPU is given back. The workers import deploy.ray from the repo.
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        object_store_memory=128 * 1024**2,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(repo), "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = klein_serve.app_builder(
            {
                "model": str(tiny_bundle),
                "replicas": "2",
                "num_cpus": "1",
                "threads": "1",
                "graceful_shutdown_timeout_s": "2",
                **{name: str(path) for name, path in ray_caches.items()},
                "prompt_cache_max_mib": "64",
                "cpu_cache_max_gib": "16",
            }
        )
        deployed = threading.Event()
        failure: list[BaseException] = []

        def deploy() -> None:
            try:
                serve.run(app, name=APP, route_prefix="/")
            except BaseException as error:  # reported below
                failure.append(error)
            deployed.set()

        threading.Thread(target=deploy, daemon=True).start()
        assert deployed.wait(DEPLOY_TIMEOUT), f"the deployment was not running after {DEPLOY_TIMEOUT} s"
        assert not failure, failure
        url = f"http://127.0.0.1:{port}"
        health = requests.get(f"{url}/healthz", timeout=HTTP_TIMEOUT)
        assert health.status_code == 200 and health.json()["model"] == "klein-tiny", health.text
        yield url
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


class Failed(Exception):
    """A request answered with an HTTP error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status = status


def send(url: str, job: Job, reference: bytes) -> bytes:
    """One request; the PNG it answered, or Failed with the status. Transport errors and
    timeouts propagate (the test counts them as wrong)."""
    if job.edit:
        response = requests.post(
            f"{url}/v1/images/edits",
            files=[("image[]", ("ref.png", reference, "image/png"))],
            data={"prompt": job.prompt, "size": "64x64", "seed": str(job.seed)},
            timeout=HTTP_TIMEOUT,
        )
        if response.status_code != 200:
            raise Failed(response.status_code, response.text)
        body = response.json()
        assert body["seed"] == job.seed
        (image,) = body["data"]
        return base64.b64decode(image["b64_json"])
    client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=HTTP_TIMEOUT)
    try:
        answer = client.images.generate(prompt=job.prompt, size="64x64", extra_body={"seed": job.seed})
    except APIStatusError as error:
        raise Failed(error.status_code, str(error)) from None
    assert answer.model_extra["seed"] == job.seed
    (image,) = answer.data
    return base64.b64decode(image.b64_json)


def send_all(url: str, jobs: list[Job], reference: bytes, during=None) -> dict[str, bytes | Failed]:
    """Every job at once; `during()` runs once the first answer is in (requests in flight)."""
    results: dict[str, bytes | Failed] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = {pool.submit(send, url, job, reference): job for job in jobs}
        if during is not None:
            concurrent.futures.wait(futures, timeout=HTTP_TIMEOUT, return_when=concurrent.futures.FIRST_COMPLETED)
            during()
        for future in concurrent.futures.as_completed(futures, timeout=2 * HTTP_TIMEOUT):
            job = futures[future]
            try:
                results[job.name] = future.result()
            except Failed as failed:
                results[job.name] = failed
    return results


def replica_names() -> list[str]:
    import ray

    return sorted(
        actor["name"]
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["namespace"] == "serve" and actor["name"].startswith("SERVE_REPLICA") and DEPLOYMENT in actor["name"]
    )


def running_replicas() -> int:
    from ray import serve

    deployment = serve.status().applications[APP].deployments[DEPLOYMENT]
    return deployment.replica_states.get("RUNNING", 0)


def test_openai_api_errors(serve_url, expected):
    url = serve_url
    cases = [
        ({"prompt": "a fox", "size": "8000x64"}, "size"),
        ({"prompt": "a fox", "response_format": "url"}, "response_format"),
        ({"prompt": "a fox", "colour": "red"}, "colour"),
        ({"prompt": "a fox", "n": 0}, "n"),
        ({"size": "64x64"}, "prompt"),
        # Refused by the klein package, named as the request's field.
        ({"prompt": "a \ud800 fox", "size": "64x64"}, "prompt"),
        ({"prompt": "a fox", "size": "2304x2304"}, "size"),  # over the token budget
    ]
    for body, param in cases:
        response = requests.post(f"{url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, None), error
    form = {"prompt": "a fox", "size": "64x64"}
    reference = ("image[]", ("ref.png", expected["ref.png"], "image/png"))
    mask = requests.post(
        f"{url}/v1/images/edits", files=[reference, ("mask", ("m.png", b"x", "image/png"))], data=form, timeout=60
    )
    assert mask.status_code == 400 and "image m.png" in mask.json()["error"]["message"], mask.text
    assert mask.json()["error"]["param"] == "mask", mask.text  # klein's error, as the field that carried it
    for strength in ("0", "1.5", "much", "0.7_5", "nan"):
        r = requests.post(f"{url}/v1/images/edits", files=[reference], data=form | {"strength": strength}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "strength", r.text
    # klein's own check: an upload that is no image, named in the message.
    notes = ("image[]", ("notes.png", b"these are not pixels", "image/png"))
    bad = requests.post(f"{url}/v1/images/edits", files=[notes], data=form, timeout=HTTP_TIMEOUT)
    assert bad.status_code == 400 and "notes.png" in bad.json()["error"]["message"], bad.text
    assert bad.json()["error"]["param"] == "image", bad.text


def test_openai_settings_as_klein_serve_takes_them(serve_url, expected):
    """OpenAI's settings klein does one way: those values taken (moderation and input_fidelity with
    a warning), the others refused with the reason, naming the field, on both routes."""
    url = serve_url
    body = {"prompt": "a fox", "size": "64x64", "steps": 1, "seed": 3, "background": "opaque", "stream": False}
    body |= {"moderation": "low", "partial_images": 0, "safety_identifier": "user-7", "quality": "auto"}
    r = requests.post(f"{url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert any("moderation `low`" in w for w in r.json()["warnings"]), r.json()["warnings"]
    form = {"prompt": "a fox", "size": "64x64", "steps": "1", "stream": "false", "input_fidelity": "high"}
    reference = ("image[]", ("ref.png", expected["ref.png"], "image/png"))
    r = requests.post(f"{url}/v1/images/edits", files=[reference], data=form, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert any("input_fidelity `high`" in w for w in r.json()["warnings"]), r.json()["warnings"]
    # No seed given: a random one, below 2^53 as every front end draws it (JSON clients keep it exact).
    assert 0 <= r.json()["seed"] < 2**53, r.json()["seed"]
    for field, value, reason in (
        ("background", "transparent", "no alpha"),
        ("style", "vivid", "no style presets"),
        ("stream", True, "stream false"),
        ("partial_images", 2, "stream"),
        ("moderation", "strict", "auto or low"),
    ):
        r = requests.post(f"{url}/v1/images/generations", json={"prompt": "a fox", field: value}, timeout=60)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and reason in error["message"], r.text
        text = str(value).lower() if isinstance(value, bool) else str(value)
        r = requests.post(
            f"{url}/v1/images/edits", files=[reference], data={"prompt": "a fox", field: text}, timeout=60
        )
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == field and reason in error["message"], r.text


def png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def test_edits_with_a_mask_or_a_strength_are_the_cli_inpainting_files(
    serve_url, klein_bin, tiny_bundle, tmp_path, inpaint_inputs
):
    """An edit with OpenAI's mask (transparent where to edit) and a strength gives `klein generate
    --image --mask --strength`'s file, the mask there white where the upload is transparent; with a
    strength alone, img2img (`--image --strength`); a mask without an alpha channel is refused."""
    inpaint_inputs.source.save(tmp_path / "source.png")
    inpaint_inputs.white.save(tmp_path / "mask.png")
    base = [str(klein_bin), "generate", "--model", str(tiny_bundle), "-q", "a hat", "--image", "source.png"]
    run = {"cwd": tmp_path, "check": True, "timeout": 180, "capture_output": True}
    subprocess.run([*base, "--mask", "mask.png", "--strength", "0.75", "--seed", "4", "-o", "inpaint.png"], **run)
    subprocess.run([*base, "--strength", "0.5", "--seed", "5", "-o", "img2img.png"], **run)

    image = ("image", ("source.png", (tmp_path / "source.png").read_bytes(), "image/png"))
    mask = ("mask", ("mask.png", png(inpaint_inputs.transparent), "image/png"))
    form = {"prompt": "a hat", "seed": "4", "strength": "0.75"}
    r = requests.post(f"{serve_url}/v1/images/edits", files=[image, mask], data=form, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["data"][0]["b64_json"]) == (tmp_path / "inpaint.png").read_bytes()
    assert (r.json()["width"], r.json()["height"]) == (96, 64)

    form = {"prompt": "a hat", "seed": "5", "strength": "0.5"}
    r = requests.post(f"{serve_url}/v1/images/edits", files=[image], data=form, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert base64.b64decode(r.json()["data"][0]["b64_json"]) == (tmp_path / "img2img.png").read_bytes()

    opaque = ("mask", ("opaque.png", png(inpaint_inputs.white), "image/png"))
    r = requests.post(f"{serve_url}/v1/images/edits", files=[image, opaque], data=form, timeout=HTTP_TIMEOUT)
    assert r.status_code == 400, r.text  # klein's own check, naming the upload (as for references)
    assert "image opaque.png: OpenAI's mask is a PNG with an alpha channel" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "mask", r.text


def test_two_replicas_answer_the_cli_files_and_survive_a_killed_replica(serve_url, expected):
    import ray

    url, reference = serve_url, expected["ref.png"]
    start = time.monotonic()
    first = send_all(url, JOBS, reference)
    wave1 = time.monotonic() - start
    assert first == {j.name: expected[j.name] for j in JOBS}

    replicas = replica_names()
    assert len(replicas) == 2, replicas
    victim = replicas[0]
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic() - start)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=False)

    start = time.monotonic()
    second = send_all(url, JOBS, reference, during=kill)
    wave2 = time.monotonic() - start
    assert set(second) == {j.name for j in JOBS}  # every request answered, none lost
    failed = [name for name, result in second.items() if isinstance(result, Failed)]
    for name, result in second.items():
        if not isinstance(result, Failed):
            assert result == expected[name], f"{name}: a wrong image"
    assert all(second[name].status >= 500 for name in failed), [second[n] for n in failed]

    # Serve replaces the replica; then the failed requests, sent again, succeed.
    deadline = time.monotonic() + RECOVERY_TIMEOUT
    while True:
        now = replica_names()
        replacements = sorted(set(now) - set(replicas))
        if len(now) == 2 and victim not in now and replacements and running_replicas() == 2:
            break
        assert time.monotonic() < deadline, f"no replacement replica after {RECOVERY_TIMEOUT} s: {now}"
        time.sleep(0.25)
    recovered = time.monotonic() - start
    retried = send_all(url, [j for j in JOBS if j.name in failed], reference)
    assert retried == {name: expected[name] for name in failed}
    answered = len(second) - len(failed) + len(retried)
    assert answered == len(JOBS)
    print(
        f"\nray serve: wave 1 {len(JOBS)} requests in {wave1:.1f} s; wave 2: replica {victim} killed at "
        f"{killed_at[0]:.1f} s, {len(failed)} of {len(JOBS)} failed with HTTP "
        f"{sorted({second[n].status for n in failed})} ({', '.join(sorted(failed))}), the rest right, "
        f"in {wave2:.1f} s; replaced by {replacements[0]}, 2 replicas running at {recovered:.1f} s; "
        f"{len(failed)} retried, all right"
    )


def test_replicas_share_their_caches(serve_url, ray_caches):
    """After the requests above (every image the CLI's file), the replicas' shared caches hold
    each graph the CPU runs and an entry for each prompt the replicas encoded."""
    saved = sorted(path.name for path in ray_caches["cpu_cache"].glob("*/*.onnx"))
    assert {"text_encoder.onnx", "transformer.onnx", "vae_decoder.onnx"} <= set(saved), saved
    entries = list(ray_caches["prompt_cache"].glob("*.safetensors"))
    assert len(entries) >= len(JOBS), [entry.name for entry in entries]


def test_app_builder_checks_its_settings(repo, tiny_bundle):
    """A bad setting is named when the application is built, not when its replicas fail to start."""
    if str(repo) not in sys.path:
        sys.path.insert(0, str(repo))
    from deploy.ray import klein_serve

    model = str(tiny_bundle)
    for args, message in [
        ({"model": model, "threads": "0"}, "threads=0: give a whole number of at least 1"),
        ({"model": model, "replicas": "abc"}, "replicas='abc': give a whole number of at least 1"),
        ({"model": model, "num_gpus": "-1"}, "num_gpus=-1.0"),
        ({"model": model, "max_replicas": "1", "min_replicas": "3"}, "max_replicas=1"),
        ({"model": model, "prompt_cache": "p", "prompt_cache_max_mib": "0"}, "prompt_cache_max_mib=0: give"),
        ({"model": model, "prompt_cache_max_mib": "5"}, "prompt_cache_max_mib needs prompt_cache"),
        ({"model": model, "cpu_cache_max_gib": "5"}, "cpu_cache_max_gib needs cpu_cache"),
        ({"model": model, "cpu_cache": "c", "cpu_cache_max_gib": "-2"}, "cpu_cache_max_gib=-2: give"),
        ({"model": model, "cpu_cache": "c", "cpu_cache_max_gib": "16385"}, "at least 1 and at most 16384"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            klein_serve.app_builder(args)
    # A Serve config's YAML list of LoRAs is taken as the list it is (it was one spec, "['a:0.5']").
    app = klein_serve.app_builder({"model": model, "loras": ["a.safetensors:0.5", "b.safetensors"]})
    assert app._bound_deployment.init_kwargs["loras"] == ["a.safetensors:0.5", "b.safetensors"]
    # Cache directories by their absolute paths, as the replicas (in other directories) need them.
    app = klein_serve.app_builder({"model": model, "cpu_cache": "c", "prompt_cache": "p"})
    kwargs = app._bound_deployment.init_kwargs
    assert (kwargs["cpu_cache"], kwargs["prompt_cache"]) == (str(Path("c").resolve()), str(Path("p").resolve()))
    assert kwargs["prompt_cache_max_mib"] is None and kwargs["cpu_cache_max_gib"] is None


def _png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


#: Bodies of `POST /v1/images/generations`, good and bad, each sent to both front ends.
SHARED_GENERATIONS = [
    {"prompt": "a fox", "size": "64x64", "steps": 1, "seed": 5},
    {"prompt": "a fox", "size": "64x48", "steps": 2, "seed": 6, "n": 2, "moderation": "low", "quality": "auto"},
    {"prompt": "a fox", "size": "64x64", "steps": 1, "seed": 7, "output_format": "jpeg", "output_compression": 60},
    {"prompt": "a fox", "size": "64x64", "steps": 1, "seed": 7, "output_format": "webp"},
    {"prompt": "a fox", "size": "8000x64"},
    {"prompt": "a fox", "size": "2304x2304"},
    {"prompt": "a fox", "size": "big"},
    {"prompt": "a fox", "n": 0},
    {"prompt": "a fox", "n": -1},
    {"prompt": "a fox", "n": 17},
    {"prompt": "a fox", "steps": 0},
    {"prompt": "a fox", "steps": "two"},
    {"prompt": "a fox", "guidance": 200},
    {"prompt": "a fox", "seed": 2**64},
    {"prompt": "a fox", "response_format": "url"},
    {"prompt": "a fox", "output_format": "gif"},
    {"prompt": "a fox", "output_compression": 101},
    {"prompt": "a fox", "colour": "red"},
    {"size": "64x64"},
    {"prompt": "a fox", "background": "transparent"},
    {"prompt": "a fox", "style": "vivid"},
    {"prompt": "a fox", "stream": True},
    {"prompt": "a fox", "partial_images": 2},
    {"prompt": "a fox", "moderation": "strict"},
    {"prompt": "a fox", "quality": "hd"},
    {"prompt": "x" * 70000},
    {"prompt": "a fox", "size": "64x64", "steps": 1, "negative_prompt": "blurry"},  # a distilled model
]


def _edit_forms(reference: bytes) -> list[tuple[list, dict]]:
    """Forms of `POST /v1/images/edits`, good and bad: (files, text fields)."""
    image = ("image[]", ("ref.png", reference, "image/png"))
    transparent = _png_bytes(Image.new("RGBA", (64, 64), (0, 0, 0, 0)))
    mask = ("mask", ("m.png", transparent, "image/png"))
    form = {"prompt": "a hat", "size": "64x64", "steps": "1", "seed": "3"}
    return [
        ([image], form),
        ([image, mask], form | {"strength": "0.75"}),
        ([image], form | {"input_fidelity": "high"}),
        ([], form),
        ([image, ("mask", ("m.png", b"x", "image/png"))], form),
        ([image], form | {"strength": "1.5"}),
        ([image], form | {"strength": "much"}),
        ([image], form | {"n": "two"}),
        ([image], form | {"colour": "red"}),
        ([image], form | {"steps": "-1"}),
        ([image], form | {"input_fidelity": "max"}),
        ([("image[]", ("notes.png", b"these are not pixels", "image/png"))], form),
        ([image] * 11, form),
    ]


def _answer(response: requests.Response) -> tuple:
    """What a front end answered: the status and the body (errors whole; for images, the images
    and every field but the time)."""
    body = response.json()
    body.pop("created", None)
    return response.status_code, body


def test_klein_serve_and_ray_answer_the_same_bodies_alike(serve_url, klein_bin, tiny_bundle, expected):
    """One OpenAI schema (klein::api::openai): the same good and bad bodies sent to `klein serve`
    and to the Ray deployment get the same status and body: the same images byte for byte, and
    the same error type, param and message."""
    from test_serve import Server

    server = Server(klein_bin, tiny_bundle)
    try:
        for body in SHARED_GENERATIONS:
            got = [
                _answer(requests.post(f"{url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT))
                for url in (server.url, serve_url)
            ]
            assert got[0] == got[1], (body, got)
            assert got[0][0] in (200, 400), (body, got)
        for files, data in _edit_forms(expected["ref.png"]):
            # Text fields as parts too: multipart even without an image.
            parts = files + [(name, (None, value)) for name, value in data.items()]
            got = [
                _answer(requests.post(f"{url}/v1/images/edits", files=parts, timeout=HTTP_TIMEOUT))
                for url in (server.url, serve_url)
            ]
            assert got[0] == got[1], (data, [f[1][0] for f in files], got)
        # The model routes (klein::api::models): the same object, but for when each started and the
        # server's --max-pixels (the Ray deployment has no such cap: null).
        listed = [requests.get(f"{url}/v1/models", timeout=HTTP_TIMEOUT) for url in (server.url, serve_url)]
        assert [r.status_code for r in listed] == [200, 200], [r.text for r in listed]
        objects = [r.json()["data"][0] for r in listed]
        assert objects[1]["klein"]["max_pixels"] is None and isinstance(objects[1]["created"], int)
        for obj in objects:
            obj.pop("created"), obj["klein"].pop("max_pixels")
        assert objects[0] == objects[1] and objects[0]["id"] == "klein-tiny", objects
        for name, status in (("klein-tiny", 200), ("other", 404)):
            urls = (f"{server.url}/v1/models/{name}", f"{serve_url}/v1/models/{name}")
            got = [_answer(requests.get(url, timeout=HTTP_TIMEOUT)) for url in urls]
            assert [g[0] for g in got] == [status, status], got
            if status == 404:
                assert got[0] == got[1], got
    finally:
        assert server.stop() == 0
