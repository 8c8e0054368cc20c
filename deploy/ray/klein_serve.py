"""klein on Ray Serve: one ``klein.Pipeline`` per replica behind a FastAPI ingress, speaking the
OpenAI images API as ``klein serve`` does (``POST /v1/images/generations``, ``POST
/v1/images/edits``, ``GET /healthz``).

    serve run deploy.ray.klein_serve:app_builder model=bundles/klein-4b replicas=2
    serve run deploy.ray.klein_serve:app_builder model=/models/klein-4b min_replicas=1 max_replicas=8 num_gpus=1

Every setting is an argument of ``app_builder`` (``serve run ... key=value``, or a Serve config
file's ``args``), else an environment variable, else a default:

| argument | environment | default | |
|---|---|---|---|
| model | KLEIN_MODEL | (required) | bundle directory, as every replica sees it (a shared volume) |
| device | KLEIN_DEVICE | cuda with num_gpus > 0, else cpu | klein.Pipeline's device |
| threads | KLEIN_THREADS | ONNX Runtime's choice | threads per operator in a replica |
| loras | KLEIN_LORAS | none | FILE:SCALE, comma-separated |
| low_memory | KLEIN_LOW_MEMORY | false | release the text encoder between requests and the transformer before decodes |
| cpu_cache | KLEIN_CPU_CACHE | none | CPU load cache directory shared by the replicas (later ones load faster) |
| cpu_cache_max_gib | KLEIN_CPU_CACHE_MAX_GIB | no limit | most GiB its entries take (the least recently used go) |
| prompt_cache | KLEIN_PROMPT_CACHE | none | directory of prompt embeddings, shared by the replicas |
| prompt_cache_max_mib | KLEIN_PROMPT_CACHE_MAX_MIB | 4096 | most MiB its entries take (the least recently used go) |
| replicas | KLEIN_REPLICAS | 1 | fixed number of replicas |
| min_replicas, max_replicas | KLEIN_MIN_REPLICAS, KLEIN_MAX_REPLICAS | | autoscaling instead of replicas |
| target_ongoing_requests | KLEIN_TARGET_ONGOING_REQUESTS | 1 | autoscaling target per replica |
| max_ongoing_requests | KLEIN_MAX_ONGOING_REQUESTS | 2 | requests a replica holds (one runs, the rest wait) |
| num_cpus, num_gpus | KLEIN_NUM_CPUS, KLEIN_NUM_GPUS | 1, 0 | ray_actor_options of each replica |
| ort_lib | ORT_DYLIB_PATH | the onnxruntime package's | ONNX Runtime library |
| graceful_shutdown_timeout_s | KLEIN_GRACEFUL_SHUTDOWN_TIMEOUT_S | 20 | |

A replica runs one generation at a time (its pipeline is behind a lock); generation runs in a
thread with the GIL released, so the replica's event loop keeps answering. Scale with replicas.
"""

import base64
import json
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import klein
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve import Application
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

app = FastAPI(title="klein", description="FLUX.2-klein on Ray Serve: the OpenAI images API")

#: Fields of a generations body (and text fields of an edits form). klein's own: seed, steps, guidance.
FIELDS = (
    "prompt",
    "model",
    "n",
    "size",
    "response_format",
    "output_format",
    "user",
    "safety_identifier",
    "quality",
    "background",
    "moderation",
    "style",
    "stream",
    "partial_images",
    "negative_prompt",
    "seed",
    "steps",
    "guidance",
)
#: The numbers of an edits form, parsed from their text.
INTEGER_FIELDS = ("n", "seed", "steps", "partial_images")
#: Where a client that asked OpenAI's routes to stream is sent (as ``klein serve`` says it).
STREAM_ELSEWHERE = (
    "this deployment answers each request whole; give stream false or leave it out (klein serve streams "
    "steps and previews on POST /v1/klein/generate/stream)"
)
#: ``klein.InvalidInputError.param`` (the Python argument) as the request's field: the source
#: and the references are both ``image`` fields of the edit form.
PARAMS = {
    "image": "image",
    "image_reference": "image",
    "mask_image": "mask",
    "prompt": "prompt",
    "negative_prompt": "negative_prompt",
    "num_inference_steps": "steps",
    "guidance_scale": "guidance",
    "width": "size",
    "height": "size",
    "num_images_per_prompt": "n",
    "strength": "strength",
}


class ApiError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, kind: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": None}}
        return JSONResponse(body, status_code=self.status)


