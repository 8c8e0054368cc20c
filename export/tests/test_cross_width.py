"""Models of other widths (klein 9B beside 4B): the presets, checkpoints that record their own text
encoder out layers, and what the export tool refuses when a LoRA, a bundle or a reference is of
another width than the checkpoint. The widths here are tiny (16 and 24 for the text encoder, 64 and 96
for the transformer); the checks compare shapes, whatever their size."""

import json
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lora_files import linear_shapes, write_lokr_bfl, write_peft

from klein_export.against import check_same_model, component_differences
from klein_export.checkpoint import Checkpoint
from klein_export.convert import _export_text_encoder, check_variant, convert
from klein_export.diffusers_reference import diffusers_image, load_pipeline, reference_images
from klein_export.errors import BundleError, CheckpointError, LoraError
from klein_export.lora_map import add_lora_map
from klein_export.lora_merge import LoraSpec, check_loras, merge_loras
from klein_export.manifest import architecture
from klein_export.ort_pipeline import run_graph
from klein_export.tiny import PRESETS, build_tiny
from klein_export.verify import verify, verify_images
from klein_export.wrappers import TextEncoder

# The tiny model at other widths: text encoder 24 (not 16), transformer 3 x 32 = 96 (not 64).
OTHER_WIDTH = {
    "transformer_overrides": {"num_attention_heads": 3, "joint_attention_dim": 3 * 24},
    "qwen_overrides": {"hidden_size": 24},
}


@pytest.fixture(scope="module")
def other_width_checkpoint(tmp_path_factory):
    return build_tiny(tmp_path_factory.mktemp("other") / "klein-tiny-96", seed=0, **OTHER_WIDTH)


@pytest.fixture(scope="module")
def tiny_loras(tiny_checkpoint, tmp_path_factory):
    """A PEFT LoRA and a BFL LoKr (fused QKV) made for the tiny checkpoint's widths."""
    out = tmp_path_factory.mktemp("loras")
    transformer = Checkpoint(tiny_checkpoint).load_transformer()
    shapes = linear_shapes(transformer)
    return [write_peft(transformer, out / "peft.safetensors"), write_lokr_bfl(shapes, out / "lokr.safetensors")]


def _parameters(module_class, config) -> int:
    with torch.device("meta"):
        model = module_class(config) if not isinstance(config, dict) else module_class(**config)
    return sum(p.numel() for p in model.parameters())


