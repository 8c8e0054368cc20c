"""Quantization of exported graphs: `--quantize int8|int4`, by default weight-only as ORT `MatMulNBits`.

The selected graphs are quantized once every component is exported (the torch modules are freed),
one graph in memory at a time, with ONNX Runtime's `MatMulNBitsQuantizer` (round to nearest,
blockwise along K); `klein-export quantize` does the same to a copy of an existing bundle. Only
`MatMul` nodes with a constant 2-D weight become `com.microsoft.MatMulNBits`: the projections and
MLPs of Qwen3 and of the MM-DiT blocks, and the transformer's input/output projections. Left in
float, by construction:

- the transformer's per-image projections: the timestep embedder, the shift/scale/gate modulation
  projections and the final AdaLayerNorm (their input is 2-D `[batch, dim]`; the exporter writes them
  as MatMul with the weight first, ort_fusions.weight_first_vector_products, or Gemm in static-shape
  bundles: neither has a constant second operand to quantize). Errors there scale every token.
- `MatMul` of two activations: attention scores and the attention-weighted sum.
- the text encoder's embedding table (`Gather`; the quantizer offers 4-bit `GatherBlockQuantized` only).
- norms, RoPE, the residual stream: not matrix products.

`--method dynamic` (int8 only) writes `com.microsoft.DynamicQuantizeMatMul` instead: the same
MatMuls, weights int8 per output channel (symmetric), activations quantized to uint8 per tensor when
the graph runs; ONNX Runtime's CPU provider then runs integer GEMMs (VNNI or AVX2): a wide
transformer step in 2.39 s against 4.85 s with MatMulNBits at accuracy level 4, for a larger error
(benches/RESULTS.md, "Performance"). It is a CPU-only kernel.

`--method static` (int8 only) is for the VAE decoder, a convolution network, and nothing else: ONNX
Runtime's `quantize_static` writes QuantizeLinear/DequantizeLinear pairs around every `Conv` but the
RGB output conv (QDQ format; STATIC_MIN_OUT_CHANNELS) and around the upsamplers' phase interleaves
(Concat, DepthToSpace: upsample_convs.py), int8 weights per output channel (symmetric) and uint8
activations per tensor with ranges measured (MinMax) on calibration latents, and ONNX Runtime's CPU
provider fuses each pair into an integer convolution (`QLinearConv`) and interleaves in uint8. Each
group norm with its SiLU is then computed in channel parts concatenated in uint8 (in float before
the RGB output conv; norm_parts.py: the same output, less memory). The calibration latents are
what the decoder will see: the bundle's own text-to-image latents for CALIBRATION_PROMPTS and the
bundle's VAE encoder's latents of synthetic images (edits and img2img), at CALIBRATION_SIZE. A
wide decode at 512x512: 5.15 s against 13.93 s in fp32 (benches/RESULTS.md, "Performance"). The VAE encoder is
never quantized (its error would move every reference and source image), and MatMulNBits/dynamic
never touch the VAE (no MatMul worth it)."""

import contextlib
import json
import logging
import shutil
from pathlib import Path

import onnx

from .atomic import atomic_directory, check_output
from .cache_key import stamp_bundle
from .errors import BundleError, BundleExistsError, QuantizationError
from .external_data import DataWriter, is_external, load_graph, load_structure, nbytes, read_tensor
from .manifest import MANIFEST, bundle_files, check_files, read_manifest, write_manifest
from .norm_parts import group_norms_in_parts
from .onnx_export import EXTERNAL_DATA_THRESHOLD
from .options import (  # noqa: F401 (the quantizer's names, as before)
    BITS,
    BLOCK_SIZES,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_COMPONENTS,
    DYNAMIC,
    METHOD,
    METHODS,
    QUANTIZABLE,
    STATIC,
    STATIC_QUANTIZABLE,
    VAE_NAMES,
    QuantizationConfig,
    default_components,
    parse_components,
)
from .product_splits import cut_float_products, plan_products, product_nodes

