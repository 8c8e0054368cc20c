"""klein_runtime: the FLUX.2-klein image models on ONNX Runtime, from Python (``pip install
klein-runtime``; the name ``klein`` is another project's on PyPI).

    import klein_runtime as klein

    pipe = klein.Pipeline("bundles/klein-4b")  # default: $KLEIN_MODEL, else the bundled tiny model
    out = pipe(prompt="a red fox in the snow", width=512, height=512, generator=7)
    out.images[0].save("fox.png")

The call mirrors diffusers' ``Flux2KleinPipeline``: ``image`` (references to edit or compose: PIL
images, file paths, or files' bytes as ``klein.EncodedImage``), ``height``, ``width``,
``num_inference_steps``, ``guidance_scale``, ``generator`` (a seed, or a ``torch.Generator`` whose
``initial_seed()`` is used), ``num_images_per_prompt`` and ``output_type`` (``"pil"``, ``"np"`` or
``"png"``: the bytes of the file ``klein generate`` writes for the same options). ``pipe.inpaint``
mirrors ``Flux2KleinInpaintPipeline``: ``image`` (the source), ``mask_image``, ``image_reference``
and ``strength``. Generation runs in
Rust with the GIL released; one pipeline serves one call at a time (calls from other threads wait
their turn), so use one pipeline per thread for parallel work.

The ONNX Runtime library is the one the ``onnxruntime`` package ships (``onnxruntime/capi/``);
``ort_lib=`` or ``$ORT_DYLIB_PATH`` names another (``onnxruntime-gpu``'s for CUDA). One process
loads one ONNX Runtime library.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import numpy as np
from PIL import Image

from . import _klein
from ._klein import (
    DEVICES,
    MAX_BATCH,
    MAX_CPU_CACHE_GIB,
    MAX_GUIDANCE,
    MAX_PROMPT_BYTES,
    MAX_PROMPT_CACHE_MIB,
    MAX_REFERENCES,
    MAX_SIDE,
    MAX_STEPS,
    MAX_THREADS,
    CancelledError,
    InvalidInputError,
    KleinError,
    OpenAiRequest,
    random_seed,
    tiny_model_dir,
)

__all__ = [
    "DEVICES",
    "MAX_BATCH",
    "MAX_CPU_CACHE_GIB",
    "MAX_GUIDANCE",
    "MAX_PROMPT_BYTES",
    "MAX_PROMPT_CACHE_MIB",
    "MAX_REFERENCES",
    "MAX_SIDE",
    "MAX_STEPS",
    "MAX_THREADS",
    "CancelledError",
    "EncodedImage",
    "InvalidInputError",
    "KleinError",
    "KleinPipelineOutput",
    "KleinWarning",
    "OpenAiRequest",
    "Pipeline",
    "find_ort_library",
    "random_seed",
    "tiny_model_dir",
]

__version__ = _klein.version()


@dataclass(frozen=True)
class EncodedImage:
    """The bytes of a PNG, JPEG or WebP file (an upload, a download), decoded by klein exactly as
    the file would be (EXIF orientation included); ``name`` labels it in errors and in the PNG."""

    data: bytes
    name: str = "image"

    def __post_init__(self) -> None:
        if not isinstance(self.data, (bytes, bytearray, memoryview)):
            raise _invalid(f"EncodedImage.data must be the image file's bytes, not {type(self.data).__name__}", "image")
        if not isinstance(self.name, str):
            raise _invalid(f"EncodedImage.name must be a string, not {type(self.name).__name__}", "image")


#: A reference image: a PIL image, the path of a PNG, JPEG or WebP file, or such a file's bytes.
ImageInput = Union[Image.Image, str, "os.PathLike[str]", EncodedImage, bytes]
#: A LoRA: ``(path, scale)``, ``"FILE"`` or ``"FILE:SCALE"`` (as ``--lora``), or a path (scale 1).
LoraInput = Union[tuple[Union[str, "os.PathLike[str]"], float], str, "os.PathLike[str]"]

# Modes Pillow writes to PNG as they are; other modes are converted to RGB (RGBA with alpha).
_PNG_MODES = {"1", "L", "LA", "I;16", "I;16B", "P", "RGB", "RGBA"}
_OUTPUT_TYPES = ("pil", "np", "png")
#: The native arguments whose Python names differ, as ``InvalidInputError.param`` names them.
_NATIVE_PARAMS = {
    "steps": "num_inference_steps",
    "guidance": "guidance_scale",
    "num_images": "num_images_per_prompt",
    "ort_library": "ort_lib",
}
_U32 = 2**32
_U64 = 2**64


def _renamed(error: KleinError, native: str | None) -> KleinError:
    """``error`` whose message names the native argument ``native`` (klein's ``num_images is 0``)
    by the caller's argument, its ``param`` (``num_images_per_prompt is 0``)."""
    if native and error.param and native != error.param and error.args:
        message = str(error.args[0]).replace(f"request: {native} ", f"request: {error.param} ", 1)
        error.args = (message, *error.args[1:])
    return error


def _named(error: KleinError, default: str | None = None) -> KleinError:
    """``error`` with ``param`` set to ``default`` where klein named no argument."""
    if getattr(error, "param", None) is None:
        error.param = default
    return error


class KleinWarning(UserWarning):
    """Something klein did not stop for: a truncated prompt, guidance given to a distilled model."""


def _invalid(message: str, param: str | None = None) -> InvalidInputError:
    """``InvalidInputError("invalid request: <message>")`` naming the argument ``param``."""
    error = InvalidInputError(f"invalid request: {message}")
    error.param = param
    return error


def _path(name: str, value: Any) -> str | None:
    """An optional path argument as a string."""
    if value is None:
        return None
    if not isinstance(value, (str, bytes, os.PathLike)):
        raise _invalid(f"{name} must be a path (str or os.PathLike), not {type(value).__name__}", name)
    return os.fsdecode(value)


@dataclass
class KleinPipelineOutput:
    """What a call made. ``images`` is a list of RGB ``PIL.Image``s (``output_type="pil"``), a
    float32 array ``[N, H, W, 3]`` in [0, 1] (``"np"``: the 8-bit pixels / 255), or a list of PNG
    files as bytes (``"png"``)."""

    images: list[Image.Image] | np.ndarray | list[bytes]
    seed: int
    width: int
    height: int
    steps: int
    guidance: float
    #: Seconds per stage ("encode prompt", "denoise", "decode", "load transformer"...).
    timings: dict[str, float] = field(default_factory=dict)
    prompt_truncated: bool = False
    #: The labels stored for the references: each path as given, ``image-<i>`` for PIL images.
    references: list[str] = field(default_factory=list)
    #: Where the graphs ran (``cpu``, ``cuda:0``, or per graph).
    device: str = ""


def find_ort_library(ort_lib: str | os.PathLike[str] | None = None) -> Path:
    """The ONNX Runtime shared library klein loads: ``ort_lib`` when given, else
    ``$ORT_DYLIB_PATH``, else the one inside the installed ``onnxruntime`` (or ``onnxruntime-gpu``)
    package. Raises ``KleinError`` when there is none."""
    if ort_lib is not None:
        return Path(ort_lib)
    from_env = os.environ.get("ORT_DYLIB_PATH")
    if from_env:
        return Path(from_env)
    how = (
        "install the onnxruntime package (pip install onnxruntime==1.31.1, or onnxruntime-gpu==1.31.1 "
        "for CUDA), or pass ort_lib= (or set ORT_DYLIB_PATH) to an ONNX Runtime 1.31 shared library"
    )
    spec = importlib.util.find_spec("onnxruntime")  # found without importing it
    if spec is None or not spec.submodule_search_locations:
        raise KleinError(f"ONNX Runtime library: the onnxruntime package is not installed; {how}")
    searched = []
    for location in spec.submodule_search_locations:
        capi = Path(location) / "capi"
        searched.append(str(capi))
        if sys.platform == "win32":
            candidates = [capi / "onnxruntime.dll"]
        elif sys.platform == "darwin":
            candidates = [*capi.glob("libonnxruntime.*.dylib"), capi / "libonnxruntime.dylib"]
        else:
            candidates = [*capi.glob("libonnxruntime.so.*"), capi / "libonnxruntime.so"]
        # The fully versioned name first (libonnxruntime.so.1.31.1 over a libonnxruntime.so.1 link).
        for candidate in sorted(candidates, key=lambda p: (-len(p.name), p.name)):
            if candidate.is_file():
                return candidate
    raise KleinError(
        f"ONNX Runtime library: no shared library in the onnxruntime package ({', '.join(searched)}); {how}"
    )


def _count(
    name: str, value: Any, *, optional: bool = True, limit: int = _U32, bounds: tuple[int, int] | None = None
) -> int | None:
    """An integer argument as the native call takes it. klein checks its bounds; a value the native
    call cannot hold (below 0, or not below ``limit``) is refused here, with klein's ``bounds``
    where they are known, as klein would refuse it."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise _invalid(f"{name} must be an integer, not {type(value).__name__}", name)
    if not 0 <= int(value) < limit:
        low, high = bounds if bounds is not None else (0, limit - 1)
        raise _invalid(f"{name} is {int(value)}: it must be between {low} and {high}", name)
    return int(value)


def _text(name: str, value: Any, *, optional: bool = False) -> str | None:
    """A prompt: a string of Unicode text (not a lone surrogate, which UTF-8 cannot hold)."""
    if value is None and optional:
        return None
    if not isinstance(value, str):
        hint = " (klein takes one prompt per call)" if isinstance(value, (list, tuple)) else ""
        raise _invalid(f"{name} must be a string, not {type(value).__name__}{hint}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise _invalid(
            f"{name} is not valid text: character {error.start} is a lone surrogate ({value[error.start]!r})", name
        ) from None
    return value


def _number(name: str, value: Any, bounds: tuple[float, float] | None = None, param: str | None = None) -> float | None:
    """A number argument; with ``bounds``, finite and within them. Errors name ``param`` (default:
    ``name``)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise _invalid(f"{name} must be a number, not {type(value).__name__}", param or name)
    number = float(value)
    if bounds is not None and not (math.isfinite(number) and bounds[0] <= number <= bounds[1]):
        raise _invalid(
            f"{name} is {number}: it must be a number between {bounds[0]:g} and {bounds[1]:g}", param or name
        )
    return number


def _seed(generator: Any) -> int | None:
    """The seed of ``generator``: None (klein draws a random one), an integer, or a
    torch.Generator's ``initial_seed()`` (klein draws the noise of every image from that seed, as
    torch does from a freshly seeded generator)."""
    if generator is None:
        return None
    if isinstance(generator, (list, tuple)):
        if len(generator) != 1:
            raise _invalid(
                f"generator: {len(generator)} generators given; klein takes one "
                "(the noise of all num_images_per_prompt images comes from one seed)",
                "generator",
            )
        generator = generator[0]
    if hasattr(generator, "initial_seed") and not isinstance(generator, (int, np.integer)):
        generator = generator.initial_seed()
    seed = _count("generator", generator, optional=False, limit=_U64)
    assert seed is not None
    return seed


def _png_bytes(image: Image.Image, label: str) -> bytes:
    """``image`` as a PNG file, losslessly and in its own mode where PNG has it; without EXIF
    (a PIL image is used as it is, not rotated by its EXIF orientation), ICC profile or text.
    ``label`` names the image in errors."""
    param = label.split("[")[0]
    if image.width == 0 or image.height == 0:
        raise _invalid(f"{label} is an empty image ({image.width}x{image.height})", param)
    try:
        if image.mode == "La":
            # Premultiplied: PIL converts it only to LA.
            image = image.convert("LA")
        if image.mode not in _PNG_MODES:
            image = image.convert("RGBA" if image.has_transparency_data else "RGB")
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", compress_level=1, icc_profile=None)
    except (ValueError, OSError) as error:  # a closed image, a mode PNG cannot take
        raise _invalid(f"{label}: {error}", param) from None
    return buffer.getvalue()


def _references(image: Any, name: str = "image") -> list[str | tuple[bytes, str]]:
    """``image`` (one or a sequence) as the native side takes it; PIL images and bare bytes are
    labelled ``<name>-<i>`` (errors and the PNG's text name them so)."""
    if image is None:
        return []
    items = list(image) if isinstance(image, (list, tuple)) else [image]
    references: list[str | tuple[bytes, str]] = []
    for index, item in enumerate(items):
        if isinstance(item, Image.Image):
            references.append((_png_bytes(item, f"{name}[{index}]"), f"{name}-{index}"))
        elif isinstance(item, (str, os.PathLike)):
            references.append(os.fsdecode(item))
        elif isinstance(item, EncodedImage):
            references.append((bytes(item.data), str(item.name)))
        elif isinstance(item, (bytes, bytearray, memoryview)):
            references.append((bytes(item), f"{name}-{index}"))
        else:
            raise _invalid(
                f"{name}[{index}] is of type {type(item).__name__}; give a PIL.Image.Image "
                "(a numpy array: PIL.Image.fromarray(array)), the path of a PNG, JPEG or WebP "
                "file, or its bytes (bytes or klein.EncodedImage)",
                name,
            )
    return references


def _vae_tiling(tiling: Any, tile_size: Any) -> str:
    """``vae_tiling`` as the native side takes it: ``"auto"``, ``"on"`` or ``"off"`` (a bool:
    on or off); without it, on with a tile size, else auto."""
    if tiling is None:
        return "on" if tile_size is not None else "auto"
    if isinstance(tiling, bool):
        return "on" if tiling else "off"
    if not isinstance(tiling, str):
        raise _invalid(f"vae_tiling must be 'auto', 'on' or 'off', not {type(tiling).__name__}", "vae_tiling")
    if tiling == "off" and tile_size is not None:
        # As `klein generate`: a tile size asks for tiles.
        raise _invalid("vae_tile_size does not apply with vae_tiling='off'; leave one of them out", "vae_tile_size")
    return tiling


def _preview_callback(preview: Any) -> Callable[[int, int, list[tuple[bytes, int, int]]], Any] | None:
    """The native preview callback for ``preview(step, total, images)``, which takes PIL images."""
    if preview is None:
        return None
    if not callable(preview):
        raise _invalid("preview must be callable(step, total, images)", "preview")

    def native(step: int, total: int, images: list[tuple[bytes, int, int]]) -> Any:
        return preview(step, total, [Image.frombytes("RGB", (w, h), raw) for raw, w, h in images])

    return native


def _utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _lora_pair(lora: Any) -> bool:
    """Whether ``lora`` is one ``(path, scale)`` pair (a tuple of LoRAs is a sequence of them)."""
    return (
        isinstance(lora, tuple)
        and len(lora) == 2
        and isinstance(lora[0], (str, os.PathLike))
        and isinstance(lora[1], numbers.Real)
        and not isinstance(lora[1], bool)
    )


def _loras(loras: Any) -> list[str | tuple[str, float]]:
    if loras is None:
        return []
    if isinstance(loras, (str, os.PathLike)) or _lora_pair(loras):
        loras = [loras]
    elif isinstance(loras, dict):
        loras = list(loras.items())  # {path: scale}
    elif isinstance(loras, tuple):
        loras = list(loras)
    elif not isinstance(loras, list):
        raise _invalid(
            f"loras must be a list of (path, scale), 'FILE' or 'FILE:SCALE', or a dict of path: scale; "
            f"not {type(loras).__name__}",
            "loras",
        )
    specs: list[str | tuple[str, float]] = []
    for index, lora in enumerate(loras):
        if isinstance(lora, str) and not _utf8(lora):
            # A file name that is not UTF-8 (os.fsdecode's surrogates): "FILE:SCALE" split here,
            # as the native side splits text, since only a path can carry such a name.
            path, colon, scale = lora.rpartition(":")
            try:
                specs.append((path, float(scale)) if colon and path else (lora, 1.0))
            except ValueError:
                specs.append((lora, 1.0))
        elif isinstance(lora, str):
            specs.append(lora)
        elif isinstance(lora, os.PathLike):
            specs.append((os.fsdecode(lora), 1.0))
        elif isinstance(lora, tuple) and len(lora) == 2 and isinstance(lora[0], (str, os.PathLike)):
            scale = _number(f"loras[{index}] scale", lora[1], param="loras")
            assert scale is not None
            specs.append((os.fsdecode(lora[0]), scale))
        else:
            raise _invalid(f"loras[{index}]: give (path, scale), 'FILE' or 'FILE:SCALE', not {lora!r}", "loras")
    return specs


class Pipeline:
    """A loaded klein bundle (``klein-export convert`` writes them).

    ``model``: the bundle directory (default ``$KLEIN_MODEL``, else the bundled tiny model, random
    weights, as the CLI runs without ``--model``). ``device``: ``cpu``, ``cuda``,
    ``cuda:N``, ``coreml`` or ``auto``. ``threads``: threads per operator (default: ONNX Runtime's
    choice). ``loras``: ``[(path, scale)]`` or ``["FILE:SCALE"]``. ``verify_hashes``: check the
    bundle's files against its manifest (skipped while a stamp in the cache vouches for them).
    ``keep_text_encoder``: keep the text encoder loaded between calls (faster for many prompts; by
    default its memory goes back before the transformer loads, and it loads again on the next call).
    ``release_transformer``: release the transformer before each call's decode and load it again on
    the next call (the run's peak memory is then the larger of denoising and decoding, not their
    sum; for one image per process, or little memory; default: kept).
    ``vae_tiling``: ``"auto"`` (tile the VAE above 1024x1024 pixels), ``"on"`` (as diffusers'
    ``vae.enable_tiling()``) or ``"off"`` (``True``/``False``: on/off); default ``"auto"``, or
    ``"on"`` with ``vae_tile_size``.
    ``vae_tile_size``: the VAE's tile side in pixels, a multiple of 64 (default: the bundle's, 1024),
    as diffusers' ``vae.tile_sample_min_size``. ``cpu_cache``: a directory where the CPU keeps each graph
    as ONNX Runtime optimised it, with its prepacked weights (the first load writes it, about the
    bundle's size again; later loads map it and are faster); its entries take at most
    ``cpu_cache_max_gib`` GiB (default: no limit), the least recently used removed when a graph is
    saved past it. ``prompt_cache``: a directory where
    prompt embeddings are kept between calls and processes (a prompt seen before skips the text
    encoder); its entries take at most ``prompt_cache_max_mib`` MiB (default 4096), the least
    recently used removed past it. ``ort_lib``: the ONNX Runtime library
    (default: the ``onnxruntime`` package's).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str = "cpu",
        threads: int | None = None,
        loras: Sequence[LoraInput] | None = None,
        verify_hashes: bool = True,
        keep_text_encoder: bool = False,
        release_transformer: bool = False,
        vae_tiling: Literal["auto", "on", "off"] | bool | None = None,
        vae_tile_size: int | None = None,
        cpu_cache: str | os.PathLike[str] | None = None,
        cpu_cache_max_gib: int | None = None,
        prompt_cache: str | os.PathLike[str] | None = None,
        prompt_cache_max_mib: int | None = None,
        ort_lib: str | os.PathLike[str] | None = None,
    ) -> None:
        if model is None:
            model = os.environ.get("KLEIN_MODEL") or None
            if model is None:
                # The bundled tiny model (random weights), as the CLI runs with no --model.
                model = _klein.tiny_model_dir()
        if not isinstance(model, (str, os.PathLike)):
            raise _invalid(
                f"model must be a bundle directory's path (str or os.PathLike), not {type(model).__name__}", "model"
            )
        if not isinstance(device, str):
            raise _invalid(f"device must be a string, not {type(device).__name__}", "device")
        arguments = {
            "device": device,
            "threads": _count("threads", threads, bounds=(1, MAX_THREADS)),
            "loras": _loras(loras),
            "verify_hashes": bool(verify_hashes),
            "keep_text_encoder": bool(keep_text_encoder),
            "release_transformer": bool(release_transformer),
            "vae_tiling": _vae_tiling(vae_tiling, vae_tile_size),
            "vae_tile_size": _count("vae_tile_size", vae_tile_size, bounds=(64, MAX_SIDE)),
            "cpu_cache": _path("cpu_cache", cpu_cache),
            "cpu_cache_max_gib": _count("cpu_cache_max_gib", cpu_cache_max_gib, bounds=(1, MAX_CPU_CACHE_GIB)),
            "prompt_cache": _path("prompt_cache", prompt_cache),
            "prompt_cache_max_mib": _count(
                "prompt_cache_max_mib", prompt_cache_max_mib, bounds=(1, MAX_PROMPT_CACHE_MIB)
            ),
            "ort_lib": os.fsdecode(find_ort_library(_path("ort_lib", ort_lib))),
        }
        try:
            self._native = _klein.Pipeline(os.fsdecode(model), **arguments)
        except KleinError as error:
            # klein names the argument (``param``): a LoRA file's is ``loras``, the library's ``ort_lib``.
            error.param = _NATIVE_PARAMS.get(error.param, error.param)
            raise error from None

    def __call__(
        self,
        prompt: str,
        *,
        image: ImageInput | Sequence[ImageInput] | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        negative_prompt: str | None = None,
        generator: Any = None,
        num_images_per_prompt: int = 1,
        output_type: Literal["pil", "np", "png"] = "pil",
        callback: Callable[[int, int], bool | None] | None = None,
        preview: Callable[[int, int, list[Image.Image]], bool | None] | None = None,
        preview_every: int = 1,
        return_dict: bool = True,
    ) -> KleinPipelineOutput | tuple[Any]:
        """Generates ``num_images_per_prompt`` images of ``prompt``, from the references in
        ``image`` if any. Defaults (None): the first reference's size, else the bundle's; the
        bundle's steps and guidance; a random seed (returned as ``seed``). ``negative_prompt``:
        what guidance steers away from, base models with guidance above 1 only (default: empty, as
        diffusers). ``callback(step,
        total)`` runs after every denoising step; returning ``False`` raises ``CancelledError``;
        Ctrl-C stops between steps with ``KeyboardInterrupt``. ``preview(step, total, images)``
        gets PIL previews of the images being made (1/8 of their side, the model's current
        estimate) every ``preview_every`` steps and after the last; returning ``False`` cancels.
        With ``return_dict=False``, the tuple ``(images,)`` as diffusers."""
        return self._run(
            prompt,
            references=_references(image),
            inpaint={},
            params={"references": "image"},
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            generator=generator,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
            callback=callback,
            preview=preview,
            preview_every=preview_every,
            return_dict=return_dict,
        )

    def inpaint(
        self,
        prompt: str,
        *,
        image: ImageInput,
        mask_image: ImageInput | None = None,
        mask_transparent: bool = False,
        image_reference: ImageInput | Sequence[ImageInput] | None = None,
        strength: float | None = None,
        padding_mask_crop: int | None = None,
        height: int | None = None,
        width: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        negative_prompt: str | None = None,
        generator: Any = None,
        num_images_per_prompt: int = 1,
        output_type: Literal["pil", "np", "png"] = "pil",
        callback: Callable[[int, int], bool | None] | None = None,
        preview: Callable[[int, int, list[Image.Image]], bool | None] | None = None,
        preview_every: int = 1,
        return_dict: bool = True,
    ) -> KleinPipelineOutput | tuple[Any]:
        """Inpainting and img2img, as diffusers' ``Flux2KleinInpaintPipeline``: ``image`` is the
        source (the output has its size, floored to multiples of 16), ``mask_image`` where to
        repaint (white; black is kept; None: img2img, everything repainted; ``mask_transparent``:
        its fully transparent pixels instead, as OpenAI's edits, and a mask without alpha is
        refused; how a mask is read, so nothing without one), ``image_reference``
        extra references, ``strength`` in (0, 1] the share of the steps that run (default 1.0,
        where diffusers' is 0.8: at 4 steps both run the same schedule). ``padding_mask_crop``
        (pixels) inpaints only the mask's region, padded, and pastes it back into the whole source
        (the output then has the source's size; the mask must have it too), as diffusers'
        argument of that name. ``height`` and ``width``, which diffusers ignores there, may only
        give the size the source is generated at once floored to 16 as it is (downscaled above 1
        megapixel, floored to 16: an 80x72 source takes 80x72 or 80x64; with ``padding_mask_crop``
        the output still has the source's whole size): another is refused, as by ``klein
        generate``. The other arguments are ``__call__``'s."""
        sources, masks = _references(image), _references(mask_image, "mask_image")
        if len(sources) != 1 or len(masks) > 1:
            raise _invalid(
                "inpaint takes one source image and at most one mask_image",
                "image" if len(sources) != 1 else "mask_image",
            )
        return self._run(
            prompt,
            references=_references(image_reference, "image_reference"),
            params={"source": "image", "mask": "mask_image", "references": "image_reference"},
            inpaint={
                "source": sources[0],
                "mask": masks[0] if masks else None,
                "mask_transparent": bool(mask_transparent),
                "strength": _number("strength", strength),
                "mask_crop": _count("padding_mask_crop", padding_mask_crop, bounds=(0, MAX_SIDE)),
            },
            height=height,
            width=width,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            negative_prompt=negative_prompt,
            generator=generator,
            num_images_per_prompt=num_images_per_prompt,
            output_type=output_type,
            callback=callback,
            preview=preview,
            preview_every=preview_every,
            return_dict=return_dict,
        )

    def _run(
        self,
        prompt: str,
        *,
        references: list[str | tuple[bytes, str]],
        inpaint: dict[str, Any],
        params: dict[str, str],
        height: int | None,
        width: int | None,
        num_inference_steps: int | None,
        guidance_scale: float | None,
        negative_prompt: str | None,
        generator: Any,
        num_images_per_prompt: int,
        output_type: str,
        callback: Callable[[int, int], bool | None] | None,
        preview: Callable[[int, int, list[Image.Image]], bool | None] | None,
        preview_every: int,
        return_dict: bool,
    ) -> KleinPipelineOutput | tuple[Any]:
        _text("prompt", prompt)
        if output_type not in _OUTPUT_TYPES:
            raise _invalid(f"output_type {output_type!r}: use one of {', '.join(_OUTPUT_TYPES)}", "output_type")
        if callback is not None and not callable(callback):
            raise _invalid("callback must be callable(step, total)", "callback")
        count = _count("num_images_per_prompt", num_images_per_prompt, optional=False, bounds=(1, MAX_BATCH))
        arguments = {
            "references": references,
            **inpaint,
            "width": _count("width", width, bounds=(16, MAX_SIDE)),
            "height": _count("height", height, bounds=(16, MAX_SIDE)),
            "steps": _count("num_inference_steps", num_inference_steps, bounds=(1, MAX_STEPS)),
            "guidance": _number("guidance_scale", guidance_scale),
            "negative_prompt": _text("negative_prompt", negative_prompt, optional=True),
            "seed": _seed(generator),
            "num_images": count,
            "png": output_type == "png",
            "callback": callback,
            "preview_every": _count("preview_every", preview_every, optional=False, bounds=(1, MAX_STEPS))
            if preview
            else None,
            "preview": _preview_callback(preview),
        }
        try:
            generation = self._native.generate(prompt, **arguments)
        except KleinError as error:
            # An input's error names the native argument (``source``, ``mask``, ``references``,
            # ``steps``...): as the caller's argument (``params``, else ``_NATIVE_PARAMS``).
            native = error.param
            error.param = params.get(native, _NATIVE_PARAMS.get(native, native))
            raise _renamed(error, native) from None
        for message in generation.warnings:
            warnings.warn(message, KleinWarning, stacklevel=3)
        if generation.prompt_truncated:
            warnings.warn(
                "the prompt is longer than the text encoder reads and was truncated, as diffusers does",
                KleinWarning,
                stacklevel=3,
            )
        size = (generation.width, generation.height)
        images: list[Image.Image] | np.ndarray | list[bytes]
        if output_type == "png":
            images = list(generation.png or [])
        elif output_type == "np":
            shape = (generation.height, generation.width, 3)
            pixels = [np.frombuffer(raw, dtype=np.uint8).reshape(shape) for raw in generation.images]
            images = np.stack(pixels).astype(np.float32) / 255
        else:
            images = [Image.frombytes("RGB", size, raw) for raw in generation.images]
        if not return_dict:
            return (images,)
        return KleinPipelineOutput(
            images=images,
            seed=generation.seed,
            width=generation.width,
            height=generation.height,
            steps=generation.steps,
            guidance=generation.guidance,
            timings=dict(generation.timings),
            prompt_truncated=generation.prompt_truncated,
            references=list(generation.references),
            device=generation.device,
        )

    def answer_openai(self, request: OpenAiRequest) -> dict[str, Any]:
        """Runs a request of the OpenAI images API (``OpenAiRequest.generations(body)`` or
        ``OpenAiRequest.edits(parts)``, checked as ``klein serve`` checks it) and returns the answer
        ``klein serve`` gives: ``{"created", "data": [{"b64_json"}], "seed", ...}``. Errors raise
        ``InvalidInputError`` whose ``param`` is the request's field. The GIL is released."""
        return json.loads(self._native.answer_openai(request))

    def openai_model(self, model_id: str | None = None) -> dict[str, Any]:
        """OpenAI's model object of this pipeline's model, as ``klein serve`` answers ``GET
        /v1/models/{id}``: ``{"id", "object": "model", "created", "owned_by", "klein": {...}}``
        (``created``: when the pipeline loaded; ``klein.max_pixels``: None, no cap). With
        ``model_id``, a ``LookupError`` (the 404 message of that route) unless it is the model's."""
        return json.loads(self._native.openai_model(model_id))

    def set_loras(self, loras: Sequence[LoraInput] | None) -> None:
        """Applies ``loras`` in place of the current ones (empty or None: none). Only the
        transformer reloads; a LoRA that does not fit the bundle raises and changes nothing."""
        try:
            self._native.set_loras(_loras(loras))
        except InvalidInputError as error:
            raise _named(error, "loras") from None

    @property
    def loras(self) -> list[tuple[Path, float]]:
        """The applied LoRAs, ``(path, scale)``."""
        return [(Path(path), scale) for path, scale in self._native.loras]

    @property
    def model_name(self) -> str:
        return self._native.model_name

    @property
    def variant(self) -> str:
        """``4b``, ``9b``, ``tiny`` or ``custom``."""
        return self._native.variant

    @property
    def family(self) -> str:
        """``flux2`` (FLUX.2-klein) or ``flux3`` (FLUX.3 Image Klein)."""
        return self._native.family

    @property
    def is_distilled(self) -> bool:
        return self._native.is_distilled

    @property
    def default_width(self) -> int:
        return self._native.default_width

    @property
    def default_height(self) -> int:
        return self._native.default_height

    @property
    def default_steps(self) -> int:
        return self._native.default_steps

    @property
    def default_guidance(self) -> float:
        return self._native.default_guidance

    @property
    def bundle_dir(self) -> Path:
        return Path(self._native.bundle_dir)

    @property
    def device(self) -> str:
        """The device asked for (``cpu``, ``cuda:0``, ``coreml``, ``auto``)."""
        return self._native.device

    @property
    def device_used(self) -> str:
        """Where the graphs loaded so far run, as of the last call that ended; ``none`` before
        the first. Read at once, also while a generation runs (from its callback, or another
        thread)."""
        return self._native.device_used

    def bundle_sha256(self) -> str:
        """sha256 of the bundle's manifest.json, as stored in every PNG."""
        return self._native.bundle_sha256()

    def __repr__(self) -> str:
        return repr(self._native)
