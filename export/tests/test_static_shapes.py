"""`convert --static-shapes` (fixed-shape graphs per size bucket, for CoreML) and the
`COREML_CACHE_KEY` of every graph; the klein CLI on a static bundle.

The bucket graphs are the dynamic graphs with fixed input shapes, except that the static
transformer keeps attention as MatMul-Softmax-MatMul (CoreML runs it) where the dynamic one has
ONNX Runtime's fused MultiHeadAttention. On the same inputs ONNX Runtime must give the same VAE
outputs (measured: bit-equal; asserted within 1e-6 relative, room for a different kernel choice at
a fixed shape) and the same transformer output up to fp32 summation order (measured 2.3e-6
relative; asserted within 1e-5). klein's images from the static bundle must be within 1 level of
the dynamic bundle's in at most 1% of pixels, the tolerance of every fp32 comparison here.
"""

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from klein_binary import KLEIN
from PIL import Image
from safetensors.numpy import load_file, save_file

from klein_export.cache_key import KEY, stamp
from klein_export.cli import main
from klein_export.convert import convert

REPO = Path(__file__).resolve().parents[2]
BUCKETS = [(64, 64), (96, 64)]  # references must be 64 px or more a side


@pytest.fixture(scope="module")
def static_bundle(tiny_checkpoint, tmp_path_factory, export_cache):
    out = tmp_path_factory.mktemp("static") / "klein-tiny-static"
    return convert(
        tiny_checkpoint,
        out,
        variant="tiny",
        static_shapes="64x64,96x64",
        refs=1,
        log=lambda _: None,
        cache=export_cache,
    )


def _manifest(bundle):
    return json.loads((bundle / "manifest.json").read_text())


def _session(path):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _feeds(component, width, height, rng):
    lat_h, lat_w = height // 16, width // 16
    tokens = 2 * lat_h * lat_w  # output + one reference of the output's size
    return {
        "transformer": {
            "latents": rng.standard_normal((1, tokens, 128), dtype=np.float32),
            "prompt_embeds": rng.standard_normal((1, 512, 48), dtype=np.float32),
            "timestep": np.array([0.6], np.float32),
            "img_ids": rng.integers(0, 8, (tokens, 4)),
            "txt_ids": rng.integers(0, 8, (512, 4)),
        },
        "vae_decoder": {"latents": rng.standard_normal((1, 128, lat_h, lat_w), dtype=np.float32)},
        "vae_encoder": {"image": rng.uniform(-1, 1, (1, 3, height, width)).astype(np.float32)},
    }[component]