@dataclass
class Job:
    """A checked request."""

    prompt: str
    n: int = 1
    width: int | None = None
    height: int | None = None
    seed: int = 0
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    references: list[klein.EncodedImage] = field(default_factory=list)
    #: Inpainting and img2img (an edits form with a mask or a strength): the first image, edited.
    source: klein.EncodedImage | None = None
    #: Where to repaint: OpenAI's mask as uploaded (transparent pixels); None: img2img.
    mask: klein.EncodedImage | None = None
    strength: float | None = None
    #: The answer's warnings of the request's own (settings that change nothing).
    notes: list[str] = field(default_factory=list)


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{name} {json.dumps(value)}: give a whole number", name)
    if not low <= value <= high:
        raise ApiError(f"{name} {value}: give {low} to {high}", name)
    return value


def _size(size: Any) -> tuple[int | None, int | None]:
    """``WxH`` (16 to klein.MAX_SIDE each) or ``auto``/absent: the first reference's size, else the
    bundle's default."""
    if size is None or (isinstance(size, str) and size.strip().lower() == "auto"):
        return None, None
    bad = ApiError(
        f"size {json.dumps(size)}: give WIDTHxHEIGHT (16 to {klein.MAX_SIDE} each, e.g. 1024x1024) or auto", "size"
    )
    if not isinstance(size, str):
        raise bad
    width, sep, height = size.strip().lower().partition("x")
    if not sep or not width.isdigit() or not height.isdigit():
        raise bad
    w, h = int(width), int(height)
    for side in (w, h):
        if not 16 <= side <= klein.MAX_SIDE:
            raise ApiError(f"size {side}: each side must be 16 to {klein.MAX_SIDE} pixels", "size")
    return w, h


def check_request(body: dict[str, Any], references: list[klein.EncodedImage]) -> Job:
    """The fields of a generations body or an edits form (as JSON values), checked as ``klein
    serve`` checks them; each error names its field."""
    unknown = [name for name in body if name not in FIELDS]
    if unknown:
        raise ApiError(f"unknown field `{unknown[0]}`; the fields are {', '.join(FIELDS)}", unknown[0])
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError("prompt is required: a string", "prompt")
    for name in ("model", "user", "negative_prompt"):  # model, user: accepted, unused
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(f"{name} must be a string", name)
    if body.get("response_format") not in (None, "b64_json"):
        raise ApiError(
            f"response_format {json.dumps(body['response_format'])} is not supported: this deployment stores "
            "no images to link to; use b64_json",
            "response_format",
        )
    if body.get("output_format") not in (None, "png"):
        raise ApiError(
            f"output_format {json.dumps(body['output_format'])}: this deployment returns png", "output_format"
        )
    if body.get("quality") not in (None, "auto", "standard"):
        raise ApiError(
            f"quality {json.dumps(body['quality'])}: klein has one quality; give auto or standard, and steps for more "
            "denoising",
            "quality",
        )
    notes = _openai_settings(body)
    guidance = body.get("guidance")
    if guidance is not None and (
        isinstance(guidance, bool) or not isinstance(guidance, (int, float)) or not 0 <= guidance <= klein.MAX_GUIDANCE
    ):
        raise ApiError(f"guidance {json.dumps(guidance)}: give 0 to {klein.MAX_GUIDANCE:g}", "guidance")
    width, height = _size(body.get("size"))
    seed = _integer(body, "seed", 0, 2**64 - 1)
    return Job(
        prompt=prompt,
        n=_integer(body, "n", 1, klein.MAX_BATCH) or 1,
        width=width,
        height=height,
        seed=klein.random_seed() if seed is None else seed,
        steps=_integer(body, "steps", 1, klein.MAX_STEPS),
        guidance=None if guidance is None else float(guidance),
        negative_prompt=body.get("negative_prompt"),
        references=references,
        notes=notes,
    )


def _openai_settings(body: dict[str, Any]) -> list[str]:
    """OpenAI's fields for what klein does one way only, as ``klein serve`` takes them: the values
    that ask for that way accepted, the others refused naming the field; returns the warnings of
    accepted fields that change nothing."""
    if body.get("safety_identifier") is not None and not isinstance(body["safety_identifier"], str):
        raise ApiError("safety_identifier must be a string", "safety_identifier")
    if body.get("background") not in (None, "auto", "opaque"):
        raise ApiError(
            f"background {json.dumps(body['background'])}: klein's images are opaque (no alpha channel); give auto "
            "or opaque",
            "background",
        )
    if body.get("style") is not None:
        raise ApiError(
            f"style {json.dumps(body['style'])}: klein has no style presets (DALL-E 3's vivid and natural); describe "
            "the style in the prompt",
            "style",
        )
    if body.get("stream") not in (None, False):
        raise ApiError(f"stream {json.dumps(body['stream'])}: {STREAM_ELSEWHERE}", "stream")
    partial = _integer(body, "partial_images", 0, 2**31)
    if partial:
        raise ApiError(
            f"partial_images {partial}: partial images come with stream; {STREAM_ELSEWHERE}", "partial_images"
        )
    moderation = body.get("moderation")
    if moderation is None:
        return []
    if moderation not in ("auto", "low"):
        raise ApiError(
            f"moderation {json.dumps(moderation)}: give auto or low (klein moderates nothing at either)", "moderation"
        )
    return [f"moderation `{moderation}` changed nothing: klein moderates no prompt or image"]


