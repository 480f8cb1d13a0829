"""`qwen3vl-encoder serve`: settings from flags and environment, then uvicorn.

On SIGTERM the server first drains for `drain_s`: it serves on, /ready answers 503 and every response carries
`Connection: close`, so clients leave their keep-alive connections (a request sent on an idle one just as the server
closed it would fail). Then uvicorn stops accepting connections and waits (up to `graceful_shutdown_s`) for requests
in flight; the app's shutdown drains the engine, so no accepted request is lost. Exit code 0.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time

from pydantic import ValidationError

from .errors import CheckpointError
from .model.config import model_tower_config
from .runtime import configure_process, proc_stat, settle_process
from .settings import Settings

log = logging.getLogger(__name__)


def seconds_since_launch() -> float:
    """Seconds since this process started (Linux: /proc), for the start-up's log; NaN elsewhere."""
    fields = proc_stat()
    try:
        ticks = int(fields[19])  # field 22, starttime: clock ticks after boot
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")
    except (TypeError, OSError, ValueError, IndexError):
        return float("nan")


def listening_socket(config, reuse_port: bool = True, listen: bool = True) -> socket.socket:
    """A socket bound to the configured address with SO_REUSEPORT, listening: several of them share the address and
    the kernel spreads new connections over them by a hash of each connection's addresses."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, int(reuse_port))
    sock.bind((config.host, config.port))
    if listen:
        sock.listen(config.backlog)
    sock.set_inheritable(True)
    return sock


def _frontends_class():
    import threading

    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.supervisors.multiprocess import Multiprocess

    from .uvicorn_server import FrontendProcess

    class Frontends(Multiprocess):
        """uvicorn's supervisor of the front-end processes, with a listening socket per process.

        With one shared socket a burst of new connections goes to whichever process wakes first, and it accepts
        every one queued: a few front-ends held nearly all keep-alive connections, ran at a core each and bounded
        throughput at a fraction of the forward. Here slot i's process listens on socket i, all bound to
        the address with SO_REUSEPORT, and the kernel spreads connections over the slots. A slot's socket belongs
        to this process: a front-end restarted in its slot takes over the connections queued while it was down."""

        draining = False  # the drain was signalled to the front-ends
        drain_started = False  # ... and is yet to be timed by the supervisor's loop

        def __init__(self, config):
            super().__init__(config, sockets=[])
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, self._on_signal)
            # another process listening on the port would share it silently through SO_REUSEPORT: refuse instead
            listening_socket(config, reuse_port=False, listen=False).close()
            self.slots = [listening_socket(config) for _ in range(config.workers)]

        def init_processes(self) -> None:
            for sock in self.slots:
                process = FrontendProcess(self.config, [sock])
                process.start()
                self.processes.append(process)

        def keep_subprocess_alive(self) -> None:
            for idx, process in enumerate(self.processes):
                if self.should_exit.is_set() or self.draining:  # a front-end started mid-drain would take requests
                    return
                if process.is_alive(timeout=self.config.timeout_worker_healthcheck):
                    continue
                process.kill()  # hung or dead
                process.join()
                if process.exitcode == STARTUP_FAILURE:  # the app itself cannot start: restarting would loop
                    log.error("front-end process %s failed to start; stopping", process.pid)
                    self.should_exit.set()
                    return
                log.warning("front-end process %s died; starting another in its slot", process.pid)
                self.processes[idx] = FrontendProcess(self.config, [self.slots[idx]])
                self.processes[idx].start()

        def restart_all(self) -> None:  # SIGHUP
            log.warning("SIGHUP: restarting front-end processes is not supported; restart the server")

        def handle_ttin(self) -> None:
            log.warning("SIGTTIN: the number of front-end processes is fixed (QWEN3VL_HTTP_WORKERS)")

        handle_ttou = handle_ttin

        def _on_signal(self, sig, frame) -> None:
            # in the signal handler, not at the supervisor's next half-second tick: /ready turns 503 at once
            if sig in (signal.SIGTERM, signal.SIGINT) and not self.draining and self.config.drain_s > 0:
                self.draining = True
                for process in self.processes:
                    with contextlib.suppress(OSError, TypeError):
                        os.kill(process.pid, signal.SIGUSR1)
                self.drain_started = True
            self.signal_queue.append(sig)

        def handle_term(self) -> None:
            """The first SIGTERM (or SIGINT): the front-ends drain (SIGUSR1, sent by the handler) for `drain_s`,
            then they stop; a second one stops them at once."""
            if self.drain_started:
                self.drain_started = False
                log.info("SIGTERM: draining for %.1f s, then stopping", self.config.drain_s)
                threading.Timer(self.config.drain_s, self.should_exit.set).start()
                return
            self.should_exit.set()

        handle_int = handle_term

        def terminate_all(self) -> None:
            # Close this process's copies of the listening sockets first: once the front-ends close theirs, the
            # kernel refuses new connections instead of queueing them to be reset when this process exits.
            for sock in self.slots:
                sock.close()
            super().terminate_all()

    return Frontends


def limit_connections(config, settings: Settings, balance: tuple[str, int] | None = None) -> None:
    """uvicorn's `config` bounded by the settings' connection limits (`uvicorn_server.LimitedHttpToolsProtocol`);
    `balance`: the front-ends' connection board (`uvicorn_server.ConnectionBoard`: its file, the front-ends)."""
    from .uvicorn_server import ConnectionLimits, LimitedHttpToolsProtocol

    config.http = LimitedHttpToolsProtocol
    config.connection_limits = ConnectionLimits(settings.max_connections, settings.max_header_bytes,
                                                settings.max_headers, settings.header_timeout_s,
                                                settings.body_timeout_s, balance)
    config.timeout_keep_alive = settings.keep_alive_s


def settings_from_args(args) -> Settings:
    """The flags given (`service.cli.add_settings_flags`: one per field), over the environment."""
    return Settings(**{k: v for k, v in vars(args).items() if k in Settings.model_fields})


def run(args) -> int:
    import uvicorn

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        for err in e.errors():
            log.error("invalid setting %s: %s (flag --%s or env QWEN3VL_%s)", ".".join(map(str, err["loc"])),
                      err["msg"], str(err["loc"][0]).replace("_", "-"), str(err["loc"][0]).upper())
        return 2
    try:  # what can be told of the model without torch: a bad --model is one line and exit code 2, at once
        model_tower_config(settings.model)
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    if settings.resolved_http_workers():
        return run_with_engine_process(settings)
    try:  # before the model loads: a port in use is found in a second, not after the warm-up
        listening_socket(settings, reuse_port=False, listen=False).close()
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
        return 1
    from .http.app import create_app  # not before run_with_engine_process: it sets up multiprocess metrics first
    from .model.encoder import bind_thread
    from .uvicorn_server import server_class

    configure_process("local")
    try:  # a device this process cannot use is one line and exit code 2, not a traceback from the app's start-up
        bind_thread(settings.resolved_device())
    except (RuntimeError, ValueError) as e:
        log.error("cannot use the device: %s", " ".join(str(e).split()))
        return 2
    app = create_app(settings)
    app.state.service.on_ready = settle_process
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.graceful_shutdown_s, access_log=False)
    limit_connections(config, settings)
    server = server_class(settings.drain_s, app.state.service.start_draining)(config)
    try:
        server.run()
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    return 0 if server.started else 1  # not started: the lifespan (model load) failed and was logged