CALIBRATION_PROMPTS = (
    ("a lighthouse on a cliff at dusk, oil painting", 101),
    ("a close-up photo of a red fox in the snow", 102),
)
CALIBRATION_IMAGE_SEEDS = (1, 2)
CALIBRATION_SIZE = 256
# Convolutions with fewer output channels than this stay float under --method static: the decoder's
# RGB output conv (128 -> 3). ONNX Runtime's QLinearConv builds its whole im2col for it (1024x1024:
# 1.2 GB, 0.92 s for 7 GFLOP) where the float Conv works in blocks (0.15 s), and its error goes
# straight into the pixels.
STATIC_MIN_OUT_CHANNELS = 16
INTERLEAVE_OPS = ("Concat", "DepthToSpace")  # an upsampler's phases, interleaved (upsample_convs.py)
LEFT_IN_FLOAT = (
    "the per-image projections (timestep embedder, modulation, final AdaLayerNorm), "
    "MatMul of two activations (attention), "
    "Gather (embedding table), norms, RoPE, residual stream"
)


def _float_nodes(model: onnx.ModelProto, int8_convs=False) -> dict:
    """Counts of matrix-product and embedding nodes that hold float weights or take two activations
    (`int8_convs`: not the Conv nodes whose weight is dequantized from int8, QDQ's)."""
    weights = {i.name for i in model.graph.initializer}
    made_by = {o: n.op_type for n in model.graph.node for o in n.output}
    counts = {}
    for node in model.graph.node:
        if node.op_type in ("MatMul", "Gemm", "Gather", "Conv") and node.domain in ("", "ai.onnx"):
            if node.op_type == "Gather" and node.input[0] not in weights:
                continue  # index bookkeeping, not an embedding table
            if int8_convs and node.op_type == "Conv" and made_by.get(node.input[1]) == "DequantizeLinear":
                continue
            counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def _quantizer_class():
    """MatMulNBitsQuantizer, imported without its module's `logging.basicConfig(level=INFO)` side effect."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    root.handlers[:] = handlers
    root.setLevel(level)
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    return MatMulNBitsQuantizer


REDUCED_CODE_LIMIT = 64  # ONNX Runtime's reduced int8 range, [-64, 64]


def code_limit(reduce_range: bool) -> int:
    """The largest |int8 code| of a weight: 127, or REDUCED_CODE_LIMIT with `--reduce-range`. u8 x s8
    kernels without VNNI (AVX2's `vpmaddubsw`) add two products in 16 bits with saturation; with
    |code| <= 64 a pair is at most 2 x 255 x 64 = 32640, under 32767, so those kernels are exact and
    the runtime need not convert the weights to uint8 (slower kernels)."""
    return REDUCED_CODE_LIMIT if reduce_range else 127


def per_channel_int8(weight_kn, reduce_range=False):
    """`[K, N]` float weight -> (int8 codes `[K, N]`, float32 scale `[N]`): symmetric per output
    channel, `scale[n] = max_k |w[k, n]| / limit` (`code_limit`), codes rounded half to even."""
    import numpy as np

    limit = code_limit(reduce_range)
    scale = (np.abs(weight_kn).max(axis=0) / float(limit)).astype(np.float32)
    scale[scale == 0] = 1.0  # an all-zero column: any scale gives code 0
    codes = np.clip(np.rint(weight_kn / scale), -limit, limit).astype(np.int8)
    return codes, scale


def _dynamic_matmuls(path: Path, reduce_range=False):
    """The graph at `path` with every MatMul with a constant 2-D float32 weight as
    DynamicQuantizeMatMul(x, codes, scale, 0), one per column range where its output is only cut into
    ranges and one per part where its input is only a concatenation (product_splits.py); the new
    weights file, or None; the number of weights quantized and of products split along their input.

    Weights are read and quantized one at a time (external_data.py), so a graph larger than memory (the
    full-size 4B transformer, 15.5 GB in float32) is quantized in about one weight's memory. When the
    result still needs external data (`save`'s rule), its weights are written to a `.partial` file next
    to `path`, returned with the model, which refers to them by the final `.onnx.data` name:
    `quantize_graph` renames it into place once the old file is gone."""
    import numpy as np
    from onnx import helper, numpy_helper

    model = load_structure(path)
    graph, base_dir = model.graph, path.parent
    weights = {i.name: i for i in graph.initializer}

    def weight_of(node):  # its constant 2-D float32 weight, if it is a product to quantize
        w = weights.get(node.input[1]) if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") else None
        return w if w is not None and len(w.dims) == 2 and w.data_type == onnx.TensorProto.FLOAT else None

    plans, cut = plan_products(graph, base_dir, weight_of)  # product -> its plan; the cut nodes it replaces
    nodes, blocks = [], {}  # blocks: weight name -> [(name of a quantized block, rows, columns)]
    for i, node in enumerate(graph.node):
        w = weight_of(node)
        if i in cut:
            continue
        if w is None:
            nodes.append(node)
            continue
        plan, name = plans[i], node.name or node.output[0]

        def product(part, piece, output, plan=plan, name=name, w=w):
            base = name + "_int8" + (f"_{piece.start}" if len(plan.pieces) > 1 else "")
            base += f"_rows_{part.start}" if len(plan.parts) > 1 else ""
            blocks.setdefault(w.name, []).append((base, (part.start, part.stop), (piece.start, piece.stop)))
            inputs = [part.input, base + "_codes", base + "_scale", base + "_zero"]
            return helper.make_node(DYNAMIC, inputs, [output], name=base, domain="com.microsoft")

        nodes += product_nodes(plan, name, product)
    used = {name for node in nodes for name in node.input}
    # The cut nodes' constants (Slice bounds, Split sizes) go with them.
    cut_inputs = {name for i, node in enumerate(graph.node) if i in cut for name in node.input}
    kept = {i.name for i in graph.initializer if i.name in used or (i.name not in blocks and i.name not in cut_inputs)}
    out_bytes = sum(nbytes(i) for i in graph.initializer if i.name in kept)
    for copies in blocks.values():  # codes, scale, zero
        out_bytes += sum((r1 - r0) * (c1 - c0) + 5 * (c1 - c0) for _, (r0, r1), (c0, c1) in copies)
    partial = path.with_name(path.name + ".data.partial") if out_bytes >= EXTERNAL_DATA_THRESHOLD * 0.9 else None
    initializers = []
    with DataWriter(partial, path.name + ".data") if partial else contextlib.nullcontext() as writer:

        def store(name, values):  # -> a tensor in the new weights file, or in the graph
            return writer.add(name, values) if writer else numpy_helper.from_array(values, name)

        for tensor in graph.initializer:
            if tensor.name in blocks:
                codes, scale = per_channel_int8(read_tensor(tensor, base_dir), reduce_range)
                # Per output channel of the whole weight: a block's codes and scales are its rows' and columns'.
                for base, (r0, r1), (c0, c1) in blocks[tensor.name]:
                    initializers += [
                        store(base + "_codes", np.ascontiguousarray(codes[r0:r1, c0:c1])),
                        store(base + "_scale", scale[c0:c1]),
                        store(base + "_zero", np.zeros(c1 - c0, np.int8)),
                    ]
            if tensor.name in kept:
                external = is_external(tensor)
                initializers.append(store(tensor.name, read_tensor(tensor, base_dir)) if external else tensor)
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    del graph.node[:]
    graph.node.extend(nodes)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, partial, len(blocks), sum(len(plan.parts) > 1 for plan in plans.values())


def _nbits_matmuls(model: onnx.ModelProto, config: QuantizationConfig, base_dir: Path):
    """`model` (its weights in memory) with every MatMul with a constant weight as MatMulNBits, one per
    column range where its output is only cut into ranges and one per part where its input is only a
    concatenation on block boundaries (product_splits.py); the number of weights quantized and of
    products split along their input."""
    added, split_inputs = cut_float_products(model, base_dir, config.block_size)
    quantizer = _quantizer_class()(
        model,
        bits=config.bits,
        block_size=config.block_size,
        is_symmetric=config.symmetric,
        accuracy_level=config.accuracy_level or None,
        op_types_to_quantize=("MatMul",),
    )
    quantizer.process()
    quantized = quantizer.model.model
    return quantized, sum(n.op_type == METHOD for n in quantized.graph.node) - added, split_inputs


def calibration_latents(bundle_dir: Path) -> list:
    """The VAE decoder's inputs `[1, C, h, w]` that `--method static` measures activation ranges on: the
    bundle's own text-to-image latents for CALIBRATION_PROMPTS, and its VAE encoder's latents of
    synthetic images, all at CALIBRATION_SIZE."""
    import numpy as np

    from .fixtures import synthetic_image
    from .manifest import read_manifest
    from .ort_pipeline import bundle_latents, run_graph

    size = CALIBRATION_SIZE
    latents = [bundle_latents(bundle_dir, prompt, seed, size, size) for prompt, seed in CALIBRATION_PROMPTS]
    encoder = read_manifest(bundle_dir)["graphs"]["vae_encoder"]
    for seed in CALIBRATION_IMAGE_SEEDS:
        pixels = np.asarray(synthetic_image(size, size, "RGB", seed), np.float32) / 127.5 - 1  # [H, W, 3] in [-1, 1]
        image = np.ascontiguousarray(pixels.transpose(2, 0, 1)[None])  # [1, 3, H, W]
        latents.append(run_graph(bundle_dir, encoder, {"image": image}))
    return latents


def _narrow_convs(model: onnx.ModelProto) -> list:
    """Names of the Conv nodes with a constant weight of fewer than STATIC_MIN_OUT_CHANNELS output channels."""
    shapes = {i.name: i.dims for i in model.graph.initializer}
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Conv" and n.input[1] in shapes and shapes[n.input[1]][0] < STATIC_MIN_OUT_CHANNELS
    ]


def _not_interleaves(model: onnx.ModelProto, float_convs: list) -> list:
    """Names of the Concat and DepthToSpace nodes that do not interleave an upsampler's phase
    convolutions (upsample_convs.py: Concat of Convs -> DepthToSpace) quantized as integers (none of
    `float_convs`), which `--method static` leaves alone."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    integer = {o for o, n in made_by.items() if n.op_type == "Conv" and n.name not in float_convs}
    interleaves = set()
    for node in model.graph.node:
        concat = made_by.get(node.input[0]) if node.op_type == "DepthToSpace" else None
        if concat is not None and concat.op_type == "Concat" and set(concat.input) <= integer:
            interleaves.update((node.name, concat.name))
    return [n.name for n in model.graph.node if n.op_type in INTERLEAVE_OPS and n.name not in interleaves]


def _static_convs(path: Path, latents: list, reduce_range=False) -> onnx.ModelProto:
    """The graph at `path` with QuantizeLinear/DequantizeLinear around every Conv but the narrow ones
    (`_narrow_convs`) and around the upsamplers' interleaves (`_not_interleaves`: ONNX Runtime then
    concatenates and interleaves the phases in uint8, a quarter of the bytes): int8 weights per
    output channel (symmetric; codes in [-64, 64] with `reduce_range`), uint8 activations per
    tensor, ranges the MinMax of `latents`' activations."""
    import tempfile

    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"latents": x} for x in latents])

        def get_next(self):
            return next(self.items, None)

    # quantize_static logs advice on the root logger ("consider pre-processing"): not for our users.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    structure = load_structure(path)
    narrow = _narrow_convs(structure)
    try:
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".static-") as tmp:
            out = Path(tmp) / path.name
            quantize_static(
                str(path),
                str(out),
                Reader(),
                quant_format=QuantFormat.QDQ,
                op_types_to_quantize=["Conv", *INTERLEAVE_OPS],
                nodes_to_exclude=narrow + _not_interleaves(structure, narrow),
                per_channel=True,
                reduce_range=reduce_range,
                activation_type=QuantType.QUInt8,
                weight_type=QuantType.QInt8,
                calibrate_method=CalibrationMethod.MinMax,
                extra_options={"ActivationSymmetric": False, "WeightSymmetric": True},
            )
            return onnx.load(str(out))
    finally:
        root.setLevel(level)