def test_presets_have_the_published_sizes():
    from diffusers import Flux2Transformer2DModel
    from transformers import Qwen3Config, Qwen3ForCausalLM

    assert _parameters(Flux2Transformer2DModel, PRESETS["4b"].transformer) == 3_875_544_576
    assert _parameters(Flux2Transformer2DModel, PRESETS["9b"].transformer) == 9_078_581_248
    assert _parameters(Qwen3ForCausalLM, Qwen3Config(**PRESETS["9b"].qwen)) == 8_190_735_360  # Qwen3-8B
    wide, full = PRESETS["9b-wide"], PRESETS["9b"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert wide.qwen[key] == full.qwen[key], key
    for key in ("num_attention_heads", "attention_head_dim", "joint_attention_dim", "axes_dims_rope", "in_channels"):
        assert wide.transformer[key] == full.transformer[key], key
    assert (wide.transformer["num_layers"], wide.transformer["num_single_layers"]) == (1, 2)
    assert wide.transformer["joint_attention_dim"] == len(wide.out_layers) * wide.qwen["hidden_size"] == 12288
    assert max(wide.out_layers) < wide.qwen["num_hidden_layers"]  # the exporter still cuts a layer
    assert wide.vae == PRESETS["4b"].vae


@pytest.fixture(scope="module")
def four_layer_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose 4-layer text encoder feeds layers 1, 2, 3 (as the 9b-wide preset)."""
    out = tmp_path_factory.mktemp("four") / "klein-tiny-4"
    return build_tiny(out, seed=0, qwen_overrides={"num_hidden_layers": 4}, out_layers=(1, 2, 3))


def test_recorded_out_layers_reach_the_export_and_diffusers(four_layer_checkpoint, tmp_path):
    ckpt = Checkpoint(four_layer_checkpoint)
    assert json.loads((four_layer_checkpoint / "model_index.json").read_text())["text_encoder_out_layers"] == [1, 2, 3]
    assert ckpt.text_encoder_out_layers == (1, 2, 3)
    assert architecture(ckpt)["text_encoder"] == {
        "hidden_size": 16,
        "num_hidden_layers": 4,
        "layers_in_graph": 3,
        "hidden_layers": [1, 2, 3],
        "embed_dim": 48,
    }
    # The exported graph computes diffusers' embeddings with those layers (the default 9/18/27 would
    # not even exist in this text encoder).
    (entry,) = _export_text_encoder(ckpt, tmp_path, "fp32", ())
    pipe = load_pipeline(four_layer_checkpoint, transformer=None, vae=None)
    tokenizer = pipe.tokenizer
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "a cat"}], tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    enc = tokenizer(text, return_tensors="np", padding="max_length", truncation=True, max_length=512)
    feeds = {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}
    got = run_graph(tmp_path, entry.to_json(), feeds)
    with torch.no_grad():
        want = pipe.encode_prompt("a cat", text_encoder_out_layers=(1, 2, 3))[0].numpy()
        other = pipe.encode_prompt("a cat", text_encoder_out_layers=(1, 2, 2))[0].numpy()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale
    assert np.abs(got - other).max() > 1e-2 * scale  # the layers matter
    # verify's diffusers reference (staged) passes them too, and equals one whole pipeline.
    case = {"prompt": "a cat", "seed": 3, "width": 32, "height": 32}
    (staged,) = reference_images(four_layer_checkpoint, [case], 2)
    whole = diffusers_image(load_pipeline(four_layer_checkpoint), "a cat", 3, 32, 32, 2, out_layers=(1, 2, 3))
    np.testing.assert_array_equal(staged, whole)


def test_wrapping_the_text_encoder_leaves_it_intact(tiny_checkpoint):
    """transformers hooks a model's layers at its first forward: the wrapper's copy must not hook
    them a second time (every hidden state would then be recorded twice, shifting the layers)."""
    ckpt = Checkpoint(tiny_checkpoint)
    wrapped, fresh = ckpt.load_text_encoder(), ckpt.load_text_encoder()
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        TextEncoder(wrapped, (9, 18, 27))(ids, mask)
        got = wrapped(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        want = fresh(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(got) == len(want) == 29
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_out_layers_are_checked(tiny_checkpoint, tmp_path):
    for layers, words in (
        ([9, 18, 28], "outside 1..27"),  # the last layer's hidden state is the normed output
        ([0, 9, 18], "outside 1..27"),
        (["9", 18, 27], "list of layer numbers"),
        ([9, 18], "joint_attention_dim 48"),  # 16 x 2 != 48
    ):
        root = tmp_path / f"ckpt-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_checkpoint, root)
        index = json.loads((root / "model_index.json").read_text())
        (root / "model_index.json").write_text(json.dumps({**index, "text_encoder_out_layers": layers}))
        with pytest.raises(CheckpointError, match=words):
            Checkpoint(root)


def test_text_encoder_of_another_width_is_refused(tiny_checkpoint, tmp_path):
    root = tmp_path / "mixed"
    shutil.copytree(tiny_checkpoint, root)
    config = json.loads((root / "transformer" / "config.json").read_text())
    (root / "transformer" / "config.json").write_text(json.dumps({**config, "joint_attention_dim": 72}))
    with pytest.raises(CheckpointError, match=r"hidden_size 16 x 3 .* = 48, but .*joint_attention_dim 72"):
        Checkpoint(root)


def test_lora_of_another_width_is_refused(tiny_checkpoint, other_width_checkpoint, tiny_loras, tmp_path):
    other = Checkpoint(other_width_checkpoint)
    check_loras(Checkpoint(tiny_checkpoint).transformer_config, [LoraSpec(p) for p in tiny_loras])  # they fit there
    for path in tiny_loras:
        for refuse in (
            lambda spec: merge_loras(other.load_transformer(), [spec]),
            lambda spec: check_loras(other.transformer_config, [spec]),
        ):
            with pytest.raises(LoraError) as error:
                refuse(LoraSpec(path))
            message = str(error.value)
            assert message.startswith(f"{path}: ")
            assert "context_embedder is [96, 72], the LoRA gives [64, 48]" in message
            assert "hidden size is 96" in message
            assert "size mismatch" not in message  # not torch's wall of text


def test_export_with_a_lora_of_another_width_stops_before_exporting(other_width_checkpoint, tiny_loras, tmp_path):
    out = tmp_path / "bundle"
    with pytest.raises(LoraError, match="do not have the shape"):
        convert(other_width_checkpoint, out, loras=[LoraSpec(tiny_loras[0])], log=lambda _: None)
    assert not out.exists() and not list(tmp_path.iterdir())


def test_bundle_of_another_width_is_refused(other_width_checkpoint, tiny_bundle):
    manifest = (tiny_bundle / "manifest.json").read_bytes()
    expected = r"manifest.json does not describe the checkpoint .*text_encoder.hidden_size 16 vs 24"
    with pytest.raises(BundleError, match=expected) as error:
        add_lora_map(other_width_checkpoint, tiny_bundle)
    assert "transformer.num_attention_heads 2 vs 3" in str(error.value)
    assert (tiny_bundle / "manifest.json").read_bytes() == manifest  # untouched
    with pytest.raises(BundleError, match=expected):
        next(verify(other_width_checkpoint, tiny_bundle))
    with pytest.raises(BundleError, match=expected):
        next(verify_images(other_width_checkpoint, tiny_bundle))


def test_reference_bundle_of_another_width_is_refused(tiny_bundle, tmp_path):
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    del manifest["vae"]["sample_size"]  # an older exporter's manifest: fields it lacks are not compared
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    check_same_model(tiny_bundle, tmp_path)
    manifest["text_encoder"].update(hidden_size=24, embed_dim=72)
    manifest["transformer"].update(num_attention_heads=3, joint_attention_dim=72)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"not a reference bundle of the model .*text_encoder.embed_dim 48 vs 72"):
        next(component_differences(tiny_bundle, tmp_path))


def test_a_reference_bundle_that_is_not_fp32_is_refused(tiny_bundle, tmp_path):
    """`verify --bundle FP32 --against INT8` (the operands swapped) said only "PSNR ... FAIL"."""
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    manifest["graphs"]["transformer"].update(precision="fp16")
    manifest["graphs"]["text_encoder"].update(quantization={"method": "dynamic", "bits": 8})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    expected = r"not an fp32 bundle \(text_encoder fp32 quantized, transformer fp16\): .*the other way round"
    with pytest.raises(BundleError, match=expected):
        check_same_model(tiny_bundle, tmp_path)


def test_variant_must_have_its_widths(tiny_checkpoint, tmp_path):
    def checkpoint(text, heads, joint):
        return SimpleNamespace(
            root=tmp_path / "ckpt",
            text_encoder_config={"hidden_size": text},
            transformer_config={"num_attention_heads": heads, "attention_head_dim": 128, "joint_attention_dim": joint},
        )

    nine = checkpoint(4096, 32, 12288)
    check_variant(nine, "9b")
    check_variant(nine, "custom")
    with pytest.raises(CheckpointError, match=r"--variant 4b: .* has the widths of klein 9b \(text encoder 4096"):
        check_variant(nine, "4b")
    with pytest.raises(CheckpointError, match="--variant 9b: .* has the widths of klein 4b"):
        check_variant(checkpoint(2560, 24, 7680), "9b")
    out = tmp_path / "bundle"
    with pytest.raises(CheckpointError, match="the widths of neither klein 4B nor 9B"):
        convert(tiny_checkpoint, out, variant="4b", log=lambda _: None)
    assert not out.exists()
