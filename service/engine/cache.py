"""A content-addressed cache of encoded items, in front of the engine, shared by the server's HTTP processes.

A chat resends its images on every turn, and its connections may reach any of the front-end processes. An item
whose bytes, options and model match an earlier one is answered from here: neither decoded nor sent to the engine.
Identical items in flight at once in one process share one encoding: the first (the leader) encodes, the others
wait for its result. Only results are kept; an input that fails fails each request that sends it, each with its own
error.

Entries are files in one directory, in shared memory (/dev/shm) where there is one: a small header (the item's
description, the result's shapes and dtypes) and the tensors' bytes. A writer renames a finished file into place,
so a reader never sees half an entry. The directory is bounded in bytes, least recently used out: a hit refreshes
an entry's time, and a process that has written an eighth of the budget since its last look evicts the oldest
entries until the whole directory fits (so it may run over by an eighth per process in between).

Large entries (a vLLM layout's results: 3.2 MB a 448 px image) are written at most `write_bytes_per_s` a process,
with a second's worth at once; the rest go unwritten. Writing into fresh shared-memory pages costs about 1.3 ms of
CPU a megabyte (the kernel allocates and clears each page), a fifth of a front-end's CPU under a load of distinct
images in vLLM's layout, where nothing is read back. Repeats at a chat's pace are all written.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

import orjson

if TYPE_CHECKING:  # torch only where an entry is read or written: `serve`'s main process makes the directory alone
    from ..model.results import EncodeResult

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<I")
_DTYPES = {"float32", "bfloat16", "float16", "int64"}
_FIELDS = ("embeds", "deepstack", "pooled")
_WRITE_INLINE = 256 << 10  # bytes of a result below which its entry is written on the event loop


def _nbytes(result: EncodeResult) -> int:
    return sum(getattr(result, name).nbytes for name in _FIELDS)


@dataclass
class CachedItem:
    """What a response needs of a cached item besides its result: the preprocessor's description (its kind, and a
    video's sampled frames and timestamps), without its pixels."""

    meta: dict

    @property
    def kind(self) -> str:
        return self.meta.get("kind", "image")


def cache_key(data: bytes, variant: Hashable) -> str:
    """The entry's name: a digest of the input's bytes and of everything else its result depends on (`variant`:
    the model, dtype, sizing and sampling options, the outputs asked for)."""
    h = hashlib.sha256(data)  # SHA-256 runs in the CPU's SHA instructions: a fraction of BLAKE2's time per request
    h.update(repr(variant).encode())
    return h.hexdigest()


def encode_entry(item: CachedItem, result: EncodeResult) -> list:
    """An entry's file: header length, header, then the tensors' bytes."""
    import torch

    from .protocol import raw_bytes

    tensors = [(name, getattr(result, name)) for name in _FIELDS]
    header = orjson.dumps({"meta": item.meta, "grid_thw": list(result.grid_thw), "num_tokens": result.num_tokens,
                           "tensors": [[name, str(t.dtype).removeprefix("torch."), list(t.shape)]
                                       for name, t in tensors]}, option=orjson.OPT_SERIALIZE_NUMPY)
    assert all(isinstance(t, torch.Tensor) for _, t in tensors)
    return [_HEADER.pack(len(header)), header, *(raw_bytes(t) for _, t in tensors)]


def decode_entry(data: bytes) -> tuple[CachedItem, EncodeResult]:
    import torch

    from ..model.results import EncodeResult
    from .protocol import tensor_at

    (n,) = _HEADER.unpack_from(data)
    header = orjson.loads(data[_HEADER.size:_HEADER.size + n])
    offset, fields = _HEADER.size + n, {}
    for name, dtype, shape in header["tensors"]:
        if name not in _FIELDS or dtype not in _DTYPES:
            raise ValueError(f"unexpected tensor {name} of {dtype}")
        fields[name], offset = tensor_at(data, offset, shape, getattr(torch, dtype))
    if offset != len(data):
        raise ValueError("entry of the wrong length")
    return CachedItem(header["meta"]), EncodeResult(grid_thw=tuple(header["grid_thw"]),
                                                    num_tokens=header["num_tokens"], **fields)


