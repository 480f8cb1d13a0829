"""A real uvicorn server on loopback, in a background thread, for the API tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from service.http.app import create_app
from service.settings import Settings


def wait_until_ready(url: str, server, timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll `url`/ready until it answers 200 (True), or the deadline passes or the server process `server` (a
    Popen) exits (False)."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.time() > deadline or server.poll() is not None:
            return False
        time.sleep(interval_s)


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
