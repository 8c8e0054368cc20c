"""`convert --static-shapes WxH,... [--refs N]`: fixed-shape graphs for CoreML, one set per size bucket.

CoreML compiles a graph for the shapes it is given; dynamic dimensions leave most of the graph on
the CPU. A static bundle has, for batch 1 and the tokenizer's fixed sequence length:
- `text_encoder.onnx` with `[1, seq]` inputs (one graph: the prompt length is always `seq`);
- per bucket `WxH`: `transformer.WxH.onnx` (output tokens plus N references of the output's size),
  `vae_decoder.WxH.onnx` and, with N > 0, `vae_encoder.WxH.onnx`.
The bucket graphs of one component share one weights file (`transformer.weights`, ...): each graph is
only its structure with fixed input shapes, and its initializers point into the shared file, so ten
buckets cost ten small protos, not ten copies of the weights. With N = 0 the dynamic
`vae_encoder.onnx` stays (the runtime refuses references for such a bundle and never loads it).

The manifest's `static_shapes` lists the buckets; `graphs.*.file` names the first bucket's graph.
"""

from pathlib import Path

import onnx
from onnx.external_data_helper import convert_model_to_external_data

from .contract import BATCH, HEIGHT, LAT_H, LAT_W, SEQ, TOKENS, WIDTH
from .errors import StaticShapesError

PER_BUCKET = ("transformer", "vae_decoder", "vae_encoder")
MAX_SIDE = 4096  # the runtime's largest side (src/pipeline.rs MAX_SIDE)
MAX_REFS = 4


def parse_buckets(text: str, multiple: int) -> list:
    """`"1024x1024,768x1024"` -> [(1024, 1024), (768, 1024)]: WIDTHxHEIGHT, multiples of `multiple`."""
    buckets = []
    for item in (s.strip() for s in text.split(",")):
        parts = item.lower().split("x")
        if len(parts) != 2 or not all(p.isascii() and p.isdigit() for p in parts):
            raise StaticShapesError(f"--static-shapes: `{item}` is not WIDTHxHEIGHT (e.g. 1024x1024,768x1024)")
        w, h = int(parts[0]), int(parts[1])
        for side in (w, h):
            if side % multiple or not multiple <= side <= MAX_SIDE:
                raise StaticShapesError(
                    f"--static-shapes: `{item}`: each side must be a multiple of {multiple} "
                    f"between {multiple} and {MAX_SIDE}"
                )
        if (w, h) in buckets:
            raise StaticShapesError(f"--static-shapes: `{item}` is given twice")
        buckets.append((w, h))
    return buckets


def check_refs(refs: int):
    if not 0 <= refs <= MAX_REFS:
        raise StaticShapesError(f"--refs {refs}: give 0 to {MAX_REFS} references per bucket")


def bucket_file(component: str, bucket) -> str:
    return f"{component}.{bucket[0]}x{bucket[1]}.onnx"


def _dims(width, height, refs, seq, multiple) -> dict:
    lat_h, lat_w = height // multiple, width // multiple
    return {
        BATCH: 1,
        SEQ: seq,
        TOKENS: lat_h * lat_w * (1 + refs),
        HEIGHT: height,
        WIDTH: width,
        LAT_H: lat_h,
        LAT_W: lat_w,
    }


def _fix_shapes(model, spec: dict, dims: dict):
    """Sets every input and output of `model` to the manifest spec's shape with `dims` substituted,
    and drops the exporter's intermediate shapes (symbolic, e.g. `tokens + seq`): ONNX Runtime
    infers them again from the fixed inputs."""
    tensors = {t["name"]: t for t in spec["inputs"] + spec["outputs"]}
    for value in list(model.graph.input) + list(model.graph.output):
        shape = [d if isinstance(d, int) else dims[d] for d in tensors[value.name]["shape"]]
        dim_protos = value.type.tensor_type.shape.dim
        if len(dim_protos) != len(shape):
            raise RuntimeError(f"{value.name}: rank {len(dim_protos)} in the graph, {len(shape)} in the manifest")
        for proto, size in zip(dim_protos, shape, strict=True):
            proto.Clear()
            proto.dim_value = size
    del model.graph.value_info[:]


def make_static(bundle_dir, graphs: dict, buckets: list, refs: int, seq: int, multiple: int, log=print) -> dict:
    """Rewrites the dynamic bundle graphs in `bundle_dir` as static ones. `graphs` is the manifest's
    `graphs` (updated in place: each file becomes the first bucket's). Returns the manifest's
    `static_shapes` section."""
    bundle_dir = Path(bundle_dir)
    # The text encoder: one graph, fixed in place (its weights, inline or external, are untouched).
    path = bundle_dir / graphs["text_encoder"]["file"]
    model = onnx.load(str(path), load_external_data=False)
    _fix_shapes(model, graphs["text_encoder"], _dims(multiple, multiple, 0, seq, multiple))
    onnx.save_model(model, str(path))

    files_per_bucket = [{} for _ in buckets]
    components = [c for c in PER_BUCKET if c != "vae_encoder" or refs > 0]
    for component in components:
        spec = graphs[component]
        dynamic = bundle_dir / spec["file"]
        model = onnx.load(str(dynamic))  # with its weights
        weights = f"{component}.weights"
        convert_model_to_external_data(model, all_tensors_to_one_file=True, location=weights, size_threshold=1024)
        for i, bucket in enumerate(buckets):
            _fix_shapes(model, spec, _dims(*bucket, refs, seq, multiple))
            name = bucket_file(component, bucket)
            # The first save writes the weights file; later ones write only the proto, whose
            # initializers already point into it.
            onnx.save_model(model, str(bundle_dir / name))
            if i == 0:
                model = onnx.load(str(bundle_dir / name), load_external_data=False)
            files_per_bucket[i][component] = name
        for old in (dynamic, dynamic.with_name(dynamic.name + ".data")):
            old.unlink(missing_ok=True)
        spec["file"] = files_per_bucket[0][component]
        # Static bundles (CoreML) take LoRAs at export only (convert --lora); the map pointed at the
        # dynamic graph removed above.
        spec.pop("lora_targets", None)
        log(f"static {component}: {len(buckets)} bucket graph(s) sharing {weights}")
    return {
        "batch": 1,
        "seq": seq,
        "refs": refs,
        "buckets": [
            {"width": w, "height": h, "files": files} for (w, h), files in zip(buckets, files_per_bucket, strict=True)
        ],
    }