def _shapes_of_codes(model: onnx.ModelProto):
    """Points (in place) every Shape of a dequantized value, directly or through a Reshape, at the
    uint8 codes instead (through a Reshape of the codes by the same shape). The group norms take
    the shape of their own input (`ort_fusions.group_norms_as_layer_norms`), and ONNX Runtime gives
    each consumer of a quantized value its own DequantizeLinear: each such Shape had a float copy
    of a convolution's output computed for it alone (18 in the decoder; at 1024x1024, up to 1 GiB
    each). A shape is the same whatever the element type: the output is unchanged."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    for shape in [n for n in model.graph.node if n.op_type == "Shape"]:
        reshape = made_by.get(shape.input[0])
        through = reshape is not None and reshape.op_type == "Reshape"
        dq = made_by.get(reshape.input[0]) if through else reshape
        if dq is None or dq.op_type != "DequantizeLinear":
            continue
        codes = dq.input[0]
        if through:  # the codes given the Reshape's shape (one such Reshape for all its Shapes)
            codes = f"{reshape.output[0]}_codes"
            if codes not in made_by:
                copy = onnx.helper.make_node("Reshape", [dq.input[0], reshape.input[1]], [codes], name=codes)
                copy.attribute.extend(reshape.attribute)  # allowzero, if set
                model.graph.node.insert(list(model.graph.node).index(shape), copy)
                made_by[codes] = copy
        shape.input[0] = codes


def _check_code_range(model: onnx.ModelProto, path: Path):
    """Refuses to write a `--reduce-range` graph whose int8 weight codes leave [-64, 64]: the runtime
    trusts the manifest's `reduce_range` and would run such codes on kernels that saturate."""
    from onnx import numpy_helper

    limit = REDUCED_CODE_LIMIT
    for tensor in model.graph.initializer:
        if tensor.data_type == onnx.TensorProto.INT8 and len(tensor.dims) >= 2:
            largest = int(abs(numpy_helper.to_array(tensor).astype("int16")).max(initial=0))
            if largest > limit:
                raise QuantizationError(
                    f"{path.name}: --reduce-range wrote codes up to {largest} in {tensor.name}, expected at most "
                    f"{limit} (the quantizer's reduced range changed?)"
                )


