"""The embedding cache: identical inputs with identical options are answered without the engine, identical inputs in
flight share one encoding, bad input is refused every time, and the byte budget holds."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import torch

from conftest import encode_bytes, photos
from servers import serve
from service.engine.cache import CachedItem, EncoderCache, cache_key, encode_entry
from service.model.results import EncodeResult

PHOTO = encode_bytes(photos()["coffee"].resize((120, 90)), "JPEG")
OTHER = encode_bytes(photos()["chelsea"].resize((90, 120)), "PNG")


class Counting:
    """Wraps the engine's preprocess and submit: how often each ran (and an optional delay, to overlap requests)."""

    def __init__(self, monkeypatch, engine, delay_s: float = 0.0):
        self.preprocessed, self.submitted = 0, 0
        preprocess, submit = engine.preprocess, engine.submit

        async def counted_preprocess(inputs, *a, **kw):
            self.preprocessed += len(inputs)
            await asyncio.sleep(delay_s)
            return await preprocess(inputs, *a, **kw)

        async def counted_submit(items, deadline, **kw):
            self.submitted += len(items)
            return await submit(items, deadline, **kw)

        monkeypatch.setattr(engine, "preprocess", counted_preprocess)
        monkeypatch.setattr(engine, "submit", counted_submit)


@pytest.fixture
def server(monkeypatch):
    with serve(max_wait_ms=5) as (url, app):
        yield url, Counting(monkeypatch, app.state.service.engine, delay_s=0.2)


def _post(url, body, query="", ctype="image/jpeg"):
    return httpx.post(f"{url}/embed{query}", content=body, headers={"content-type": ctype}, timeout=60)


def test_a_hit_does_not_reach_the_engine(server):
    url, counts = server
    first = _post(url, PHOTO, "?pooling=mean")
    assert first.status_code == 200 and first.headers["x-cache"] == "miss"
    assert (counts.preprocessed, counts.submitted) == (1, 1)
    again = _post(url, PHOTO, "?pooling=mean")
    assert again.status_code == 200 and again.headers["x-cache"] == "hit"
    assert (counts.preprocessed, counts.submitted) == (1, 1)
    assert again.json()["data"] == first.json()["data"]
    # the gauge counts what was written, before any eviction pass
    gauge = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
             if line.startswith("qwen3vl_embedding_cache_bytes ")]
    assert gauge and float(gauge[0].split()[1]) > 0, gauge
    # other renderings of the same result are hits too; other options are not
    assert _post(url, PHOTO, "?pooling=mean&encoding=base64&dtype=float16").headers["x-cache"] == "hit"
    for query in ("?pooling=mean&max_pixels=4096", "?pooling=mean&embeddings=false", "?pooling=mean&deepstack=true"):
        assert _post(url, PHOTO, query).headers["x-cache"] == "miss", query
    assert counts.submitted == 4
    metrics = httpx.get(f"{url}/metrics").text
    assert 'qwen3vl_embedding_cache_items_total{result="hit"} 2.0' in metrics
    assert 'qwen3vl_embedding_cache_items_total{result="miss"} 4.0' in metrics
    assert "qwen3vl_embedding_cache_bytes" in metrics


def test_a_request_of_hits_and_misses(server):
    url, counts = server
    assert _post(url, PHOTO).status_code == 200
    files = [("file", ("a", PHOTO, "image/jpeg")), ("file", ("b", OTHER, "image/png")), ("file", ("c", PHOTO, "x/y"))]
    r = httpx.post(f"{url}/embed", files=files, timeout=60)
    assert r.status_code == 200 and r.headers["x-cache"] == "miss"
    assert counts.submitted == 2  # the first photo, then only the other one
    data = r.json()["data"]
    assert data[0]["embeddings"] == data[2]["embeddings"] != data[1]["embeddings"]
    assert [d["index"] for d in data] == [0, 1, 2]


def test_identical_requests_in_flight_share_one_forward(server):
    url, counts = server

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(*(c.post(f"{url}/embed", content=OTHER, headers={"content-type": "image/png"})
                                          for _ in range(8)))

    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies)
    assert counts.submitted == 1 and counts.preprocessed == 1
    assert sorted(r.headers["x-cache"] for r in replies) == ["hit"] * 7 + ["miss"]
    assert len({r.content for r in replies}) == 1