def test_manifest_lists_buckets_sharing_weights(static_bundle):
    manifest = _manifest(static_bundle)
    assert "lora_targets" not in manifest["graphs"]["transformer"]  # LoRAs merge at export only
    shapes = manifest["static_shapes"]
    assert (shapes["batch"], shapes["seq"], shapes["refs"]) == (1, 512, 1)
    assert [(b["width"], b["height"]) for b in shapes["buckets"]] == BUCKETS
    for bucket in shapes["buckets"]:
        name = f"{bucket['width']}x{bucket['height']}"
        assert bucket["files"] == {c: f"{c}.{name}.onnx" for c in ("transformer", "vae_decoder", "vae_encoder")}
    assert {c: g["file"] for c, g in manifest["graphs"].items()} == {
        "text_encoder": "text_encoder.onnx",
        "transformer": "transformer.64x64.onnx",
        "vae_encoder": "vae_encoder.64x64.onnx",
        "vae_decoder": "vae_decoder.64x64.onnx",
    }
    files = {p.name for p in static_bundle.iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == files
    assert not {"transformer.onnx", "vae_decoder.onnx", "vae_encoder.onnx"} & files, "dynamic graphs removed"
    for component in ("transformer", "vae_decoder", "vae_encoder"):
        weights = static_bundle / f"{component}.weights"
        graphs = [static_bundle / f"{component}.{w}x{h}.onnx" for w, h in BUCKETS]
        # Each bucket graph is structure only: its large initializers live in the one shared file.
        for graph in graphs:
            model = onnx.load(str(graph), load_external_data=False)
            external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
            assert external and {e.value for t in external for e in t.external_data if e.key == "location"} == {
                weights.name
            }
            assert graph.stat().st_size < weights.stat().st_size / 5, graph.name
        # onnx writes external data 0600; the bundle's files get the umask's mode like any new file.
        umask = os.umask(0)
        os.umask(umask)
        assert weights.stat().st_mode & 0o777 == graphs[0].stat().st_mode & 0o777 == 0o666 & ~umask


def test_bucket_graphs_have_fixed_shapes_and_compute_what_the_dynamic_graphs_do(static_bundle, tiny_bundle):
    rng = np.random.default_rng(0)
    for width, height in BUCKETS:
        for component in ("transformer", "vae_decoder", "vae_encoder"):
            path = static_bundle / f"{component}.{width}x{height}.onnx"
            model = onnx.load(str(path), load_external_data=False)
            for value in list(model.graph.input) + list(model.graph.output):
                dims = value.type.tensor_type.shape.dim
                assert all(d.HasField("dim_value") for d in dims), f"{path.name}: {value.name} is not static"
            feeds = _feeds(component, width, height, rng)
            got = _session(path).run(None, feeds)[0]
            want = _session(tiny_bundle / f"{component}.onnx").run(None, feeds)[0]
            assert got.shape == want.shape
            tolerance = 1e-5 if component == "transformer" else 1e-6  # attention's summation order
            assert np.abs(got - want).max() <= tolerance * np.abs(want).max(), f"{path.name}"
    ids = {"input_ids": rng.integers(0, 1000, (1, 512)), "attention_mask": np.ones((1, 512), np.int64)}
    # The static encoder keeps the plain operators, the dynamic one ONNX Runtime's fused norms and
    # attention: float32 rounding in another order, which the tiny encoder amplifies over its layers
    # (`verify`: torch's own fp32-vs-fp64 error on 512 tokens is up to 6.2e-3 of outputs up to 21,
    # 2.9e-4 relative; these two measured 1.2e-4). 1e-3 relative: a few times that floor, far under a
    # wrong graph's error (of the order of the outputs).
    got = _session(static_bundle / "text_encoder.onnx").run(None, ids)[0]
    want = _session(tiny_bundle / "text_encoder.onnx").run(None, ids)[0]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    with pytest.raises(Exception, match="latents"):
        _session(static_bundle / "transformer.64x64.onnx").run(None, _feeds("transformer", 96, 64, rng))


def test_every_graph_carries_its_coreml_cache_key(static_bundle, tiny_bundle, tmp_path):
    keys = {}
    for bundle in (static_bundle, tiny_bundle):
        for path in sorted(bundle.glob("*.onnx")):
            meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
            key = meta[KEY]
            assert len(key) == 64 and key.isalnum(), path.name
            keys[(bundle.name, path.name)] = key
    assert len(set(keys.values())) == len(keys), "every graph has its own key (bucket graphs differ in shapes)"
    # Stamping again gives the same key; other weights give another.
    copy = tmp_path / "vae_decoder.onnx"
    copy.write_bytes((tiny_bundle / "vae_decoder.onnx").read_bytes())
    assert stamp(copy) == keys[(tiny_bundle.name, "vae_decoder.onnx")]
    model = onnx.load(str(copy))
    weight = next(t for t in model.graph.initializer if t.dims and t.data_type == onnx.TensorProto.FLOAT)
    array = onnx.numpy_helper.to_array(weight).copy()
    array.flat[0] += 1.0
    weight.CopyFrom(onnx.numpy_helper.from_array(array, weight.name))
    onnx.save_model(model, str(copy))
    assert stamp(copy) != keys[(tiny_bundle.name, "vae_decoder.onnx")]


def _klein(*args):
    assert KLEIN.is_file(), f"{KLEIN} is missing: build it with `cargo build --release` (scripts/test.sh does)"
    return subprocess.run([str(KLEIN), *map(str, args)], capture_output=True, text=True, timeout=300)


def _image(path):
    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


@pytest.mark.parametrize("width, height", BUCKETS)
def test_klein_runs_each_bucket_as_the_dynamic_bundle(static_bundle, tiny_bundle, tmp_path, width, height):
    ref = tmp_path / "ref.png"
    rng = np.random.default_rng(width)
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(ref)
    common = ["--width", width, "--height", height, "--steps", 2, "--seed", 11, "--ref", ref, "--num-images", 2, "-q"]
    for name, bundle in (("static", static_bundle), ("dynamic", tiny_bundle)):
        run = _klein("generate", "a red fox", "-m", bundle, "-o", tmp_path / f"{name}.png", *common)
        assert run.returncode == 0, run.stderr
    for i in (1, 2):
        got, want = _image(tmp_path / f"static-{i}.png"), _image(tmp_path / f"dynamic-{i}.png")
        assert got.shape == (height, width, 3)
        diff = np.abs(got - want)
        pixels = float((diff > 0).any(axis=-1).mean())
        print(f"{width}x{height} image {i}: max diff {diff.max()}, {100 * pixels:.2f}% of pixels differ")
        assert diff.max() <= 1 and pixels <= 0.01, (diff.max(), pixels)


def test_non_finite_latents_are_counted_over_every_chunk(tiny_checkpoint, tmp_path, export_cache):
    """Static graphs denoise one image per call, so `--num-images 2` runs in two chunks: the
    warning about non-finite latents must count both (one warning, 2 x 2048 values at 64x64), and
    the images are still written, as diffusers would. The overflow is the LoRA test's (tests/it/
    lora.rs): one `to_q` filled with 1.58e38, within float32, whose products are not; static bundles
    refuse LoRAs, so here it is the checkpoint's own weight."""
    checkpoint = tmp_path / "overflowing-ckpt"
    shutil.copytree(tiny_checkpoint, checkpoint)
    weights = checkpoint / "transformer" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(weights)
    to_q = "transformer_blocks.0.attn.to_q.weight"
    tensors[to_q] = np.full_like(tensors[to_q], 1.58e38)
    save_file(tensors, weights)
    # Its text encoder and VAE are the static bundle's (from the export cache).
    bundle = convert(
        checkpoint,
        tmp_path / "bundle",
        variant="tiny",
        static_shapes="64x64",
        refs=1,
        log=lambda _: None,
        cache=export_cache,
    )
    ref = tmp_path / "ref.png"
    Image.new("RGB", (64, 64), (90, 140, 200)).save(ref)
    out = tmp_path / "out.png"
    args = ["--width", 64, "--height", 64, "--steps", 1, "--seed", 1, "--ref", ref, "--num-images", 2]
    run = _klein("generate", "a fox", "-m", bundle, "-o", out, *args)
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("denoised latent values are not finite") == 1, run.stderr
    assert "4096 of 4096 denoised latent values are not finite" in run.stderr, run.stderr
    assert all((tmp_path / f"out-{i}.png").is_file() for i in (1, 2))


def test_quantize_refuses_a_static_bundle_naming_it(static_bundle, tmp_path, capsys):
    out = tmp_path / "q"
    assert main(["quantize", "--bundle", str(static_bundle), "--out", str(out), "--quantize", "int8"]) == 2
    err = capsys.readouterr().err
    assert f"{static_bundle}: a static-shape bundle is for CoreML" in err, err
    assert ".partial" not in err and not out.exists()


def test_klein_refuses_a_size_or_reference_count_outside_the_buckets(static_bundle, tmp_path):
    ref = tmp_path / "ref.png"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(ref)
    cases = [
        (["--width", 80, "--height", 48, "--ref", ref], ["generates only 64x64, 96x64, not 80x48", "--static-shapes"]),
        (["--width", 64, "--height", 64], ["exactly 1 reference image(s)", "the request has 0"]),
        (["--width", 96, "--height", 64, "--ref", ref], ["output's size 96x64", "reference 1 is 64x64"]),
        (
            ["--width", 64, "--height", 64, "--ref", ref, "--lora", tmp_path / "style.safetensors"],
            ["static-shape", "--lora"],
        ),
    ]
    for args, needles in cases:
        out = tmp_path / "out.png"
        run = _klein("generate", "a cat", "-m", static_bundle, "-o", out, "--steps", 1, *args)
        assert run.returncode == 2, run.stderr
        assert all(n in run.stderr for n in needles), run.stderr
        assert "panicked" not in run.stderr and not out.exists()
    info = _klein("info", static_bundle)
    assert info.returncode == 0 and "static shapes: 64x64, 96x64 (batch 1, 512 tokens, 1 reference(s)" in info.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--static-shapes", "64x64,1000"], "`1000` is not WIDTHxHEIGHT"),
        (["--static-shapes", "64x72"], "multiple of 16"),
        (["--static-shapes", "64x64,64x64"], "given twice"),
        (["--static-shapes", "64x64", "--refs", "9"], "--refs 9"),
        (["--refs", "1"], "--refs applies with --static-shapes only"),
        (["--static-shapes", "64x64", "--quantize", "int8"], "leave out --quantize"),
    ],
)
def test_bad_static_shape_options_are_refused(tiny_checkpoint, tmp_path, capsys, args, message):
    out = tmp_path / "bundle"
    assert main(["convert", "--checkpoint", str(tiny_checkpoint), "--out", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_attention_is_fused_in_dynamic_bundles_only(static_bundle, tiny_bundle, tiny_checkpoint):
    """One MultiHeadAttention node per transformer block and no Softmax in the dynamic transformer
    graph (ONNX Runtime's fused attention); the static (CoreML) one keeps MatMul-Softmax-MatMul."""
    config = json.loads((tiny_checkpoint / "transformer" / "config.json").read_text())
    blocks = config["num_layers"] + config["num_single_layers"]

    def ops(path):
        return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]

    dynamic = ops(tiny_bundle / "transformer.onnx")
    assert (dynamic.count("MultiHeadAttention"), dynamic.count("Softmax")) == (blocks, 0)
    static = ops(static_bundle / "transformer.64x64.onnx")
    assert (static.count("MultiHeadAttention"), static.count("Softmax")) == (0, blocks)
    # Rotary embeddings (query and key of every block) and the query/key RMSNorms (image and text
    # streams in double blocks, one stream in single blocks) fused too; none left in the static graph.
    norms = 4 * config["num_layers"] + 2 * config["num_single_layers"]
    assert (dynamic.count("RotaryEmbedding"), dynamic.count("Neg")) == (2 * blocks, 0)
    assert (dynamic.count("SimplifiedLayerNormalization"), dynamic.count("Pow")) == (norms, 0)
    fusions = json.loads((tiny_bundle / "manifest.json").read_text())["graphs"]["transformer"]["fusions"]
    # The per-image projections (timestep embedder x 2, modulations x 3, final AdaLayerNorm) as MatMul
    # with the weight first, which ONNX Runtime does not prepack; Gemm in the static graph.
    assert fusions == {"rms_normalization": norms, "weight_first_vector_products": 6}
    assert (dynamic.count("Gemm"), static.count("Gemm")) == (0, 6)
    assert (static.count("RotaryEmbedding"), static.count("SimplifiedLayerNormalization")) == (0, 0)
    assert static.count("Pow") == norms


def test_text_encoder_norms_and_attention_are_fused_in_dynamic_bundles_only(static_bundle, tiny_bundle):
    """The dynamic text encoder: one MultiHeadAttention per layer (no Softmax, IsNaN or score-sized
    Where left), every RMSNorm one SimplifiedLayerNormalization or, with the residual add before it,
    SkipSimplifiedLayerNormalization (no Pow); the counts are in the manifest. The static (CoreML)
    encoder keeps the exporter's plain operators."""
    manifest = json.loads((tiny_bundle / "manifest.json").read_text())
    layers = manifest["text_encoder"]["layers_in_graph"]

    def ops(path):
        return [n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node]

    dynamic = ops(tiny_bundle / "text_encoder.onnx")
    assert dynamic.count("MultiHeadAttention") == layers
    assert [dynamic.count(op) for op in ("Softmax", "IsNaN", "Pow")] == [0, 0, 0]
    # input, q, k, post-attention norms per layer; the last layer's output is not normed
    norms = dynamic.count("SimplifiedLayerNormalization") + dynamic.count("SkipSimplifiedLayerNormalization")
    assert norms == 4 * layers
    fusions = manifest["graphs"]["text_encoder"]["fusions"]
    assert fusions["rms_normalization"] == 4 * layers and fusions["sdpa_via_mha"] == layers
    # Every attention reads its keys, values and bias trimmed to the batch's last real token, the
    # keys and values projected from the real tokens' rows only and padded with zero rows (verify's
    # padded batches check the outputs against torch).
    assert fusions["attention_keys_trimmed"] == layers and fusions["key_projections_trimmed"] == 2 * layers
    model = onnx.load(str(tiny_bundle / "text_encoder.onnx"), load_external_data=False)
    made_by = {out: node.op_type for node in model.graph.node for out in node.output}
    attentions = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"]
    assert all([made_by[n.input[i]] for i in (1, 2, 5)] == ["Pad", "Pad", "Slice"] for n in attentions)
    _trimmed_key_counts_are_multiples_of_16(model, attentions[0])
    static_manifest = json.loads((static_bundle / "manifest.json").read_text())
    static_file = static_manifest["graphs"]["text_encoder"]["file"]
    static = ops(static_bundle / static_file)
    assert (static.count("MultiHeadAttention"), static.count("Softmax"), static.count("Pow")) == (0, layers, 4 * layers)
    assert "fusions" not in static_manifest["graphs"]["text_encoder"]


def _trimmed_key_counts_are_multiples_of_16(model, attention):
    """The keys an attention keeps: 1 + the last real position, rounded up to a multiple of 16 and at
    most all of them (ONNX Runtime's CUDA attention refused a 41-key bias: rows must be aligned); the
    key projection's input: the rows up to the last real position only, of any row of the batch."""
    made_by = {out: node for node in model.graph.node for out in node.output}
    key, bias = attention.input[1], made_by[attention.input[5]].input[2]
    # The first product of a Slice: layer 0's key projection, of the real rows of its input.
    products = (n for n in model.graph.node if n.op_type == "MatMul")
    projected = next(n.input[0] for n in products if made_by[n.input[0]].op_type == "Slice")
    for name in (key, projected):
        model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    model.graph.output.append(onnx.helper.make_tensor_value_info(bias, onnx.TensorProto.INT64, [1]))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    seq = 512
    for real, expected in ((1, 16), (40, 48), (48, 48), (49, 64), (500, 512), (512, 512)):
        for short in (real, 1):  # a batch of two: the other row's prompt shorter
            mask = np.stack([np.arange(seq) < real, np.arange(seq) < short]).astype(np.int64)
            feeds = {"input_ids": np.zeros((2, seq), np.int64), "attention_mask": mask}
            keys, rows, end = session.run([key, projected, bias], feeds)
            assert (end.tolist(), keys.shape[1], rows.shape[1]) == ([expected], expected, real), real
            assert not keys[:, real:].any(), "the keys after the last real token are zero rows"
