"""The engines as the HTTP front-end processes see them: `RemoteEngine`, a client of one engine process's socket,
and `EnginePool`, the `api.Engine` over the engine processes, one per device, which it follows through their
restarts. Decoding and resizing run here, in threads (videos in a sandbox process); only the uint8 frames cross to
an engine process (`protocol.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import mmap
import os
import time
from typing import Callable

import numpy as np
import torch

from .. import errors
from ..shared_rows import claim_row
from ..model.results import EncodeResult
from ..model.preprocess import Preprocessed
from .api import (BatchListener, BatchStats, ChangeListener, Decoder, DeviceStats, Encoded, EngineStats, ModelInfo,
                  Timing)
from .latency import LatencyPolicy
from .protocol import read_message, rebuild_error, region_bytes, tensor_at, write_message
from .shm import Arena, new_arena

log = logging.getLogger(__name__)

# how long past a request's deadline a front-end waits for the engine's reply (the engine enforces the deadline and
# answers; this covers an engine that cannot)
REPLY_GRACE_S = 10.0


class LoadBoard:
    """What every front-end has outstanding at each engine: a small file beside the engines' sockets, mapped by each
    front-end, with one row per front-end (written by it alone) and one column per engine, each cell the patches that
    front-end submitted there and has not had answered. A column's sum is the work ahead of a new request at that
    engine from every front-end, read at the moment a request is routed: a front-end's own in-flight count and the
    queue depth an engine last reported to it are a stale fraction of that, and with a few dozen requests per GPU
    that left one GPU idle while another queued.

    A front-end claims the first row no live process holds and zeroes it (`shared_rows.claim_row`). Where the file
    cannot be made or every row is held, `open` returns None and the front-end routes by what it alone sees."""

    ROWS = 128  # the most front-ends (64), twice over: a restarted one may start before its predecessor is gone

    def __init__(self, fd: int, row: int, engines: int):
        self._fd, self.row = fd, row  # the descriptor holds the row's lock: kept open for the process's life
        self._map = mmap.mmap(fd, self.ROWS * engines * 8)
        self.table = np.ndarray((self.ROWS, engines), np.int64, self._map)

    @classmethod
    def open(cls, path: str, engines: int) -> "LoadBoard | None":
        try:
            claimed = claim_row(path, cls.ROWS, engines * 8)
        except OSError as e:
            log.warning("no shared load board at %s (%s): requests are routed by this front-end's view", path, e)
            return None
        return cls(*claimed, engines) if claimed is not None else None

    def set(self, engine: int, patches: int) -> None:
        self.table[self.row, engine] = patches

    def loads(self) -> np.ndarray:
        """Patches outstanding at each engine, from every front-end."""
        return self.table.sum(axis=0)


def load_board_path(socket_path: str) -> str:
    """The `LoadBoard` file of the engines listening beside `socket_path`."""
    return os.path.join(os.path.dirname(socket_path), "engine-loads")


class RemoteEngine:
    """One engine process as a front-end sees it (`submit`, `stats`), over its Unix socket; `EnginePool` puts
    several behind the `api.Engine` interface and decodes for them.

    The engine process may die and be restarted by the server's supervisor: `connect()` opens a new connection,
    `disconnected()` waits for it to close. Requests the engine held when its connection closed fail with
    `EngineUnavailable` (503): they are not retried, since the front-end cannot tell whether its own input was
    what killed the engine."""

    def __init__(self, path: str, on_batch: Callable[[BatchStats], None] | None = None, device: str = "",
                 shared_memory_bytes: int = 0):
        """`on_batch`: called with the stats of each forward the engine reports back (to this front-end's metrics;
        each forward is reported to one front-end only); `device`: the engine's device, for metrics and /info;
        `shared_memory_bytes`: each connection's frame arena (`shm.Arena`; 0: frames travel in the messages)."""
        self.path = path
        self.device = device
        self.shared_memory_bytes = shared_memory_bytes
        self.on_batch = on_batch
        self._ids = itertools.count()
        self._link: _Link | None = None
        self.model: ModelInfo | None = None
        self.info: dict = {}  # the model's description, the process's pid and how many engines died before it
        self._sent_patches = 0  # patches this front-end has submitted and not had answered
        self.reported_patches = 0  # patches queued in the engine, as its last reply said
        self.board: LoadBoard | None = None  # where `sent_patches` is published to the other front-ends
        self.index = 0  # this engine's column there

    async def connect(self, timeout_s: float = 5.0):
        """Connect and fetch the model's description; `OSError` or `EngineUnavailable` if the engine does not
        answer within `timeout_s`."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path, limit=2**22), timeout_s)
        link = _Link(writer, self.on_batch, self)
        link.reader_task = asyncio.create_task(link.read_loop(reader), name="engine-reader")
        arena = new_arena(self.shared_memory_bytes)
        try:
            header, _ = await asyncio.wait_for(
                self._request({"op": "hello", "arena": arena.path if arena is not None else None}, link), timeout_s)
        except BaseException:
            link.close()
            if arena is not None:
                arena.close()
            raise
        if arena is not None:
            arena.unlink()  # mapped by the engine now (or never): the memory lives as long as the mappings
            if header.get("arena"):
                link.arena = arena
            else:
                log.warning("the engine could not map the frame arena; frames go over the socket")
                arena.close()
        self.info = header["info"]
        self.model = ModelInfo.from_wire(self.info)
        self._link = link

    async def disconnected(self) -> str:
        """Wait until the current connection closes; why it closed."""
        link = self._link
        if link is None:
            return "never connected"
        try:
            await asyncio.shield(link.reader_task)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # this wait was cancelled (the pool stops), not the reader
                raise
        return link.broken or "closed"

    async def stop(self):
        if self._link is not None:
            self._link.close()
            with contextlib.suppress(Exception):
                await self._link.writer.wait_closed()

    @property
    def sent_patches(self) -> int:
        return self._sent_patches

    @sent_patches.setter
    def sent_patches(self, patches: int) -> None:
        self._sent_patches = patches
        if self.board is not None:
            self.board.set(self.index, patches)

    @property
    def load(self) -> int:
        """Patches ahead of a new request on this engine, as far as this front-end alone can tell (without a
        `LoadBoard`)."""
        return self.sent_patches + self.reported_patches

    @property
    def alive(self) -> bool:
        return self._link is not None and self._link.broken is None

    def _live_link(self) -> "_Link":
        link = self._link
        if link is None or link.broken is not None:
            raise errors.EngineUnavailable("the engine process is restarting" if link is not None else
                                           "the engine process is not running yet", retry_after=2.0)
        return link

    async def _request(self, header: dict, link: "_Link | None" = None) -> tuple[dict, bytes]:
        link = link or self._live_link()
        rid = next(self._ids)
        fut = link.send({**header, "id": rid})
        try:
            await link.drain()
            return await fut
        finally:
            link.forget(rid, fut)

    def expect(self) -> None:
        """Tell the engine that a lone request's submit follows shortly (no reply; `EngineServer.expect`)."""
        if self.alive:
            with contextlib.suppress(Exception):  # a closing link: the submit that follows reports it
                write_message(self._link.writer, {"op": "expect", "id": -1})

    async def stats(self) -> DeviceStats:
        header, _ = await self._request({"op": "stats"})
        return DeviceStats(**{**header["stats"], "device": self.device, "restarts": self.info.get("restarts", 0)})

    async def submit(self, items: list[Preprocessed], deadline: float, *, deepstack: bool = True,
                     tokens: bool = True, client: str = "", abandoned: asyncio.Event | None = None,
                     poll: Callable[[], bool] | None = None) -> Encoded:
        """Same contract as `api.Engine.submit`; the engine enforces the deadline, `abandoned` (set when the
        client disconnects) cancels the request there. `poll`: while it is true, the reply is awaited by turning the
        event loop over rather than sleeping in it (`latency.LatencyPolicy`, 2.)."""
        timeout_s = deadline - time.monotonic()
        if timeout_s <= 0:
            raise errors.DeadlineExceeded("request not served by its deadline: none of it was left to encode it")
        link = self._live_link()
        rid = next(self._ids)
        frames = [np.ascontiguousarray(it.frames) for it in items]
        # each item's frames in the arena (their offset), or in the message (None)
        placed = [link.arena.put(f) if link.arena is not None else None for f in frames]
        # a region for the results, which the engine writes there rather than into its reply
        out_bytes = self._result_bytes(items, deepstack, tokens) if link.arena is not None else 0
        out = link.arena.reserve(out_bytes) if out_bytes else None
        header = {"op": "submit", "id": rid, "timeout_s": timeout_s, "deepstack": deepstack, "tokens": tokens,
                  "client": client,
                  "items": [(f.shape, it.grid_thw, it.meta, at) for f, it, at in zip(frames, items, placed)],
                  "out": (out, out_bytes) if out is not None else None}
        patches = sum(it.num_patches for it in items)
        self.sent_patches += patches
        fut = waiter = None
        replied = lent = False
        try:
            fut = link.send(header, [f for f, at in zip(frames, placed) if at is None])
            if abandoned is not None:  # the client went away: stop waiting, and the engine drops the request
                waiter = asyncio.ensure_future(abandoned.wait())
                waiter.add_done_callback(lambda w: fut.cancel() if not w.cancelled() else None)
            await link.drain()
            # the reply is awaited directly (one wake-up); the reader's metrics run after it
            async with asyncio.timeout(timeout_s + REPLY_GRACE_S):
                while poll is not None and not fut.done() and poll():
                    await asyncio.sleep(0)
                reply, payload = await fut
            replied = True
            if reply.get("in_arena"):  # read in place; the region is freed once the results are dropped
                loop = asyncio.get_running_loop()
                payload, lent = link.arena.lend(out, out_bytes, lambda: _release_soon(loop, link.arena, out)), True
        except BaseException as e:
            if fut is not None and (not fut.done() or fut.cancelled()):
                link.cancel(rid)
            if isinstance(e, TimeoutError):
                raise errors.DeadlineExceeded(f"request not served within {timeout_s:.1f} s") from None
            raise
        finally:
            self.sent_patches -= patches
            _release(link.arena, placed)
            if out is not None and not lent:
                if replied or fut is None or rid not in link.pending:  # (not pending: its reply has come)
                    link.arena.release(out)
                else:  # the engine may still write there: free it on the request's last reply (`_Link.read_loop`)
                    link.held[rid] = out
            if fut is not None:
                link.forget(rid, fut)
            if waiter is not None:
                waiter.cancel()
        if reply["op"] == "error":
            raise rebuild_error(reply)
        results, offset, align = [], 0, bool(reply.get("in_arena"))
        for grid, num_tokens, dtype, shape, ds_shape, pooled_shape in reply["results"]:
            dt = getattr(torch, dtype)
            embeds, offset = tensor_at(payload, offset, shape, dt, align)
            ds, offset = tensor_at(payload, offset, ds_shape, dt, align)
            pooled, offset = tensor_at(payload, offset, pooled_shape, torch.float32, align)
            results.append(EncodeResult(embeds=embeds, deepstack=ds, grid_thw=tuple(grid), pooled=pooled,
                                        num_tokens=num_tokens))
        return Encoded(results, Timing(*reply["timing"]))

    def _result_bytes(self, items: list[Preprocessed], deepstack: bool, tokens: bool) -> int:
        """The bytes the engine's results for `items` take in a region (`protocol.write_tensors`): per item its
        merged tokens and DeepStack features where asked for, in the model's dtype, and its float32 pooled vector."""
        config, size = self.model.config, self.model.dtype.itemsize
        width, levels = config.out_hidden_size, len(config.deepstack_visual_indexes) if deepstack else 0
        nbytes = []
        for it in items:
            n = it.num_patches // config.merge_unit
            nbytes += [n * width * size * tokens, levels * n * width * size, width * 4]
        return region_bytes(nbytes)


