"""A real uvicorn server on loopback, in a background thread, for the API tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from service.api import create_app
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(encoder=None, **settings):
    port = free_port()
    cfg = Settings(**{"model": "random:tiny", "device": "cpu", "port": port, "host": "127.0.0.1", **settings})
    app = create_app(cfg, encoder=encoder)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 60
    while not server.started:
        if time.time() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(30)
