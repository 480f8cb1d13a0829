"""ASGI middleware: request count and latency by route and status, requests in flight, X-Total-Time-Ms, and
`Connection: close` on every response while the server drains; the API key."""

from __future__ import annotations

import hmac
import json
import time

from .metrics import Metrics

OBSERVED_ROUTES = ("/embed", "/v1/embeddings", "/health", "/ready", "/info")


class ObserveMiddleware:
    """Request count and latency by route and status, in-flight gauge, X-Total-Time-Ms header.

    A plain ASGI middleware: Starlette's BaseHTTPMiddleware spawns task groups per request, which
    showed up as ~15% of the event loop's time under load."""

    def __init__(self, app, metrics: Metrics, closing=lambda: False):
        """`closing()`: whether responses should close their connections now (the server is draining)."""
        self.app, self.metrics, self.closing = app, metrics, closing

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        status = {"code": 500}

        async def send_wrapper(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                elapsed = time.perf_counter() - start
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-total-time-ms", f"{elapsed * 1000:.2f}".encode())]
                if self.closing():
                    message["headers"].append((b"connection", b"close"))
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            self.metrics.in_flight.dec()
            route = scope.get("path", "")
            if route in OBSERVED_ROUTES:
                code = str(status["code"])
                self.metrics.requests.labels(route, code).inc()
                self.metrics.request_latency.labels(route, code).observe(time.perf_counter() - start)


# what answers without the key: orchestrators' probes and Prometheus' scrape
OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics"})


class ApiKeyMiddleware:
    """With an API key set, every route but OPEN_ROUTES (the encoding routes, /info with its paths and pids, /docs,
    /redoc, /openapi.json, unknown paths) needs `Authorization: Bearer <key>`: the scheme's name in any case (RFC 7235),
    the key compared in constant time. Otherwise 401 with `WWW-Authenticate: Bearer`."""

    def __init__(self, app, key: str, on_reject=lambda: None):
        self.app, self.key, self.on_reject = app, key.encode(), on_reject

    def _authorized(self, headers) -> bool:
        for name, value in headers:
            if name == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES or self._authorized(scope["headers"]):
            return await self.app(scope, receive, send)
        self.on_reject()
        body = json.dumps({"error": {"type": "unauthorized", "message": "missing or wrong API key: send "
                                     "'Authorization: Bearer <key>'"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