def _quantized_convs(model: onnx.ModelProto) -> int:
    """Conv nodes whose weight comes from a DequantizeLinear of an int8 initializer."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    weights = {i.name: i for i in model.graph.initializer}
    count = 0
    for node in model.graph.node:
        dq = made_by.get(node.input[1]) if node.op_type == "Conv" else None
        if dq is not None and dq.op_type == "DequantizeLinear":
            w = weights.get(dq.input[0])
            count += w is not None and w.data_type == onnx.TensorProto.INT8
    return count


def _integer_nodes(model: onnx.ModelProto) -> list:
    """The nodes `--method static` runs on integers: every tensor input (at least one; constants
    aside) a DequantizeLinear's output and every output read by QuantizeLinear only."""
    made_by = {o: n.op_type for n in model.graph.node for o in n.output}
    read_by = {}
    for node in model.graph.node:
        for name in node.input:
            read_by.setdefault(name, []).append(node.op_type)
    constants = {i.name for i in model.graph.initializer}
    return [
        n
        for n in model.graph.node
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear")
        and {made_by.get(i) for i in n.input if i and i not in constants} == {"DequantizeLinear"}
        and all(op == "QuantizeLinear" for o in n.output for op in read_by.get(o, []))
    ]


def quantize_graph(path: Path, config: QuantizationConfig, calibration=None) -> dict:
    """Quantizes the graph at `path` in place; returns the scheme written to its metadata and the manifest.
    `calibration`: the decoder inputs `--method static` measures ranges on (`calibration_latents`)."""
    from onnxruntime import __version__ as ort_version

    path = Path(path)
    if config.method == STATIC:
        model = _static_convs(path, calibration, config.reduce_range)
        _shapes_of_codes(model)
        norms_in_parts = group_norms_in_parts(model)
        scheme = {
            "method": STATIC,
            "reduce_range": config.reduce_range,
            "bits": 8,
            "block_size": None,
            "symmetric": True,
            "accuracy_level": None,
            "op_types": sorted({n.op_type for n in _integer_nodes(model)}),
            "algorithm": "MinMax calibration",
            "quantized_nodes": _quantized_convs(model),
            "group_norms_in_parts": norms_in_parts,  # of PARTS channel ranges each (norm_parts.py)
            "float_nodes": _float_nodes(model, int8_convs=True),
            "left_in_float": "the RGB output convolution, the mid-block attention, group norms, SiLU, "
            + ("upsampling (Resize), " if any(n.op_type == "Resize" for n in model.graph.node) else "")
            + "the latent denormalisation",
            "quantizer": f"onnxruntime {ort_version} quantize_static (QDQ)",
            "granularity": f"{_weights_granularity(config)}; activations: uint8 per tensor, ranges calibrated",
            "calibration": f"{len(CALIBRATION_PROMPTS)} text-to-image latents of this bundle and "
            f"{len(CALIBRATION_IMAGE_SEEDS)} VAE-encoded synthetic images, {CALIBRATION_SIZE}x{CALIBRATION_SIZE}",
        }
        if scheme["quantized_nodes"] == 0:
            raise QuantizationError(f"{path.name}: no Conv with a constant weight to quantize")
        if config.reduce_range:
            _check_code_range(model, path)
        return _write(model, path, scheme)
    dynamic = config.method == DYNAMIC
    if dynamic:
        model, partial, weights, split_inputs = _dynamic_matmuls(path, config.reduce_range)
    else:  # external data read into memory
        (model, weights, split_inputs), partial = _nbits_matmuls(load_graph(path), config, path.parent), None
    quantized = sum(n.op_type == config.method for n in model.graph.node)
    if quantized == 0:
        raise QuantizationError(f"{path.name}: no MatMul with a constant weight to quantize")
    scheme = {
        "method": config.method,
        "bits": config.bits,
        "block_size": None if dynamic else config.block_size,
        "symmetric": config.symmetric,
        "accuracy_level": None if dynamic else config.accuracy_level,
        "op_types": ["MatMul"],
        "algorithm": "RTN",
        "quantized_nodes": quantized,
        "quantized_weights": weights,  # fewer than the nodes where a product is cut (product_splits.py)
        "split_inputs": split_inputs,  # products computed per part of a concatenated input (product_splits.py)
        "float_nodes": _float_nodes(model),
        "left_in_float": LEFT_IN_FLOAT,
        "quantizer": f"klein per-channel int8 (onnxruntime {ort_version} kernel)"
        if dynamic
        else f"onnxruntime {ort_version} MatMulNBitsQuantizer",
    }
    if dynamic:
        scheme["reduce_range"] = config.reduce_range
        scheme["granularity"] = f"{_weights_granularity(config)}; activations: uint8 per tensor at run time"
    _write(model, path, scheme)  # removes the old weights file
    if partial is not None:
        partial.rename(path.with_name(path.name + ".data"))
    return scheme


