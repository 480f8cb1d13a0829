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

    from .api import create_app

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        for err in e.errors():
            log.error("invalid setting %s: %s (flag --%s or env QWEN3VL_%s)", ".".join(map(str, err["loc"])),
                      err["msg"], str(err["loc"][0]).replace("_", "-"), str(err["loc"][0]).upper())
        return 2
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
