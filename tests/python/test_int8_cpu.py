"""An int8 bundle of 8-bit codes (`klein-export quantize --quantize int8 --method dynamic`) on the CPU
at hand: the CLI, the Python bindings and `klein serve` give the same PNG, and that image is the one
the export tool computes from the same graphs (klein_export.ort_pipeline, which runs the int8
weights as the runtime does on this CPU: int8_kernels.py).

scripts/test.sh runs this file twice: as the host is, and under benches/avx2-host.sh (an AVX2-only
CPU without VNNI, where ONNX Runtime's u8 x s8 products saturate unless the weights are converted to
uint8). A front end or the export tool that did not convert there would be about 20 dB off (issue
62's figure on the tiny model), far outside the tolerance below.
"""

import base64
import subprocess
import warnings
from pathlib import Path

import httpx2 as httpx
import numpy as np
import pytest
from PIL import Image
from test_serve import Server

pytestmark = pytest.mark.int8_kernels

PROMPT, SEED, WIDTH, HEIGHT = "a lighthouse at dusk", 21, 64, 48


@pytest.fixture(scope="module")
def int8_bundle(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from klein_export.cli import main

    out = tmp_path_factory.mktemp("int8") / "bundle"
    args = ["quantize", "--bundle", str(tiny_bundle), "--out", str(out), "--quantize", "int8", "--method", "dynamic"]
    assert main(args) == 0
    return out


def test_every_front_end_gives_the_export_tools_int8_image(int8_bundle: Path, klein_bin: Path, tmp_path: Path):
    import klein_runtime as klein

    from klein_export.int8_kernels import int8_products_saturate
    from klein_export.ort_pipeline import bundle_image

    cli_out = tmp_path / "cli.png"
    subprocess.run(
        [str(klein_bin), "generate", PROMPT, "--model", str(int8_bundle), "-q", "-o", str(cli_out)]
        + ["--seed", str(SEED), "--width", str(WIDTH), "--height", str(HEIGHT)],
        check=True,
        timeout=120,
    )
    cli_png = cli_out.read_bytes()

    pipe = klein.Pipeline(int8_bundle)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pipe(prompt=PROMPT, width=WIDTH, height=HEIGHT, generator=SEED, output_type="png")
    assert out.images == [cli_png], "the Python bindings' PNG is not the CLI's"
    # The runtime says when it converts, exactly where the export tool's probe finds saturation.
    said = any("this CPU has no VNNI" in str(w.message) for w in caught)
    assert said is int8_products_saturate(), [str(w.message) for w in caught]

    server = Server(klein_bin, int8_bundle)
    try:
        body = {"prompt": PROMPT, "size": f"{WIDTH}x{HEIGHT}", "seed": SEED, "response_format": "b64_json"}
        response = httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=120)
        assert response.status_code == 200, response.text
        assert base64.b64decode(response.json()["data"][0]["b64_json"]) == cli_png, "the server's PNG is not the CLI's"
    finally:
        assert server.stop() == 0

    # The export tool's image of the same graphs: the glue differs (numpy and torch against Rust), so
    # the tolerance is the one the CLI meets against diffusers (export/tests/test_runtime_e2e.py): at
    # most 1 level anywhere, in at most 1% of pixels.
    want = np.round(bundle_image(int8_bundle, PROMPT, SEED, WIDTH, HEIGHT)).astype(int)
    got = np.asarray(Image.open(cli_out).convert("RGB")).astype(int)
    diff = np.abs(got - want)
    pixels = float((diff > 0).any(axis=-1).mean())
    assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)
