"""A real uvicorn server on loopback, in a background thread, for the API tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import uvicorn

from service.http.app import create_app
from service.settings import Settings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(encoder=None, on_ready=None, **settings):
    port = free_port()
    cfg = Settings(**{"model": "random:tiny", "device": "cpu", "port": port, "host": "127.0.0.1", **settings})
    app = create_app(cfg, encoder=encoder)
    app.state.service.on_ready = on_ready
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


class KeepAliveClient:
    """One load-test client on a shared keep-alive connection pool, as locust's and httpx's clients run: it posts the
    images in turn (its own offset into them) and knows whether each request goes out on a fresh connection (the
    first, or after a `Connection: close` answer or a transport error), which is what a drained server may refuse."""

    def __init__(self, client, url: str, images: list[bytes], offset: int):
        self.client, self.url, self.images, self.sent = client, url, images, offset
        self.fresh = True

    async def post(self):
        """One request: (start, end, status code or the transport error, the answer's Connection header, fresh)."""
        import httpx

        start, fresh = time.monotonic(), self.fresh
        image = self.images[self.sent % len(self.images)]
        self.sent += 1
        try:
            r = await self.client.post(f"{self.url}/embed", content=image,
                                       params={"embeddings": "false", "pooling": "mean"},
                                       headers={"content-type": "image/png"})
        except httpx.TransportError as e:
            self.fresh = True
            return start, time.monotonic(), e, None, fresh
        self.fresh = r.headers.get("connection") == "close"
        return start, time.monotonic(), r.status_code, r.headers.get("connection"), fresh