def _range_note(config: QuantizationConfig) -> str:
    """` in [-64, 64] (7 bits, --reduce-range)` for 7-bit codes, else nothing."""
    limit = REDUCED_CODE_LIMIT
    return f" in [-{limit}, {limit}] (7 bits, --reduce-range)" if config.reduce_range else ""


def _weights_granularity(config: QuantizationConfig) -> str:
    """The weights' part of an int8-compute scheme's `granularity`."""
    return f"weights: int8 per output channel, symmetric{_range_note(config)}"


def _write(model: onnx.ModelProto, path: Path, scheme: dict) -> dict:
    """Records `scheme` in the graph's metadata and saves it to `path`; returns `scheme`."""
    meta = {p.key: p.value for p in model.metadata_props}
    meta["klein.quantization"] = json.dumps(scheme, sort_keys=True)
    del model.metadata_props[:]
    for key, value in meta.items():
        model.metadata_props.add(key=key, value=value)
    save(model, path)
    return scheme


def save(model: onnx.ModelProto, path: Path):
    """Writes `model` to `path`, its weights to `path.data` when the graph would pass protobuf's 2 GB."""
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)  # onnx appends to an existing external-data file
    weight_bytes = sum(t.ByteSize() for t in model.graph.initializer)
    if weight_bytes >= EXTERNAL_DATA_THRESHOLD * 0.9:
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name)
    else:
        onnx.save_model(model, str(path))


