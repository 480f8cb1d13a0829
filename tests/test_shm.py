"""Frames and results through shared memory between a front-end and the engine process (`service.engine.shm`):
the arena's regions against a model of them, what the engine reads back, and a front-end and an engine server
talking over a real socket with and without an arena (tiny random preset on the CPU)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import torch

import numpy as np
import pytest
from PIL import Image

from conftest import rel_err
from service.engine.api import Encoded
from service.engine.local import LocalEngine
from service.settings import Settings
from service.engine import process
from service.engine.process import EngineServer
from service.engine.remote import RemoteEngine
from service.engine.shm import PREFIX, SHM_DIR, Arena, attach, new_arena
from service.model.encoder import Encoder
from service.model.results import EncodeResult

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs /dev/shm")


def _leftovers() -> set[str]:
    return {f for f in os.listdir(SHM_DIR) if f.startswith(f"{PREFIX}{os.getpid()}-")}


def test_regions_in_any_order_and_what_the_engine_reads():
    """Random puts and releases against a model: regions never overlap, the engine's read-only mapping reads back
    each region's bytes, a put that no free region holds is refused, and releasing everything leaves one region."""
    rng = np.random.default_rng(0)
    arena = Arena(1 << 16)
    engine_view = attach(arena.path)
    arena.unlink()
    live: dict[int, np.ndarray] = {}
    for _ in range(600):
        if live and rng.random() < 0.45:
            offset = list(live)[int(rng.integers(len(live)))]
            arena.release(offset)
            del live[offset]
            continue
        data = rng.integers(0, 256, int(rng.integers(1, 9000)), dtype=np.uint8)
        offset = arena.put(data)
        if offset is None:
            assert arena.free_bytes < data.nbytes + Arena.ALIGN or len(arena._free) > 1  # full, or fragmented
            continue
        assert offset % Arena.ALIGN == 0
        live[offset] = data
        spans = sorted((o, o + d.nbytes) for o, d in live.items())
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        for o, d in live.items():
            assert np.array_equal(np.frombuffer(engine_view, np.uint8, d.nbytes, o), d)
    for offset in list(live):
        arena.release(offset)
    assert arena._free == [(0, 1 << 16)] and not arena._used
    assert arena.put(np.zeros((1 << 16) + 1, np.uint8)) is None
    arena.close()


def test_no_arena_where_there_is_no_room():
    assert new_arena(0) is None
    with pytest.raises(OSError):
        Arena(4096, directory=os.path.join(tempfile.gettempdir(), "no-such-dir-qwen3vl"))
    with pytest.raises(ValueError):
        attach("/etc/passwd")


@pytest.fixture(scope="module")
def tiny():
    return Encoder.load("random:tiny")


async def _serving(tiny, path, **settings):
    settings = Settings(**{"max_batch_patches": 1 << 16, "max_batch_items": 64, "max_wait_ms": 5,
                           "max_queue_items": 64, "warmup": False, "device": "cpu", **settings})
    engine = LocalEngine(settings, tiny)
    await engine.start()
    listener = await EngineServer(engine).serve(path)
    return engine, listener


def _items(tiny, sizes, seed=1):
    rng = np.random.default_rng(seed)
    return [tiny.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)), max_pixels=1 << 22)
            for h, w in sizes]