def test_bad_input_is_refused_every_time_with_its_own_index(server):
    url, counts = server
    bad = PHOTO[: len(PHOTO) // 3]

    async def burst():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(
                c.post(f"{url}/embed", content=bad, headers={"content-type": "image/jpeg"}),
                c.post(f"{url}/embed", files=[("file", ("a", OTHER, "image/png")), ("file", ("b", bad, "x/y"))]))

    for _ in range(2):
        alone, second = asyncio.run(burst())
        assert alone.status_code == second.status_code == 422
        assert alone.json()["error"]["index"] == 0 and second.json()["error"]["index"] == 1
    assert _post(url, OTHER, ctype="image/png").status_code == 200


def test_an_input_shared_with_a_failing_request_is_still_served(server):
    """A request whose other input is bad fails; the request waiting on its good input encodes that itself."""
    url, _ = server

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            failing = asyncio.create_task(c.post(f"{url}/embed", files=[("file", ("a", OTHER, "image/png")),
                                                                        ("file", ("b", b"not an image", "x/y"))]))
            await asyncio.sleep(0.05)  # the first request leads OTHER's encoding
            good = await c.post(f"{url}/embed", content=OTHER, headers={"content-type": "image/png"})
            return await failing, good

    def shared() -> float:
        for line in httpx.get(f"{url}/metrics").text.splitlines():
            if line.startswith('qwen3vl_embedding_cache_items_total{result="shared"}'):
                return float(line.split()[1])
        return 0.0

    before = shared()
    failing, good = asyncio.run(together())
    assert failing.status_code == 422 and failing.json()["error"]["index"] == 1
    assert good.status_code == 200, good.text
    # it was encoded for this request after all: a miss, not a hit, and not counted as shared
    assert good.headers["x-cache"] == "miss" and shared() == before


def _entry(n_bytes: int, fill: float = 0.0, meta=None):
    n = n_bytes // 4
    result = EncodeResult(embeds=torch.full((n, 1), float(fill)), deepstack=torch.empty(0, n, 1), grid_thw=(1, 2, 2),
                          pooled=torch.empty(0), num_tokens=n)
    return CachedItem(meta or {"kind": "image"}), result


def _put(cache, key, value):
    async def run():
        cache.lead(key)
        cache.finish(key, value)

    asyncio.run(run())


def test_entries_round_trip(tmp_path):
    """Every dtype and shape a result holds, empty outputs and a video's description included."""
    cache = EncoderCache(str(tmp_path), 1 << 20)
    meta = {"kind": "video", "frame_indices": [0, 3, 6, 9], "timestamps": [0.25, 1.25], "source_frames": 10,
            "source_fps": 8.0}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        result = EncodeResult(embeds=torch.randn(7, 48).to(dtype), deepstack=torch.randn(2, 7, 48).to(dtype),
                              grid_thw=(2, 2, 14), pooled=torch.randn(48), num_tokens=7)
        key = cache_key(str(dtype).encode(), ("m",))
        _put(cache, key, (CachedItem(meta), result))
        item, got = cache.get(key)
        assert item.kind == "video" and item.meta == meta and got.grid_thw == (2, 2, 14) and got.num_tokens == 7
        for name in ("embeds", "deepstack", "pooled"):
            assert getattr(got, name).dtype == getattr(result, name).dtype
            assert torch.equal(getattr(got, name), getattr(result, name)), (dtype, name)
    empty = EncodeResult(embeds=torch.empty(0, 48), deepstack=torch.empty(0, 7, 48), grid_thw=(1, 2, 14),
                         pooled=torch.randn(48), num_tokens=7)
    _put(cache, "empty", (CachedItem({"kind": "image"}), empty))
    assert cache.get("empty")[1].embeds.shape == (0, 48)
    (tmp_path / "damaged").write_bytes(b"\x05\x00\x00\x00{}")  # a damaged entry is a miss, not an error
    assert cache.get("damaged") is None and cache.get("absent") is None


def test_processes_share_entries(tmp_path):
    """Two caches on one directory (two front-end processes): what one wrote, the other reads."""
    a, b = EncoderCache(str(tmp_path), 1 << 20), EncoderCache(str(tmp_path), 1 << 20)
    key = cache_key(PHOTO, ("m",))
    _put(a, key, _entry(400, fill=3.0))
    assert b.get(key)[1].embeds[0, 0] == 3.0


def test_byte_budget_least_recently_used_first_out(tmp_path):
    entry = len(b"".join(bytes(memoryview(p)) for p in encode_entry(*_entry(10_000))))
    cache = EncoderCache(str(tmp_path), 8 * entry + 100)  # an eighth of it: a pass after each write
    keys = [cache_key(bytes([i]), ("model", "opts")) for i in range(12)]
    for i, k in enumerate(keys):
        _put(cache, k, _entry(10_000, fill=i))
        os.utime(tmp_path / k, (1000 + i, 1000 + i))  # distinct times, whatever the clock's resolution
        if i == 9:
            assert cache.get(keys[0]) is None  # the oldest went first
            assert cache.get(keys[5]) is not None  # used: now the most recent
            os.utime(tmp_path / keys[5], (2000, 2000))
    assert cache.bytes <= 8 * entry + 100
    assert cache.get(keys[5]) is not None and cache.get(keys[11]) is not None
    assert sum(f.stat().st_size for f in tmp_path.iterdir()) <= 8 * entry + 100
    _put(cache, "big", _entry(8 * entry))  # over an eighth of the budget: served, not kept
    assert cache.get("big") is None


def test_keys_never_cross_models_or_options():
    base = cache_key(PHOTO, ("model-a", "torch.bfloat16", None, None, None, None, True, True))
    assert base == cache_key(PHOTO, ("model-a", "torch.bfloat16", None, None, None, None, True, True))
    assert base != cache_key(PHOTO, ("model-b", "torch.bfloat16", None, None, None, None, True, True))
    assert base != cache_key(PHOTO, ("model-a", "torch.float32", None, None, None, None, True, True))
    assert base != cache_key(PHOTO, ("model-a", "torch.bfloat16", 256, None, None, None, True, True))
    assert base != cache_key(OTHER, ("model-a", "torch.bfloat16", None, None, None, None, True, True))


def test_no_budget_keeps_nothing(monkeypatch):
    with serve(embedding_cache_mib=0) as (url, app):
        counts = Counting(monkeypatch, app.state.service.engine)
        assert _post(url, PHOTO).headers["x-cache"] == "miss"
        assert _post(url, PHOTO).headers["x-cache"] == "miss"
        assert counts.submitted == 2


def test_an_entry_is_written_after_the_callers_reply(tmp_path):
    """`finish` hands the result to the waiters at once, and writes the entry on the event loop's next turn: after
    the leader's reply has been sent (the write, a file created in the directory, once took ~0.2 ms of a lone
    request's time); the size callback (the metrics' gauge) hears of it then."""
    sizes = []
    cache = EncoderCache(str(tmp_path), 1 << 20, sizes.append)
    key, value = cache_key(b"photo", ("m",)), _entry(4096)

    async def run():
        cache.lead(key)
        waiter = cache.in_flight(key)
        cache.finish(key, value)
        assert waiter.done() and waiter.result() is value
        written_at_once = cache.get(key) is not None
        await asyncio.sleep(0)
        return written_at_once, cache.get(key)

    written_at_once, entry = asyncio.run(run())
    assert not written_at_once
    assert entry is not None and torch.equal(entry[1].embeds, value[1].embeds)
    assert sizes and sizes[-1] == cache.bytes > 4096


def test_large_entries_are_written_at_the_write_rate_small_ones_always(tmp_path):
    """Results of 256 KiB or more go through a token bucket of `write_bytes_per_s`, a second's worth deep; the rest
    are left unwritten (`on_skip` hears of each) and served all the same; small results are written whatever the
    bucket holds. With no rate every result is written."""
    now, skipped = [0.0], []
    cache = EncoderCache(str(tmp_path), 64 << 20, write_bytes_per_s=1 << 20, on_skip=lambda: skipped.append(1),
                         clock=lambda: now[0])
    big = 300 << 10  # bytes of each result's tensors: 3 fit in the bucket's 1 MiB, with 124 KiB left

    def put(first: int, n: int) -> list[bool]:
        for i in range(first, first + n):
            _put(cache, f"b{i}", _entry(big, fill=i))
        return [cache.get(f"b{i}") is not None for i in range(first, first + n)]

    assert put(0, 5) == [True, True, True, False, False] and len(skipped) == 2
    _put(cache, "small", _entry(4096))
    assert cache.get("small") is not None
    now[0] += 0.5  # 124 + 512 KiB: two more
    assert put(5, 3) == [True, True, False] and len(skipped) == 3
    now[0] += 10.0  # a long pause refills a second's worth, no more
    assert put(8, 5) == [True, True, True, False, False] and len(skipped) == 5
    unbounded = EncoderCache(str(tmp_path / "all"), 64 << 20)
    (tmp_path / "all").mkdir()
    for i in range(8):
        _put(unbounded, f"u{i}", _entry(big))
    assert all(unbounded.get(f"u{i}") is not None for i in range(8))


def test_the_server_s_cache_takes_the_write_rate_setting():
    with serve(embedding_cache_write_mib_s=3) as (url, app):
        cache = app.state.service.cache
        assert cache.write_bytes_per_s == 3 << 20 and cache.on_skip is not None
        assert _post(url, PHOTO).headers["x-cache"] == "miss" and _post(url, PHOTO).headers["x-cache"] == "hit"
