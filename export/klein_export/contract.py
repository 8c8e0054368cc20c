"""The I/O contract of every graph in a bundle: names, dtypes and dimensions.

This is the single place that names graph inputs and outputs. The exporter uses it to name the graphs
and to write `manifest.json["graphs"]`; the Rust runtime checks loaded graphs against that manifest.
See onnx/README.md.
"""

from dataclasses import dataclass

# Symbolic dimension names used in the manifest.
BATCH, SEQ, TOKENS, HEIGHT, WIDTH, LAT_H, LAT_W = "batch", "seq", "tokens", "height", "width", "lat_h", "lat_w"
# The KV transformer's (kv_cache.py): reference tokens extracted now, and those of the cached K/V.
REF_TOKENS, CACHED_TOKENS = "ref_tokens", "cached_tokens"


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str  # "float32" | "float16" | "int64"
    shape: tuple  # ints and symbolic dimension names

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class GraphIO:
    component: str
    file: str
    inputs: tuple
    outputs: tuple

    def input_names(self) -> list:
        return [t.name for t in self.inputs]

    def output_names(self) -> list:
        return [t.name for t in self.outputs]


@dataclass(frozen=True)
class GraphEntry:
    """An exported graph as `manifest.json["graphs"]` records it (unquantized: quantize.py sets that)."""

    io: GraphIO
    precision: str  # "fp32" | "fp16"
    precision_scheme: dict | None = None  # PrecisionScheme.to_json() of an fp16 graph
    lora_targets: dict | None = None  # lora_map.lora_targets() of the transformer graph
    fusions: dict | None = None  # ort_fusions.fuse_for_ort()'s counts: ONNX Runtime operators written

    def to_json(self) -> dict:
        entry = {
            "file": self.io.file,
            "precision": self.precision,
            "quantization": None,
            "inputs": [t.to_json() for t in self.io.inputs],
            "outputs": [t.to_json() for t in self.io.outputs],
        }
        if self.precision_scheme is not None:
            entry["precision_scheme"] = self.precision_scheme
        if self.lora_targets is not None:
            entry["lora_targets"] = self.lora_targets
        if self.fusions is not None:
            entry["fusions"] = self.fusions
        return entry


def text_encoder_io(embed_dim: int) -> GraphIO:
    return GraphIO(
        "text_encoder",
        "text_encoder.onnx",
        (Tensor("input_ids", "int64", (BATCH, SEQ)), Tensor("attention_mask", "int64", (BATCH, SEQ))),
        (Tensor("prompt_embeds", "float32", (BATCH, SEQ, embed_dim)),),
    )


def transformer_io(in_channels: int, joint_dim: int, n_axes: int) -> GraphIO:
    return GraphIO(
        "transformer",
        "transformer.onnx",
        (
            Tensor("latents", "float32", (BATCH, TOKENS, in_channels)),
            Tensor("prompt_embeds", "float32", (BATCH, SEQ, joint_dim)),
            Tensor("timestep", "float32", (BATCH,)),
            Tensor("img_ids", "int64", (TOKENS, n_axes)),
            Tensor("txt_ids", "int64", (SEQ, n_axes)),
        ),
        (Tensor("velocity", "float32", (BATCH, TOKENS, in_channels)),),
    )


def transformer_kv_io(in_channels: int, joint_dim: int, n_axes: int, layers: int, inner_dim: int) -> GraphIO:
    """A KV checkpoint's transformer (kv_cache.py): the plain inputs, plus the references to extract
    and the K/V cached by an earlier step; the extracted K/V as a second output."""
    plain = transformer_io(in_channels, joint_dim, n_axes)
    kv = (layers, 2, BATCH)
    return GraphIO(
        plain.component,
        plain.file,
        plain.inputs
        + (
            Tensor("ref_latents", "float32", (BATCH, REF_TOKENS, in_channels)),
            Tensor("ref_ids", "int64", (REF_TOKENS, n_axes)),
            Tensor("cached_kv", "float32", kv + (CACHED_TOKENS, inner_dim)),
        ),
        plain.outputs + (Tensor("ref_kv", "float32", kv + (REF_TOKENS, inner_dim)),),
    )


def flux3_transformer_io(in_channels: int, joint_dim: int, n_axes: int, flow_map: bool) -> GraphIO:
    """FLUX.3's transformer (flux3_wrappers.Flux3Transformer): the references are tokens of their own
    (`cond_latents`, none for text-to-image) and a flow-map model takes `target_timestep` too."""
    plain = transformer_io(in_channels, joint_dim, n_axes)
    inputs = plain.inputs + (
        Tensor("cond_latents", "float32", (BATCH, REF_TOKENS, in_channels)),
        Tensor("cond_ids", "int64", (REF_TOKENS, n_axes)),
    )
    if flow_map:
        inputs += (Tensor("target_timestep", "float32", (BATCH,)),)
    return GraphIO(plain.component, plain.file, inputs, plain.outputs)


def vae_encoder_io(latent_channels: int) -> GraphIO:
    return GraphIO(
        "vae_encoder",
        "vae_encoder.onnx",
        (Tensor("image", "float32", (BATCH, 3, HEIGHT, WIDTH)),),
        (Tensor("latents", "float32", (BATCH, latent_channels, LAT_H, LAT_W)),),
    )


def vae_decoder_io(latent_channels: int) -> GraphIO:
    return GraphIO(
        "vae_decoder",
        "vae_decoder.onnx",
        (Tensor("latents", "float32", (BATCH, latent_channels, LAT_H, LAT_W)),),
        (Tensor("image", "float32", (BATCH, 3, HEIGHT, WIDTH)),),
    )


COMPONENTS = ("text_encoder", "transformer", "vae_encoder", "vae_decoder")
