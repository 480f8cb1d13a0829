"""Errors -> HTTP status codes, in one place. Every error body is `{"error": {"type", "message", "index"?}}`; every
429 and 503 carries Retry-After. A 500 means a bug or a broken checkpoint, never input or load."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..errors import (CheckpointError, EncoderError, ImageTooLarge, InferenceFailed, InvalidInput, Overloaded,
                      Unavailable, UnsupportedImage)
from .metrics import Metrics

log = logging.getLogger(__name__)

STATUS = {
    ImageTooLarge: 413, UnsupportedImage: 422, InvalidInput: 422, Overloaded: 429,
    Unavailable: 503, CheckpointError: 500,
}


class HTTPError(Exception):
    """An error decided by the API layer itself (content type, size, auth, malformed JSON, not ready)."""

    def __init__(self, status: int, reason: str, message: str, index: int | None = None, headers=None):
        super().__init__(message)
        self.status, self.reason, self.message, self.index, self.headers = status, reason, message, index, headers


CLIENT_CLOSED = 499  # nginx's status for a request whose client went away


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def respond(status: int, reason: str, message: str, index=None, headers=None) -> JSONResponse:
        metrics.errors.labels(reason).inc()
        err = {"type": reason, "message": message}
        if index is not None:
            err["index"] = index
        return JSONResponse({"error": err}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _routing_error(request: Request, e: StarletteHTTPException):
        # no route (404), a route without this method (405): the same error body as everything else
        reason = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        return respond(e.status_code, reason, f"{request.method} {request.url.path}: {e.detail}",
                       headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(request: Request, e: ClientDisconnect):
        # the client closed its connection before its request's body arrived: its fault, not the server's, and no
        # one reads the reply; recorded as nginx records it (499), without a traceback
        return respond(CLIENT_CLOSED, "client_closed", "the client closed the connection before sending its body")

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return respond(e.status, e.reason, e.message, e.index, e.headers)

    @app.exception_handler(EncoderError)
    async def _encoder_error(request: Request, e: EncoderError):
        status = next((s for cls, s in STATUS.items() if isinstance(e, cls)), 500)
        retry_after = getattr(e, "retry_after", None)
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        if status == 500 or isinstance(e, InferenceFailed):
            log.error("request failed: %s", e)
        return respond(status, e.reason, getattr(e, "message", str(e)), getattr(e, "index", None), headers)