class EncoderCache:
    """Entries under `path` within `max_bytes` (0: nothing is kept, but identical items in flight still share one
    encoding). `on_size`: called with `bytes` after each write (the metrics' gauge); `write_bytes_per_s`: the large
    entries written a second (0: no bound), `on_skip` called with each one left unwritten (the metrics' counter)."""

    def __init__(self, path: str | None, max_bytes: int, on_size: "Callable[[int], None] | None" = None,
                 write_bytes_per_s: int = 0, on_skip: "Callable[[], None] | None" = None,
                 clock: Callable[[], float] = time.monotonic):
        self.path = path
        self.max_bytes = max_bytes if path else 0
        self.on_size = on_size
        self.write_bytes_per_s = write_bytes_per_s
        self.on_skip = on_skip
        self._clock = clock
        self._allowance, self._allowed_at = float(write_bytes_per_s), clock()
        self.bytes = 0  # of the directory, at this process's last look
        self._written = 0  # by this process since its last look
        self._in_flight: dict[str, asyncio.Future] = {}
        self._warned = False

    def get(self, key: str) -> tuple[CachedItem, EncodeResult] | None:
        """The cached value, or None."""
        if not self.max_bytes:
            return None
        path = os.path.join(self.path, key)
        try:
            with open(path, "rb") as f:
                data = f.read()
            os.utime(path)  # recently used
            return decode_entry(data)
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError, struct.error) as e:  # evicted meanwhile, or damaged: a miss
            log.debug("embedding cache entry %s unreadable: %s", key, e)
            return None

    def in_flight(self, key: str) -> asyncio.Future | None:
        """The future of the identical item being encoded now in this process, if any."""
        return self._in_flight.get(key)

    def lead(self, key: str) -> asyncio.Future:
        """Mark `key` as being encoded by the caller, who must `finish` it."""
        future = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        return future

    def finish(self, key: str, value: tuple[CachedItem, EncodeResult] | None = None,
               error: BaseException | None = None) -> None:
        """The leader's outcome: handed to the waiters (`error` raised in them), and `value` written to the cache
        after the caller's reply is on its way (the event loop's next turn: the write, a file created in the cache's
        directory, took ~0.2 ms of a lone request's time when it came first), or in a thread when it is large
        (megabytes of an LLM layout's features are not copied on the event loop)."""
        future = self._in_flight.pop(key, None)
        if future is not None and not future.done():
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits
        if error is None and self.max_bytes:
            loop = asyncio.get_running_loop()
            size = _nbytes(value[1])
            if size < _WRITE_INLINE:
                loop.call_soon(self._put, key, value)
            elif self._admit(size):
                loop.run_in_executor(None, self._put, key, value)
            elif self.on_skip is not None:
                self.on_skip()

    def _admit(self, size: int) -> bool:
        """Whether a large entry of `size` bytes is written: a token bucket of `write_bytes_per_s`, a second's worth
        deep (on the event loop: one thread keeps the count)."""
        if not self.write_bytes_per_s:
            return True
        now = self._clock()
        self._allowance = min(float(self.write_bytes_per_s),
                              self._allowance + (now - self._allowed_at) * self.write_bytes_per_s)
        self._allowed_at = now
        if size > self._allowance:
            return False
        self._allowance -= size
        return True

    def _put(self, key: str, value: tuple[CachedItem, EncodeResult]) -> None:
        parts = encode_entry(*value)
        size = sum(memoryview(p).nbytes for p in parts)
        if size > self.max_bytes // 8:
            return
        tmp = os.path.join(self.path, f".{os.getpid()}-{threading.get_ident()}-{key}")
        try:
            with open(tmp, "wb") as f:
                for p in parts:
                    f.write(p)
            os.replace(tmp, os.path.join(self.path, key))
        except OSError as e:  # no room left in shared memory, or the directory is gone: serve without caching
            if not self._warned:
                log.warning("embedding cache: cannot write in %s (%s); results go uncached until there is room",
                            self.path, e)
                self._warned = True
            self._remove(tmp)
            self._evict(self.max_bytes // 2)
            return
        self._written += size
        self.bytes += size  # (an eviction pass counts the directory again)
        if self._written > self.max_bytes // 8:
            self._evict(self.max_bytes)
        if self.on_size is not None:
            self.on_size(self.bytes)

    def _evict(self, target: int) -> None:
        """Remove the least recently used entries until the directory holds at most `target` bytes."""
        self._written = 0
        entries = []
        try:
            with os.scandir(self.path) as it:
                for e in it:
                    if not e.name.startswith("."):
                        st = e.stat()
                        entries.append((st.st_mtime, st.st_size, e.path))
        except OSError:
            return
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= target:
                break
            self._remove(path)
            total -= size
        self.bytes = total

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def cache_parent() -> str:
    """Where cache directories go: shared memory where there is one, else the temporary directory."""
    import tempfile

    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


def make_cache_dir() -> str:
    """A fresh directory for the cache (`cache_parent`), named after this process. Directories of processes that
    no longer exist (a server killed with SIGKILL cannot remove its own) go first."""
    import shutil
    import tempfile

    parent = cache_parent()
    prefix = "qwen3vl-embeddings-"
    with contextlib.suppress(OSError):
        for name in os.listdir(parent):
            pid = name[len(prefix):].split("-", 1)[0]
            if name.startswith(prefix) and pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=parent)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True
