"""A content-addressed cache of encoded items, in front of the engine.

A chat resends its images on every turn. An item whose bytes, options and model match an earlier one is answered
from here: neither decoded nor sent to the engine. Identical items in flight at once share one encoding: the first
(the leader) encodes, the others wait for its result. Only results are kept; an input that fails fails each request
that sends it, each with its own error.

The cache is per process (each HTTP front-end keeps its own), bounded in bytes, least recently used first out.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable

import torch


@dataclass
class CachedItem:
    """What a response needs of a cached item besides its result: the preprocessor's description (its kind, and a
    video's sampled frames and timestamps), without its pixels."""

    meta: dict

    @property
    def kind(self) -> str:
        return self.meta.get("kind", "image")


@dataclass(frozen=True)
class CacheKey:
    digest: bytes  # of the input's bytes
    variant: Hashable  # everything else the result depends on: model, dtype, sizing and sampling options, outputs


def cache_key(data: bytes, variant: Hashable) -> CacheKey:
    return CacheKey(hashlib.blake2b(data, digest_size=20).digest(), variant)


def _nbytes(value: Any) -> int:
    return sum(t.nbytes for t in vars(value).values() if isinstance(t, torch.Tensor))


def _own(value: Any, copy: bool) -> Any:
    """`value` with its tensors copied where they are views of a larger buffer (`copy`: all of them, as when they
    were read from the reply of several items), so that a cached item keeps only its own bytes alive."""
    for name, t in vars(value).items():
        if isinstance(t, torch.Tensor) and (copy or t.untyped_storage().nbytes() > t.nbytes):
            setattr(value, name, t.clone())
    return value


class EncoderCache:
    """`(CachedItem, result)` entries by `CacheKey`, within `max_bytes` of result tensors (0: nothing is kept, but
    identical items in flight still share one encoding)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self._in_flight: dict[CacheKey, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey):
        """The cached value, or None."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def in_flight(self, key: CacheKey) -> asyncio.Future | None:
        """The future of the identical item being encoded now, if any."""
        return self._in_flight.get(key)

    def lead(self, key: CacheKey) -> asyncio.Future:
        """Mark `key` as being encoded by the caller, who must `finish` it."""
        future = asyncio.get_running_loop().create_future()
        self._in_flight[key] = future
        return future

    def finish(self, key: CacheKey, value: Any = None, error: BaseException | None = None,
               shared_buffer: bool = False) -> None:
        """The leader's outcome: `value` is cached and handed to the waiters, or `error` is raised in them.
        `shared_buffer`: the result's tensors are views of a buffer shared with other results (copied if kept)."""
        future = self._in_flight.pop(key, None)
        if error is None:
            self._put(key, value, shared_buffer)
        if future is not None and not future.done():
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
                future.exception()  # retrieved: no "never retrieved" warning when nobody waits

    def _put(self, key: CacheKey, value: Any, shared_buffer: bool) -> None:
        _, result = value
        size = _nbytes(result)
        if size > self.max_bytes:
            return
        _own(result, shared_buffer)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        self._entries[key] = (value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted
