"""FLUX.3 Image Klein's base checkpoint (50 steps, classifier-free guidance 3.5): the klein CLI and
the Python bindings against diffusers' `Flux3ModularPipeline`. A tiny random-weight checkpoint with 8
Qwen3-VL layers, all stacked (`text_encoder_out_layers` in its index; the last is the final-normed
output), widths no other test uses.
"""

import pytest
from diffusers.utils import load_image
from flux3_helpers import check_manifest, compare_png, flux3_bundle, klein_cli

from klein_export.fixtures import synthetic_image
from klein_export.flux3_reference import run_reference


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    # 8 Qwen3-VL layers, all stacked (recorded in the index): the last is the final-normed output.
    text = {"intermediate_size": 24, "num_hidden_layers": 8}
    return flux3_bundle(tmp_path_factory.mktemp("flux3-base"), 32, False, text, out_layers=range(1, 9))


BASE_CASES = [
    {"id": "default-guidance-3.5", "prompt": "a red fox", "seed": 1, "size": (96, 64), "steps": 3, "kw": {}},
    {
        "id": "negative-prompt-longer-window",
        "prompt": "a red fox in the snow",
        "seed": 2,
        "size": (64, 64),
        "steps": 2,
        "kw": {"negative_prompt": ", ".join(["blurry"] * 60), "guidance": 2.5},
    },
]


@pytest.mark.parametrize("case", BASE_CASES, ids=[c["id"] for c in BASE_CASES])
def test_base_equals_diffusers(base, case, tmp_path):
    pipe, bundle = base
    kw = case["kw"]
    want = run_reference(
        pipe, case["prompt"], case["seed"], *case["size"], steps=case["steps"], output_type="pil", **kw
    )
    extra = []
    if "negative_prompt" in kw:
        extra += ["--negative-prompt", kw["negative_prompt"]]
    if "guidance" in kw:
        extra += ["--guidance", str(kw["guidance"])]
    klein_cli(bundle, case["prompt"], case["seed"], tmp_path / "k.png", case["size"], case["steps"], extra)
    compare_png(tmp_path / "k.png", want[0], case["id"])


def test_manifest_names_the_family_and_the_recipe(base):
    check_manifest(base[1], 50, 3.5, False)


def test_python_bindings_follow_the_family(base, tmp_path):
    """`klein_runtime.Pipeline` on the base bundle: one reference (cropped back), guidance 2 and a
    negative prompt, as diffusers; no option names the family."""
    import klein_runtime

    pipe, bundle = base
    klein = klein_runtime.Pipeline(bundle)
    assert (klein.family, klein.default_steps, klein.default_guidance) == ("flux3", 50, 3.5)
    synthetic_image(100, 70, "RGB", seed=8).save(tmp_path / "ref.png")
    kw = {"negative_prompt": "fog", "guidance": 2.0}
    want = run_reference(
        pipe, "a boat", 6, steps=2, output_type="pil", images=load_image(str(tmp_path / "ref.png")), **kw
    )
    got = klein(
        "a boat",
        image=tmp_path / "ref.png",
        num_inference_steps=2,
        generator=6,
        negative_prompt="fog",
        guidance_scale=2.0,
    ).images[0]
    got.save(tmp_path / "k.png")
    compare_png(tmp_path / "k.png", want[0], "python, base, one reference")


def test_server_follows_the_family(base, tmp_path):
    """`klein serve` on the base bundle: the model object says FLUX.3 with guidance, and
    `/v1/klein/generate` with one reference and a negative prompt gives diffusers' image."""
    import base64
    import io
    import re
    import signal
    import subprocess
    import threading

    import httpx2 as httpx
    from flux3_helpers import KLEIN
    from PIL import Image

    pipe, bundle = base
    synthetic_image(90, 60, "RGB", seed=9).save(tmp_path / "ref.png")
    server = subprocess.Popen(
        [str(KLEIN), "serve", "--model", str(bundle), "--port", "0"], stderr=subprocess.PIPE, text=True
    )
    try:
        url = None
        for line in server.stderr:
            match = re.search(r"listening on (http://[\d.]+:\d+)", line)
            if match:
                url = match.group(1)
                break
        assert url, "klein serve did not start"
        # Its log is read on, so that the pipe never fills.
        threading.Thread(target=lambda: [None for _ in server.stderr], daemon=True).start()
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["klein"]
        assert (model["family"], model["guidance"], model["default_steps"]) == ("flux3", True, 50)
        body = {
            "prompt": "a harbour",
            "seed": 12,
            "steps": 2,
            "guidance": 3.0,
            "negative_prompt": "people",
            "refs": [{"name": "ref.png", "data": base64.b64encode((tmp_path / "ref.png").read_bytes()).decode()}],
        }
        answer = httpx.post(f"{url}/v1/klein/generate", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        answer = answer.json()
        assert (answer["width"], answer["height"]) == (90, 60)  # the canvas cropped back
        Image.open(io.BytesIO(base64.b64decode(answer["images"][0]))).save(tmp_path / "k.png")
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    want = run_reference(
        pipe,
        "a harbour",
        12,
        steps=2,
        guidance=3.0,
        negative_prompt="people",
        output_type="pil",
        images=load_image(str(tmp_path / "ref.png")),
    )
    compare_png(tmp_path / "k.png", want[0], "server, base, one reference")