def _release_soon(loop: asyncio.AbstractEventLoop, arena: Arena, offset: int) -> None:
    """Free a lent region on the event loop that owns the arena, from whatever thread dropped its last tensor."""
    try:
        loop.call_soon_threadsafe(arena.release, offset)
    except RuntimeError:  # the loop is closed: so is the arena's use
        pass


def _release(arena: Arena | None, placed: list[int | None]) -> None:
    for offset in placed:
        if offset is not None:
            arena.release(offset)


class _Link:
    """One connection to the engine process: its writer, its reader task, the replies it awaits, and its frame arena
    (None: frames travel in the messages). When it closes, every awaited reply fails with `EngineUnavailable`."""

    def __init__(self, writer: asyncio.StreamWriter, on_batch, engine: RemoteEngine):
        self.arena: Arena | None = None
        self.held: dict[int, int] = {}  # request id -> its results' region, of requests given up on before the reply
        self.writer = writer
        self.on_batch = on_batch
        self.engine = engine
        self.pending: dict[int, asyncio.Future] = {}
        self.broken: str | None = None
        self.reader_task: asyncio.Task | None = None

    async def read_loop(self, reader):
        try:
            while True:
                header, payload = await read_message(reader)
                self.engine.reported_patches = header.get("queued_patches", 0)
                fut = self.pending.pop(header["id"], None)
                if fut is not None:
                    if not fut.done():
                        fut.set_result((header, payload))
                elif self.held:  # the last word on a request given up on: the engine no longer writes its region
                    held = self.held.pop(header["id"], None)
                    if held is not None:
                        self.arena.release(held)
                if self.on_batch is not None and header.get("batches"):
                    # metrics after the request this reply wakes, which then runs up to writing its response
                    asyncio.get_running_loop().call_soon(self._observe, header["batches"])
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            self.broken = f"the engine process closed the connection ({type(e).__name__})"
        finally:
            self.broken = self.broken or "the engine connection was closed"
            err = errors.EngineUnavailable(f"the engine process went away with this request: {self.broken}",
                                           retry_after=2.0)
            for fut in self.pending.values():
                if not fut.done():
                    fut.set_exception(err)
            self.pending.clear()

    def _observe(self, batches) -> None:
        for stats in batches:
            self.on_batch(BatchStats(*stats))

    def send(self, header: dict, buffers=()) -> asyncio.Future:
        if self.broken is None and self.writer.is_closing():  # the engine died; this link's reader has not seen it
            self.broken = "the engine connection was closed"
        if self.broken is not None:
            raise errors.EngineUnavailable(f"engine unavailable: {self.broken}", retry_after=2.0)
        fut = asyncio.get_running_loop().create_future()
        try:
            write_message(self.writer, header, buffers)
        except (RuntimeError, ConnectionError, OSError) as e:  # uvloop: "the handler is closed"
            self.broken = self.broken or f"the engine connection failed ({type(e).__name__})"
            raise errors.EngineUnavailable(f"engine unavailable: {self.broken}", retry_after=2.0) from None
        self.pending[header["id"]] = fut
        return fut

    async def drain(self):
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as e:
            self.broken = self.broken or f"the engine connection failed ({type(e).__name__})"
            raise errors.EngineUnavailable(f"engine unavailable: {self.broken}", retry_after=2.0) from None

    def cancel(self, rid: int) -> None:
        if self.broken is None:
            with contextlib.suppress(Exception):
                write_message(self.writer, {"op": "cancel", "id": rid})

    def forget(self, rid: int, fut: asyncio.Future) -> None:
        """Drop a reply no longer awaited; an error it already holds counts as retrieved."""
        self.pending.pop(rid, None)
        if fut.done() and not fut.cancelled():
            fut.exception()

    def close(self) -> None:
        self.writer.close()
        if self.reader_task is not None:
            self.reader_task.cancel()


