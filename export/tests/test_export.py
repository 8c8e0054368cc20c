"""convert + verify on the tiny checkpoint, the manifest and metadata, and export safety."""

import hashlib
import json
import shutil

import onnx
import pytest
import torch
from safetensors.torch import save_file

from klein_export import FORMAT_VERSION
from klein_export.checkpoint import CheckpointError
from klein_export.cli import main
from klein_export.contract import COMPONENTS
from klein_export.convert import BundleExistsError, convert
from klein_export.verify import verify


def test_every_component_matches_torch(tiny_checkpoint, tiny_bundle):
    results = list(verify(tiny_checkpoint, tiny_bundle))
    assert {r.component for r in results} == set(COMPONENTS)
    assert all(sum(r.component == c for r in results) >= 3 for c in COMPONENTS), "three shapes or more per component"
    failed = [r.line() for r in results if not r.ok]
    assert not failed, "\n".join(failed)


def test_manifest_schema_and_hashes(tiny_bundle):
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    assert manifest["format_version"] == FORMAT_VERSION
    assert manifest["model"] == {
        "name": "klein-tiny",
        "variant": "tiny",
        "is_distilled": True,
        "default_steps": 4,
        "default_guidance": 1.0,
        "default_width": 1024,
        "default_height": 1024,
    }
    tok = manifest["tokenizer"]
    assert tok["prompt_prefix"] == "<|im_start|>user\n"
    assert tok["prompt_suffix"] == "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert (tok["pad_token"], tok["pad_token_id"], tok["padding_side"], tok["max_sequence_length"]) == (
        "<|endoftext|>",
        151643,
        "right",
        512,
    )
    te = manifest["text_encoder"]
    assert (te["hidden_layers"], te["layers_in_graph"], te["embed_dim"], te["num_hidden_layers"]) == (
        [9, 18, 27],
        27,
        48,
        28,
    )
    assert manifest["transformer"]["joint_attention_dim"] == 48
    assert manifest["scheduler"]["time_shift_type"] == "exponential" and manifest["scheduler"]["use_dynamic_shifting"]
    assert manifest["latents"] == {"channels": 128, "pixel_multiple": 16}
    files = {p.name for p in tiny_bundle.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    for name, entry in manifest["files"].items():
        data = (tiny_bundle / name).read_bytes()
        assert entry == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    for component in COMPONENTS:
        spec = manifest["graphs"][component]
        assert (spec["precision"], spec["quantization"]) == ("fp32", None)
        model = onnx.load(str(tiny_bundle / spec["file"]))
        meta = {p.key: p.value for p in model.metadata_props}
        assert meta == {
            "klein.component": component,
            "klein.precision": "fp32",
            "klein.quantization": "none",
            "klein.format_version": str(FORMAT_VERSION),
            "COREML_CACHE_KEY": meta["COREML_CACHE_KEY"],  # test_static_shapes.py checks it
        }
        assert [i.name for i in model.graph.input] == [t["name"] for t in spec["inputs"]]
        assert [o.name for o in model.graph.output] == [t["name"] for t in spec["outputs"]]
        assert not any(n.metadata_props for n in model.graph.node), "exporter debug metadata is stripped"


def test_text_encoder_graph_stops_at_last_layer(tiny_bundle):
    model = onnx.load(str(tiny_bundle / "text_encoder.onnx"))
    norms = {i.name.split(".")[2] for i in model.graph.initializer if i.name.endswith("input_layernorm.weight")}
    # The tiny Qwen3 has 28 layers; the graph holds the 27 it needs and not the final norm.
    assert norms == {str(k) for k in range(27)}
    assert not any(i.name.startswith("model.norm") for i in model.graph.initializer)


def test_refuses_to_overwrite(tiny_checkpoint, tiny_bundle, capsys):
    before = (tiny_bundle / "manifest.json").read_bytes()
    with pytest.raises(BundleExistsError, match="--force"):
        convert(tiny_checkpoint, tiny_bundle)
    assert main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(tiny_bundle)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert (tiny_bundle / "manifest.json").read_bytes() == before


def _copy(ckpt, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(ckpt, dst)
    return dst


def test_missing_component_is_a_clear_error(tiny_checkpoint, tmp_path, capsys):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    shutil.rmtree(ckpt / "vae")
    with pytest.raises(CheckpointError, match=r"vae: missing component directory"):
        convert(ckpt, tmp_path / "out")
    assert main(["convert", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    assert "vae" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_wrong_component_class_is_a_clear_error(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    index = json.loads((ckpt / "model_index.json").read_text())
    index["transformer"] = ["diffusers", "FluxTransformer2DModel"]
    (ckpt / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="'transformer' is 'FluxTransformer2DModel'"):
        convert(ckpt, tmp_path / "out")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        # Found when the checkpoint is opened, before any export.
        (lambda w: w.write_bytes(w.read_bytes()[:1000]), "not a readable safetensors file"),
        # Found from the headers, against a weightless copy of the model, before any export.
        (lambda w: save_file({"not.a.weight": torch.zeros(3)}, w), "transformer: its safetensors files lack"),
    ],
)
def test_corrupt_weights_leave_no_partial_bundle(tiny_checkpoint, tmp_path, corrupt, message):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    corrupt(next((ckpt / "transformer").glob("*.safetensors")))
    with pytest.raises(CheckpointError, match=message):
        convert(ckpt, tmp_path / "out")
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"], "no bundle and no temporary directory left behind"


@pytest.mark.parametrize(
    "component, change, message",
    [
        ("transformer", {"num_layers": 3}, "transformer: its safetensors files lack 16 of the model's weights"),
        ("transformer", {"num_layers": 1}, "transformer: 16 weights have no place in the model"),
        ("vae", {"layers_per_block": 2}, "vae: its safetensors files lack 64"),
        ("text_encoder", {"intermediate_size": 96}, "text_encoder: 81 weights have another shape"),
    ],
)
def test_a_config_of_another_size_is_refused_before_any_export(tiny_checkpoint, tmp_path, component, change, message):
    """A config.json that does not describe its weights (diffusers would leave weights out, or make
    some up): refused from the headers before the text encoder's export, which took most of a
    minute here and minutes on the 4B."""
    ckpt = _copy(tiny_checkpoint, tmp_path)
    config = ckpt / component / "config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | change))
    with pytest.raises(CheckpointError, match=message):
        convert(ckpt, tmp_path / "out", log=lambda line: pytest.fail(f"exported before the check: {line}"))
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


def test_variant_weights_are_not_read_and_a_missing_chat_template_is_named(tiny_checkpoint, tmp_path):
    """Files diffusers loads only when asked for a variant are left alone (a partial fp16 download
    beside the weights); a tokenizer without its chat template is named, not a traceback."""
    from klein_export.checkpoint import Checkpoint

    ckpt = _copy(tiny_checkpoint, tmp_path)
    (ckpt / "transformer" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"partial")
    Checkpoint(ckpt).check_weights()
    for name in ("diffusion_pytorch_model.safetensors",):
        (ckpt / "vae" / name).rename(ckpt / "vae" / "diffusion_pytorch_model.fp16.safetensors")
    with pytest.raises(CheckpointError, match=r"vae: no \*.safetensors weights but variants"):
        Checkpoint(ckpt)
    ckpt = _copy(tiny_checkpoint, tmp_path / "again")
    settings = ckpt / "tokenizer" / "tokenizer_config.json"
    settings.write_text(json.dumps({k: v for k, v in json.loads(settings.read_text()).items() if k != "chat_template"}))
    with pytest.raises(CheckpointError, match="tokenizer: no chat template"):
        Checkpoint(ckpt)
    settings.unlink()
    with pytest.raises(CheckpointError, match="tokenizer_config.json: missing"):
        Checkpoint(ckpt)


def test_unsupported_scheduler_option_is_refused(tiny_checkpoint, tmp_path):
    ckpt = _copy(tiny_checkpoint, tmp_path)
    path = ckpt / "scheduler" / "scheduler_config.json"
    cfg = json.loads(path.read_text())
    cfg["use_karras_sigmas"] = True
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="use_karras_sigmas"):
        convert(ckpt, tmp_path / "out")


@pytest.mark.parametrize(
    "name, group",
    [("SIGINT", False), ("SIGINT", True), ("SIGTERM", False), ("SIGHUP", True)],
    ids=["parent-only", "terminal", "kill", "hangup"],
)
def test_an_interrupted_convert_ends_at_once_and_leaves_nothing(tiny_checkpoint, tmp_path, name, group):
    """Ctrl-C while a component exports in its worker process: `klein-export` exits 130 within seconds
    with its one line after the progress lines, no traceback (the worker's included) and no warning,
    no output, no process left. `parent-only` is `timeout -s INT` or `kill -INT PID` (the worker
    outlived it and the exit hung in 3 of 14 tries); `terminal` signals the whole process group, as a terminal's Ctrl-C.
    The child starts with SIGINT's default action: started from a background job, the test run
    inherits SIGINT ignored, and so would the child (Python then leaves it ignored, and the
    export ran to its end; a terminal user has the default). `kill` (SIGTERM to the parent) and
    `hangup` (SIGHUP to the group, as a closed terminal) end it the same way, exit 128 + the
    signal's number (they ended the parent alone, the worker exporting on and the partial output
    left behind)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "out"
    command = [sys.executable, "-m", "klein_export.cli", "convert", "--checkpoint", str(tiny_checkpoint)]
    child = subprocess.Popen(
        command + ["--out", str(out)],
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(12)  # the worker is exporting the text encoder (about 35 s in all)
    assert child.poll() is None, "the export was still running when interrupted"
    signum = getattr(signal, name)
    if group:
        os.killpg(child.pid, signum)
    else:
        os.kill(child.pid, signum)
    started = time.monotonic()
    _, err = child.communicate(timeout=60)
    waited = time.monotonic() - started
    for _ in range(50):  # multiprocessing's resource tracker ends once it sees the parent's end
        leftover = subprocess.run(["pgrep", "-g", str(child.pid)], capture_output=True, text=True).stdout.split()
        if not leftover:
            break
        time.sleep(0.1)
    said = "interrupted" if name == "SIGINT" else f"stopped by {name}"
    # The progress lines of what ran, then the one line that says it stopped: no traceback, no warning.
    *progress, last = err.decode().splitlines()
    assert (child.returncode, last) == (128 + signum, f"klein-export: {said}; nothing was written"), err
    assert all(line.startswith(("klein-export: [", "klein-export: exported ")) for line in progress), err
    assert waited < 15, f"exited {waited:.1f} s after the interrupt"
    assert not leftover, f"processes of the group still running: {leftover}"
    assert list(tmp_path.iterdir()) == []
