"""`EngineSupervisor`: runs the engine process (`process.engine_process_main`) and starts a new one when it dies.

It runs in the server's main process, beside uvicorn's supervisor of the HTTP front-ends, which keep serving
throughout: while no engine listens they answer /ready and the encoding routes with 503 and Retry-After, and they
reconnect by themselves when a new engine listens.

Policy:
- an engine that dies (a signal, the OOM killer, a device fault's exit) is restarted after a backoff that starts at
  `backoff_s` and doubles with each death still inside the crash window, up to `max_backoff_s`;
- more than `max_restarts` deaths within `window_s` is a crash loop: the supervisor gives up (exit code 3) so the
  orchestrator sees a failed container rather than a server that never serves;
- an engine that fails to start (an error in warm-up, a device that will not initialise, a death before it is
  ready) is retried with the same backoff; one that never became ready and exhausts its restarts is a load failure:
  exit code 2, its last error on one line, the same as the single-process server's. Only an error of the checkpoint
  itself (`errors.CheckpointError`: a missing directory, an unknown preset), the same on every try, is not retried;
- `stop()` tells a ready engine to finish its queue and exit; one still starting is killed (it holds no requests).

With `standby`, the next engine process is spawned as soon as the current one is ready and waits with its modules
imported (torch, Triton, the kernels: most of a start's CPU time before the model loads), without touching the GPU;
a restart then only loads and warms the model. It costs one idle process's host memory. An engine that serves at
once (the first, or one restarted without a standby) creates its GPU's context while its modules import.

Only the supervisor's thread waits on the engine process (two threads reaping one child race in waitpid).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from typing import Callable

from .wiring import Wiring


log = logging.getLogger(__name__)

LOAD_ERROR_EXIT = 2
CRASH_LOOP_EXIT = 3


def _engine_main(conn, env: dict[str, str], open_device: bool = False) -> int:
    """The engine process's entry point: `process.engine_process_main`, imported there rather than here, so the main
    process never imports torch (seconds, before any engine could start). `open_device`: create the GPU's context
    while the modules import (`open_device_early`)."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the imports (seconds of torch): the main process stops us
        signal.signal(sig, signal.SIG_IGN)
    began = time.monotonic()
    if open_device:
        open_device_early(env)
    from .process import engine_process_main

    code = engine_process_main(conn, env, imported_s=time.monotonic() - began)
    # out without the interpreter's teardown, as a forked child leaves: everything is flushed and closed, and at
    # teardown Triton's bindings report each of their objects still alive as a leak, dozens of lines per engine
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def open_device_early(env: dict[str, str]) -> threading.Thread | None:
    """Create the CUDA driver's primary context of the engine's GPU on a thread, while the main thread imports torch
    and the kernels: torch finds it made when the engine binds its device. A context takes a fraction of a second,
    more when several GPUs' engines start at once (0.8 s each on four against 0.3 s alone). Only an engine that owns
    its GPU at once calls this: a standby waits for the engine serving there to die before it touches the GPU."""
    device = env.get("QWEN3VL_DEVICE", "")
    if not device.startswith("cuda"):
        return None
    os.environ.update(env)  # CUDA_VISIBLE_DEVICES before the driver reads it
    index = int(device.partition(":")[2] or 0)

    def retain() -> None:
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return  # no driver: binding the device says so, in the engine's own words
        handle, context = ctypes.c_int(), ctypes.c_void_p()
        if driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(handle), index) == 0:
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), handle)  # held for the process's life

    thread = threading.Thread(target=retain, name="cuda-context", daemon=True)
    thread.start()
    return thread


def engine_environment(device: str) -> dict[str, str]:
    """The environment of the engine process on `device` (cuda:N, cuda or cpu). A GPU engine sees its own GPU alone,
    as cuda:0 (CUDA_VISIBLE_DEVICES): no thread of it can create a context or allocate on another engine's GPU, and
    Triton launches where its tensors are. N counts the GPUs this process sees, so an orchestrator's own
    CUDA_VISIBLE_DEVICES (a pod given GPUs 4-7) still applies."""
    if not device.startswith("cuda"):
        return {"QWEN3VL_DEVICE": device}
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None or not visible.strip():
        gpu = str(index)
    else:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
        if index >= len(ids):
            raise ValueError(f"device {device}: CUDA_VISIBLE_DEVICES={visible} makes {len(ids)} GPUs visible")
        gpu = ids[index]
    return {"CUDA_VISIBLE_DEVICES": gpu, "QWEN3VL_DEVICE": "cuda:0"}


def started_marker(socket_path: str) -> str:
    """The file `serve` writes beside the engines' sockets once every engine has been ready (start-up is over)."""
    return os.path.join(os.path.dirname(socket_path), "engines-started")