class EnginePool:
    """The `api.Engine` of a front-end process: the engine processes (one per device, `Wiring.engine_sockets`),
    each connected whenever it listens, again after every restart. Decoding and resizing run here, in threads
    (videos in the sandbox); each request then goes, whole, to the live engine with the fewest patches ahead of it
    (`RemoteEngine.load`). While none is connected the pool is not alive: the API answers 503 (the supervisors in
    the main process restart the engines)."""

    def __init__(self, engines: list[RemoteEngine], decoder: Decoder, *, on_change: ChangeListener | None = None,
                 started_marker: str | None = None, board: LoadBoard | None = None):
        """`started_marker`: the file the server writes once every engine has been up (`started`); `board`: the
        front-ends' shared account of the work outstanding at each engine, by which requests are routed."""
        self.engines = engines
        self.board = board
        for i, e in enumerate(engines):
            e.board, e.index = board, i
        self.on_change = on_change
        self._started_marker = started_marker
        self._ever_up: set[RemoteEngine] = set()  # the engines this front-end has been connected to
        # the engines found not listening once start-up was over (restarting): a front-end started since need not
        # wait for them
        self._missed: set[RemoteEngine] = set()
        self._decode = decoder
        self._links: list[asyncio.Task] = []
        self.latency = LatencyPolicy()

    @classmethod
    def of(cls, sockets: list[str], devices: list[str], decoder: Decoder, *, shared_memory_bytes: int = 0,
           on_batch: BatchListener | None = None, on_change: ChangeListener | None = None,
           started_marker: str | None = None) -> "EnginePool":
        """A pool of the engine processes listening at `sockets`, one per device in `devices`."""
        def reporter(device: str):
            return (lambda stats: on_batch(device, stats)) if on_batch is not None else None

        engines = [RemoteEngine(path, on_batch=reporter(device), device=device, shared_memory_bytes=shared_memory_bytes)
                   for path, device in zip(sockets, devices)]
        board = LoadBoard.open(load_board_path(sockets[0]), len(engines)) if len(engines) > 1 else None
        return cls(engines, decoder, on_change=on_change, started_marker=started_marker, board=board)

    @property
    def alive(self) -> bool:
        return any(e.alive for e in self.engines)

    @property
    def started(self) -> bool:
        """Whether start-up is over for this front-end: it has been connected to every engine (a pod is not ready at
        a fraction of its capacity). A front-end started after the server's start-up (`started_marker`: every engine
        has been up) needs only to have tried each one: connected, or found it not listening (restarting). After
        that, any one live engine serves (`alive`) while the others restart."""
        return len(self._ever_up | self._missed) == len(self.engines)  # (`_missed` fills only after start-up)

    @property
    def capacity(self) -> tuple[int, int]:
        """(engines up, engines configured)."""
        return sum(e.alive for e in self.engines), len(self.engines)

    @property
    def state(self) -> str:
        if self.alive:
            return "up"
        return "restarting" if self.model is not None else "starting"

    @property
    def model(self) -> ModelInfo | None:
        return next((e.model for e in self.engines if e.model is not None), None)

    async def start(self) -> None:
        """Follow each engine process in the background; returns at once."""
        self._links = [asyncio.create_task(self._follow(e), name=f"engine-link-{e.device}") for e in self.engines]

    async def _follow(self, engine: RemoteEngine) -> None:
        """Connect to an engine process whenever it listens, and report each connection and its loss."""
        while True:
            try:
                await engine.connect()
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, errors.EncoderError):
                if (engine not in self._missed and self._started_marker is not None
                        and os.path.exists(self._started_marker)):
                    self._missed.add(engine)  # restarting after start-up: `started` need not wait for it
                    self._tried(engine, False)
                await asyncio.sleep(0.1)  # not listening yet (loading, warming up or restarting)
                continue
            log.info("engine on %s connected (process %s)", engine.device, engine.info.get("pid"))
            self._ever_up.add(engine)
            self._tried(engine, True)
            why = await engine.disconnected()
            log.warning("lost the engine process on %s (%s); %s", engine.device, why,
                        "the other engines serve" if self.alive else "answering 503 until it is back")
            if self.on_change is not None:
                self.on_change(engine.device, False)

    def _tried(self, engine: RemoteEngine, up: bool) -> None:
        """`engine` connected (`up`) or was found restarting: once every engine has been tried, the video sandbox
        starts (`Decoder.prepare`); the listener hears of it."""
        if self.started:
            self._decode.prepare()
        if self.on_change is not None:
            self.on_change(engine.device, up)

    def _least_loaded(self) -> RemoteEngine | None:
        """The live engine with the fewest patches ahead of a new request (where it goes), or None: outstanding from
        every front-end where they share a `LoadBoard`, else as this front-end sees it."""
        live = [e for e in self.engines if e.alive]
        if self.board is None or len(live) < 2:
            return min(live, key=lambda e: e.load, default=None)
        loads = self.board.loads()
        return min(live, key=lambda e: loads[e.index])

    async def preprocess(self, inputs: list[bytes], min_pixels: int | None = None, max_pixels: int | None = None,
                         fps: float | None = None, num_frames: int | None = None) -> list[Preprocessed]:
        """Decode and resize in the pool's threads (videos in the sandbox); a lone request's single small JPEG on
        the event loop, the engine it will go to told to expect it (`latency.LatencyPolicy`, 1.)."""
        pre = self.model.preprocessor  # the engines' description carries the server's limits
        args = (min_pixels, max_pixels, fps, num_frames)
        with self.latency.busy():
            inline = self.latency.decode_inline(pre, inputs, min_pixels, max_pixels)
            if inline and (engine := self._least_loaded()) is not None:
                engine.expect()  # the engine `submit` will pick wakes while this decodes
            return await self._decode.all(pre, inputs, *args, inline=inline)

    async def submit(self, items: list[Preprocessed], deadline: float, **kwargs) -> Encoded:
        engine = self._least_loaded()
        if engine is None:
            raise errors.EngineUnavailable("no engine process is running (restarting)", retry_after=2.0)
        with self.latency.busy():
            return await engine.submit(items, deadline, poll=self.latency.reply_poll(), **kwargs)

    async def stats(self) -> EngineStats:
        per = []
        for e in self.engines:
            entry = DeviceStats(e.device, state="down", restarts=e.info.get("restarts", 0))
            if e.alive:
                with contextlib.suppress(errors.EngineUnavailable):
                    entry = await e.stats()
            per.append(entry)
        return EngineStats(per)

    async def stop(self) -> None:
        for task in self._links:
            task.cancel()
        for e in self.engines:
            await e.stop()
        self._decode.close()