def _refuse_static(bundle_dir, manifest):
    if manifest.get("static_shapes"):
        raise QuantizationError(
            f"{bundle_dir}: a static-shape bundle is for CoreML, which cannot run quantized graphs; "
            "quantize a bundle without --static-shapes"
        )


def quantize_bundle(bundle_dir, config: QuantizationConfig, log=print):
    """Quantizes `config.components` of the bundle in `bundle_dir` in place, one graph at a time,
    and rewrites its manifest: each graph's `quantization`, and the size and hash of the files that
    changed (a graph that shrinks under 2 GB loses its `.onnx.data` file)."""
    bundle_dir = Path(bundle_dir)
    manifest = read_manifest(bundle_dir)
    _refuse_static(bundle_dir, manifest)
    changed = set()
    calibration = calibration_latents(bundle_dir) if config.method == STATIC else None
    for component in config.components:
        spec = manifest["graphs"][component]
        if spec.get("quantization") is not None:
            raise QuantizationError(
                f"{bundle_dir / spec['file']}: already quantized ({spec['quantization']['bits']} bits)"
            )
        spec["quantization"] = quantize_graph(bundle_dir / spec["file"], config, calibration)
        # The runtime cannot merge LoRAs into MatMulNBits weights: merge at export (convert --lora).
        spec.pop("lora_targets", None)
        changed |= {spec["file"], spec["file"] + ".data"}
        count = spec["quantization"]["quantized_nodes"]
        log(f"quantized {component} to {config.bits} bits{_range_note(config)}: {count} {config.method} nodes")
    from .int8_kernels import cpu_note

    if note := cpu_note({c: manifest["graphs"][c] for c in config.components}):
        log(note)
    stamp_bundle(bundle_dir, [manifest["graphs"][c]["file"] for c in config.components])
    manifest["files"] = bundle_files(bundle_dir, manifest["files"], changed)
    write_manifest(manifest, bundle_dir)
    return manifest


