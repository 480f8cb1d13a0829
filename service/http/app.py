"""The FastAPI app: routes, the service state they share, and its lifespan.

Routes: POST /embed, POST /v1/embeddings (OpenAI-compatible), GET /health, /ready, /info, /metrics. The engine is
whichever `service.engine.api.Engine` the settings name (`open_engine`): the model in this process, or the engine
processes behind a front-end. Errors map to status codes in `status.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi_offline import FastAPIOffline
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, multiprocess

from .. import __version__
from ..engine.api import Engine
from ..engine.factory import open_engine
from ..engine.cache import CachedItem, EncoderCache, cache_key, make_cache_dir
from ..engine.wiring import Wiring
from ..errors import DeadlineExceeded, InvalidInput
from ..runtime import configure_process, settle_process
from ..settings import Settings
from . import openapi
from .metrics import Metrics
from .middleware import ApiKeyMiddleware, ObserveMiddleware
from .output import LLM_LAYOUTS, embed_response, llm_response, openai_response, wants_deepstack
from .parsing import check_limits, parse_embed, parse_openai
from .schemas import EmbedOptions
from .status import HTTPError, install_error_handlers

if TYPE_CHECKING:
    from ..engine.api import Encoder

log = logging.getLogger(__name__)


class Service:
    """What the routes share: the settings, the metrics, the engine and the embedding cache."""

    def __init__(self, settings: Settings, metrics: Metrics, encoder: Encoder | None = None,
                 wiring: Wiring = Wiring()):
        """`encoder`: an already loaded model to serve in this process (tests); `wiring`: a front-end's engine
        processes and shared cache directory (`serve`), or none (one process serves)."""
        self.metrics = metrics
        self.ready = False
        # called once, when start-up is done (`serve` and the front-ends: `runtime.settle_process`)
        self.on_ready: Callable[[], None] | None = None
        self.draining = False  # SIGTERM received: /ready 503, every response closes its connection
        # one process serves: its own cache directory, made at start-up and removed at shut-down, however the start
        # went (`serve` makes the one its front-ends share)
        self.wiring = wiring
        self._own_cache_dir = bool(settings.embedding_cache_mib and not wiring.cache_dir)
        self.settings = settings
        self.cache = self._cache(wiring.cache_dir)
        self.engine: Engine = open_engine(settings, wiring, encoder, on_batch=metrics.observe_batch,
                                          on_change=self._engine_changed)
        self._lag_watch: asyncio.Task | None = None

    def _cache(self, path: str | None) -> EncoderCache:
        return EncoderCache(path, self.settings.embedding_cache_mib << 20, self.metrics.cache_bytes.set,
                            self.settings.embedding_cache_write_mib_s << 20, self.metrics.cache_skipped.inc)

    @property
    def model(self):
        return self.engine.model

    async def start(self):
        """Start the engine: the model in this process is loaded and warmed before this returns; engine processes are
        followed in the background (/health answers at once, /ready is 503 until one is connected)."""
        self.metrics.engines.set(self.engine.capacity[1])
        if self._own_cache_dir:
            self.cache = self._cache(make_cache_dir())
        self._lag_watch = asyncio.create_task(self.watch_loop_lag(), name="event-loop-lag")
        await self.engine.start()

    async def watch_loop_lag(self, interval_s: float = 0.25) -> None:
        """How late this process's event loop runs a wake-up it scheduled (`qwen3vl_event_loop_lag_seconds`): the
        loop parses, routes and answers every request of this process, so its lag is what a saturated front-end
        adds to each of them."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + interval_s
            await asyncio.sleep(interval_s)
            self.metrics.loop_lag.observe(max(0.0, loop.time() - due))

    def _engine_changed(self, device: str, up: bool) -> None:
        """An engine connected (`up`), or was lost or found not listening: ready while start-up is over (every
        engine has been up, `EnginePool.started`) and one serves."""
        self.metrics.engine_up.labels(device).set(int(up))
        serving = self.engine.started and self.engine.alive
        if serving and not self.ready:
            self._set_ready()
        elif not serving and self.ready:
            self.ready = False
            self._mark_ready(False)

    def _frontends_dir(self) -> str | None:
        """With front-end processes: where each one marks itself ready (beside the engines' sockets)."""
        if not self.wiring.frontend:
            return None
        return os.path.join(self.wiring.workdir, "frontends-ready")

    def _mark_ready(self, ready: bool) -> None:
        """This front-end's mark: a file named by its pid, present while it can serve."""
        folder = self._frontends_dir()
        if folder is None:
            return
        path = os.path.join(folder, str(os.getpid()))
        try:
            if ready:
                os.makedirs(folder, exist_ok=True)
                open(path, "w").close()
            else:
                os.unlink(path)
        except OSError:
            pass

    def start_draining(self) -> None:
        if not self.draining:
            self.draining = True
            log.info("draining: /ready answers 503 and every response closes its connection")

    def every_frontend_ready(self) -> bool:
        """Whether all `http_workers` front-ends can serve: a load balancer that saw /ready 200 from one may send the
        next request to any (marks of processes that died are not counted)."""
        folder = self._frontends_dir()
        if folder is None:
            return True
        alive = 0
        try:
            for name in os.listdir(folder):
                try:
                    os.kill(int(name), 0)
                    alive += 1
                except (ValueError, ProcessLookupError):
                    pass
                except PermissionError:  # alive, another user's
                    alive += 1
        except OSError:
            return False
        return alive >= self.settings.resolved_http_workers()

    def _set_ready(self):
        settings, enc = self.settings, self.model
        self.metrics.model_info.labels(settings.model, str(enc.dtype).removeprefix("torch."), str(enc.device),
                                       enc.backend, str(settings.model.startswith("random:")).lower()).set(1)
        self.ready = True
        self._mark_ready(True)
        log.info("ready: %s (%s%s), attention backend %s", settings.model, enc.dtype,
                 ", FP8 blocks" if enc.quantization == "fp8" else "", enc.backend)
        if self.on_ready is not None:  # the first time only (an engine's restart sets it ready again)
            on_ready, self.on_ready = self.on_ready, None
            on_ready()

    async def stop(self):
        self.ready = False
        self._mark_ready(False)
        if self._lag_watch is not None:
            self._lag_watch.cancel()
        if self._own_cache_dir and self.cache.path:
            shutil.rmtree(self.cache.path, ignore_errors=True)
        await self.engine.stop()
        if self.wiring.frontend and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            multiprocess.mark_process_dead(os.getpid())

    def serving_engine(self) -> Engine:
        state = self.engine.state
        if state == "restarting":
            raise HTTPError(503, "engine_unavailable", "the engine process is restarting", headers={"Retry-After": "2"})
        if state == "failed":
            raise HTTPError(503, "engine_unavailable", "the engine hit a device fault; this server must be restarted "
                            "(/ready answers 503)", headers={"Retry-After": "10"})
        if state != "up" or not self.ready:
            raise HTTPError(503, "not_ready", "the model is still loading or warming up", headers={"Retry-After": "5"})
        return self.engine

    async def encode(self, request: Request, inputs: list[bytes], opts: EmbedOptions):
        """Preprocess and encode one request's inputs; the results, the items, and the timing headers."""
        eng = self.serving_engine()
        pre = eng.model.preprocessor.config
        check_limits(opts, self.settings, pre.max_pixels, pre.video.max_frames, self._has_deepstack(eng))
        return await self._encode(eng, request, inputs, opts, time.perf_counter())

    async def _encode(self, eng, request: Request, inputs: list[bytes], opts: EmbedOptions, arrival: float):
        """Each input from the cache, from an identical input in flight, or encoded here (the misses, preprocessed
        and submitted together)."""
        deepstack, tokens = wants_deepstack(opts, self._has_deepstack(eng)), opts.embeddings
        variant = (self.settings.model, str(eng.model.dtype), opts.min_pixels, opts.max_pixels, opts.fps,
                   opts.num_frames, deepstack, tokens)
        keys = [cache_key(data, variant) for data in inputs]
        served: list = [None] * len(inputs)  # (item, result) of each input
        waits, misses = {}, []
        for i, key in enumerate(keys):
            if (hit := self.cache.get(key)) is not None:
                served[i] = hit
            elif (future := self.cache.in_flight(key)) is not None:
                waits[i] = future
            else:
                self.cache.lead(key)
                misses.append(i)
        self.metrics.cache_items.labels("hit").inc(len(inputs) - len(misses) - len(waits))
        self.metrics.cache_items.labels("miss").inc(len(misses))  # shared ones: once their encoding is in
        timing, preprocessed = None, time.perf_counter()
        if misses:
            try:
                items, results, timing, preprocessed = await self._encode_misses(
                    eng, request, [inputs[i] for i in misses], misses, opts, arrival, deepstack, tokens)
            except BaseException as e:
                failed = e.index if isinstance(e, InvalidInput) else None
                for i in misses:  # an input's own error is shared; any other failure, each waiter retries alone
                    self.cache.finish(keys[i], error=e if i == failed else _Retry())
                raise
            for i, item, result in zip(misses, items, results):
                served[i] = (item, result)
                self.cache.finish(keys[i], (CachedItem(item.meta), result))
        retried = 0
        for i, future in waits.items():
            try:
                served[i] = await asyncio.shield(future)
            except InvalidInput as e:
                self.metrics.cache_items.labels("shared").inc()
                raise e.at(i) from e.__cause__
            except _Retry:  # the identical input's request failed for its own reasons: encoded here after all
                self.metrics.cache_items.labels("miss").inc()
                retried += 1
                (item,), (result,), timing, _ = await self._encode_misses(eng, request, [inputs[i]], [i], opts,
                                                                          arrival, deepstack, tokens)
                served[i] = (item, result)
            else:
                self.metrics.cache_items.labels("shared").inc()
        items, results = [s[0] for s in served], [s[1] for s in served]
        headers = {"X-Cache": "miss" if misses or retried else "hit",
                   "X-Preprocess-Time-Ms": f"{(preprocessed - arrival) * 1000:.2f}",
                   "X-Queue-Time-Ms": f"{(timing.queue_s if timing else 0.0) * 1000:.2f}",
                   "X-Inference-Time-Ms": f"{(timing.inference_s if timing else 0.0) * 1000:.2f}"}
        return results, items, headers

    async def _encode_misses(self, eng, request: Request, inputs: list[bytes], indices: list[int], opts: EmbedOptions,
                             arrival: float, deepstack: bool, tokens: bool):
        """Preprocess and encode `inputs` (items `indices` of the request) on the engine."""
        start = time.perf_counter()
        try:
            items = await eng.preprocess(inputs, opts.min_pixels, opts.max_pixels, opts.fps, opts.num_frames)
        except InvalidInput as e:
            raise (e if e.index is None else e.at(indices[e.index])) from e.__cause__
        preprocessed = time.perf_counter()
        for _ in items:  # the request's decoding, concurrent across its inputs
            self.metrics.preprocess_time.observe(preprocessed - start)
        budget = self.settings.resolved_max_request_patches(eng.model.device.type)
        if (patches := sum(it.num_patches for it in items)) > budget:
            largest = max(range(len(items)), key=lambda k: items[k].num_patches)
            raise HTTPError(413, "request_too_large",
                            f"the request's inputs come to {patches} patches after resizing (the largest, input "
                            f"{indices[largest]}: {items[largest].num_patches}); the limit per request is {budget} "
                            "(max_request_patches): send fewer or smaller inputs, or a lower max_pixels")
        disconnected = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(request, disconnected))
        try:
            remaining = self.settings.request_timeout_s - (time.perf_counter() - arrival)
            if remaining <= 0:
                raise DeadlineExceeded(f"request not served within its {self.settings.request_timeout_s:.1f} s "
                                       f"deadline: decoding its inputs took {preprocessed - arrival:.1f} s")
            done = await eng.submit(items, time.monotonic() + remaining, deepstack=deepstack, tokens=tokens,
                                    client=request.client.host if request.client else "", abandoned=disconnected)
        finally:
            watcher.cancel()
        self.metrics.observe_request(items, done.results, done.timing.queue_s)
        return items, done.results, done.timing, preprocessed

    @staticmethod
    def _has_deepstack(eng) -> bool:
        return bool(eng.model.config.deepstack_visual_indexes)

    async def info(self) -> dict[str, Any]:
        settings, enc, eng = self.settings, self.model, self.engine
        body: dict[str, Any] = {"version": __version__, "model": settings.model,
                                "family": enc.config.family if enc is not None else None,
                                "random_weights": settings.model.startswith("random:"), "ready": self.ready}
        if settings.model.startswith("random:"):
            body["warning"] = "random weights: embeddings are meaningless"
        if enc is not None:
            pre = enc.preprocessor.config
            body.update({
                "architecture": enc.config.to_dict(), "dtype": str(enc.dtype).removeprefix("torch."),
                "quantization": enc.quantization,
                "device": str(enc.device), "attention_backend": enc.backend,
                "preprocessing": {"patch_size": pre.patch_size, "merge_size": pre.merge_size,
                                  "temporal_patch_size": pre.temporal_patch_size, "min_pixels": pre.min_pixels,
                                  "max_pixels": pre.max_pixels, "image_mean": pre.image_mean,
                                  "image_std": pre.image_std, "video": asdict(pre.video)}})
        body["limits"] = {k: getattr(settings, k) for k in (
            "max_body_bytes", "max_inputs_per_request", "request_timeout_s", "max_image_pixels", "min_pixels_limit",
            "max_batch_patches", "max_batch_items", "max_wait_ms", "max_queue_items", "max_video_frames")}
        body["limits"]["max_pixels_limit"] = enc.preprocessor.config.max_pixels if enc else None
        body["limits"]["max_request_patches"] = (settings.resolved_max_request_patches(enc.device.type) if enc else
                                                 settings.max_request_patches)
        stats = await eng.stats()
        up, configured = eng.capacity
        body["engine"] = {"state": eng.state, "engines_up": up, "engines_configured": configured, "started": eng.started,
                          **stats.as_dict(),
                          "process": "this" if any(e.pid == os.getpid() for e in stats.engines) else "separate"}
        body["embedding_cache"] = {"max_bytes": self.cache.max_bytes, "bytes": self.cache.bytes,
                                   "path": self.cache.path}
        body["http_workers"] = settings.resolved_http_workers()
        body["http_process"] = os.getpid()  # the front-end process that answered
        body["cuda_graphs"] = settings.resolved_cuda_graphs()
        return body