class EngineSupervisor:
    def __init__(self, env: dict[str, str], *, backoff_s: float = 0.5, max_backoff_s: float = 15.0,
                 max_restarts: int = 5, window_s: float = 600.0, standby: bool = True,
                 on_restart: Callable[[], None] | None = None, on_give_up: Callable[[int], None] | None = None,
                 name: str = "engine", retry_start: bool = True):
        """`env`: the engine's settings as QWEN3VL_* variables; `on_restart()`: called at each restart (a metric);
        `on_give_up(exit_code)`: called once if the supervisor gives up (the server then stops); `retry_start`
        False: an engine that fails before it was ever ready gives up at once, without a log line (the caller says
        why, from `last_error`)."""
        self.env = env
        self.retry_start = retry_start
        self.name = name  # its device, in logs
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.max_restarts, self.window_s = max_restarts, window_s
        self.standby = standby
        self.on_restart, self.on_give_up = on_restart, on_give_up
        self.ready = threading.Event()  # an engine is up and listening
        self.exit_code: int | None = None  # set when the supervisor gave up
        self.last_error: str | None = None  # why, on one line
        self.restarts = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards _proc/_conn between the thread and stop()
        self._proc = None
        self._conn = None
        self._spare: tuple | None = None  # (process, conn) of the standby engine
        self._thread = threading.Thread(target=self._run, name="engine-supervisor", daemon=True)

    @classmethod
    def of(cls, settings, env: dict[str, str], device: str, device_env: dict[str, str], socket: str,
           **kwargs) -> "EngineSupervisor":
        """The supervisor of `device`'s engine, listening at `socket`, with `settings`' restart policy; its
        environment `env` (every engine's variables) with the device's (`engine_environment`) and its socket's."""
        return cls({**env, **device_env, **Wiring(engine_sockets=(socket,)).to_env()},
                   backoff_s=settings.engine_restart_backoff_s, max_restarts=settings.engine_max_restarts,
                   window_s=settings.engine_restart_window_s, standby=settings.engine_standby, name=device, **kwargs)

    def start(self) -> None:
        self._thread.start()

    @property
    def pid(self) -> int | None:
        """The serving engine process's id (None while there is none)."""
        proc = self._proc
        return proc.pid if proc is not None else None

    def stop(self, timeout_s: float) -> int:
        """Stop the engine: a ready one finishes its queue first. 0 if it exited cleanly in time, else 1."""
        self._stopping.set()
        with self._lock:
            proc, conn, ready = self._proc, self._conn, self.ready.is_set()
            if self._spare is not None:
                self._spare[1].close()  # the standby reads EOF and exits
            if proc is not None:
                if ready:
                    try:
                        conn.send("stop")
                    except OSError:
                        pass
                else:
                    proc.kill()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("the engine process did not stop within %.0f s; killing it", timeout_s)
            if proc is not None:
                proc.kill()
            self._thread.join()
            return 1
        if proc is None or not ready:  # none, or one still starting: it held no request
            return 0
        return 0 if proc.exitcode == 0 else 1

    def _spawn(self, open_device: bool = False):
        """An engine process; `open_device`: it serves at once (not a standby), so it may open its GPU while it
        imports."""
        conn, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_engine_main, args=(child, self.env, open_device), name="qwen3vl-engine")
        proc.start()
        child.close()
        return proc, conn

    def _run(self) -> None:
        try:
            self._supervise()
        finally:
            with self._lock:
                spare, self._spare = self._spare, None
            if spare is not None:
                spare[1].close()
                spare[0].join(10)
                if spare[0].is_alive():
                    spare[0].kill()
                    spare[0].join()

    def _supervise(self) -> None:
        deaths: collections.deque[float] = collections.deque()
        ever_ready = False
        while not self._stopping.is_set():
            with self._lock:
                if self._stopping.is_set():
                    return
                proc, conn = self._spare or self._spawn(open_device=True)
                self._spare = None
                self._proc, self._conn = proc, conn
            try:
                conn.send(("go", self.restarts))
            except OSError:
                pass  # a standby that died: counted below
            status, message = self._await_ready(proc, conn)
            if status == "ready":
                ever_ready = True
                self.ready.set()
                log.info("engine process %d on %s ready%s", proc.pid, self.name,
                         f" (restart {self.restarts})" if self.restarts else "")
                if self.standby:
                    with self._lock:
                        if not self._stopping.is_set():
                            self._spare = self._spawn()
                multiprocessing.connection.wait([proc.sentinel])
            proc.join()
            self.ready.clear()
            if self._stopping.is_set():
                return
            how = message if status in ("error", "fatal") else _exit_description(proc.exitcode)
            if not ever_ready and (status == "fatal" or not self.retry_start):
                self.last_error = how
                if self.retry_start:
                    log.error("the engine on %s could not start: %s", self.name, how)
                return self._give_up(LOAD_ERROR_EXIT)
            now = time.monotonic()
            deaths.append(now)
            while deaths and deaths[0] < now - self.window_s:
                deaths.popleft()
            if len(deaths) > self.max_restarts:
                self.last_error = how
                if not ever_ready:
                    log.error("the engine on %s could not start (%d tries): %s", self.name, len(deaths), how)
                    return self._give_up(LOAD_ERROR_EXIT)
                log.error("the engine process on %s died %d times within %.0f s (last: %s); giving up", self.name,
                          len(deaths), self.window_s, how)
                return self._give_up(CRASH_LOOP_EXIT)
            delay = min(self.max_backoff_s, self.backoff_s * 2 ** (len(deaths) - 1))
            self.restarts += 1
            log.error("the engine process %d on %s %s (%s); starting a new one in %.1f s (restart %d)", proc.pid,
                      self.name, "died" if ever_ready else "failed to start", how, delay, self.restarts)
            if self.on_restart is not None:
                self.on_restart()
            self._stopping.wait(delay)

    def _await_ready(self, proc, conn) -> tuple[str, str | None]:
        """("ready", None), ("error", message) or ("fatal", message) as the engine reported it (fatal: the same on
        every try), or ("died", None)."""
        try:
            while not multiprocessing.connection.wait([conn, proc.sentinel], 0.5):
                if self._stopping.is_set():
                    return "died", None
            if conn.poll():
                return conn.recv()
        except (EOFError, OSError):
            pass
        return "died", None

    def _give_up(self, code: int) -> None:
        self.exit_code = code
        if self.on_give_up is not None:
            self.on_give_up(code)


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"
