"""The one helper that calls the ONNX exporter, and the metadata every graph carries."""

import logging
import warnings
from contextlib import contextmanager
from pathlib import Path

import onnx
import torch
from onnxscript import rewriter

from . import FORMAT_VERSION

OPSET = 20
EXTERNAL_DATA_THRESHOLD = 1 << 31  # protobuf's 2 GB limit


def export_graph(
    module, example_args, dynamic_shapes, io, out_dir: Path, precision="fp32", translations=None, fuse=None
):
    """Export `module` to `out_dir / io.file` with the contract's names and metadata (unquantized:
    quantize.py rewrites `klein.quantization`). `translations`: the exporter's custom translation
    table (fused_attention.py, fused_rotary.py). `fuse`: a rewrite of the exported graph into ONNX
    Runtime's fused operators (ort_fusions.py), which returns the count of each fusion it applied.
    Returns the path and those counts (empty without `fuse`)."""
    path = Path(out_dir) / io.file
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = param_bytes >= EXTERNAL_DATA_THRESHOLD * 0.9
    with torch.no_grad(), without_slices_split(), _exporter_notes_silenced():
        program = torch.onnx.export(
            module,
            tuple(example_args),
            dynamo=True,
            opset_version=OPSET,
            input_names=io.input_names(),
            output_names=io.output_names(),
            dynamic_shapes=dynamic_shapes,
            optimize=True,
            verbose=False,
            custom_translation_table=translations,
        )
        fusions = fuse(program.model) if fuse else {}
    # Drop the exporter's per-node debug metadata (stack traces with local paths: a third of the file)
    # and its graph-level notes (torch.export's signature and range constraints: the latter's order
    # follows Python's string hashing, so two exports of one checkpoint differed in those bytes alone).
    for node in program.model.graph.all_nodes():
        node.metadata_props.clear()
    program.model.graph.metadata_props.clear()
    program.model.metadata_props.update(
        {
            "klein.component": io.component,
            "klein.precision": precision,
            "klein.quantization": "none",
            "klein.format_version": str(FORMAT_VERSION),
        }
    )
    program.save(str(path), external_data=external)
    check_names(path, io)
    return path, fusions


@contextmanager
def _exporter_notes_silenced():
    """The exporter's notes that say nothing about this export, silenced in the block: "torchvision is
    not installed. Skipping torchvision::nms" (four lines per graph) and "The axis name: batch will not
    be used, since it shares the same shape constraints with another axis: batch" (one per dynamic
    axis shared by inputs, as every graph here has)."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"# The axis name: .* will not be used", category=UserWarning)
            yield
    finally:
        registration.setLevel(level)


SLICES_SPLIT = "SlicesSplit"


@contextmanager
def without_slices_split():
    """Leaves onnxscript's `SlicesSplit` rewrite out of its default rules (those of the exporter's
    optimizer and of `optimize_for_ort`'s) while the block runs.

    The rule (two `Slice`s of the halves of a last axis -> one `Split`) is the one default rule whose
    pattern has two outputs, and onnxscript matches such a pattern by enumerating, for every node it
    tries, every node of the graph: quadratic in the graph's size. On the tiny checkpoint's 28-layer
    text encoder it took 32 of the export's 82 s. It never applies to these graphs: the exporter writes
    the second half's open end as INT64_MAX, where the rule asks for the axis length. With it and
    without it the tiny bundle's four graphs had the same nodes, initializers, inputs and outputs
    (export/tests/test_onnx_export.py checks rotate_half's halves)."""
    saved = rewriter._DEFAULT_REWRITE_RULES
    rewriter._DEFAULT_REWRITE_RULES = tuple(r for r in saved if r.name != SLICES_SPLIT)
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = saved


def check_names(path: Path, io):
    """The saved graph has exactly the contract's inputs and outputs."""
    model = onnx.load(str(path), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if inputs != io.input_names() or outputs != io.output_names():
        raise RuntimeError(
            f"{path}: exported I/O {inputs} -> {outputs}, contract says {io.input_names()} -> {io.output_names()}"
        )


def timestep_frequencies_as_torch(model, channels) -> dict:
    """The sinusoidal timestep embedding's frequencies `exp(-ln(10000) * i / half)` as torch computes
    them. The exporter folds that constant with numpy, whose float32 `exp` differs from torch's in the
    last bit of 55 of the 128 values; times a timestep of up to 1000, that moved the embedding's
    phases by up to 1e-4 and the transformer's output by 10x torch's own float32 error."""
    import math

    import numpy as np
    import onnx_ir as ir

    half = channels // 2
    exponent = -math.log(10000) * torch.arange(0, half, dtype=torch.float32) / half
    folded, wanted = np.exp(exponent.numpy()), torch.exp(exponent).numpy()
    replaced = 0
    for name, value in list(model.graph.initializers.items()):
        array = value.const_value.numpy() if value.const_value is not None else None
        if array is None or array.dtype != np.float32 or array.size != half:
            continue
        if np.array_equal(array.reshape(-1), folded):
            value.const_value = ir.Tensor(wanted.reshape(array.shape), name=name)
            replaced += 1
    if not replaced:
        # The exporter folds the constant otherwise now: the fix would silently stop applying.
        raise RuntimeError("no folded timestep-frequency constant found in the transformer graph")
    return {"timestep_frequencies": replaced}
