"""Decoding where a crash costs one input: each call runs in a child process with CPU-time and memory limits.

FFmpeg (through PyAV) decodes untrusted video containers in native code; a segfault, a runaway loop or a huge
allocation there would otherwise take down the process serving every other request. The children fork from a
forkserver that has already imported the decoders, torch and this module, so a call costs a fork (milliseconds) next
to a video decode (tens to hundreds of milliseconds) and reads no module from disk. The forkserver is started by
`prepare()`, in the background, once the server is ready: not by the first video (importing torch there takes seconds
of CPU, which each front-end would otherwise spend at once under load when the first videos arrive), and not while the
engines start (every front-end's forkserver importing torch beside them slows their own imports). What the child
returns is pickled back through a pipe.

Outcomes, each a typed `InvalidInput` naming the problem (the API answers 422 or 413):
- the child is killed by a signal (SIGSEGV, SIGABRT, the kernel's OOM killer): `UnsupportedVideo`;
- it used more CPU time than `cpu_s` (SIGXCPU from RLIMIT_CPU) or ran past `wall_s`: `UnsupportedVideo`;
- it asked for more memory than `memory_bytes` (RLIMIT_DATA; MemoryError in Python): `ImageTooLarge`.
A child that cannot be started, or dies before it runs the decoder (the forkserver gone, its target not importable, no
processes left), is the server's fault, not the input's: `Unavailable` (503 with Retry-After).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import resource
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ImageTooLarge, InvalidInput, Unavailable, UnsupportedVideo
from ..model.preprocess import Preprocessed, Preprocessor, decode_in_worker_config

if TYPE_CHECKING:
    from ..settings import Settings

PRELOAD = ["numpy", "PIL.Image", "av", "torch", "service.model.preprocess", __name__]


def _child(conn, fn: Callable, args: tuple, cpu_s: float, memory_bytes: int) -> None:
    cpu = max(1, int(cpu_s))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 5))
    resource.setrlimit(resource.RLIMIT_DATA, (memory_bytes, memory_bytes))
    try:
        result: tuple[bool, Any] = (True, fn(*args))
    except MemoryError:
        result = (False, ImageTooLarge(f"decoding needs more than {memory_bytes >> 20} MiB of memory"))
    except InvalidInput as e:
        result = (False, e)
    except Exception as e:  # noqa: BLE001 - any decoder failure is this input's problem
        result = (False, UnsupportedVideo(f"could not decode: {type(e).__name__}: {e}"))
    conn.send(result)
    conn.close()


class DecodeSandbox:
    """`await run(fn, *args)`: `fn(*args)` in a fresh child process, at most `concurrency` at a time. `fn` must be
    importable by reference (a module-level function)."""

    def __init__(self, concurrency: int = 4, cpu_s: float = 60.0, memory_bytes: int = 4 << 30,
                 wall_s: float | None = None):
        self.cpu_s, self.memory_bytes = cpu_s, memory_bytes
        self.wall_s = wall_s if wall_s is not None else 2 * cpu_s + 10
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD)
        self._threads = ThreadPoolExecutor(concurrency, thread_name_prefix="sandbox")
        self._prepared = False

    def prepare(self) -> None:
        """Start the forkserver in the background (once; a call before it is up waits for it, under the forkserver
        module's lock, and a call without it starts it)."""
        if not self._prepared:
            self._prepared = True
            self._threads.submit(multiprocessing.forkserver.ensure_running)

    async def preprocess(self, preprocessor: Preprocessor, data: bytes, *args) -> Preprocessed:
        """`preprocessor(data, *args)` in a child process: only its uint8 frames, grid and metadata come back."""
        frames, grid, meta = await self.run(decode_in_worker_config, preprocessor.config, data, *args)
        return preprocessor.item(frames, grid, meta)

    async def run(self, fn: Callable, *args):
        ok, value = await asyncio.get_running_loop().run_in_executor(self._threads, self._call, fn, args)
        if ok:
            return value
        raise value

    def _call(self, fn: Callable, args: tuple) -> tuple[bool, Any]:
        for attempt in range(3):
            if attempt:  # a forkserver killed just now still looks alive to the next start for a moment
                time.sleep(0.1 * attempt)
            recv, send = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=_child, args=(send, fn, args, self.cpu_s, self.memory_bytes), daemon=True)
            try:
                proc.start()
                break
            # the forkserver died (EOFError reading the new child's pid; the next start replaces it), the child died
            # reading its arguments (BrokenPipeError), or no process could be made: the input never ran, so again
            # (twice at most)
            except (OSError, EOFError) as e:
                recv.close()
                send.close()
                if attempt == 2:
                    return False, Unavailable(f"the video decoder could not be started ({type(e).__name__}: {e})")
        send.close()
        try:
            ready = multiprocessing.connection.wait([recv, proc.sentinel], self.wall_s)
            if recv in ready:
                try:
                    return recv.recv()
                except EOFError:  # died before answering
                    pass
            if not ready:
                proc.kill()
                proc.join()
                return False, UnsupportedVideo(f"decoding took more than {self.wall_s:g} s")
            proc.join()
            return False, self._death(proc.exitcode)
        finally:
            recv.close()
            if proc.is_alive():
                proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def _death(self, code: int | None) -> InvalidInput | Unavailable:
        if code is not None and code < 0:
            sig = signal.Signals(-code)
            if sig == signal.SIGXCPU:
                return UnsupportedVideo(f"decoding used more than {self.cpu_s:g} s of CPU time")
            if sig == signal.SIGKILL:
                return ImageTooLarge("the decoder was killed (out of memory, or past its limits)")
            return UnsupportedVideo(f"the decoder crashed on this input ({sig.name})")
        # `_child` answers for every exception of the decoder; a process that exits with a code of its own and no
        # answer failed before it ran (its target could not be unpickled or imported): not this input's fault
        return Unavailable(f"the video decoder process failed before decoding (exit code {code})")

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


def video_sandbox(settings: Settings) -> DecodeSandbox | None:
    """Where videos are decoded: a sandbox process per video (`Settings.video_sandbox`), else None (threads)."""
    if not settings.video_sandbox:
        return None
    return DecodeSandbox(settings.preprocess_workers, cpu_s=settings.video_decode_cpu_s,
                         memory_bytes=settings.video_decode_memory_mib << 20)
