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

import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import klein_runtime as klein
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from ray import serve
from ray.serve import Application
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

app = FastAPI(title="klein", description="FLUX.2-klein on Ray Serve: the OpenAI images API")


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


#: The most parts an edits form may have: its images, a mask, and a text field of each name.
MAX_FORM_PARTS = klein.MAX_REFERENCES + 32


async def _generations_request(request: Request) -> klein.OpenAiRequest:
    """The JSON body, checked by klein as ``klein serve`` checks it (the same schema)."""
    return klein.OpenAiRequest.generations(await request.body())


async def _edits_request(request: Request) -> klein.OpenAiRequest:
    """The multipart form, its parts in order, checked by klein as ``klein serve`` checks it."""
    content_type = request.headers.get("content-type", "none")
    if not content_type.startswith("multipart/form-data"):
        raise ApiError(
            "/v1/images/edits takes multipart/form-data, as OpenAI's (image[] files and text fields): this body's "
            f"Content-Type is {content_type}"
        )
    try:
        form = await request.form(max_files=MAX_FORM_PARTS, max_fields=MAX_FORM_PARTS)
    except Exception as error:  # starlette's multipart errors (malformed form, too many parts)
        raise ApiError(f"multipart body: {getattr(error, 'detail', error)}") from None
    try:
        parts = []
        for name, value in form.multi_items():
            if isinstance(value, UploadFile):
                parts.append((name, value.filename or None, await value.read()))
            else:
                parts.append((name, None, value.encode("utf-8", "surrogateescape")))
    finally:
        await form.close()
    return klein.OpenAiRequest.edits(parts)


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

    @app.get("/v1/models")
    def models(self) -> dict[str, Any]:
        """OpenAI's model list: the one model this deployment runs, as ``klein serve`` lists it."""
        return {"object": "list", "data": [self.pipe.openai_model()]}

    @app.get("/v1/models/{model_id}")
    def model(self, model_id: str) -> JSONResponse:
        """The one model, by its name (the OpenAI clients' ``models.retrieve``); 404 otherwise."""
        try:
            return JSONResponse(self.pipe.openai_model(model_id))
        except LookupError as error:
            return ApiError(str(error), status=404, kind="not_found_error").response()

    @app.post("/v1/images/generations")
    async def generations(self, request: Request) -> JSONResponse:
        return await self._answer(_generations_request(request))

    @app.post("/v1/images/edits")
    async def edits(self, request: Request) -> JSONResponse:
        return await self._answer(_edits_request(request))

    async def _answer(self, reading: Awaitable[klein.OpenAiRequest]) -> JSONResponse:
        """The answer to the request being read: klein serve's answer, generated in a worker thread
        (klein releases the GIL), or an error naming the request's field."""
        try:
            request = await reading
            return JSONResponse(await run_in_threadpool(self.pipe.answer_openai, request))
        except ApiError as error:
            return error.response()
        except klein.InvalidInputError as error:
            return ApiError(str(error), getattr(error, "param", None)).response()
        except Exception as error:  # an answer in the API's format, whatever failed
            return ApiError(f"internal error: {error}", status=500).response()


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