class _Retry(Exception):
    """Handed to the requests waiting on an identical input when its encoding failed for a reason of its own
    request (a deadline, a disconnect, another input's error): each encodes it itself."""


async def _watch_disconnect(request: Request, disconnected: asyncio.Event):
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            disconnected.set()
            return


class RequestRoute(APIRoute):
    """A route whose endpoint takes the `Request` alone and returns a `Response`: in the OpenAPI schema like any
    other, but called as it is, without FastAPI's per-request parameter resolution and response serialisation
    (there is nothing for them to do, and they cost a measurable part of a lone image's host time). Errors still
    reach the handlers of `status.py`."""

    def get_route_handler(self):
        return self.endpoint


router = APIRouter()
encoding_router = APIRouter(route_class=RequestRoute)  # the routes that serve traffic
OPENAI_OPTIONS = EmbedOptions(pooling="mean", embeddings=False)  # what /v1/embeddings computes: the pooled vector


def _service(request: Request) -> Service:
    return request.app.state.service


@encoding_router.post("/embed", summary="Encode images and videos into merged visual tokens, DeepStack features, "
                                        "pooled vectors, or the layouts vLLM and SGLang take")
async def embed(request: Request):
    svc = _service(request)
    inputs, opts = await parse_embed(request, svc.settings)
    results, items, headers = await svc.encode(request, inputs, opts)
    if opts.format in LLM_LAYOUTS:  # megabytes to copy and encode: in a thread, the loop serves on meanwhile
        return await asyncio.to_thread(llm_response, results, items, opts, svc.settings.model,
                                       svc.model.config.out_hidden_size, headers)
    return embed_response(results, items, opts, svc.settings.model, svc.model.config.out_hidden_size, headers)


