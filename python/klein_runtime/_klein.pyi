"""Type stubs of klein_runtime._klein, the native module (python/src/lib.rs). Use the ``klein_runtime`` package:
its ``Pipeline`` takes PIL images, generators and output types and calls this one."""

import os
from collections.abc import Callable, Sequence
from pathlib import Path

MAX_SIDE: int
"""Largest width or height, in pixels (the smallest is 16)."""
MAX_BATCH: int
"""Most images per call."""
MAX_STEPS: int
MAX_GUIDANCE: float
MAX_REFERENCES: int
"""Most reference images per call."""
MAX_THREADS: int
MAX_PROMPT_CACHE_MIB: int
MAX_CPU_CACHE_GIB: int
"""Most threads per operator."""
MAX_PROMPT_BYTES: int
DEVICES: tuple[str, ...]
"""The kinds of device this build can run on, in the order ``device="auto"`` tries them: ``cuda``
and ``coreml`` where compiled in, then ``cpu``."""

class KleinError(Exception):
    """An error of klein (the message names the file, field or stage)."""

    param: str | None
    """The argument at fault, as the call names it: an input image that could not be read or
    used (``image``, ``mask_image``, ``image_reference``), a number, text or list out of bounds
    (``width`` also for a size over the token budget, ``num_inference_steps``, ``prompt``,
    ``image`` for too many references...); None where no one argument is at fault (a bundle,
    the runtime)."""

class InvalidInputError(KleinError, ValueError):
    """What the caller gave cannot be used: a file, a bundle, a size, a count, an option."""

class CancelledError(KleinError):
    """The progress callback returned False."""

class Generation:
    """What ``Pipeline.generate`` made."""

    @property
    def images(self) -> list[bytes]:
        """Each image's pixels: ``height * width * 3`` bytes, RGB, row-major."""
    @property
    def png(self) -> list[bytes] | None:
        """Each image as a PNG file with the settings as text (as the CLI writes it), when asked."""
    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def guidance(self) -> float: ...
    @property
    def seed(self) -> int: ...
    @property
    def prompt_truncated(self) -> bool: ...
    @property
    def timings(self) -> list[tuple[str, float]]:
        """Seconds per stage label, in the order the stages first ran."""
    @property
    def references(self) -> list[str]:
        """The label of each reference, as stored in the PNG."""
    @property
    def warnings(self) -> list[str]: ...
    @property
    def device(self) -> str: ...

class Pipeline:
    """A loaded bundle; calls run without the GIL, one at a time."""

    def __new__(
        cls,
        model: str | os.PathLike[str],
        *,
        device: str = "cpu",
        threads: int | None = None,
        loras: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], float]] = [],
        verify_hashes: bool = True,
        keep_text_encoder: bool = False,
        release_transformer: bool = False,
        vae_tiling: str = "auto",
        vae_tile_size: int | None = None,
        cpu_cache: str | None = None,
        cpu_cache_max_gib: int | None = None,
        prompt_cache: str | None = None,
        prompt_cache_max_mib: int | None = None,
        ort_lib: str | os.PathLike[str] | None = None,
    ) -> Pipeline: ...
    def generate(
        self,
        prompt: str,
        *,
        references: Sequence[str | tuple[bytes, str]] = [],
        width: int | None = None,
        height: int | None = None,
        steps: int | None = None,
        guidance: float | None = None,
        negative_prompt: str | None = None,
        seed: int | None = None,
        num_images: int = 1,
        png: bool = False,
        callback: Callable[[int, int], object] | None = None,
        source: str | tuple[bytes, str] | None = None,
        mask: str | tuple[bytes, str] | None = None,
        mask_transparent: bool = False,
        strength: float | None = None,
        mask_crop: int | None = None,
        preview_every: int | None = None,
        preview: Callable[[int, int, list[tuple[bytes, int, int]]], object] | None = None,
    ) -> Generation: ...
    def answer_openai(self, request: OpenAiRequest) -> str: ...
    def openai_model(self, model_id: str | None = None) -> str: ...
    def set_loras(self, loras: Sequence[str | os.PathLike[str] | tuple[str | os.PathLike[str], float]]) -> None: ...
    @property
    def loras(self) -> list[tuple[Path, float]]: ...
    @property
    def model_name(self) -> str: ...
    @property
    def variant(self) -> str: ...
    @property
    def family(self) -> str: ...
    @property
    def is_distilled(self) -> bool: ...
    @property
    def default_width(self) -> int: ...
    @property
    def default_height(self) -> int: ...
    @property
    def default_steps(self) -> int: ...
    @property
    def default_guidance(self) -> float: ...
    @property
    def bundle_dir(self) -> Path: ...
    @property
    def device(self) -> str: ...
    @property
    def device_used(self) -> str: ...
    def bundle_sha256(self) -> str: ...

def version() -> str:
    """The version of the klein library this module was built with."""

def tiny_model_dir() -> Path:
    """The directory of the bundled tiny model (random weights), written to the cache directory on
    first use: the model ``klein.Pipeline()`` runs when none is named, as the CLI does."""

class OpenAiRequest:
    """A checked request of the OpenAI images API, as klein serve checks it."""

    @staticmethod
    def generations(body: bytes) -> OpenAiRequest: ...
    @staticmethod
    def edits(parts: Sequence[tuple[str, str | None, bytes]]) -> OpenAiRequest: ...
    @property
    def loras(self) -> list[str]: ...

def random_seed() -> int:
    """A seed for a generation that names none, below 2^53, as the CLI and the server draw it."""