@pytest.mark.parametrize("arena_bytes", [0, 3 << 19, 200 << 10])
def test_frames_and_results_through_the_arena_or_the_message(tiny, arena_bytes, monkeypatch):
    """Items that fit the arena travel as offsets, the one that does not (and every item without an arena) in the
    message; so do results, each request's in the region it reserved, or in the reply where none was free (a
    200 KiB arena, which most requests' frames and results do not fit at once). The engine's results, with and
    without DeepStack and tokens, equal in-process encoding; every region is free again after the replies, and the
    arena's file is gone from /dev/shm as soon as the engine has mapped it."""
    items = _items(tiny, ((40, 72), (64, 64), (700, 640), (33, 20), (2, 300)))  # the third: 1.3 MB of frames
    asks = [(True, True), (False, True), (True, False), (True, True), (False, False)]  # (deepstack, tokens)
    path = os.path.join(tempfile.mkdtemp(), "engine.sock")
    written = []
    write = process.write_tensors
    monkeypatch.setattr(process, "write_tensors", lambda *a: written.append(write(*a)) or written[-1])

    async def go():
        engine, listener = await _serving(tiny, path)
        remote = RemoteEngine(path, shared_memory_bytes=arena_bytes)
        await remote.connect()
        arena = remote._link.arena
        assert (arena is not None) == bool(arena_bytes) and not _leftovers()
        sent = []
        put = arena.put if arena is not None else None
        if arena is not None:
            arena.put = lambda data: sent.append(put(data)) or sent[-1]
        tasks = [asyncio.create_task(remote.submit([it], time.monotonic() + 30, deepstack=ds, tokens=tok))
                 for it, (ds, tok) in zip(items, asks)]
        await asyncio.wait(tasks)
        results = [t.result() for t in tasks]
        del tasks
        # results read in place hold their regions until dropped; copies do not
        held = arena.free_bytes if arena is not None else 0
        copies = [Encoded([EncodeResult(**{k: v.clone() if isinstance(v, torch.Tensor) else v
                                           for k, v in vars(r).items()}) for r in done.results], done.timing)
                  for done in results]
        del results  # (reference counting frees them at once: no collection needed)
        await asyncio.sleep(0)  # the regions' releases, queued by the last tensors' finalizers
        freed = arena.free_bytes - held if arena is not None else 0
        await remote.stop()
        listener.close()
        await engine.stop()
        return copies, arena, sent, freed

    results, arena, sent, freed = asyncio.run(go())
    for it, (ds, tok), done in zip(items, asks, results):
        got, want = done.results[0], tiny.encode([it])[0]
        assert rel_err(got.pooled, want.pooled) <= 1e-5
        assert got.embeds.shape == (want.embeds.shape if tok else (0, want.embeds.shape[1]))
        if tok:
            assert rel_err(got.embeds, want.embeds) <= 1e-5
        if ds:
            assert rel_err(got.deepstack, want.deepstack) <= 1e-5
        else:
            assert got.deepstack.numel() == 0
    if arena_bytes == 3 << 19:
        assert [s is None for s in sent] == [False, False, True, False, False]
        assert written == [True] * 5  # every request's results in its region
        assert freed > 0  # and held there until the results were dropped
    elif arena_bytes:
        assert False in written or len(written) < 5  # some came back in the reply
    if arena is not None:
        assert arena._free == [(0, arena.size)]


def test_a_region_given_up_on_is_held_until_the_engine_has_answered(tiny):
    """A request given up on while the engine holds it: its results' region stays reserved (the engine could still
    write there) until the engine's last word on it, then it is free; the next request's results are right."""
    items = _items(tiny, ((64, 96), (48, 48)), seed=2)
    path = os.path.join(tempfile.mkdtemp(), "engine.sock")

    async def go():
        engine, listener = await _serving(tiny, path, max_wait_ms=300, max_batch_items=64)
        remote = RemoteEngine(path, shared_memory_bytes=1 << 20)
        await remote.connect()
        link = remote._link
        gone = asyncio.Event()
        task = asyncio.create_task(remote.submit([items[0]], time.monotonic() + 30, abandoned=gone))
        await asyncio.sleep(0.05)  # sent, and waiting in the engine's batch window
        gone.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        held = dict(link.held)
        for _ in range(200):  # the engine's answer to the cancelled request frees the region
            if not link.held:
                break
            await asyncio.sleep(0.01)
        free_after = list(link.arena._free)
        done = await remote.submit([items[1]], time.monotonic() + 30)
        await remote.stop()
        listener.close()
        await engine.stop()
        return held, link.held, free_after, link.arena, done

    held, still_held, free_after, arena, done = asyncio.run(go())
    assert len(held) == 1 and not still_held
    assert free_after == [(0, arena.size)]
    assert rel_err(done.results[0].embeds, tiny.encode([items[1]])[0].embeds) <= 1e-5


def test_write_tensors_places_what_tensor_at_reads():
    """Tensors of any strides and dtypes written at aligned offsets read back equal; what does not fit the region
    (or lies outside the mapping) writes nothing."""
    from service.engine.protocol import ALIGN, region_bytes, tensor_at, write_tensors

    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(7, 33, generator=g).bfloat16(), torch.randn(3, 5, 9, generator=g)[:, 1:4],
               torch.empty(0, 16), torch.randn(131, generator=g).half(), torch.randn(1, 1, generator=g)]
    size = region_bytes([t.nbytes for t in tensors])
    mapping = bytearray(size + 3 * ALIGN)
    assert write_tensors(mapping, ALIGN, size, tensors)
    payload, offset = bytes(mapping[ALIGN:ALIGN + size]), 0
    for t in tensors:
        got, offset = tensor_at(payload, offset, t.shape, t.dtype, align=True)
        assert torch.equal(got, t)
    before = bytes(mapping)
    exact = size - ALIGN + tensors[-1].nbytes  # the last tensor's padding is not needed
    assert not write_tensors(mapping, ALIGN, exact - 1, tensors)
    assert not write_tensors(mapping, 4 * ALIGN, size, tensors)  # past the end of the mapping
    assert not write_tensors(mapping, -ALIGN, size, tensors)
    assert bytes(mapping) == before
    assert write_tensors(mapping, ALIGN, exact, tensors)