@encoding_router.post("/v1/embeddings", summary="OpenAI-compatible: mean-pooled, L2-normalised image embeddings")
async def openai_embeddings(request: Request):
    svc = _service(request)
    inputs, req = await parse_openai(request, svc.settings)
    results, _, headers = await svc.encode(request, inputs, OPENAI_OPTIONS)
    return openai_response(results, req.model or svc.settings.model, req.encoding_format, headers)


@router.get("/health", summary="Liveness: the process is up")
async def health():
    return {"status": "ok"}


@router.get("/ready", summary="Readiness: model loaded and kernels warmed up")
async def ready(request: Request):
    svc = _service(request)
    if svc.draining or not (svc.ready and svc.engine.alive and svc.engine.started and svc.every_frontend_ready()):
        return JSONResponse({"ready": False}, status_code=503)
    return {"ready": True}


@router.get("/info", summary="Model, dimensions, device, attention backend, limits, version")
async def info(request: Request):
    return await _service(request).info()


@router.get("/metrics", summary="Prometheus metrics")
async def prometheus(request: Request):
    svc = _service(request)
    if svc.engine.alive:
        with contextlib.suppress(Exception):  # a scrape never fails for want of the engine's gauges
            for engine in (await svc.engine.stats()).engines:
                if engine.state == "up":
                    svc.metrics.sample_engine(engine)
    return Response(svc.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: Settings, encoder: Encoder | None = None, wiring: Wiring = Wiring()) -> FastAPI:
    """The app for `settings`; `encoder`: an already loaded model (tests), else loaded at start-up; `wiring`: a
    front-end's engine processes (`serve`), none for one process."""
    # python-multipart warns once per malformed header line: a hostile body would write thousands of lines; the
    # request's own 4xx says what was wrong
    logging.getLogger("python_multipart").setLevel(logging.ERROR)
    metrics = Metrics(max_batch_patches=settings.max_batch_patches)
    service = Service(settings, metrics, encoder, wiring)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if wiring.frontend:  # a front-end process: `serve`'s main process signals the drain
            asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, service.start_draining)
        try:
            await service.start()
            yield
        finally:
            await service.stop()

    # /docs with Swagger UI's assets served from the package (fastapi-offline), not a CDN: it works air-gapped
    app = FastAPIOffline(title="Qwen3-VL vision encoder", version=__version__, lifespan=lifespan)
    install_error_handlers(app, metrics)
    if settings.api_key is not None:  # inside the observer: a 401 is counted like any reply
        app.add_middleware(ApiKeyMiddleware, key=settings.api_key.get_secret_value(),
                           on_reject=metrics.errors.labels("unauthorized").inc)
    app.add_middleware(ObserveMiddleware, metrics=metrics, closing=lambda: service.draining)
    app.include_router(encoding_router)
    app.include_router(router)
    openapi.install(app)  # request bodies, options and error replies as they are (service.http.openapi)
    app.state.metrics = metrics
    app.state.service = service
    return app


def frontend_app() -> FastAPI:
    """uvicorn factory of the front-end worker processes: settings from the environment the main process set."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[http %(process)d]: %(message)s")
    configure_process("frontend")
    app = create_app(Settings(), wiring=Wiring.from_env())
    app.state.service.on_ready = settle_process
    return app
