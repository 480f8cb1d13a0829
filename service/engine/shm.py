"""Shared memory between a front-end process and an engine process: the frames going in, the results coming back.

A 448 px image is 600 KB of uint8 frames, and its merged tokens and DeepStack features 3.2 MB of bfloat16. Through
the Unix socket each takes several wake-ups of both processes (the socket holds a fraction of it at a time) and
about a millisecond of CPU on each side per 3 MB: a visible delay for a request that comes alone to an idle host,
and under load the engine's one event loop spends a core on it. Instead each connection of a front-end to an engine
(`remote._Link`) owns an `Arena`: a file in /dev/shm that the front-end creates and sizes, the engine maps when it
answers `hello`, and the front-end then unlinks (the memory lives while either process maps it, so a crash leaves
nothing behind). Only offsets travel in the messages:
- frames: the front-end copies them into a region, freed when the request's reply arrives or it is given up on (an
  engine still reading a given-up region computes garbage for an item whose result nobody reads);
- results: the front-end reserves a region of their size with the request, the engine copies them there before it
  replies, and the front-end reads them in place (`Arena.lend`): the region is freed when the last tensor over it
  is dropped. A region the engine may still write (a request given up on before its
  reply) stays reserved until the reply comes (`_Link.held`), since it could otherwise land in another request's.
What does not fit, or a front-end without an arena (no /dev/shm, or not enough room in it), travels in the messages.

On a GPU the engine page-locks its mapping with the CUDA driver (`page_lock`): the copy engine then reads frames from
the arena where they lie, with no copy through pinned memory in front of a forward.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import secrets
import weakref
from typing import Callable

import numpy as np

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
PREFIX = "qwen3vl-frames-"


ALIGN = 64  # where regions start, and tensors within a region of results (`protocol.write_tensors`)


def aligned(n: int) -> int:
    """`n` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


class Arena:
    """A front-end's shared buffer: first-fit regions, freed in any order (one event loop uses it)."""

    ALIGN = ALIGN

    def __init__(self, size: int, directory: str = SHM_DIR):
        """Create and map `size` bytes; `OSError` where the directory is missing or has no room for them."""
        self.size = size
        self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # the pages now, or ENOSPC now: never a SIGBUS on a later write
            self._map = mmap.mmap(fd, size)
        except BaseException:
            self.unlink()
            raise
        finally:
            os.close(fd)
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), by offset, never adjacent
        self._used: dict[int, int] = {}  # offset -> length

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid): once the engine has mapped it, or if it never will."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def free_bytes(self) -> int:
        return sum(length for _, length in self._free)

    def reserve(self, n: int) -> int | None:
        """A free region of at least `n` bytes (first fit); its offset, or None where no region is large enough."""
        need = max(ALIGN, aligned(n))
        for i, (offset, length) in enumerate(self._free):
            if length >= need:
                if length == need:
                    del self._free[i]
                else:
                    self._free[i] = (offset + need, length - need)
                self._used[offset] = need
                return offset
        return None

    def put(self, data: np.ndarray) -> int | None:
        """Copy `data` (contiguous uint8) into a free region; its offset, or None where no region is large enough."""
        offset = self.reserve(data.nbytes)
        if offset is not None:
            np.frombuffer(self._map, np.uint8, data.nbytes, offset)[:] = data.reshape(-1)
        return offset

    def lend(self, offset: int, n: int, on_free: Callable[[], None]):
        """The `n` bytes at `offset` in place (what the engine wrote into a reserved region), as a buffer that numpy
        and torch views keep alive; `on_free` runs, in whatever thread drops the last of them, once none is left.
        (A ctypes array, not a memoryview: numpy keeps its own view of a memoryview's exporter, not the memoryview.)"""
        lent = (ctypes.c_char * n).from_buffer(self._map, offset)
        weakref.finalize(lent, on_free)
        return lent

    def release(self, offset: int) -> None:
        """Free the region at `offset`, merged with free neighbours."""
        length = self._used.pop(offset)
        i = bisect.bisect(self._free, (offset, length))
        if i < len(self._free) and self._free[i][0] == offset + length:  # the next region is free: absorb it
            length += self._free.pop(i)[1]
        if i and self._free[i - 1][0] + self._free[i - 1][1] == offset:  # the previous one too
            offset, length = self._free[i - 1][0], self._free[i - 1][1] + length
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (offset, length))

    def close(self) -> None:
        self.unlink()
        try:
            self._map.close()
        except BufferError:  # results still lent out: the mapping goes when they do
            pass


def new_arena(size: int) -> Arena | None:
    """An arena of `size` bytes, or None (logged) where shared memory cannot hold it or `size` is 0."""
    if size <= 0:
        return None
    try:
        return Arena(size)
    except OSError as e:
        log.warning("no shared memory for frames and results (%s: %s); they go over the engine socket. Give the "
                    "container more /dev/shm (compose: shm_size) or set QWEN3VL_SHARED_MEMORY_MIB=0 to silence this",
                    type(e).__name__, e)
        return None


def attach(path: str) -> mmap.mmap:
    """The engine's mapping of a front-end's arena (`path` as the front-end's `hello` gave it): it reads frames from
    it and writes results into the regions a request reserved."""
    if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
        raise ValueError(f"not a frame arena: {path!r}")
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


# CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_READ_ONLY: pinned for every context, only read by the GPU (frames)
_LOCK_FLAGS = 0x01 | 0x08


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")  # loaded already in any process that uses CUDA
    except OSError:
        return None


def page_lock(mapping: mmap.mmap, device) -> int | None:
    """Page-lock an arena mapping for `device`'s copy engine (the CUDA driver's host registration, so no runtime
    error state is left behind by a refusal); its address, to give `page_unlock`, or None where the driver refuses
    (frames are then copied through pinned memory)."""
    import torch

    driver = _driver()
    if driver is None:
        return None
    # the device's primary context, current on this thread (the driver registers memory in the current context)
    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    address = np.frombuffer(mapping, np.uint8).ctypes.data
    result = driver.cuMemHostRegister_v2(ctypes.c_void_p(address), ctypes.c_size_t(len(mapping)),
                                         ctypes.c_uint(_LOCK_FLAGS))
    if result != 0:
        log.warning("could not page-lock the frame arena for the GPU (CUDA driver error %d); frames are staged "
                    "through pinned memory", result)
        return None
    return address


def page_unlock(address: int, device) -> None:
    """Undo `page_lock` once nothing reads the arena: after every copy queued on `device` has run."""
    import torch

    torch.cuda.synchronize(device)
    _driver().cuMemHostUnregister(ctypes.c_void_p(address))
