"""HTTP API: FastAPI app factory. The only module that knows about HTTP status codes and Prometheus.

Routes: POST /embed, POST /v1/embeddings (OpenAI-compatible), GET /health, /ready, /info, /metrics.
Typed errors from the engine and the preprocessor are mapped to status codes in `_STATUS`, in one
place; every error body is `{"error": {"type", "message", "index"?}}`.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import os
import time
from dataclasses import asdict, replace
from typing import Any

import numpy as np
import orjson
import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, multiprocess
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from safetensors.torch import save as safetensors_save
from starlette.datastructures import UploadFile

from . import __version__
from .encoder import EncodeResult, Encoder, result_tensors
from .engine import BatchStats, Engine
from .ipc import RemoteEngine
from .errors import (
    CheckpointError,
    DeadlineExceeded,
    EncoderError,
    ImageTooLarge,
    InvalidInput,
    Overloaded,
    ShuttingDown,
    UnsupportedImage,
)
from .metrics import Metrics
from .preprocess import Preprocessor
from .settings import Settings

log = logging.getLogger(__name__)

_STATUS = {
    ImageTooLarge: 413, UnsupportedImage: 422, InvalidInput: 422, Overloaded: 429,
    DeadlineExceeded: 503, ShuttingDown: 503, CheckpointError: 500,
}


class HTTPError(Exception):
    """An error decided by the API layer itself (content type, size, auth, malformed JSON)."""

    def __init__(self, status: int, reason: str, message: str, index: int | None = None, headers=None):
        super().__init__(message)
        self.status, self.reason, self.message, self.index, self.headers = status, reason, message, index, headers


class EmbedOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    format: str = Field("json", pattern="^(json|safetensors)$")
    encoding: str = Field("float", pattern="^(float|base64)$")
    dtype: str | None = Field(None, pattern="^(float32|float16|bfloat16)$")
    deepstack: bool | None = None  # default: false for JSON, true for safetensors (the CLI's layout)
    pooling: str = Field("none", pattern="^(none|mean)$")
    normalize: bool = False
    min_pixels: int | None = Field(None, ge=1)  # images
    max_pixels: int | None = Field(None, ge=1)  # images
    fps: float | None = Field(None, gt=0, le=240)  # videos: frames sampled per second of video
    num_frames: int | None = Field(None, ge=2)  # videos: frames sampled in all (exclusive with fps)


class JSONInput(BaseModel):
    """One input: base64 bytes or a data: URI. Images and videos are told apart by their bytes, so the
    key only documents intent."""

    model_config = ConfigDict(extra="forbid")
    image: str | None = None
    video: str | None = None

    @model_validator(mode="after")
    def _one(self):
        if (self.image is None) == (self.video is None):
            raise ValueError('each input needs exactly one of "image" or "video"')
        return self

    @property
    def data(self) -> str:
        return self.image if self.image is not None else self.video


class EmbedJSON(EmbedOptions):
    inputs: list[JSONInput]


class OpenAIEmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    input: str | list[str]
    model: str | None = None
    encoding_format: str = Field("float", pattern="^(float|base64)$")


def _orjson(content: Any, status: int = 200, headers=None) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def decode_base64_input(s: str, index: int) -> bytes:
    if s.startswith("data:"):
        head, sep, s = s.partition(",")
        if not sep or ";base64" not in head:
            raise HTTPError(422, "invalid_base64", "data: URI must be of the form data:<type>;base64,<data>", index)
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError) as e:
        raise HTTPError(422, "invalid_base64", f"invalid base64 data ({e})", index) from e


def _encode_array(t: torch.Tensor, encoding: str, dtype: str | None):
    """float -> numpy (serialised by orjson without Python floats); base64 -> little-endian bytes."""
    dtype = dtype or "float32"
    if encoding == "float":
        return np.ascontiguousarray(t.float().numpy())
    tt = t.to(getattr(torch, dtype)).contiguous()
    raw = (tt.view(torch.int16) if dtype == "bfloat16" else tt).numpy().tobytes()
    return base64.b64encode(raw).decode("ascii")


def pooled(results: list[EncodeResult], normalize: bool) -> list[torch.Tensor]:
    out = []
    for r in results:
        v = r.embeds.float().mean(0)
        out.append(torch.nn.functional.normalize(v, dim=0) if normalize else v)
    return out


OBSERVED_ROUTES = ("/embed", "/v1/embeddings", "/health", "/ready", "/info")


class ObserveMiddleware:
    """Request count and latency by route and status, in-flight gauge, X-Total-Time-Ms header.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware spawns task groups per request, which
    showed up as ~15% of the event loop's time under load."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                elapsed = time.perf_counter() - start
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-total-time-ms", f"{elapsed * 1000:.2f}".encode())]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("path", "")
            if route in OBSERVED_ROUTES:
                code = str(status["code"])
                self.metrics.requests.labels(route, code).inc()
                self.metrics.request_latency.labels(route, code).observe(time.perf_counter() - start)


def create_app(settings: Settings, encoder: Encoder | None = None) -> FastAPI:
    metrics = Metrics()
    state: dict[str, Any] = {"ready": False, "engine": None, "encoder": encoder}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.engine_socket:  # a front-end process: the model lives in the engine process (service.ipc)
            engine = RemoteEngine(settings.engine_socket, settings.preprocess_workers)
            await engine.start()
            enc = state["encoder"] = engine.encoder  # its preprocessor carries the engine's (server's) limits
        else:
            enc, engine = await engine_for(settings, metrics, state["encoder"])
            state["encoder"] = enc
            if settings.warmup:
                await asyncio.to_thread(warmup, enc, settings)
            await engine.start()
        state["engine"] = engine
        metrics.model_info.labels(settings.model, str(enc.dtype).removeprefix("torch."), str(enc.device), enc.backend,
                                  str(settings.model.startswith("random:")).lower()).set(1)
        state["ready"] = True
        log.info("ready: %s on %s (%s), attention backend %s%s", settings.model, enc.device, enc.dtype, enc.backend,
                 "" if engine.local else f", engine process at {settings.engine_socket}")
        try:
            yield
        finally:
            state["ready"] = False
            await engine.stop()
            if not engine.local and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
                multiprocess.mark_process_dead(os.getpid())

    app = FastAPI(title="Qwen3-VL vision encoder", version=__version__, lifespan=lifespan)

    # -- errors, in one place ------------------------------------------------------------------------

    def error_response(status: int, reason: str, message: str, index=None, headers=None) -> JSONResponse:
        metrics.errors.labels(reason).inc()
        err = {"type": reason, "message": message}
        if index is not None:
            err["index"] = index
        return JSONResponse({"error": err}, status_code=status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return error_response(e.status, e.reason, e.message, e.index, e.headers)

    @app.exception_handler(EncoderError)
    async def _encoder_error(request: Request, e: EncoderError):
        status = next((s for cls, s in _STATUS.items() if isinstance(e, cls)), 500)
        headers = {"Retry-After": str(int(np.ceil(e.retry_after)))} if isinstance(e, Overloaded) else None
        index = getattr(e, "index", None)
        message = getattr(e, "message", str(e))
        if status >= 500 and not isinstance(e, (DeadlineExceeded, ShuttingDown)):
            log.error("request failed: %s", e)
        return error_response(status, e.reason, message, index, headers)

    app.add_middleware(ObserveMiddleware, metrics=metrics)

    def check_auth(request: Request):
        if settings.api_key is None:
            return
        header = request.headers.get("authorization", "")
        if header != f"Bearer {settings.api_key.get_secret_value()}":
            raise HTTPError(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            headers={"WWW-Authenticate": "Bearer"})

    def engine() -> "Engine | RemoteEngine":
        if not state["ready"]:
            raise HTTPError(503, "not_ready", "the model is still loading or warming up")
        eng = state["engine"]
        if not eng.local and not eng.alive:
            raise HTTPError(503, "engine_unavailable", "the engine process is not running")
        return eng

    # -- request parsing ----------------------------------------------------------------------------------

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > settings.max_body_bytes:
            raise HTTPError(413, "body_too_large", f"request body of {declared} bytes exceeds the limit of "
                                                   f"{settings.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > settings.max_body_bytes:
                raise HTTPError(413, "body_too_large", f"request body exceeds the limit of {settings.max_body_bytes} "
                                                       "bytes")
            chunks.append(chunk)
        body = b"".join(chunks)
        request._body = body  # starlette re-reads the cached body for form parsing
        return body

    def check_count(n: int):
        if n == 0:
            raise HTTPError(422, "no_inputs", "the request has no images or videos")
        if n > settings.max_inputs_per_request:
            raise HTTPError(413, "too_many_inputs", f"{n} inputs in one request; the limit is "
                                                    f"{settings.max_inputs_per_request}")

    def parse_options(raw: dict) -> EmbedOptions:
        try:
            return EmbedOptions(**raw)
        except ValidationError as e:
            raise HTTPError(422, "invalid_options", _validation_message(e)) from e

    async def parse_embed(request: Request) -> tuple[list[bytes], EmbedOptions]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        query = dict(request.query_params)
        body = await read_body(request)
        if ctype == "multipart/form-data":
            try:
                form = await request.form(max_files=settings.max_inputs_per_request + 1,
                                          max_fields=settings.max_inputs_per_request + 32)
            except Exception as e:  # noqa: BLE001 - starlette raises several types for a bad form
                raise HTTPError(422, "invalid_multipart", f"malformed multipart body ({e})") from e
            parts = form.getlist("file")
            not_files = [i for i, f in enumerate(parts) if not isinstance(f, UploadFile)]
            if not_files:
                raise HTTPError(422, "invalid_multipart", "form field 'file' must be a file part (with a filename), "
                                                          "not text", not_files[0])
            files = parts
            bad = [k for k, v in form.multi_items() if k != "file"]
            if bad:
                raise HTTPError(422, "invalid_multipart", f"unexpected form field(s) {sorted(set(bad))}; send images "
                                                          "and videos as 'file' parts and options as query "
                                                          "parameters")
            check_count(len(files))
            return [await f.read() for f in files], parse_options(query)
        if ctype.startswith(("image/", "video/")):
            check_count(1 if body else 0)
            return [body], parse_options(query)
        if ctype == "application/json":
            try:
                raw = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise HTTPError(422, "invalid_json", f"request body is not valid JSON ({e})") from e
            if not isinstance(raw, dict) or not isinstance(raw.get("inputs"), list):
                raise HTTPError(422, "invalid_json", 'expected {"inputs": [{"image": "<base64 or data URI>"}, '
                                                     '{"video": "<base64 or data URI>"}, ...]}')
            check_count(len(raw["inputs"]))
            try:
                req = EmbedJSON(**{**query, **raw})
            except ValidationError as e:
                raise HTTPError(422, "invalid_json", _validation_message(e)) from e
            images = [decode_base64_input(inp.data, i) for i, inp in enumerate(req.inputs)]
            return images, EmbedOptions(**req.model_dump(exclude={"inputs"}))
        raise HTTPError(415, "unsupported_media_type",
                        f"content type {ctype or '(none)'!r}: send multipart/form-data 'file' parts, an image/* or "
                        "video/* body, or application/json")

    async def encode_all(request: Request, images: list[bytes], opts: EmbedOptions):
        eng = engine()
        limit = settings.max_pixels_limit or eng.encoder.preprocessor.config.max_pixels
        for name, v in (("min_pixels", opts.min_pixels), ("max_pixels", opts.max_pixels)):
            if v is not None and not settings.min_pixels_limit <= v <= limit:
                raise HTTPError(422, "invalid_options", f"{name}={v} outside the server's limits "
                                                        f"[{settings.min_pixels_limit}, {limit}]")
        if opts.min_pixels and opts.max_pixels and opts.min_pixels > opts.max_pixels:
            raise HTTPError(422, "invalid_options", "min_pixels > max_pixels")
        if opts.fps is not None and opts.num_frames is not None:
            raise HTTPError(422, "invalid_options", "fps and num_frames are mutually exclusive")
        max_frames = eng.encoder.preprocessor.config.video.max_frames
        if opts.num_frames is not None and opts.num_frames > max_frames:
            raise HTTPError(422, "invalid_options", f"num_frames={opts.num_frames} exceeds the video processor's "
                                                    f"max_frames={max_frames}")
        t0 = time.perf_counter()
        arrival = t0

        async def one(i, data):
            start = time.perf_counter()
            try:
                item = await eng.preprocess(data, opts.min_pixels, opts.max_pixels, opts.fps, opts.num_frames)
            except InvalidInput as e:
                raise e.at(i) from e.__cause__
            metrics.preprocess_time.observe(time.perf_counter() - start)
            return item

        items = await asyncio.gather(*(one(i, d) for i, d in enumerate(images)))
        disconnected = asyncio.Event()

        async def watch():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    disconnected.set()
                    return

        watcher = asyncio.create_task(watch())
        try:
            remaining = settings.request_timeout_s - (time.perf_counter() - arrival)
            if eng.local:
                metrics.queue_depth.set(eng.queue_depth + len(items))
            wants_deepstack = opts.deepstack if opts.deepstack is not None else opts.format == "safetensors"
            results, timing = await eng.submit(items, timeout_s=max(0.001, remaining), abandoned=disconnected,
                                               deepstack=wants_deepstack)
        finally:
            watcher.cancel()
            if eng.local:
                metrics.queue_depth.set(eng.queue_depth)
        metrics.queue_time.observe(timing.queue_s)
        for it, r in zip(items, results):
            if it.kind == "video":
                metrics.video_frames.inc(len(it.meta["frame_indices"]))
            else:
                metrics.images.inc()
            metrics.output_tokens.inc(r.num_tokens)
        headers = {"X-Queue-Time-Ms": f"{timing.queue_s * 1000:.2f}",
                   "X-Inference-Time-Ms": f"{timing.inference_s * 1000:.2f}"}
        return results, items, headers

    # -- routes -----------------------------------------------------------------------------------------------

    @app.post("/embed", summary="Encode images and videos into merged visual tokens, DeepStack features and pooled "
                                "vectors",
              openapi_extra={"requestBody": {"content": {
                  "multipart/form-data": {"schema": {"type": "object", "properties": {
                      "file": {"type": "array", "items": {"type": "string", "format": "binary"}}}}},
                  "image/*": {"schema": {"type": "string", "format": "binary"}},
                  "video/*": {"schema": {"type": "string", "format": "binary"}},
                  "application/json": {"schema": EmbedJSON.model_json_schema()}}}})
    async def embed(request: Request):
        check_auth(request)
        images, opts = await parse_embed(request)
        results, items, headers = await encode_all(request, images, opts)
        pools = pooled(results, opts.normalize) if opts.pooling == "mean" else None
        if opts.format == "safetensors":
            tensors = result_tensors(results, pooled=pools)
            if not (opts.deepstack if opts.deepstack is not None else True):
                tensors = {k: v for k, v in tensors.items() if not k.startswith("deepstack.")}
            if opts.dtype:
                tensors = {k: v.to(getattr(torch, opts.dtype)) if v.is_floating_point() else v
                           for k, v in tensors.items()}
            return Response(safetensors_save(tensors), media_type="application/octet-stream", headers=headers)
        data = []
        for i, (it, r) in enumerate(zip(items, results)):
            entry: dict[str, Any] = {"index": i, "type": it.kind, "grid_thw": list(r.grid_thw),
                                     "num_tokens": r.num_tokens, "shape": list(r.embeds.shape),
                                     "embeddings": _encode_array(r.embeds, opts.encoding, opts.dtype)}
            if it.kind == "video":
                entry["video"] = {k: it.meta[k] for k in ("frame_indices", "timestamps", "source_frames",
                                                          "source_fps")}
            if opts.deepstack:
                entry["deepstack"] = _encode_array(r.deepstack, opts.encoding, opts.dtype)
                entry["deepstack_shape"] = list(r.deepstack.shape)
            if pools is not None:
                entry["pooled"] = _encode_array(pools[i], opts.encoding, opts.dtype)
            data.append(entry)
        enc = state["encoder"]
        body = {"model": settings.model, "encoding": opts.encoding,
                "dtype": (opts.dtype or "float32") if opts.encoding == "base64" else "float32", "data": data,
                "usage": {"images": sum(it.kind == "image" for it in items),
                          "videos": sum(it.kind == "video" for it in items),
                          "tokens": sum(r.num_tokens for r in results)},
                "out_hidden_size": enc.config.out_hidden_size}
        return _orjson(body, headers=headers)

    @app.post("/v1/embeddings", summary="OpenAI-compatible: mean-pooled, L2-normalised image embeddings")
    async def openai_embeddings(request: Request):
        check_auth(request)
        body = await read_body(request)
        try:
            req = OpenAIEmbeddingRequest(**orjson.loads(body))
        except orjson.JSONDecodeError as e:
            raise HTTPError(422, "invalid_json", f"request body is not valid JSON ({e})") from e
        except (ValidationError, TypeError) as e:
            raise HTTPError(422, "invalid_json", _validation_message(e) if isinstance(e, ValidationError) else str(e))
        inputs = [req.input] if isinstance(req.input, str) else req.input
        check_count(len(inputs))
        images = [decode_base64_input(s, i) for i, s in enumerate(inputs)]
        results, _, headers = await encode_all(request, images, EmbedOptions())
        vecs = pooled(results, normalize=True)
        data = [{"object": "embedding", "index": i,
                 "embedding": _encode_array(v, req.encoding_format, "float32")} for i, v in enumerate(vecs)]
        tokens = sum(r.num_tokens for r in results)
        return _orjson({"object": "list", "data": data, "model": req.model or settings.model,
                        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}, headers=headers)

    @app.get("/health", summary="Liveness: the process is up")
    async def health():
        return {"status": "ok"}

    @app.get("/ready", summary="Readiness: model loaded and kernels warmed up")
    async def ready():
        eng = state["engine"]
        if not state["ready"] or not (eng.local or eng.alive):
            return JSONResponse({"ready": False}, status_code=503)
        return {"ready": True}

    @app.get("/info", summary="Model, dimensions, device, attention backend, limits, version")
    async def info():
        enc = state["encoder"]
        eng = state["engine"]
        body: dict[str, Any] = {"version": __version__, "model": settings.model,
                                "random_weights": settings.model.startswith("random:"), "ready": state["ready"]}
        if settings.model.startswith("random:"):
            body["warning"] = "random weights: embeddings are meaningless"
        if enc is not None:
            pre = enc.preprocessor.config
            body.update({
                "architecture": enc.config.to_dict(), "dtype": str(enc.dtype).removeprefix("torch."),
                "device": str(enc.device), "attention_backend": enc.backend,
                "preprocessing": {"patch_size": pre.patch_size, "merge_size": pre.merge_size,
                                  "temporal_patch_size": pre.temporal_patch_size, "min_pixels": pre.min_pixels,
                                  "max_pixels": pre.max_pixels, "image_mean": pre.image_mean,
                                  "image_std": pre.image_std, "video": asdict(pre.video)}})
        body["limits"] = {k: getattr(settings, k) for k in (
            "max_body_bytes", "max_inputs_per_request", "request_timeout_s", "max_image_pixels", "min_pixels_limit",
            "max_batch_patches", "max_batch_items", "max_wait_ms", "max_queue_items", "max_video_frames")}
        body["limits"]["max_pixels_limit"] = settings.max_pixels_limit or (
            enc.preprocessor.config.max_pixels if enc else None)
        if eng is not None:
            body["engine"] = await eng.stats() if eng.local or eng.alive else {"error": "engine process not running"}
            body["engine"]["process"] = "this" if eng.local else "separate"
        body["http_workers"] = settings.resolved_http_workers()
        body["cuda_graphs"] = settings.resolved_cuda_graphs()
        return body

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus():
        eng = state["engine"]
        if eng is not None and eng.local:  # with an engine process, it samples these itself (service.ipc)
            metrics.sample_engine(eng)
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    app.state.metrics = metrics
    app.state.service = state
    return app


async def engine_for(settings: Settings, metrics: Metrics, enc: Encoder | None = None) -> tuple[Encoder, Engine]:
    """Load the model (unless given) and build the batching engine that reports to `metrics`; shared by the
    single-process server and the engine process."""
    if enc is None:
        if settings.model.startswith("random:"):
            log.warning("NO MODEL CONFIGURED or a random preset: serving %s with RANDOM WEIGHTS; embeddings are "
                        "MEANINGLESS. Set QWEN3VL_MODEL to a Qwen3-VL checkpoint directory.", settings.model)
        enc = await asyncio.to_thread(Encoder.load, settings.model, settings.resolved_device(),
                                      settings.resolved_dtype(), settings.resolved_cuda_graphs())
    # the server's decoded-size and video-length limits replace the checkpoint preprocessor's defaults
    cfg = enc.preprocessor.config
    enc.preprocessor = Preprocessor(replace(cfg, max_image_pixels=settings.max_image_pixels,
                                            video=replace(cfg.video, max_source_frames=settings.max_video_frames)))

    def on_batch(stats: BatchStats):
        metrics.forward_time.observe(stats.forward_s)
        metrics.batch_items.observe(stats.items)
        metrics.batch_patches.observe(stats.patches)
        metrics.batch_fill.observe(min(1.0, stats.patches / settings.max_batch_patches))

    engine = Engine(enc, max_batch_patches=settings.max_batch_patches, max_batch_items=settings.max_batch_items,
                    max_wait_ms=settings.max_wait_ms, max_queue_items=settings.max_queue_items,
                    preprocess_workers=settings.preprocess_workers, preprocess_processes=settings.preprocess_processes,
                    on_batch=on_batch)
    return enc, engine


def frontend_app() -> FastAPI:
    """uvicorn factory of the front-end worker processes: settings from the environment the main process set."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[http %(process)d]: %(message)s")
    return create_app(Settings())


def warmup(enc: Encoder, settings: Settings):
    """Run representative packs once so kernels compile and tune before traffic. The kernels' tuning keys
    are coarse classes (kernels.varlen_attention.seq_bucket and load_class, the QKV projection's token
    classes), so per attention length class (<=256, <=1024, <=4096, longer) one image alone and one pack
    as full as the batch limits allow cover them."""
    from PIL import Image  # noqa: PLC0415 - only the warm-up makes images

    rng = np.random.default_rng(0)
    factor = enc.preprocessor.config.factor
    sides = [16, 32, 64, 96] if enc.device.type == "cuda" else [8]
    for side in sides:
        if side * side > settings.max_batch_patches:
            break
        px = side * enc.preprocessor.config.patch_size
        img = Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8))
        item = enc.preprocess(img, min_pixels=px * px, max_pixels=px * px)
        full = min(settings.max_batch_patches // (side * side), settings.max_batch_items)
        for count in sorted({1, full}) if enc.device.type == "cuda" else [1]:
            enc.encode([item] * count)
    log.info("warm-up done (multiples of %d px)", factor)


def _validation_message(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    return "; ".join(parts)