def _fidelity(text: str) -> str:
    """OpenAI's ``input_fidelity`` of edits (high or low) as the answer's warning: klein reads its
    images one way."""
    if text.strip() not in ("high", "low"):
        raise ApiError(
            f"input_fidelity `{text}`: give high or low (klein reads its images one way at either)", "input_fidelity"
        )
    return f"input_fidelity `{text.strip()}` changed nothing: klein's model reads its images one way"


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ApiError(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    return body


@dataclass
class EditForm:
    """An edits form: its text fields as JSON values, its ``image``/``image[]`` files (each labelled
    by its file name, as ``klein serve`` does), its mask and strength."""

    body: dict[str, Any] = field(default_factory=dict)
    images: list[klein.EncodedImage] = field(default_factory=list)
    mask: klein.EncodedImage | None = None
    strength: float | None = None
    fidelity: str | None = None


def _strength(text: str) -> float:
    """``strength`` in (0, 1], as ``klein serve`` takes it (ASCII, no digit separators)."""
    try:
        if not text.isascii() or "_" in text:
            raise ValueError(text)
        strength = float(text)
    except ValueError:
        raise ApiError(f"strength `{text}`: give a number", "strength") from None
    if not 0 < strength <= 1:
        raise ApiError(f"strength {strength:g} must be above 0 and at most 1 (1 repaints from pure noise)", "strength")
    return strength


async def _edit_form(request: Request) -> EditForm:
    """The edits form of ``request``, each field checked."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise ApiError("send multipart/form-data: image[] files and the text fields")
    try:
        form = await request.form(max_files=4 * klein.MAX_REFERENCES, max_fields=4 * len(FIELDS))
    except Exception as error:  # starlette's multipart errors (malformed form, too many parts)
        raise ApiError(f"multipart body: {getattr(error, 'detail', error)}") from None
    edit = EditForm()
    try:
        for name, value in form.multi_items():
            if name == "mask":
                if not isinstance(value, UploadFile):
                    raise ApiError("mask must be a file (a PNG, transparent where to edit)", "mask")
                if edit.mask is not None:
                    raise ApiError("give one mask", "mask")
                edit.mask = klein.EncodedImage(await value.read(), value.filename or "mask")
            elif name == "strength":
                if not isinstance(value, str):
                    raise ApiError("strength must be a text field", name)
                edit.strength = _strength(value)
            elif name == "input_fidelity":
                if not isinstance(value, str):
                    raise ApiError("input_fidelity must be a text field", name)
                edit.fidelity = _fidelity(value)
            elif name in ("image", "image[]"):
                if not isinstance(value, UploadFile):
                    raise ApiError(f"{name} must be a file", name)
                label = value.filename or f"image-{len(edit.images)}"
                edit.images.append(klein.EncodedImage(await value.read(), label))
            elif name in FIELDS:
                if not isinstance(value, str):
                    raise ApiError(f"{name} must be a text field", name)
                edit.body[name] = _form_value(name, value)
            else:
                raise ApiError(
                    f"unknown field `{name}`; the form takes image[] (files), mask (a PNG, transparent where to edit), "
                    f"strength, input_fidelity and {', '.join(FIELDS)}",
                    name,
                )
    finally:
        await form.close()
    if not edit.images:
        raise ApiError("give at least one image (the image or image[] field)", "image")
    if len(edit.images) > klein.MAX_REFERENCES:
        raise ApiError(f"{len(edit.images)} images: at most {klein.MAX_REFERENCES} per request", "image")
    return edit


async def _generations_job(request: Request) -> Job:
    return check_request(await _json_body(request), [])


async def _edits_job(request: Request) -> Job:
    edit = await _edit_form(request)
    job = check_request(edit.body, edit.images)
    if edit.fidelity is not None:
        job.notes.append(edit.fidelity)
    # With a mask (or a strength), the first image is the one edited, the others references.
    if edit.mask is not None or edit.strength is not None:
        job.source = job.references.pop(0)
        job.mask, job.strength = edit.mask, edit.strength
    return job


def _form_value(name: str, text: str) -> Any:
    """A form field's text as the JSON value the body takes: numbers for the numeric fields."""
    if name in INTEGER_FIELDS:
        if not text.strip().isdigit():
            raise ApiError(f"{name} `{text}`: give a whole number", name)
        return int(text)
    if name == "stream":
        if text.strip() not in ("true", "false"):
            raise ApiError(f"stream `{text}`: give false ({STREAM_ELSEWHERE})", name)
        return text.strip() == "true"
    if name == "guidance":
        try:
            if not text.isascii() or "_" in text:  # as klein serve parses numbers
                raise ValueError(text)
            return float(text)
        except ValueError:
            raise ApiError(f"{name} `{text}`: give a number", name) from None
    return text


@serve.deployment(max_ongoing_requests=2)
@serve.ingress(app)
class KleinDeployment:
    """One klein pipeline; the replica's requests take turns on it."""

    def __init__(
        self,
        model: str,
        device: str = "cpu",
        threads: int | None = None,
        loras: list[str] | None = None,
        low_memory: bool = False,
        cpu_cache: str | None = None,
        cpu_cache_max_gib: int | None = None,
        prompt_cache: str | None = None,
        prompt_cache_max_mib: int | None = None,
        ort_lib: str | None = None,
    ) -> None:
        self.pipe = klein.Pipeline(
            model,
            device=device,
            threads=threads,
            loras=loras or [],
            keep_text_encoder=not low_memory,
            release_transformer=low_memory,
            cpu_cache=cpu_cache,
            cpu_cache_max_gib=cpu_cache_max_gib,
            prompt_cache=prompt_cache,
            prompt_cache_max_mib=prompt_cache_max_mib,
            ort_lib=ort_lib,
        )

    @app.get("/healthz")
    def healthz(self) -> dict[str, Any]:
        pipe = self.pipe
        return {"status": "ok", "model": pipe.model_name, "variant": pipe.variant, "device": pipe.device}

    @app.post("/v1/images/generations")
    async def generations(self, request: Request) -> JSONResponse:
        return await self._answer(_generations_job(request))

    @app.post("/v1/images/edits")
    async def edits(self, request: Request) -> JSONResponse:
        return await self._answer(_edits_job(request))

    async def _answer(self, reading: Awaitable[Job]) -> JSONResponse:
        """The answer to the job being read: generated in a worker thread, or an error."""
        try:
            job = await reading
            return JSONResponse(await run_in_threadpool(self.generate, job))
        except ApiError as error:
            return error.response()
        except Exception as error:  # an answer in the API's format, whatever failed
            return ApiError(f"internal error: {error}", status=500).response()

    def generate(self, job: Job) -> dict[str, Any]:
        """Runs ``job`` (in a worker thread; klein releases the GIL) and builds the answer."""
        common = {
            "width": job.width,
            "height": job.height,
            "num_inference_steps": job.steps,
            "guidance_scale": job.guidance,
            "negative_prompt": job.negative_prompt,
            "generator": job.seed,
            "num_images_per_prompt": job.n,
            "output_type": "png",
        }
        try:
            if job.source is None:
                out = self.pipe(job.prompt, image=job.references or None, **common)
            else:
                out = self.pipe.inpaint(
                    job.prompt,
                    image=job.source,
                    mask_image=job.mask,
                    mask_transparent=True,
                    image_reference=job.references or None,
                    strength=job.strength,
                    **common,
                )
        except klein.InvalidInputError as error:
            # The Python argument an image's error names, as the form field that carried it.
            raise ApiError(str(error), PARAMS.get(error.param)) from None
        except klein.KleinError as error:
            raise ApiError(str(error), status=500) from None
        return {
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode("ascii")} for png in out.images],
            "seed": out.seed,
            "width": out.width,
            "height": out.height,
            "steps": out.steps,
            "guidance": out.guidance,
            # The request's own (the pipeline's go to Python's warnings, as klein.KleinWarning).
            "warnings": job.notes,
        }


