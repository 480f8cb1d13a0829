"""Frames through shared memory between a front-end and the engine process (`service.engine.shm`): the arena's
regions against a model of them, what the engine reads back, and a front-end and an engine server talking over a
real socket with and without an arena (tiny random preset on the CPU)."""

from __future__ import annotations

import asyncio
import os
import tempfile

import numpy as np
import pytest
from PIL import Image

from conftest import rel_err
from service.engine.local import LocalEngine
from service.settings import Settings
from service.engine.process import EngineServer
from service.engine.remote import RemoteEngine
from service.engine.shm import PREFIX, SHM_DIR, Arena, attach, new_arena
from service.model.encoder import Encoder

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


@pytest.mark.parametrize("arena_bytes", [0, 1 << 20])
def test_frames_through_the_arena_or_the_message(tiny, arena_bytes):
    """Items that fit the arena travel as offsets, the one that does not (and every item without an arena) in the
    message; the engine's results equal in-process encoding; every region is free again after the replies, and the
    arena's file is gone from /dev/shm as soon as the engine has mapped it."""
    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
              for h, w in ((40, 72), (64, 64), (700, 640), (33, 20))]  # the third: 1.3 MB of frames, past 1 MiB
    items = [tiny.preprocess(img, max_pixels=1 << 22) for img in images]
    path = os.path.join(tempfile.mkdtemp(), "engine.sock")

    async def go():
        settings = Settings(max_batch_patches=1 << 16, max_batch_items=64, max_wait_ms=5, max_queue_items=64,
                            warmup=False, device="cpu")
        engine = LocalEngine(settings, tiny)
        await engine.start()
        server = EngineServer(engine)
        listener = await server.serve(path)
        remote = RemoteEngine(path, shared_memory_bytes=arena_bytes)
        await remote.connect()
        arena = remote._link.arena
        assert (arena is not None) == bool(arena_bytes) and not _leftovers()
        sent = []
        put = arena.put if arena is not None else None
        if arena is not None:
            arena.put = lambda data: sent.append(put(data)) or sent[-1]
        results = await asyncio.gather(*(remote.submit([it], timeout_s=30) for it in items))
        await remote.stop()
        listener.close()
        await engine.stop()
        return results, arena, sent

    results, arena, sent = asyncio.run(go())
    for it, done in zip(items, results):
        assert rel_err(done.results[0].embeds, tiny.encode([it])[0].embeds) <= 1e-5
    if arena is not None:
        assert [s is None for s in sent] == [False, False, True, False]
        assert arena._free == [(0, arena.size)]
