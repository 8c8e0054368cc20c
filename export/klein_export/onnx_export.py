"""The one helper that calls the ONNX exporter, and the metadata every graph carries."""

from pathlib import Path

import onnx
import torch

from . import FORMAT_VERSION

OPSET = 20
EXTERNAL_DATA_THRESHOLD = 1 << 31  # protobuf's 2 GB limit


def export_graph(
    module, example_args, dynamic_shapes, io, out_dir: Path, precision="fp32", translations=None, fuse=None
):
    """Export `module` to `out_dir / io.file` with the contract's names and metadata (unquantized:
    quantize.py rewrites `klein.quantization`). `translations`: the exporter's custom translation
    table (fused_attention.py, fused_rotary.py). `fuse`: a rewrite of the exported graph into ONNX
    Runtime's fused operators (`fuse_for_ort`, `fuse_rms_norms`), which returns the count of each
    fusion it applied. Returns the path and those counts (empty without `fuse`)."""
    path = Path(out_dir) / io.file
    param_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    external = param_bytes >= EXTERNAL_DATA_THRESHOLD * 0.9
    with torch.no_grad():
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
    # Drop the exporter's per-node debug metadata (stack traces with local paths: a third of the file).
    for node in program.model.graph.all_nodes():
        node.metadata_props.clear()
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


def fuse_for_ort(model) -> dict:
    """Rewrites `model` (an onnx_ir model, in place) with ONNX Runtime's fused operators, by
    onnxscript's `optimize_for_ort`; returns the count of each fusion applied.

    On the Qwen3 text encoder it writes each RMSNorm as SimplifiedLayerNormalization (with the
    residual add before it, SkipSimplifiedLayerNormalization) and each attention as one
    MultiHeadAttention with the causal and padding mask as its additive bias. The exporter writes
    them otherwise as Pow-ReduceMean-Sqrt-Reciprocal-Mul chains, which ONNX Runtime does not fuse
    itself, and as MatMul-Softmax-MatMul with two `Where`s and an `IsNaN` over every head's
    [tokens, tokens] scores. The wide checkpoint's encoder at 512 tokens on an AMX host: 2.73 -> 2.14 s
    in int8, same output to float32 rounding (README, "Text encoder: fused operators")."""
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    _, counts = optimize_for_ort(model)
    # ONNX's shape inference does not know SkipSimplifiedLayerNormalization: its output and residual
    # sum (outputs 0 and 3) are typed as its input, its unused statistics (1, 2) as float32, so that
    # the graph says every value's type.
    import onnx_ir as ir

    for node in model.graph:
        if node.op_type != "SkipSimplifiedLayerNormalization":
            continue
        for index, out in enumerate(node.outputs):
            if out.type is None and index in (0, 3):
                out.type, out.shape = node.inputs[0].type, node.inputs[0].shape
            elif out.type is None:
                out.type = ir.TensorType(ir.DataType.FLOAT)
    return {name: count for name, count in counts.items() if count}


def fuse_rms_norms(model) -> dict:
    """Rewrites `model`'s RMSNorms (in place) as SimplifiedLayerNormalization; returns the count.

    For the transformer, where `optimize_for_ort` as a whole would also rewrite the Gemm nodes whose
    weights the LoRA targets name. torch.nn.RMSNorm (the transformer's query and key norms) exports
    its mean over the last axis as a positive axis, which onnxscript's rule does not recognise: those
    axes are written as -1 first."""
    import onnx_ir as ir
    from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
    from onnxscript.rewriter.ort_fusions.rms_normalization import fuse_rms_normalization

    last = None
    for node in model.graph:
        if node.op_type != "ReduceMean" or len(node.inputs) < 2 or node.inputs[0].shape is None:
            continue
        axes = node.inputs[1].const_value
        rank = len(node.inputs[0].shape)
        if axes is not None and axes.numpy().tolist() == [rank - 1]:
            if last is None:
                last = ir.Value(name="klein_last_axis", const_value=ir.tensor([-1], dtype=ir.DataType.INT64))
                model.graph.register_initializer(last)
            node.replace_input_with(1, last)
    ShapeInferencePass()(model)
    count = fuse_rms_normalization(model)
    RemoveUnusedNodesPass()(model)  # the replaced chains' constants
    return {"rms_normalization": count} if count else {}


def check_names(path: Path, io):
    """The saved graph has exactly the contract's inputs and outputs."""
    model = onnx.load(str(path), load_external_data=False)
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    if inputs != io.input_names() or outputs != io.output_names():
        raise RuntimeError(
            f"{path}: exported I/O {inputs} -> {outputs}, contract says {io.input_names()} -> {io.output_names()}"
        )
