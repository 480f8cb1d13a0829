"""The engine process (`Settings.http_workers` >= 1): one process owns the model and the batching engine, and
serves it over a Unix socket to the HTTP front-end processes (`remote.RemoteEngine`; wire format in
`protocol.py`).

HTTP handling and CUDA dispatch then stop sharing one interpreter lock, and the engine still packs the images of
every front-end into one forward. The engine process holds no metrics registry: the stats of each forward ride
back to a front-end on its next reply, and the front-ends read queue depth and device memory with `stats`.

Lifecycle (`supervisor.EngineSupervisor`, in the main process): the main process spawns this process, which loads
and warms up the model, then listens; the front-ends connect whenever it does. If it dies it is started again. On
SIGTERM the front-ends drain their requests first; then the engine is told to stop, finishes whatever is still
queued, and exits. The engine ignores SIGINT/SIGTERM itself, so a Ctrl-C
that reaches the whole process group cannot stop it under the front-ends' in-flight requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict

import numpy as np

from .. import errors
from .api import BatchStats
from ..model.encoder import bind_thread
from .local import LocalEngine
from .protocol import error_header, raw_bytes, read_message, write_message, write_tensors
from .shm import attach, page_lock, page_unlock
from .latency import EXPECT_S, LatencyPolicy
from .wiring import Wiring
from ..runtime import configure_process, settle_process

log = logging.getLogger(__name__)


# threads that copy results into the front-ends' arenas (numpy's copy lets go of the interpreter lock), so that the
# event loop reads submissions and launches the next pack meanwhile; only a lone pack's small result is copied on
# the loop (`LatencyPolicy.copy_inline`)
RESULT_COPIERS = 2


def _page_lock(arena, device) -> int | None:
    """`shm.page_lock`, on the page-lock thread: a failure leaves the arena pageable (its frames staged), logged."""
    try:
        return page_lock(arena, device)
    except Exception as e:  # a driver or runtime refusal must not end the front-end's connection
        log.warning("could not page-lock a front-end's frame arena (%s: %s); its frames are staged through pinned "
                    "memory", type(e).__name__, e)
        return None


class EngineServer:
    """Serves a `LocalEngine` to front-end processes over a Unix socket, once it has started."""

    def __init__(self, engine: LocalEngine, restarts: int = 0):
        self.engine = engine
        self.restarts = restarts
        self._batches: list[tuple] = []  # stats of forwards not yet reported to a front-end
        self._expected_until = 0.0  # `expect`: turn the loop over until then, or until a submit arrives
        self._spinner: asyncio.Task | None = None
        self._copiers = ThreadPoolExecutor(RESULT_COPIERS, thread_name_prefix="results")
        # page-locks the front-ends' arenas, one after another, off the event loop: registering 256 MiB with the
        # driver takes tens of milliseconds, and every front-end connects at once (at start-up, and after a restart)
        self._pinner = ThreadPoolExecutor(1, thread_name_prefix="page-lock")

    def expect(self) -> None:
        """A front-end is decoding a lone request. An idle engine keeps its event loop turning (each turn polls the
        socket) until the submit arrives, at most EXPECT_S: asleep, it would wake to the submit on an idle core and
        read and dispatch it several times slower. A busy engine ignores it: its loop
        is awake already, and a spinning loop would take the interpreter lock from the forward thread."""
        if self.engine.batcher.queue_depth or self.engine.batcher.in_flight:
            return
        self._expected_until = time.perf_counter() + EXPECT_S
        if self._spinner is None or self._spinner.done():
            self._spinner = asyncio.create_task(self._spin())

    async def _spin(self):
        while time.perf_counter() < self._expected_until:
            await asyncio.sleep(0)

    def on_batch(self, device: str, stats: BatchStats) -> None:
        self._batches.append((stats.items, stats.patches, stats.forward_s, stats.ok))

    async def serve(self, path: str):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return await asyncio.start_unix_server(self._connection, path=path, limit=2**22)

    def _reply(self, writer, header: dict, buffers=()) -> None:
        header["queued_patches"] = self.engine.batcher.queued_patches  # for the front-ends' choice between engines
        if self._batches:
            header["batches"], self._batches = self._batches, []
        write_message(writer, header, buffers)

    async def _connection(self, reader, writer):
        gone: set[int] = set()  # request ids cancelled by the front-end
        closed = False
        tasks: set[asyncio.Task] = set()
        arena = None  # the front-end's arena (`shm`): frames in, results out
        locking = None  # the page-lock of the arena for the GPU: its address when done (None if refused)
        device = self.engine.model.device

        def abandoned_fn(rid):
            return lambda: closed or rid in gone

        try:
            while True:
                header, payload = await read_message(reader)
                op = header["op"]
                if op == "submit":
                    self._expected_until = 0.0  # it came: the batcher takes over
                    # frames in the arena once its page-lock is in place go to the GPU where they lie; before,
                    # they are staged through pinned memory
                    pinned = (locking is not None and locking.done() and not locking.cancelled()
                              and locking.result() is not None)
                    task = asyncio.create_task(self._submit(header, payload, writer, abandoned_fn(header["id"]),
                                                            arena, pinned))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                elif op == "cancel":
                    gone.add(header["id"])
                elif op == "expect":
                    self.expect()
                    continue  # nothing was written: no drain
                elif op == "hello":
                    if header.get("arena"):
                        try:
                            arena = attach(header["arena"])
                        except (OSError, ValueError) as e:
                            log.warning("cannot map the front-end's frame arena (%s); frames come over the socket", e)
                        else:
                            # the hello is answered at once: frames that come before the lock is in place are
                            # staged through pinned memory
                            if device.type == "cuda":
                                locking = asyncio.get_running_loop().run_in_executor(
                                    self._pinner, _page_lock, arena, device)
                    info = {**self.engine.model.wire(), "pid": os.getpid(), "restarts": self.restarts}
                    self._reply(writer, {"op": "hello", "id": header["id"], "info": info, "arena": arena is not None})
                elif op == "stats":
                    stats = asdict(self.engine.batcher.stats())
                    self._reply(writer, {"op": "stats", "id": header["id"], "stats": stats})
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the front-end went away: whatever it still had queued is dropped before compute
        finally:
            closed = True
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            if locking is not None:
                locked = await locking
                if locked is not None:
                    page_unlock(locked, device)
            writer.close()

    async def _submit(self, header, payload, writer, abandoned, arena=None, pinned=False):
        rid = header["id"]
        items, offset = [], 0
        pre = self.engine.model.preprocessor
        for shape, grid, meta, at in header["items"]:
            n = math.prod(shape)
            if at is None:  # in the message
                frames = np.frombuffer(payload, np.uint8, n, offset)
                offset += n
            else:  # in the front-end's arena
                frames = np.frombuffer(arena, np.uint8, n, at)
            items.append(pre.item(frames.reshape(shape), tuple(grid), meta, pinned=pinned and at is not None))
        try:
            done = await self.engine.submit(items, time.monotonic() + header["timeout_s"], abandoned=abandoned,
                                            deepstack=header["deepstack"], tokens=header["tokens"],
                                            client=header.get("client", ""))
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise
            # the batcher dropped its items (the front-end gave up on it): a last word, which frees its region
            reply, buffers = {"op": "dropped", "id": rid}, []
        except Exception as e:  # noqa: BLE001 - every failure goes back to the front-end as a typed error
            reply, buffers = error_header(rid, e), []
        else:
            sent = [(r.embeds, r.deepstack, r.pooled) for r in done.results]  # what it asked for (`Batcher.submit`)
            reply = {"op": "result", "id": rid, "timing": (done.timing.queue_s, done.timing.inference_s),
                     "results": [(r.grid_thw, r.num_tokens, str(e.dtype).removeprefix("torch."), tuple(e.shape),
                                  tuple(d.shape), tuple(p.shape)) for r, (e, d, p) in zip(done.results, sent)]}
            tensors = [t for ts in sent for t in ts]
            out = header.get("out")  # (offset, bytes): the region the front-end reserved in its arena for them
            written = False
            if out is not None and arena is not None and not abandoned():
                if LatencyPolicy.copy_inline(sum(t.nbytes for t in tensors), done.timing.pack_items):
                    written = write_tensors(arena, *out, tensors)
                else:
                    written = await asyncio.get_running_loop().run_in_executor(self._copiers, write_tensors, arena,
                                                                               *out, tensors)
            if written:
                reply["in_arena"], buffers = True, []
            else:
                buffers = [raw_bytes(t) for t in tensors]
        if abandoned() and reply["op"] == "result":  # computed, but no one waits for it: nothing was written
            reply, buffers = {"op": "dropped", "id": rid}, []
        with contextlib.suppress(ConnectionError, RuntimeError):
            self._reply(writer, reply, buffers)
            await writer.drain()


FAULT_EXIT_CODE = 70  # the exit code after a device fault (the supervisor restarts the process)


def engine_process_main(conn, settings_env: dict[str, str], imported_s: float | None = None) -> int:
    """Entry point of the engine process (spawned by `supervisor.EngineSupervisor`). It starts as a standby, with
    its modules imported, until `conn` says ("go", restarts); then it loads and warms the model, serves the socket,
    reports ("ready", None) or ("error", message) on `conn`, and stops when `conn` says so or closes (the parent is
    gone). `restarts`: how many engine processes died before this one (for /info); `imported_s`: how long its modules
    took to import (logged with the time binding its device took: what a start spends before loading)."""
    os.environ.update(settings_env)
    # every GPU engine sees its GPU as cuda:0: its lines name the GPU as the server's CUDA_VISIBLE_DEVICES does
    gpu = settings_env.get("CUDA_VISIBLE_DEVICES")
    role = f"engine GPU {gpu}" if gpu else "engine"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s %(name)s[{role}]: %(message)s")
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the main process decides when the engine stops
    from ..settings import Settings

    try:
        message = conn.recv()
    except (EOFError, OSError):
        return 0
    if not (isinstance(message, tuple) and message[0] == "go"):
        return 0
    restarts = message[1]
    settings = Settings()
    configure_process("engine")
    try:
        began = time.monotonic()
        bind_thread(settings.resolved_device())  # before anything touches CUDA: kernels launch on the current device
        if imported_s is not None and not restarts:
            log.info("engine process: modules imported in %.1f s, device bound in %.1f s", imported_s,
                     time.monotonic() - began)
        return _run(_serve(conn, settings, restarts))
    except errors.CheckpointError as e:  # the same on every try: the supervisor does not retry it
        conn.send(("fatal", _one_line(str(e))))
        return 2
    except errors.EncoderError as e:
        conn.send(("error", _one_line(str(e))))
        return 2
    except Exception as e:  # noqa: BLE001 - reported to the parent, which retries it, then exits non-zero
        log.exception("engine process failed")
        conn.send(("error", _one_line(f"{type(e).__name__}: {e}")))
        return 1


def _one_line(message: str) -> str:
    return " ".join(message.split())


def _run(coro):
    """`asyncio.run` on uvloop where it is installed (uvicorn[standard] brings it), as the front-ends run."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def _serve(conn, settings, restarts: int) -> int:
    loop = asyncio.get_running_loop()

    def on_fault(e: BaseException):
        # the CUDA context is unusable: answer what can be answered, then exit for the supervisor to restart us
        log.critical("exiting after a device fault (%s); the server starts a new engine process", e)
        loop.call_later(0.2, os._exit, FAULT_EXIT_CODE)

    engine = LocalEngine(settings, on_fault=on_fault, decodes_videos=False)  # the front-ends decode
    server = EngineServer(engine, restarts)
    engine.on_batch = server.on_batch
    await engine.start()
    settle_process()  # before the front-ends can reach it
    socket_path = Wiring.from_env().engine_sockets[0]  # the one `serve` gave this engine
    listener = await server.serve(socket_path)
    model = engine.model
    log.info("engine ready: %s on %s (%s), attention backend %s; socket %s", settings.model, model.device,
             model.dtype, model.backend, socket_path)
    conn.send(("ready", None))
    with contextlib.suppress(EOFError, OSError):
        await loop.run_in_executor(None, conn.recv)  # "stop", or EOF when the parent is gone
    log.info("engine stopping: finishing queued work")
    listener.close()
    await engine.stop()
    return 0
