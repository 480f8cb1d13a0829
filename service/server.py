"""`qwen3vl-encoder serve`: settings from flags and environment, then uvicorn.

On SIGTERM uvicorn stops accepting connections and waits (up to `graceful_shutdown_s`) for requests
in flight; the app's shutdown then drains the engine, so no accepted request is lost. Exit code 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys

from pydantic import ValidationError

from .errors import CheckpointError
from .settings import Settings

log = logging.getLogger(__name__)


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the captured signal after its graceful shutdown, so the process would
            # die "by SIGTERM"; a drained, clean shutdown exits 0 instead
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def settings_from_args(args) -> Settings:
    overrides = {k: v for k, v in vars(args).items()
                 if k in ("model", "host", "port", "device", "dtype") and v is not None}
    return Settings(**overrides)


def run(args) -> int:
    import uvicorn

    from .http.app import create_app

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        for err in e.errors():
            log.error("invalid setting %s: %s (flag --%s or env QWEN3VL_%s)", ".".join(map(str, err["loc"])),
                      err["msg"], str(err["loc"][0]).replace("_", "-"), str(err["loc"][0]).upper())
        return 2
    if settings.resolved_http_workers():
        return run_with_engine_process(settings)
    # The forward thread dispatches hundreds of CUDA ops per batch; with the default 5 ms switch
    # interval it queues behind the event loop for the GIL at every hand-off.
    sys.setswitchinterval(0.0005)
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.graceful_shutdown_s, access_log=False)
    server = _server_class()(config)
    try:
        server.run()
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    return 0 if server.started else 1  # not started: the lifespan (model load) failed and was logged


def run_with_engine_process(settings: Settings) -> int:
    """`http_workers` >= 1: spawn the engine process, wait until its model is loaded and warm, then run
    the uvicorn supervisor over `http_workers` front-end processes (service.engine.process). SIGTERM/SIGINT: the
    supervisor drains and stops the front-ends, then the engine finishes its queue and exits; 0 when
    all of that went cleanly. If the engine dies, the front-ends are stopped and the exit code is 1."""
    import contextlib
    import multiprocessing
    import os
    import tempfile
    import threading

    import uvicorn
    from uvicorn.supervisors import Multiprocess

    from .engine.process import engine_process_main
    from .engine.protocol import settings_env

    workdir = tempfile.mkdtemp(prefix="qwen3vl-")
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:  # a directory given by the operator: last run's files would be merged in
        for name in os.listdir(metrics_dir):
            if name.endswith(".db"):
                os.unlink(os.path.join(metrics_dir, name))
    else:
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(workdir, "metrics")
        os.makedirs(metrics_dir)
    settings = settings.model_copy(update={"engine_socket": os.path.join(workdir, "engine.sock"),
                                           "http_workers": settings.resolved_http_workers(),
                                           "cuda_graphs": settings.resolved_cuda_graphs()})
    env = {**settings_env(settings), "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    os.environ.update(env)  # the spawned front-ends rebuild their Settings from it

    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    engine = ctx.Process(target=engine_process_main, args=(child_conn, env), name="qwen3vl-engine")
    engine.start()
    child_conn.close()
    try:
        status, message = conn.recv()
    except EOFError:  # the engine exited before reporting
        engine.join()
        status, message = "error", f"the engine process exited with code {engine.exitcode}"
    if status != "ready":
        log.error("%s", message)
        engine.join(10)
        return 2

    config = uvicorn.Config("service.http.app:frontend_app", factory=True, host=settings.host, port=settings.port,
                            workers=settings.resolved_http_workers(), log_level="info", access_log=False,
                            timeout_graceful_shutdown=settings.graceful_shutdown_s)
    supervisor = Multiprocess(config, sockets=[config.bind_socket()])
    engine_died = threading.Event()
    engine_exited = threading.Event()
    stopping = threading.Event()

    def watch_engine():
        # The only thread that joins the engine: two threads reaping one child race in waitpid, and
        # the loser sees a live process that has in fact exited.
        engine.join()
        if not stopping.is_set():
            engine_died.set()
            log.error("the engine process exited (code %s); stopping the front-ends", engine.exitcode)
            supervisor.should_exit.set()
        engine_exited.set()

    threading.Thread(target=watch_engine, name="engine-watch", daemon=True).start()
    supervisor.run()  # returns once every front-end has drained and exited
    stopping.set()
    if not engine_died.is_set():
        with contextlib.suppress(OSError):
            conn.send("stop")
        if not engine_exited.wait(settings.graceful_shutdown_s + 30):
            log.error("the engine process did not stop in time; killing it")
            engine.kill()
            engine_exited.wait()
            return 1
    return 1 if engine_died.is_set() else (0 if engine.exitcode == 0 else 1)
