"""The engine process and its HTTP front-end processes (`QWEN3VL_HTTP_WORKERS` >= 1).

One process owns the model and the batching engine; N uvicorn worker processes parse requests, decode
and resize images, and write responses. HTTP handling and CUDA dispatch then stop sharing one
interpreter lock (the single-process service was measured GIL-bound, docs/PERFORMANCE.md), and the
engine still packs the images of every front-end into one forward.

They talk over a Unix socket. A message is a 12-byte prefix (header length u32, payload length u64),
a pickled header dict, then a raw payload: the uint8 frames going in, the embeddings coming back, no
per-element encoding. Front-end -> engine ops: `hello`, `submit`, `cancel`, `stats`; the engine
answers `hello`, `result` or `error` (with the typed error's class, message, index and retry-after),
`stats`.

Lifecycle (service.server): the main process spawns the engine, waits until it has loaded and
warmed up the model, then runs the uvicorn supervisor. On SIGTERM the front-ends drain their requests
first; then the engine is told to stop, finishes whatever is still queued, and exits. The engine
ignores SIGINT/SIGTERM itself, so a Ctrl-C that reaches the whole process group cannot stop it under
the front-ends' in-flight requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import os
import pickle
import signal
import struct
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import errors
from .encoder import EncodeResult
from .engine import Timing
from .preprocess import Preprocessor, Preprocessed

log = logging.getLogger(__name__)

_PREFIX = struct.Struct("<IQ")
# Frames and results arrive in read-only bytes; they are only ever read, never written in place.
warnings.filterwarnings("ignore", message="The given (buffer|NumPy array) is not writable")
_ERRORS = {cls.__name__: cls for cls in (errors.EncoderError, errors.InvalidInput, errors.UnsupportedImage,
                                         errors.ImageTooLarge, errors.Overloaded, errors.DeadlineExceeded,
                                         errors.ShuttingDown, errors.CheckpointError)}


def write_message(writer: asyncio.StreamWriter, header: dict, buffers=()) -> None:
    """Queue one message on `writer` (no await in between, so messages of concurrent tasks never interleave)."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    views = [memoryview(b).cast("B") for b in buffers if b.nbytes]
    writer.write(_PREFIX.pack(len(head), sum(v.nbytes for v in views)) + head)
    for v in views:
        writer.write(v)