def quantize_copy(bundle, out, config: QuantizationConfig, force=False, log=print):
    """`klein-export quantize`: copies the bundle `bundle` to `out` and quantizes the copy. The copy is
    made in a sibling temporary directory and renamed into place when complete."""
    bundle, out = Path(bundle), Path(out)
    manifest = read_manifest(bundle)  # a klein bundle, or BundleError before anything is written
    _refuse_static(bundle, manifest)  # named here, not in the temporary copy
    graphs = manifest["graphs"]
    for component, graph in graphs.items():  # named in the bundle, not in the temporary copy
        if not (bundle / graph.get("file", "")).is_file():
            raise BundleError(f"{bundle / graph.get('file', component)}: missing (graphs.{component} of the manifest)")
    for component in config.components:  # named here, not in the temporary copy
        if not isinstance(graphs.get(component), dict):
            raise BundleError(f"{bundle / 'manifest.json'}: graphs has no {component} (it has {', '.join(graphs)})")
        load_structure(bundle / graphs[component]["file"])  # BundleError when missing or not a graph
        if graphs[component].get("quantization") is not None:
            bits = graphs[component]["quantization"]["bits"]
            raise QuantizationError(f"{bundle / graphs[component]['file']}: already quantized ({bits} bits)")
    check_files(bundle, manifest)  # a replaced or deleted file would be copied, and listed afresh
    check_output(out, force, [(bundle, "the input bundle")], error=BundleExistsError)
    left_out = sorted(p.name for p in bundle.iterdir() if p.name != MANIFEST and p.name not in manifest["files"])
    if left_out:  # a user's notes, an image: not the bundle's, and they would be listed with hashes
        log(f"not copied (the manifest does not list them): {', '.join(left_out)}")
    with atomic_directory(out) as tmp:
        for name in [MANIFEST, *manifest["files"]]:
            shutil.copy2(bundle / name, tmp / name)
        quantize_bundle(tmp, config, log=log)
    return out


# ---------------------------------------------------------------------------------------------------
# The same quantization applied to torch modules, for `verify`


def dequantized(weight_kn, config: QuantizationConfig):
    """The `[K, N]` MatMul weight as MatMulNBits sees it: quantized by the quantizer's own kernel
    (`DefaultWeightOnlyQuantizer.qbits_block_quant`, what `quantize_graph` runs) and dequantized,
    `w[k, n] = (code[n, k] - zero[n, k // block]) * scale[n, k // block]`; for `--method dynamic`,
    `code[k, n] * scale[n]` (`per_channel_int8`, with the config's code range)."""
    import numpy as np

    if config.method == DYNAMIC:
        codes, scale = per_channel_int8(weight_kn, config.reduce_range)
        return (codes.astype(np.float32) * scale).astype(weight_kn.dtype)
    _quantizer_class()  # the module import, without its logging side effect
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    bits, block = config.bits, config.block_size
    quantizer = DefaultWeightOnlyQuantizer(
        DefaultWeightOnlyQuantConfig(block_size=block, is_symmetric=config.symmetric, bits=bits)
    )
    k, n = weight_kn.shape
    packed, scales, zero_points = quantizer.qbits_block_quant(np.ascontiguousarray(weight_kn))
    k_blocks = scales.shape[-1]
    scales = scales.reshape(n, k_blocks)

    def unpack(data, count):  # uint8 rows -> `count` codes per row (4 bits: low nibble first)
        data = data.reshape(n, -1)
        if bits == 4:
            data = np.stack([data & 0x0F, data >> 4], axis=-1).reshape(n, -1)
        return data[:, :count].astype(np.float32)

    codes = unpack(packed, k_blocks * block)
    zero = np.full((n, k_blocks), 2 ** (bits - 1), np.float32) if config.symmetric else unpack(zero_points, k_blocks)
    w = (codes - np.repeat(zero, block, axis=1)) * np.repeat(scales.astype(np.float32), block, axis=1)
    return w[:, :k].T.astype(weight_kn.dtype)


