"""The engine as the HTTP front-end processes see it: `RemoteEngine`, a client of the engine process's socket
with the interface of the local `Engine` (`preprocess`, `submit`, `stats`). Decoding and resizing run here, in
threads; only the uint8 frames cross to the engine process (`protocol.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from .. import errors
from ..model.encoder import EncodeResult
from ..model.preprocess import Preprocessed, Preprocessor
from .batching import BatchStats, Timing
from .protocol import read_message, rebuild_error, tensor_at, write_message


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

    def __init__(self, path: str, preprocess_workers: int = 4,
                 on_batch: Callable[[BatchStats], None] | None = None):
        """`on_batch`: called with the stats of each forward the engine reports back (to this front-end's metrics;
        each forward is reported to one front-end only)."""
        self.path = path
        self.on_batch = on_batch
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
                if self.on_batch is not None:
                    for stats in header.get("batches", ()):
                        self.on_batch(BatchStats(*stats))
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
        return header["stats"]

    async def preprocess(self, data, min_pixels=None, max_pixels=None, fps=None, num_frames=None) -> Preprocessed:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.encoder.preprocessor, data, min_pixels, max_pixels, fps,
                                          num_frames)

    async def submit(self, items: list[Preprocessed], *, timeout_s: float, abandoned: asyncio.Event | None = None,
                     deepstack: bool = True, tokens: bool = True) -> tuple[list[EncodeResult], Timing]:
        """Same contract as `Engine.submit`; the engine enforces the deadline, `abandoned` (set when the
        client disconnects) cancels the request there."""
        rid = next(self._ids)
        frames = [np.ascontiguousarray(it.frames) for it in items]
        header = {"op": "submit", "id": rid, "timeout_s": timeout_s, "deepstack": deepstack, "tokens": tokens,
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
            raise rebuild_error(reply)
        results, offset = [], 0
        for grid, num_tokens, dtype, shape, ds_shape, pooled_shape in reply["results"]:
            dt = getattr(torch, dtype)
            embeds, offset = tensor_at(payload, offset, shape, dt)
            ds, offset = tensor_at(payload, offset, ds_shape, dt)
            pooled, offset = tensor_at(payload, offset, pooled_shape, torch.float32)
            results.append(EncodeResult(embeds=embeds, deepstack=ds, grid_thw=tuple(grid), pooled=pooled,
                                        num_tokens=num_tokens))
        return results, Timing(*reply["timing"])
