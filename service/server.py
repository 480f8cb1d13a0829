"""`qwen3vl-encoder serve`: settings from flags and environment, then uvicorn.

On SIGTERM uvicorn stops accepting connections and waits (up to `graceful_shutdown_s`) for requests
in flight; the app's shutdown then drains the engine, so no accepted request is lost. Exit code 0.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError

from .errors import CheckpointError
from .settings import Settings

log = logging.getLogger(__name__)


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
    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.graceful_shutdown_s, access_log=False)
    server = uvicorn.Server(config)
    try:
        server.run()
    except CheckpointError as e:
        log.error("%s", e)
        return 2
    return 0 if server.started or not server.should_exit else 1