def emulate_quantization(module, scheme: dict, example_args, key_rows=False):
    """Replaces, in place, the weight of every `nn.Linear` of `module` that the exported graph holds as
    a MatMul (input of rank 3 or more on `example_args`; rank-2 inputs are the per-image projections,
    left in float)
    by its dequantized value under `scheme` (a graph's `quantization`); for `--method dynamic`, its
    input also goes through `quantized_activations` (a forward pre-hook that stays on the module), each
    part on its own for the scheme's `split_inputs` linears whose input the graph splits (diffusers
    marks them with `_tp_packed_row_blocks`, the widths of the parts it concatenates). `key_rows`: the
    graph computes each attention's key and value projections on the real tokens' rows only
    (`real_keys.py`, the text encoder's `key_projections_trimmed`), so their activations' range is
    those rows' (`_real_key_rows`). Returns the number of weights replaced (the graph's quantized
    weight count)."""
    import torch
    from torch import nn

    config, split_inputs = QuantizationConfig.from_scheme(scheme), scheme.get("split_inputs", 0)

    ranks, handles = {}, []

    def record(name):
        def hook(_module, args):
            ranks[name] = args[0].dim()

        return hook

    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear):
            handles.append(sub.register_forward_pre_hook(record(name)))
    try:
        with torch.no_grad():
            module(*example_args)
    finally:
        for h in handles:
            h.remove()
    keys = _real_key_rows(module) if key_rows else {}
    replaced, parted = 0, 0
    for name, sub in module.named_modules():
        if isinstance(sub, nn.Linear) and ranks.get(name, 0) >= 3:
            w = sub.weight.detach()
            deq = dequantized(w.t().contiguous().numpy(), config)
            with torch.no_grad():
                sub.weight.copy_(torch.from_numpy(deq).t())
            widths = getattr(sub, "_tp_packed_row_blocks", None) if split_inputs else None
            if config.method == DYNAMIC and name in keys:
                sub.register_forward_pre_hook(
                    lambda _module, args, rows=keys[name]: (quantized_activations(args[0], rows.get("rows")), *args[1:])
                )
            elif config.method == DYNAMIC:
                sub.register_forward_pre_hook(
                    lambda _module, args, widths=widths: (_in_parts(args[0], widths), *args[1:])
                )
            replaced += 1
            parted += widths is not None
    if config.method == DYNAMIC and parted != split_inputs:
        raise RuntimeError(f"{split_inputs} products split along their input in the graph, {parted} linears in torch")
    return replaced


def _in_parts(x, widths):
    """`quantized_activations` of `x`, or of each part of its last axis (`widths`) on its own."""
    import torch

    if widths is None:
        return quantized_activations(x)
    return torch.cat([quantized_activations(part) for part in x.split(list(widths), dim=-1)], dim=-1)


def _real_key_rows(module) -> dict:
    """For each attention of `module` (a Qwen3 `self_attn` with `k_proj` and `v_proj`): a forward
    pre-hook that records, before its projections run, how many rows of its input the graph's
    key and value projections read (`real_keys.py`: up to the last key any query may attend to, the
    batch's last real token). Returns {name of a k_proj or v_proj: the dict whose "rows" its own
    hook reads}."""
    import torch

    def record(rows):
        def hook(_module, args, kwargs):
            mask = kwargs.get("attention_mask")  # [B, 1, S, S]: bool (True: attends) or additive; None: all
            rows.pop("rows", None)
            if mask is not None:
                allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
                keys = allowed.flatten(0, 2).any(dim=0)  # [S]
                rows["rows"] = int(keys.nonzero().max()) + 1 if bool(keys.any()) else 0

        return hook

    found = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "k_proj") and hasattr(sub, "v_proj"):
            rows = {}
            sub.register_forward_pre_hook(record(rows), with_kwargs=True)
            found[f"{name}.k_proj"] = found[f"{name}.v_proj"] = rows
    return found


def quantized_activations(x, rows=None):
    """`x` as DynamicQuantizeMatMul sees it: ONNX Runtime's DynamicQuantizeLinear (uint8, one scale and
    zero point for the whole tensor, its range widened to hold 0, rounding half to even), dequantized.
    With `rows`, the range is that of `x`'s first `rows` rows (`[B, S, E]`: the graph quantizes only
    those, and the rest are not used)."""
    import torch

    seen = x if rows is None else x[:, :rows]
    low, high = torch.clamp(seen.min(), max=0), torch.clamp(seen.max(), min=0)
    scale = torch.where(high > low, (high - low) / 255, torch.ones_like(high))
    zero = torch.round(torch.clamp(-low / scale, 0, 255))
    return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale
