"""The LoRA map of a transformer graph: where each linear layer's weight lives in the bundle.

The dynamo exporter renames and transposes weights when it folds constants (`val_277` may hold
`transformer_blocks.0.attn.to_q.weight` transposed), so the graph's names say nothing. The map is
found by content: every `nn.Linear` weight of the exported module is looked up, byte for byte, among
the graph's 2-D initializers, as stored (`[out, in]`, layout "out_in") or transposed (`[in, out]`,
layout "in_out"). The runtime reads `bytes` bytes at `offset` of `file`, adds the LoRA delta and
hands the result to ONNX Runtime under `initializer` (manifest `graphs.transformer.lora_targets`,
onnx/README.md).
"""

import hashlib
from pathlib import Path

import onnx

from .external_data import load_structure

# onnx TensorProto data types the runtime merges into.
DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.FLOAT16: "float16"}


def _varint(buf, pos):
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(buf, start, end):
    """(field number, wire type, value start, value end) of each field of the message buf[start:end]."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, after = _varint(buf, pos)
            yield field, wire, pos, after
        elif wire == 1:
            yield field, wire, pos, pos + 8
            after = pos + 8
        elif wire == 2:
            length, pos = _varint(buf, pos)
            yield field, wire, pos, pos + length
            after = pos + length
        elif wire == 5:
            yield field, wire, pos, pos + 4
            after = pos + 4
        else:
            raise ValueError(f"protobuf wire type {wire} at byte {pos}")
        pos = after


def inline_offsets(graph_path: Path) -> dict:
    """Byte offset and length of the raw data of each inline initializer in the `.onnx` file
    (ModelProto.graph = 7, GraphProto.initializer = 5, TensorProto.name = 8, raw_data = 9)."""
    buf = Path(graph_path).read_bytes()
    offsets = {}
    for field, wire, start, end in _fields(buf, 0, len(buf)):
        if field != 7 or wire != 2:
            continue
        for gfield, gwire, gstart, gend in _fields(buf, start, end):
            if gfield != 5 or gwire != 2:
                continue
            name, raw = None, None
            for tfield, twire, tstart, tend in _fields(buf, gstart, gend):
                if tfield == 8 and twire == 2:
                    name = buf[tstart:tend].decode("utf-8")
                elif tfield == 9 and twire == 2:
                    raw = (tstart, tend - tstart)
            if name is not None and raw is not None:
                offsets[name] = raw
    return offsets


def _initializer_index(graph_path: Path):
    """sha256 of the bytes of every 2-D float initializer -> [(name, dims, dtype, file, offset, bytes)]."""
    graph_path = Path(graph_path)
    model = load_structure(graph_path)
    inline = None
    index = {}
    for init in model.graph.initializer:
        if len(init.dims) != 2 or init.data_type not in DTYPES:
            continue
        if init.data_location == onnx.TensorProto.EXTERNAL:
            info = {kv.key: kv.value for kv in init.external_data}
            file, offset, length = info["location"], int(info.get("offset", 0)), int(info["length"])
            with open(graph_path.parent / file, "rb") as f:
                f.seek(offset)
                data = f.read(length)
        else:
            if inline is None:
                inline = inline_offsets(graph_path)
            if init.name not in inline:
                continue  # weights stored as typed fields, not raw bytes: not mappable
            file = graph_path.name
            offset, length = inline[init.name]
            data = bytes(init.raw_data)
        record = (init.name, tuple(init.dims), DTYPES[init.data_type], file, offset, length)
        index.setdefault(hashlib.sha256(data).digest(), []).append(record)
    return index


def lora_targets(model, graph_path: Path, log=print) -> dict:
    """The manifest's `lora_targets` of the graph at `graph_path` exported from `model` (a
    `Flux2Transformer2DModel`, weights as exported): module name -> where its weight is."""
    import torch
    from torch import nn

    from .precision import Float16Island

    index = _initializer_index(graph_path)
    modules = dict(model.named_modules())
    targets, claimed, missing = {}, {}, []
    for name, sub in modules.items():
        if not isinstance(sub, nn.Linear):
            continue
        # fp16 bundles wrap layers in a Float16Island: the layer keeps its diffusers name.
        parent = name.removesuffix(".module")
        if parent != name and isinstance(modules.get(parent), Float16Island):
            name = parent
        w = sub.weight.detach()
        found = None
        for layout, tensor in (("out_in", w), ("in_out", w.t())):
            data = tensor.contiguous().view(torch.uint8).numpy().tobytes()
            for init, dims, dtype, file, offset, length in index.get(hashlib.sha256(data).digest(), []):
                if dims == tuple(tensor.shape):
                    found = {
                        "initializer": init,
                        "layout": layout,
                        "shape": list(w.shape),
                        "dtype": dtype,
                        "file": file,
                        "offset": offset,
                        "bytes": length,
                    }
                    break
            if found:
                break
        if found is None:
            missing.append(name)
            continue
        claimed.setdefault(found["initializer"], []).append(name)
        targets[name] = found
    # Two modules with identical weights folded into one initializer: a LoRA on one would change both.
    for names in claimed.values():
        if len(names) > 1:
            for name in names:
                del targets[name]
            missing.extend(names)
    if missing and targets:  # none found at all: the caller's error says why, without the list
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        log(f"LoRA map: {len(missing)} linear layers have no weight of their own in the graph: {shown}")
    return dict(sorted(targets.items()))


def add_lora_map(checkpoint, bundle) -> dict:
    """`klein-export lora-map`: the map of `bundle`'s transformer graph, found against the weights of
    `checkpoint`, written into its manifest (the graphs are not touched)."""
    from .checkpoint import Checkpoint
    from .errors import BundleError
    from .manifest import check_bundle_of, read_manifest, write_manifest
    from .precision import to_float16

    bundle = Path(bundle)
    manifest = read_manifest(bundle)
    spec = manifest["graphs"]["transformer"]
    if spec.get("quantization") is not None or manifest.get("static_shapes"):
        raise BundleError(
            f"{bundle}: quantized and static-shape bundles take LoRAs at export only (klein-export convert --lora)"
        )
    source = manifest["model"].get("transformer_file")
    if source:
        raise BundleError(
            f"{bundle}: its transformer was exported from {source.get('file')} (convert --transformer), which "
            "wrote its LoRA map; lora-map maps a checkpoint's own transformer"
        )
    ckpt = Checkpoint(checkpoint)
    check_bundle_of(manifest, bundle, ckpt)  # before loading the transformer: another model's never maps
    model = ckpt.load_transformer()
    if spec["precision"] == "fp16":
        from .wrappers import Transformer

        to_float16(Transformer(model), "transformer")
    targets = lora_targets(model, bundle / spec["file"])
    if not targets:
        raise BundleError(f"{bundle}: no weight of {checkpoint}'s transformer is in the graph: another checkpoint?")
    spec["lora_targets"] = targets
    write_manifest(manifest, bundle)
    return targets