def run_with_engine_process(settings: Settings) -> int:
    """`http_workers` >= 1: the uvicorn supervisor over `http_workers` front-end processes, serving at once (/health
    200, /ready 503 until a model is warm), and one `EngineSupervisor` per device, each running an engine process and
    restarting it if it dies (service.engine.supervisor). SIGTERM/SIGINT: the front-ends drain, then the engines
    finish their queues and exit; 0 when all of that went cleanly. When every engine has given up: 2 if the model
    could not be loaded, 3 if the engines crash-looped."""
    import shutil
    import tempfile
    import threading

    import uvicorn

    from .engine.cache import make_cache_dir
    from .engine.supervisor import EngineSupervisor, engine_environment, started_marker
    from .engine.wiring import Wiring

    workdir = tempfile.mkdtemp(prefix="qwen3vl-")
    metrics_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if metrics_dir:  # a directory given by the operator: last run's files would be merged in
        for name in os.listdir(metrics_dir):
            if name.endswith(".db"):
                os.unlink(os.path.join(metrics_dir, name))
    else:
        metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(workdir, "metrics")
        os.makedirs(metrics_dir)
    counting = time.perf_counter()
    devices = settings.resolved_devices()
    counted_s = time.perf_counter() - counting
    try:
        device_envs = [engine_environment(device) for device in devices]
    except ValueError as e:
        log.error("invalid setting devices: %s", e)
        return 2
    sockets = [os.path.join(workdir, f"engine-{i}.sock") for i in range(len(devices))]
    cache_dir = make_cache_dir() if settings.embedding_cache_mib else None  # shared by the front-ends
    settings = settings.for_processes(devices)
    wiring = Wiring(engine_sockets=tuple(sockets), cache_dir=cache_dir)  # the front-ends': every engine
    env = {**settings.as_env(), **wiring.to_env(), "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    os.environ.update(env)  # the spawned front-ends rebuild their Settings from it

    # after PROMETHEUS_MULTIPROC_DIR is set: the counter is written where the front-ends' /metrics reads
    from prometheus_client import CollectorRegistry, Counter

    restarts = Counter("qwen3vl_engine_restarts", "engine processes started after one died", ["device"],
                       registry=CollectorRegistry())
    config = uvicorn.Config("service.http.app:frontend_app", factory=True, host=settings.host, port=settings.port,
                            workers=settings.resolved_http_workers(), log_level="info", access_log=False,
                            timeout_graceful_shutdown=settings.graceful_shutdown_s)
    config.drain_s = settings.drain_s
    limit_connections(config, settings, (os.path.join(workdir, "frontend-connections"), config.workers)
                      if config.workers > 1 else None)
    try:
        frontends = _frontends_class()(config)
    except OSError as e:
        log.error("cannot listen on %s:%s: %s", settings.host, settings.port, e)
        return 1
    engines: list[EngineSupervisor] = []
    started = threading.Event()  # every engine was ready once: start-up is over

    def gave_up(code: int) -> None:
        # at start-up, any engine that cannot start stops the server: it never serves at a fraction of its capacity
        # unnoticed. Later, one device's engine crash-looping leaves the others serving; the server stops when none
        # is left.
        if not started.is_set() or all(e.exit_code is not None for e in engines):
            frontends.should_exit.set()

    for device, sock, device_env in zip(devices, sockets, device_envs):
        engines.append(EngineSupervisor.of(settings, env, device, device_env, sock,
                                           on_restart=restarts.labels(device).inc, on_give_up=gave_up))
    log.info("engine processes on %s (%.2f s after the server's launch; devices counted in %.2f s)", ", ".join(devices),
             seconds_since_launch(), counted_s)
    for engine in engines:
        engine.start()

    def await_start() -> None:
        for engine in engines:
            while not engine.ready.wait(0.5):
                if frontends.should_exit.is_set() or engine.exit_code is not None:
                    return
        started.set()
        with open(started_marker(sockets[0]), "w"):
            pass  # front-ends started later (a restarted one) read start-up as over
        log.info("all %d engines ready", len(engines))

    threading.Thread(target=await_start, name="start-up", daemon=True).start()
    frontends.run()  # returns on SIGTERM/SIGINT, or when the engines gave up, once the front-ends drained
    codes = [engine.stop(settings.graceful_shutdown_s + 30) for engine in engines]
    if cache_dir:
        shutil.rmtree(cache_dir, ignore_errors=True)
    shutil.rmtree(workdir, ignore_errors=True)
    given_up = [e for e in engines if e.exit_code is not None]
    if given_up and (not started.is_set() or len(given_up) == len(engines)):
        failed = given_up[0]
        log.error("the engine on %s could not %s: %s", failed.name, "start" if not started.is_set() else "keep running",
                  failed.last_error)
        return max(e.exit_code for e in given_up)
    return max(codes)
