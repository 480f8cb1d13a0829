"""ASGI middleware: request count and latency by route and status, requests in flight, X-Total-Time-Ms, and
`Connection: close` on every response while the server drains."""

from __future__ import annotations

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