#: app_builder's arguments and their environment variables.
SETTINGS = {
    "model": "KLEIN_MODEL",
    "device": "KLEIN_DEVICE",
    "threads": "KLEIN_THREADS",
    "loras": "KLEIN_LORAS",
    "low_memory": "KLEIN_LOW_MEMORY",
    "cpu_cache": "KLEIN_CPU_CACHE",
    "cpu_cache_max_gib": "KLEIN_CPU_CACHE_MAX_GIB",
    "prompt_cache": "KLEIN_PROMPT_CACHE",
    "prompt_cache_max_mib": "KLEIN_PROMPT_CACHE_MAX_MIB",
    "replicas": "KLEIN_REPLICAS",
    "min_replicas": "KLEIN_MIN_REPLICAS",
    "max_replicas": "KLEIN_MAX_REPLICAS",
    "target_ongoing_requests": "KLEIN_TARGET_ONGOING_REQUESTS",
    "max_ongoing_requests": "KLEIN_MAX_ONGOING_REQUESTS",
    "num_cpus": "KLEIN_NUM_CPUS",
    "num_gpus": "KLEIN_NUM_GPUS",
    "ort_lib": "ORT_DYLIB_PATH",
    "graceful_shutdown_timeout_s": "KLEIN_GRACEFUL_SHUTDOWN_TIMEOUT_S",
}


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def app_builder(args: dict[str, Any]) -> Application:
    """The Serve application, from ``args`` (``serve run ... key=value``; values may be strings)
    and the environment (module docstring)."""
    unknown = sorted(set(args) - set(SETTINGS))
    if unknown:
        raise ValueError(f"unknown argument(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")

    def setting(name: str) -> str | None:
        value = args.get(name, os.environ.get(SETTINGS[name]))
        if isinstance(value, (list, tuple)):  # a YAML list in a Serve config (loras)
            value = ",".join(str(item) for item in value)
        return None if value is None or str(value) == "" else str(value)

    def number(name: str, kind: type, default: float, minimum: float, maximum: float | None = None) -> Any:
        text = setting(name)
        what = f"{'a whole number' if kind is int else 'a number'} of at least {minimum:g}"
        what += f" and at most {maximum:g}" if maximum is not None else ""
        try:
            value = kind(text) if text is not None else kind(default)
        except ValueError:
            raise ValueError(f"{name}={text!r}: give {what}") from None
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{name}={value}: give {what}")
        return value

    model = setting("model")
    if model is None:
        raise ValueError("no model: pass model=BUNDLE_DIR or set KLEIN_MODEL")
    num_gpus = number("num_gpus", float, 0, 0)
    ray_actor_options = {"num_cpus": number("num_cpus", float, 1, 0), "num_gpus": num_gpus}
    options: dict[str, Any] = {
        "ray_actor_options": ray_actor_options,
        "max_ongoing_requests": number("max_ongoing_requests", int, 2, 1),
    }
    if setting("graceful_shutdown_timeout_s") is not None:
        options["graceful_shutdown_timeout_s"] = number("graceful_shutdown_timeout_s", float, 0, 0)
    if setting("min_replicas") is not None or setting("max_replicas") is not None:
        minimum = number("min_replicas", int, 1, 0)
        options["autoscaling_config"] = {
            "min_replicas": minimum,
            "max_replicas": number("max_replicas", int, max(minimum, 1), max(minimum, 1)),
            "target_ongoing_requests": number("target_ongoing_requests", float, 1, 0),
        }
    else:
        options["num_replicas"] = number("replicas", int, 1, 1)
    loras = setting("loras")
    for bound, cache in (("prompt_cache_max_mib", "prompt_cache"), ("cpu_cache_max_gib", "cpu_cache")):
        if setting(bound) is not None and setting(cache) is None:
            raise ValueError(f"{bound} needs {cache} (the directory it limits)")

    def limit(name: str, maximum: int) -> int | None:
        return number(name, int, 0, 1, maximum) if setting(name) is not None else None

    def directory(name: str) -> str | None:  # replicas may run in another directory
        return str(Path(setting(name)).resolve()) if setting(name) is not None else None

    return KleinDeployment.options(**options).bind(
        # Replicas may run in another directory: the bundle by its absolute path.
        model=str(Path(model).resolve()),
        device=setting("device") or ("cuda" if num_gpus > 0 else "cpu"),
        threads=number("threads", int, 0, 1) if setting("threads") is not None else None,
        loras=[spec.strip() for spec in loras.split(",") if spec.strip()] if loras else [],
        low_memory=_flag(setting("low_memory") or "false"),
        cpu_cache=directory("cpu_cache"),
        cpu_cache_max_gib=limit("cpu_cache_max_gib", klein.MAX_CPU_CACHE_GIB),
        prompt_cache=directory("prompt_cache"),
        prompt_cache_max_mib=limit("prompt_cache_max_mib", klein.MAX_PROMPT_CACHE_MIB),
        ort_lib=setting("ort_lib"),
    )
