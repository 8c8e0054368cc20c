"""FLUX.3 Image Klein through the C API and Ray Serve: each gives the klein CLI's image byte for
byte (the CLI's is checked against diffusers in test_flux3.py), with no flag naming the family.

The bundle is flux3_helpers.small_distilled's (its converts share the export cache with
test_flux3_quantized.py and test_flux3_lora.py).
"""

import base64
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import requests
from export_cache_dir import EXPORT_CACHE
from flux3_helpers import KLEIN, REPO, klein_cli, small_distilled
from PIL import Image

from klein_export.convert import convert
from klein_export.fixtures import synthetic_image

RELEASE = REPO / "target" / "release"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    root = tmp_path_factory.mktemp("flux3-frontends")
    return convert(small_distilled(root / "ckpt"), root / "bundle", log=lambda _: None, cache=EXPORT_CACHE)


def test_c_example_runs_a_flux3_bundle_as_the_cli(bundle, tmp_path):
    """examples/c/generate.c (64x64, seed 42, 2 steps, "a red fox in the snow"): every check of the
    example holds on a FLUX.3 bundle, and its pixels are the CLI's."""
    for file in (RELEASE / "libklein.so", RELEASE / "include" / "klein.h"):
        assert file.is_file(), f"{file} is missing: run `cargo build --release` first (scripts/test.sh does)"
    exe = tmp_path / "generate"
    cc = os.environ.get("CC", "cc")
    compile_cmd = [cc, str(REPO / "examples" / "c" / "generate.c"), "-std=c99", "-Wall", "-Wextra", "-Werror"]
    compile_cmd += ["-I", str(RELEASE / "include"), "-L", str(RELEASE), "-lklein", f"-Wl,-rpath,{RELEASE}"]
    subprocess.run([*compile_cmd, "-o", str(exe)], check=True, capture_output=True, timeout=120)
    run = subprocess.run([str(exe), str(bundle), str(tmp_path / "c.ppm")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "all checks passed" in run.stdout, run.stdout + run.stderr
    klein_cli(bundle, "a red fox in the snow", 42, tmp_path / "cli.png", (64, 64), 2)
    c_image = np.asarray(Image.open(tmp_path / "c.ppm").convert("RGB"))
    cli_image = np.asarray(Image.open(tmp_path / "cli.png").convert("RGB"))
    assert c_image.shape == cli_image.shape == (64, 64, 3)
    assert (c_image == cli_image).all(), int((c_image != cli_image).any(axis=-1).sum())


@pytest.fixture(scope="module")
def ray_url(bundle):
    """A local Ray cluster (this process's own) with deploy/ray/klein_serve.py on the FLUX.3 bundle."""
    import socket

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import ray
    from deploy.ray import klein_serve
    from ray import serve

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=128 * 1024**2,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO), "RAY_USAGE_STATS_ENABLED": "0"}},
    )
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        app = klein_serve.app_builder({"model": str(bundle), "replicas": "1", "num_cpus": "1", "threads": "1"})
        failure = []

        def deploy():
            try:
                serve.run(app, name="klein-flux3", route_prefix="/")
            except BaseException as error:  # reported below
                failure.append(error)
            deployed.set()

        deployed = threading.Event()
        threading.Thread(target=deploy, daemon=True).start()
        assert deployed.wait(150), "the deployment was not running after 150 s"
        assert not failure, failure
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def test_ray_serve_answers_the_cli_files(ray_url, bundle, tmp_path):
    """Text to image through the OpenAI route, and an edit with one reference (FLUX.3 keeps it whole
    on a padded canvas and crops back): each the CLI's PNG byte for byte."""
    health = requests.get(f"{ray_url}/healthz", timeout=60).json()
    assert health["status"] == "ok" and health["model"] == bundle.name, health
    body = {"prompt": "a lighthouse in a storm", "size": "64x48", "seed": 7, "response_format": "b64_json"}
    answer = requests.post(f"{ray_url}/v1/images/generations", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    got = base64.b64decode(answer.json()["data"][0]["b64_json"])
    klein_cli(bundle, "a lighthouse in a storm", 7, tmp_path / "t2i.png", (64, 48))
    assert got == (tmp_path / "t2i.png").read_bytes()

    synthetic_image(100, 70, "RGB", seed=3).save(tmp_path / "ref.png")
    reference = (tmp_path / "ref.png").read_bytes()
    answer = requests.post(
        f"{ray_url}/v1/images/edits",
        files=[("image[]", ("ref.png", reference, "image/png"))],
        data={"prompt": "make it night", "seed": "4"},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    got = base64.b64decode(answer.json()["data"][0]["b64_json"])
    # Run where ref.png lies: the PNG's metadata names the reference as the upload is named.
    cmd = [str(KLEIN), "generate", "make it night", "--model", str(bundle), "--seed", "4", "--ref", "ref.png"]
    subprocess.run([*cmd, "-o", "edit.png", "-q"], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    want = (tmp_path / "edit.png").read_bytes()
    assert Image.open(tmp_path / "edit.png").size == (100, 70)  # cropped back to the reference
    assert got == want
