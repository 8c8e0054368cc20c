"""The export's choices, light to import (no torch, no onnx), so that `klein-export --help` and a
mistyped flag answer at once: the precisions, the quantization methods and widths, and the
quantization config checked as the flags give it."""

from dataclasses import dataclass

from .errors import QuantizationError

PRECISIONS = ("fp32", "fp16", "bf16")
METHOD = "MatMulNBits"
BLOCK_SIZES = (16, 32, 64, 128, 256)
DYNAMIC = "DynamicQuantizeMatMul"
STATIC = "QDQ"
METHODS = {"nbits": METHOD, "dynamic": DYNAMIC, "static": STATIC}  # --method -> the operator written
BITS = {"int8": 8, "int4": 4}
QUANTIZABLE = ("text_encoder", "transformer")
STATIC_QUANTIZABLE = ("vae_decoder",)
DEFAULT_COMPONENTS = QUANTIZABLE
DEFAULT_BLOCK_SIZE = 32
VAE_NAMES = ("vae", "vae_encoder", "vae_decoder")


@dataclass(frozen=True)
class QuantizationConfig:
    bits: int
    block_size: int = DEFAULT_BLOCK_SIZE
    symmetric: bool = True
    accuracy_level: int = 0
    components: tuple = DEFAULT_COMPONENTS
    method: str = METHOD
    reduce_range: bool = False

    def __post_init__(self):
        if self.method not in METHODS.values():
            raise QuantizationError(f"method {self.method!r}: expected one of {', '.join(METHODS)}")
        if self.reduce_range and self.method not in (DYNAMIC, STATIC):
            raise QuantizationError(
                "--reduce-range is for int8 compute (--method dynamic or static), whose u8 x s8 products it keeps "
                "from saturating on CPUs without VNNI; MatMulNBits computes in float or with its own int8 kernels"
            )
        if self.method in (DYNAMIC, STATIC) and (
            self.bits != 8 or self.block_size != DEFAULT_BLOCK_SIZE or not self.symmetric or self.accuracy_level
        ):
            name = "dynamic" if self.method == DYNAMIC else "static"
            raise QuantizationError(
                f"--method {name} quantizes to int8, symmetric per output channel, with int8 compute: "
                "it takes no --block-size, --asymmetric or --accuracy-level, and no int4"
            )
        if self.bits not in BITS.values():
            raise QuantizationError(f"{self.bits} bits: expected one of {sorted(BITS.values())}")
        # MatMulNBits: ONNX Runtime's quantizer (MlasQuantizeBlockwise) takes these block sizes.
        if self.block_size not in BLOCK_SIZES:
            sizes = ", ".join(map(str, BLOCK_SIZES))
            raise QuantizationError(f"--block-size {self.block_size}: MatMulNBits takes {sizes}")
        if self.accuracy_level not in range(5):
            raise QuantizationError(f"--accuracy-level {self.accuracy_level}: expected 0 (unset) to 4 (int8 compute)")
        parse_components(",".join(self.components), self.method)

    @classmethod
    def from_scheme(cls, scheme: dict) -> "QuantizationConfig":
        """The config that wrote a manifest graph's `quantization` (components left at the default)."""
        reduce_range = bool(scheme.get("reduce_range"))
        if scheme["method"] == STATIC:
            return cls(bits=8, method=STATIC, components=STATIC_QUANTIZABLE, reduce_range=reduce_range)
        if scheme["method"] == DYNAMIC:
            return cls(bits=8, method=DYNAMIC, reduce_range=reduce_range)
        return cls(
            bits=scheme["bits"],
            block_size=scheme["block_size"],
            symmetric=scheme["symmetric"],
            accuracy_level=scheme.get("accuracy_level") or 0,
        )


def default_components(method: str) -> tuple:
    """The components `--method` quantizes when `--components` is not given."""
    return STATIC_QUANTIZABLE if method == STATIC else DEFAULT_COMPONENTS


def parse_components(text: str, method: str = METHOD) -> tuple:
    """`text_encoder,transformer` -> a tuple of components; what `method` cannot quantize is refused
    with the reason."""
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    quantizable = STATIC_QUANTIZABLE if method == STATIC else QUANTIZABLE
    if not names:
        raise QuantizationError(f"--components is empty: name {' or '.join(quantizable)}")
    for name in names:
        if method == STATIC and name in QUANTIZABLE:
            raise QuantizationError(
                f"--components {name}: --method static is for the VAE decoder's convolutions; quantize the "
                "text encoder and transformer with --method nbits or dynamic (in a separate `klein-export quantize`)"
            )
        if method != STATIC and name == "vae_decoder":
            raise QuantizationError(
                "--components vae_decoder: the VAE decoder is a convolution network, quantized with "
                "--method static only (MatMulNBits and dynamic cover MatMul)"
            )
        if name in VAE_NAMES and name not in STATIC_QUANTIZABLE:
            raise QuantizationError(
                f"--components {name}: the VAE encoder is never quantized (its error would move every "
                f"reference and source image); quantizable: {', '.join(QUANTIZABLE + STATIC_QUANTIZABLE)}"
            )
        if name not in quantizable:
            raise QuantizationError(f"--components {name!r}: unknown component; quantizable: {', '.join(quantizable)}")
    return names
