"""Typed errors. Only the API layer maps them to HTTP status codes (service/http/status.py)."""

from __future__ import annotations


class EncoderError(Exception):
    """Base class of every error this package raises on purpose."""

    reason = "internal"


class CheckpointError(EncoderError):
    """The model directory or preset cannot be loaded; the message names the file and key."""

    reason = "checkpoint"


class DeviceUnavailable(EncoderError):
    """The device the settings name cannot be used by this process (no CUDA, no such GPU)."""

    reason = "device"


class InvalidInput(EncoderError):
    """One input item is unusable. `index` is its position in the request, when known."""

    reason = "invalid_input"

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.message = message
        self.index = index

    def at(self, index: int) -> "InvalidInput":
        """The same error, attributed to item `index` of a request."""
        err = type(self)(self.message, index)
        err.__cause__ = self.__cause__
        return err

    def __str__(self) -> str:
        return self.message if self.index is None else f"input {self.index}: {self.message}"


class UnsupportedImage(InvalidInput):
    """Bytes that are empty, corrupt, or not an image format we decode."""

    reason = "unsupported_image"


class ImageTooLarge(InvalidInput):
    """An image over the pixel limit (including decompression bombs)."""

    reason = "image_too_large"


class UnsupportedVideo(UnsupportedImage):
    """Video bytes that are corrupt, have no video stream, or too few frames."""

    reason = "unsupported_video"


class VideoTooLong(ImageTooLarge):
    """A video with more frames than the server decodes."""

    reason = "video_too_long"


class Overloaded(EncoderError):
    """The queue is full; retry after `retry_after` seconds."""

    reason = "overloaded"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class Unavailable(EncoderError):
    """The request cannot be served now but may be later (HTTP 503 with Retry-After)."""

    reason = "unavailable"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    def __str__(self) -> str:
        return self.message


class DeadlineExceeded(Unavailable):
    reason = "deadline_exceeded"


class ShuttingDown(Unavailable):
    reason = "shutting_down"


class EngineUnavailable(Unavailable):
    """The engine process is down or restarting; requests it held when it died get this too."""

    reason = "engine_unavailable"


class InferenceFailed(Unavailable):
    """A forward failed for this item alone (after its pack was split), out of device memory included."""

    reason = "inference_failed"
