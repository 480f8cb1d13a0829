"""The wire format between the HTTP front-end processes and the engine process (a Unix socket).

A message is a 12-byte prefix (header length u32, payload length u64), a pickled header dict, then a raw
payload: the uint8 frames going in, the embeddings coming back, no per-element encoding (either may lie in the
front-end's shared arena instead, `shm`: then only offsets travel).
Front-end -> engine ops: `hello`, `submit`, `cancel`, `stats`, and `expect` (no reply: a lone request's submit
is on its way, `EngineServer.expect`). The engine answers `hello` (the model's
description), `result` or `error` (with the typed error's class, message, index and retry-after) or `dropped` (a
request the front-end gave up on), `stats`. Any
reply may carry `batches`: the stats of forwards finished since the last reply, for the front-end's metrics.
"""

from __future__ import annotations

import asyncio
import math
import pickle
import struct
import warnings

import numpy as np
import torch

from .. import errors
from .shm import ALIGN, aligned

_PREFIX = struct.Struct("<IQ")
# Frames and results arrive in read-only bytes; they are only ever read, never written in place.
warnings.filterwarnings("ignore", message="The given (buffer|NumPy array) is not writable")
_ERRORS = {cls.__name__: cls for cls in (errors.EncoderError, errors.InvalidInput, errors.UnsupportedImage,
                                         errors.ImageTooLarge, errors.UnsupportedVideo, errors.VideoTooLong,
                                         errors.Overloaded, errors.Unavailable, errors.DeadlineExceeded,
                                         errors.ShuttingDown, errors.EngineUnavailable, errors.InferenceFailed,
                                         errors.CheckpointError)}


def write_message(writer: asyncio.StreamWriter, header: dict, buffers=()) -> None:
    """Queue one message on `writer` (no await in between, so messages of concurrent tasks never interleave)."""
    head = pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)
    views = [memoryview(b).cast("B") for b in buffers if b.nbytes]
    writer.write(_PREFIX.pack(len(head), sum(v.nbytes for v in views)) + head)
    for v in views:
        writer.write(v)


async def read_message(reader: asyncio.StreamReader) -> tuple[dict, bytes]:
    head_len, payload_len = _PREFIX.unpack(await reader.readexactly(_PREFIX.size))
    header = pickle.loads(await reader.readexactly(head_len))
    payload = await reader.readexactly(payload_len) if payload_len else b""
    return header, payload


_EMPTY = np.empty(0, np.uint8)


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's bytes (any dtype, bfloat16 included) as a buffer, without a copy when contiguous: one torch call
    for an empty tensor (the outputs a request did not ask for) or a contiguous one of a dtype numpy has (the pooled
    vectors), four otherwise."""
    if not t.numel():
        return _EMPTY
    if t.dtype != torch.bfloat16 and t.is_contiguous():
        return t.numpy().reshape(-1)
    return t.contiguous().view(torch.uint8).numpy().reshape(-1)


# numpy's type of the same size for each tensor dtype that crosses (bfloat16's bits as int16)
_NUMPY = {torch.float32: np.float32, torch.bfloat16: np.int16, torch.float16: np.float16, torch.int64: np.int64}


def _numpy(t: torch.Tensor) -> np.ndarray:
    """`t`'s elements as numpy sees them, any strides (bfloat16 as the int16 of its bits)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def region_bytes(nbytes) -> int:
    """The bytes `write_tensors` takes for tensors of `nbytes` each, in a region that starts aligned (as an arena's
    regions do)."""
    return sum(aligned(n) for n in nbytes)


def write_tensors(mapping, offset: int, size: int, tensors: list[torch.Tensor]) -> bool:
    """Copy `tensors` (any strides) one after another, each at an ALIGN boundary, into `mapping[offset:offset+size]`;
    False, having written nothing, where they do not fit there. numpy's copies let go of the interpreter lock."""
    at, spans = offset, []
    for t in tensors:
        at = aligned(at)
        spans.append(at)
        at += t.nbytes
    if offset < 0 or at > min(offset + size, len(mapping)):
        return False
    for t, at in zip(tensors, spans):
        if t.numel():
            src = _numpy(t)
            np.copyto(np.frombuffer(mapping, src.dtype, src.size, at).reshape(src.shape), src)
    return True


def tensor_at(payload: bytes, offset: int, shape, dtype: torch.dtype, align: bool = False) -> tuple[torch.Tensor, int]:
    """The tensor of `shape` and `dtype` at `offset` in `payload` (no copy), and the offset after it; `align`: at
    the next ALIGN boundary, as `write_tensors` put it. Read through numpy: one or two torch calls rather than four,
    each of which costs a front-end tens of microseconds on a lone request's cold path."""
    if align:
        offset = aligned(offset)
    n = math.prod(shape)
    t = torch.from_numpy(np.frombuffer(payload, _NUMPY[dtype], n, offset).reshape(shape))
    return (t.view(dtype) if t.dtype != dtype else t), offset + n * dtype.itemsize


def error_header(rid: int, e: Exception) -> dict:
    if not isinstance(e, errors.EncoderError):
        e = errors.InferenceFailed(f"inference failed: {type(e).__name__}: {e}")
    return {"op": "error", "id": rid, "type": type(e).__name__, "message": getattr(e, "message", str(e)),
            "index": getattr(e, "index", None), "retry_after": getattr(e, "retry_after", None)}


def rebuild_error(header: dict) -> errors.EncoderError:
    cls = _ERRORS.get(header["type"], errors.EncoderError)
    if issubclass(cls, errors.InvalidInput):
        return cls(header["message"], header["index"])
    if issubclass(cls, (errors.Overloaded, errors.Unavailable)):
        return cls(header["message"], retry_after=header["retry_after"] or 1.0)
    return cls(header["message"])

