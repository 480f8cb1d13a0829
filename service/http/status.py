"""Errors -> HTTP status codes, in one place. Every error body is `{"error": {"type", "message", "index"?}}`."""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from ..errors import (CheckpointError, DeadlineExceeded, EncoderError, ImageTooLarge, InvalidInput, Overloaded,
                      ShuttingDown, UnsupportedImage)
from .metrics import Metrics

log = logging.getLogger(__name__)

STATUS = {
    ImageTooLarge: 413, UnsupportedImage: 422, InvalidInput: 422, Overloaded: 429,
    DeadlineExceeded: 503, ShuttingDown: 503, CheckpointError: 500,
}


class HTTPError(Exception):
    """An error decided by the API layer itself (content type, size, auth, malformed JSON, not ready)."""

    def __init__(self, status: int, reason: str, message: str, index: int | None = None, headers=None):
        super().__init__(message)
        self.status, self.reason, self.message, self.index, self.headers = status, reason, message, index, headers


def install_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    def respond(status: int, reason: str, message: str, index=None, headers=None) -> JSONResponse:
        metrics.errors.labels(reason).inc()
        err = {"type": reason, "message": message}
        if index is not None:
            err["index"] = index
        return JSONResponse({"error": err}, status_code=status, headers=headers)

    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, e: HTTPError):
        return respond(e.status, e.reason, e.message, e.index, e.headers)

    @app.exception_handler(EncoderError)
    async def _encoder_error(request: Request, e: EncoderError):
        status = next((s for cls, s in STATUS.items() if isinstance(e, cls)), 500)
        headers = {"Retry-After": str(math.ceil(e.retry_after))} if isinstance(e, Overloaded) else None
        if status >= 500 and not isinstance(e, (DeadlineExceeded, ShuttingDown)):
            log.error("request failed: %s", e)
        return respond(status, e.reason, getattr(e, "message", str(e)), getattr(e, "index", None), headers)