async def read_message(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    head_len, payload_len = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    header = pickle.loads(await reader.readexactly(head_len))
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return header, payload


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (any dtype, bfloat16 included) as a uint8 array, without a copy when contiguous."""
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


def _tensor(payload: bytes, offset: int, shape, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    count = math.prod(shape) * dtype.itemsize
    if count == 0:
        return torch.empty(shape, dtype=dtype), offset
    t = torch.frombuffer(payload, dtype=torch.uint8, count=count, offset=offset).view(dtype).view(shape)
    return t, offset + count


def _error_header(rid: int, e: Exception) -> dict:
    if not isinstance(e, errors.EncoderError):
        e = errors.EncoderError(f"inference failed: {type(e).__name__}: {e}")
    return {"op": "error", "id": rid, "type": type(e).__name__, "message": getattr(e, "message", str(e)),
            "index": getattr(e, "index", None), "retry_after": getattr(e, "retry_after", None)}


def _rebuild_error(header: dict) -> errors.EncoderError:
    cls = _ERRORS.get(header["type"], errors.EncoderError)
    if issubclass(cls, errors.InvalidInput):
        return cls(header["message"], header["index"])
    if issubclass(cls, errors.Overloaded):
        return cls(header["message"], retry_after=header["retry_after"] or 1.0)
    return cls(header["message"])


# ------------------------------------------------------------------------------------------------------
# Engine process side
# ------------------------------------------------------------------------------------------------------


class EngineServer:
    """Serves an `Engine` to front-end processes over a Unix socket."""

    def __init__(self, engine, info: dict):
        self.engine = engine
        self.info = info

    async def serve(self, path: str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return await asyncio.start_unix_server(self._connection, path=path, limit=2**22)

    async def _connection(self, reader, writer):
        gone: set[int] = set()  # request ids cancelled by the front-end
        closed = False
        tasks: set[asyncio.Task] = set()

        def abandoned_fn(rid):
            return lambda: closed or rid in gone

        try:
            while True:
                header, payload = await read_message(reader)
                op = header["op"]
                if op == "submit":
                    task = asyncio.create_task(self._submit(header, payload, writer, abandoned_fn(header["id"])))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif op == "cancel":
                    gone.add(header["id"])
                elif op == "hello":
                    write_message(writer, {"op": "hello", "id": header["id"], "info": self.info})
                elif op == "stats":
                    write_message(writer, {"op": "stats", "id": header["id"], **self.stats()})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front-end went away: whatever it still had queued is dropped before compute
        finally:
            closed = True
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            writer.close()

    def stats(self) -> dict:
        return {"queue_depth": self.engine.queue_depth, "in_flight": self.engine.in_flight,
                "forwards": self.engine.forwards, "pid": os.getpid()}

    async def _submit(self, header, payload, writer, abandoned):
        rid = header["id"]
        items, offset = [], 0
        pre = self.engine.encoder.preprocessor
        for shape, grid, meta in header["items"]:
            n = math.prod(shape)
            items.append(pre.item(np.frombuffer(payload, np.uint8, n, offset).reshape(shape), tuple(grid), meta))
            offset += n
        try:
            results, timing = await self.engine.submit(items, timeout_s=header["timeout_s"], abandoned=abandoned,
                                                       deepstack=header["deepstack"])
        except Exception as e:  # noqa: BLE001 - every failure goes back to the front-end as a typed error
            reply, buffers = _error_header(rid, e), []
        else:
            reply = {"op": "result", "id": rid, "timing": (timing.queue_s, timing.inference_s),
                     "results": [(r.grid_thw, tuple(r.embeds.shape), str(r.embeds.dtype).removeprefix("torch."),
                                  tuple(r.deepstack.shape)) for r in results]}
            buffers = [b for r in results for b in (_raw(r.embeds), _raw(r.deepstack))]
        if abandoned() and reply["op"] == "result":
            return
        with contextlib.suppress(ConnectionError, RuntimeError):
            write_message(writer, reply, buffers)
            await writer.drain()


def engine_process_main(conn, settings_env: dict[str, str]) -> int:
    """Entry point of the engine process (spawned by service.server): load and warm the model, serve
    the socket, report ("ready", None) or ("error", message) on `conn`, stop when `conn` says so or
    closes (the parent is gone)."""
    os.environ.update(settings_env)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the main process decides when the engine stops
    from .settings import Settings

    settings = Settings()
    try:
        return asyncio.run(_engine_process(conn, settings))
    except errors.EncoderError as e:
        conn.send(("error", str(e)))
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the parent, which exits non-zero
        log.exception("engine process failed")
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1


async def _engine_process(conn, settings) -> int:
    from .api import engine_for, warmup
    from .metrics import Metrics

    metrics = Metrics()
    enc, engine = await engine_for(settings, metrics)
    if settings.warmup:
        await asyncio.to_thread(warmup, enc, settings)
    await engine.start()
    info = {"config": enc.config, "preprocess": enc.preprocessor.config, "device": str(enc.device),
            "dtype": str(enc.dtype).removeprefix("torch."), "backend": enc.backend}
    server = await EngineServer(engine, info).serve(settings.engine_socket)
    sampler = asyncio.create_task(_sample_gauges(engine, metrics))
    log.info("engine ready: %s on %s (%s), attention backend %s; socket %s", settings.model, enc.device, enc.dtype,
             enc.backend, settings.engine_socket)
    conn.send(("ready", None))
    loop = asyncio.get_running_loop()
    with contextlib.suppress(EOFError, OSError):
        await loop.run_in_executor(None, conn.recv)  # "stop", or EOF when the parent is gone
    log.info("engine stopping: finishing queued work")
    sampler.cancel()
    server.close()
    await engine.stop()
    return 0


async def _sample_gauges(engine, metrics, every_s: float = 1.0):
    """Queue depth and GPU memory, sampled in the process that owns them (front-ends cannot read them)."""
    while True:
        metrics.sample_engine(engine)
        await asyncio.sleep(every_s)


# ------------------------------------------------------------------------------------------------------
# Front-end process side
# ------------------------------------------------------------------------------------------------------


class RemoteEncoder:
    """What the API reads of the model in a front-end process: configs, device, dtype, backend. It holds no
    weights and never touches CUDA."""

    def __init__(self, info: dict):
        self.config = info["config"]
        self.preprocessor = Preprocessor(info["preprocess"])
        self.device = torch.device(info["device"])
        self.dtype = getattr(torch, info["dtype"])
        self.backend = info["backend"]


class RemoteEngine:
    """The `Engine` interface the API uses (`preprocess`, `submit`, `stats`), backed by the engine process.
    Decoding and resizing run here, in threads; only the uint8 frames cross to the engine."""

    local = False

    def __init__(self, path: str, preprocess_workers: int = 4):
        self.path = path
        self._pool = ThreadPoolExecutor(preprocess_workers, thread_name_prefix="preprocess")
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._broken: str | None = None
        self.encoder: RemoteEncoder | None = None

    async def start(self, timeout_s: float = 5.0):
        """Connect and fetch the model's description. The engine listens before any front-end starts, so a
        socket that stays refused means the engine is gone: fail the start-up (uvicorn then stops)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(self.path, limit=2**22)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self._reader_task = asyncio.create_task(self._read_loop(reader), name="engine-reader")
        header, _ = await self._request({"op": "hello"})
        self.encoder = RemoteEncoder(header["info"])

    async def stop(self):
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self._reader_task is not None:
            self._reader_task.cancel()
        self._pool.shutdown(wait=True)

    @property
    def alive(self) -> bool:
        return self._broken is None

    async def _read_loop(self, reader):
        try:
            while True:
                header, payload = await read_message(reader)
                fut = self._pending.pop(header["id"], None)
                if fut is not None and not fut.done():
                    fut.set_result((header, payload))
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self._broken = f"the engine process closed the connection ({type(e).__name__})"
        finally:
            if self._broken is None:
                self._broken = "the engine connection was closed"
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(errors.ShuttingDown(f"engine unavailable: {self._broken}"))
            self._pending.clear()

    def _send(self, header: dict, buffers=()) -> asyncio.Future:
        if self._broken is not None:
            raise errors.ShuttingDown(f"engine unavailable: {self._broken}")
        fut = asyncio.get_running_loop().create_future()
        self._pending[header["id"]] = fut
        write_message(self._writer, header, buffers)
        return fut

    async def _request(self, header: dict) -> tuple[dict, bytes]:
        header = {**header, "id": next(self._ids)}
        fut = self._send(header)
        await self._writer.drain()
        return await fut

    async def stats(self) -> dict:
        header, _ = await self._request({"op": "stats"})
        return {k: header[k] for k in ("queue_depth", "in_flight", "forwards", "pid")}

    async def preprocess(self, data, min_pixels=None, max_pixels=None, fps=None, num_frames=None) -> Preprocessed:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.encoder.preprocessor, data, min_pixels, max_pixels, fps,
                                          num_frames)

    async def submit(self, items: list[Preprocessed], *, timeout_s: float, abandoned: asyncio.Event | None = None,
                     deepstack: bool = True) -> tuple[list[EncodeResult], Timing]:
        """Same contract as `Engine.submit`; the engine enforces the deadline, `abandoned` (set when the
        client disconnects) cancels the request there."""
        rid = next(self._ids)
        frames = [np.ascontiguousarray(it.frames) for it in items]
        header = {"op": "submit", "id": rid, "timeout_s": timeout_s, "deepstack": deepstack,
                  "items": [(f.shape, it.grid_thw, it.meta) for f, it in zip(frames, items)]}
        fut = self._send(header, frames)
        waiter = asyncio.ensure_future(abandoned.wait()) if abandoned is not None else None
        try:
            await self._writer.drain()
            done, _ = await asyncio.wait([fut] + ([waiter] if waiter else []), timeout=timeout_s + 10,
                                         return_when=asyncio.FIRST_COMPLETED)
            if fut not in done:
                raise errors.DeadlineExceeded(f"request not served within {timeout_s:.1f} s") if not (
                    waiter and waiter in done) else asyncio.CancelledError()
        except BaseException:
            self._pending.pop(rid, None)
            if self._broken is None:
                with contextlib.suppress(Exception):
                    write_message(self._writer, {"op": "cancel", "id": rid})
            raise
        finally:
            if waiter is not None:
                waiter.cancel()
        reply, payload = fut.result()
        if reply["op"] == "error":
            raise _rebuild_error(reply)
        results, offset = [], 0
        for grid, shape, dtype, ds_shape in reply["results"]:
            dt = getattr(torch, dtype)
            embeds, offset = _tensor(payload, offset, shape, dt)
            ds, offset = _tensor(payload, offset, ds_shape, dt)
            results.append(EncodeResult(embeds=embeds, deepstack=ds, grid_thw=tuple(grid)))
        return results, Timing(*reply["timing"])


def settings_env(settings) -> dict[str, str]:
    """The settings as QWEN3VL_* environment variables, for processes that rebuild them with Settings()."""
    env: dict[str, Any] = {}
    for name, value in settings.model_dump().items():
        if value is None:
            continue
        if hasattr(value, "get_secret_value"):
            value = value.get_secret_value()
        env[f"QWEN3VL_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
    return env
