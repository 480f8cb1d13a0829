"""Batching, overload, deadlines, dropped clients, failure isolation and graceful shutdown."""

from __future__ import annotations

import asyncio
import math
import statistics
import threading
import time
from dataclasses import dataclass

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import random_pngs, rel_err
from servers import serve
from service.model.encoder import Encoder
from service.engine import batching
from service.engine.batching import Batcher
from service.errors import DeadlineExceeded, EngineUnavailable, InferenceFailed, Overloaded


class RecordingEncoder:
    """Wraps a real encoder: records each forward's size, optionally slows it down or fails it."""

    def __init__(self, inner: Encoder, delay_s=0.0, fail=None):
        self.inner, self.delay_s, self.fail = inner, delay_s, fail
        self.batches: list[int] = []
        self.lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def launch(self, items, deepstack=True, tokens=True):
        with self.lock:
            self.batches.append(len(items))
        if self.fail is not None:
            self.fail(items)
        time.sleep(self.delay_s)
        return self.inner.launch(items, deepstack, tokens)

    def encode(self, items, deepstack=True, tokens=True):
        return self.inner.finish(self.launch(items, deepstack, tokens))


@pytest.fixture(scope="module")
def tiny():
    return Encoder.load("random:tiny")


def test_concurrent_requests_are_batched_and_exact(tiny):
    enc = RecordingEncoder(tiny, delay_s=0.02)
    images = random_pngs(32)
    with serve(enc, max_wait_ms=30) as (url, app):
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(f"{url}/embed", content=img, headers={"content-type": "image/png"})
                                              for img in images))

        responses = asyncio.run(go())
    warm = enc.batches[:1]  # the start-up warm-up forward
    served = enc.batches[len(warm):]
    assert all(r.status_code == 200 for r in responses)
    assert len(served) < 32 and max(served) > 1, served  # batching happened
    for img, r in zip(images, responses):
        ref = tiny.encode([tiny.preprocess(img)])[0]
        assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5


def test_overload_answers_429_and_serves_every_accepted_request(tiny):
    enc = RecordingEncoder(tiny, delay_s=0.05)
    images = random_pngs(60, seed=1)
    with serve(enc, max_wait_ms=1, max_queue_items=4, max_batch_items=2) as (url, _):
        async def go():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*(c.post(f"{url}/embed", content=img, headers={"content-type": "image/png"})
                                              for img in images))

        responses = asyncio.run(go())
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) > 0 and codes.count(200) >= 4
    for r in responses:
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["type"] == "overloaded"
        else:
            assert r.json()["data"][0]["num_tokens"] > 0


def test_request_deadline_gives_503(tiny):
    enc = RecordingEncoder(tiny, delay_s=1.0)
    with serve(enc, request_timeout_s=0.3, warmup=False) as (url, _):
        r = httpx.post(f"{url}/embed", content=random_pngs(1)[0], headers={"content-type": "image/png"}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "deadline_exceeded"


def _engine(enc, **kw):
    args = dict(max_batch_patches=4096, max_batch_items=64, max_wait_ms=20, max_queue_items=64)
    args.update(kw)
    return Batcher(enc, **args)


class SimulatedDevice:
    """A real encoder's results on a simulated device: `launch` returns at once (or after `launch_s` of host work,
    which the device waits for), each pack computes for `seconds` after the previous one ends, and `finish` waits
    until it has. The GPU time it reports is the compute's; with `launch_s`, counted as CUDA events count it, from
    the launch's start, the device's wait for the host included."""

    def __init__(self, inner: Encoder, seconds: float, download_s: float | None = None, launch_s: float = 0.0,
                 keep=()):
        self.inner, self.seconds, self.download_s, self.launch_s = inner, seconds, download_s, launch_s
        self.packs: list[int] = []
        self.free_at = 0.0
        self.spans: list[tuple[float, float]] = []  # each pack's compute, start to end
        self._kept: dict[tuple, tuple] = {}
        self._results(keep, True, True)  # the test's items, computed before any launch is timed

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _results(self, items, deepstack, tokens) -> list:
        """The real encoder's result for each item, computed alone the first time the item comes (or when the device
        is made, for the items in its `keep`) and kept: the simulated launch's host time is then `launch_s`, not the
        tiny encoder's CPU forward, which took 20-80 ms on a loaded two-core machine, more than the compute
        simulated, and left the device idle between queued packs."""
        out = []
        for it in items:
            key = (id(it), deepstack, tokens)
            if key not in self._kept:  # the item is kept with its result, so its id is not reused
                self._kept[key] = (it, self.inner.encode([it], deepstack, tokens)[0])
            out.append(self._kept[key][1])
        return out

    def launch(self, items, deepstack=True, tokens=True):
        self.packs.append(len(items))
        begun = time.perf_counter()
        results = self._results(items, deepstack, tokens)
        if not self.launch_s:  # the device computes from the launch's start
            self.free_at = max(begun, self.free_at) + self.seconds
            return SimulatedForward(results, self.free_at, self.seconds, self.download_s)
        time.sleep(self.launch_s)
        marked = max(begun, self.free_at)  # where the device passes the event recorded as the launch begins
        self.free_at = max(time.perf_counter(), self.free_at) + self.seconds
        self.spans.append((self.free_at - self.seconds, self.free_at))
        return SimulatedForward(results, self.free_at, self.free_at - marked, self.download_s)

    def finish(self, pending):
        time.sleep(max(0.0, pending.done - time.perf_counter()))
        return pending.results


@dataclass
class SimulatedForward:
    results: list
    done: float  # time.perf_counter() at which the simulated device has finished it
    gpu_s: float  # its simulated GPU time
    download_s: float | None = None  # from its end to its outputs on the host (None: unknown, as on the CPU)
    eager: bool = False  # as the real forward's (`Pending.eager`)

    def ready(self) -> bool:
        return time.perf_counter() >= self.done


def test_an_idle_gpu_gets_a_pack_at_once_and_a_busy_one_the_next_pack_just_in_time(tiny):
    """With the GPU idle, a request is dispatched at once (no waiting to fill); the requests that arrive while its
    forward runs go, all of them, into the next pack, formed just before that forward ends."""
    img = Image.fromarray(np.random.default_rng(5).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    item = tiny.preprocess(img)
    device = SimulatedDevice(tiny, seconds=0.3, keep=[item])

    async def go():
        eng = _engine(device, max_wait_ms=0)
        await eng.start()
        await eng.submit([item], timeout_s=10)  # the engine learns how long a forward takes
        t0 = time.perf_counter()
        first = asyncio.create_task(eng.submit([item], timeout_s=10))
        await asyncio.sleep(0.05)
        rest = []
        for _ in range(4):  # arrive while the first forward runs
            rest.append(asyncio.create_task(eng.submit([item], timeout_s=10)))
            await asyncio.sleep(0.03)
        await first
        first_s = time.perf_counter() - t0
        await asyncio.gather(*rest)
        await eng.stop()
        return first_s

    first_s = asyncio.run(go())
    assert device.packs == [1, 1, 4]
    assert first_s < 0.3 + 0.15  # dispatched at once: its own forward, nothing waited before it


class BucketedDevice(SimulatedDevice):
    """A simulated device whose forwards compute whole graph buckets (`Encoder.computed_tokens`), with the GPU ms of
    each bucket's forward where `bucket_ms` gives them (`Encoder.forward_ms`)."""

    def __init__(self, inner: Encoder, seconds: float, buckets: tuple[int, ...], bucket_ms: dict | None = None,
                 launch_s: float = 0.0, keep=()):
        super().__init__(inner, seconds, launch_s=launch_s, keep=keep)
        self.buckets, self.bucket_ms = buckets, bucket_ms

    def computed_tokens(self, tokens: int) -> int:
        return next((b for b in self.buckets if b >= tokens), tokens)

    def forward_ms(self, tokens: int) -> float | None:
        return self.bucket_ms[self.computed_tokens(tokens)] if self.bucket_ms else None


def test_a_busy_gpus_pack_leaves_out_the_items_that_would_pad_its_graph_bucket(tiny, monkeypatch):
    """Five requests arrive while a forward runs; with buckets of 4 and 8 items' patches, the five would compute 8
    items' rows: the next pack takes 4 (its bucket full) and the fifth goes first in the pack after. An idle GPU's
    pack is never trimmed, and every result is the item's own. Margins for a loaded host (a CI run once saw the five go
    whole): the forward takes 0.8 s, so the five arrive within its first fifth, and the launches take 50 ms of host
    time, so the next pack is taken 75 ms before the forward's predicted end, not 1 ms."""
    monkeypatch.setattr(batching, "FORWARD_ROWS", 0)
    monkeypatch.setattr(batching, "TRIM_MIN_PATCHES", 0)
    rng = np.random.default_rng(11)
    items = [tiny.preprocess(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))) for _ in range(6)]
    n = items[0].num_patches
    device = BucketedDevice(tiny, seconds=0.8, buckets=(4 * n, 8 * n), launch_s=0.05, keep=items)

    async def go():
        eng = _engine(device, max_wait_ms=0)
        await eng.start()
        await eng.submit([items[5]], timeout_s=10)  # the engine learns how long a forward takes
        first = asyncio.create_task(eng.submit([items[5]], timeout_s=10))
        await asyncio.sleep(0.05)
        rest = []
        for it in items[:5]:  # arrive while the forward runs
            rest.append(asyncio.create_task(eng.submit([it], timeout_s=10)))
            await asyncio.sleep(0.02)
        results = [await first] + await asyncio.gather(*rest)
        await eng.submit(items[:5], timeout_s=10)  # on an idle GPU: whole
        await eng.stop()
        return results

    results = asyncio.run(go())
    assert device.packs == [1, 1, 4, 1, 5]
    for it, r in zip([items[5]] + items[:5], results):
        ref = tiny.encode([it])[0]
        assert rel_err(r.results[0].embeds, ref.embeds) <= 1e-5


# the trimming tests' own buckets (about 1.125x apart up to 16,384, then every 1024): they test the trim, not the
# defaults
TRIM_BUCKETS = (256, 320, 400, 512, 640, 800, 1024, 1280, 1600, 2048, 2560, 3200, 4096, 4608, 5120, 5632, 6400, 7168,
                8192, 9216, 10240, 11776, 12800, 14336, *range(16384, 32769, 1024))


def _trimmer(buckets, bucket_ms=None):
    """A stand-in for `Batcher` with what `Batcher._trim` reads: an encoder of these buckets (and timings)."""
    class Fake:
        encoder = BucketedDevice.__new__(BucketedDevice)

    Fake.encoder.buckets, Fake.encoder.bucket_ms = buckets, bucket_ms
    return Fake()


def test_trimming_picks_the_prefix_that_fills_its_bucket_and_never_trims_without_buckets():
    """Untimed buckets (rows plus a forward's fixed cost): 448 px images (784 patches) on the buckets up to 16,384
    then every 1024: a pack of 34 (26,656 patches; 27,648 rows) goes as 30 (23,520 in 23,552), packs of 30 and 13
    (fill 99.9% and 99.5%) go whole, and so does every pack where forwards compute no padding (no graphs)."""
    trim = Batcher._trim
    bucketed, eager = _trimmer(TRIM_BUCKETS), _trimmer(())
    assert trim(bucketed, [784] * 34) == 30
    assert trim(bucketed, [784] * 30) == 30
    assert trim(bucketed, [784] * 13) == 13
    assert trim(bucketed, [784] * 4) == 4  # under TRIM_MIN_PATCHES
    for k in (2, 5, 30, 41):
        assert trim(eager, [784] * k) == k
    # mixed sizes: never below three quarters of the patches, and the rows per patch of what goes are the least
    sizes = [196, 3136, 784, 1024, 256, 4096, 784, 784, 3136, 196, 1024, 784, 4096, 256]
    k = trim(bucketed, sizes)
    total = sum(sizes)
    assert sum(sizes[:k]) >= 0.75 * total

    def rows_per_patch(j):
        t = sum(sizes[:j])
        return (batching.FORWARD_ROWS + bucketed.encoder.computed_tokens(t)) / t

    assert all(rows_per_patch(k) <= rows_per_patch(j) for j in range(1, len(sizes) + 1)
               if sum(sizes[:j]) >= 0.75 * total)


def test_trimming_follows_the_timed_buckets_where_a_row_costs_more_in_some():
    """With each bucket's forward timed at start-up (`Encoder.forward_ms`), a pack goes as the prefix whose forward
    costs the least GPU time a patch, not the least rows: where the bucket of 30,720 rows costs 4% more a row than
    its neighbours (a GEMM's last wave of tiles on few SMs), a pack of 41 448 px images goes as 35 (27,440 patches
    in 27,648 rows), not 39 (30,576 in 30,720, which the rows alone pick); with the same time a row everywhere it
    goes as 39."""
    even = {b: 1.4e-3 * b + 0.5 for b in TRIM_BUCKETS}  # ms: a fixed cost and the same time a row
    uneven = {**even, 30720: even[30720] * 1.04}
    trim = Batcher._trim
    assert trim(_trimmer(TRIM_BUCKETS), [784] * 41) == 39  # the rows alone
    assert trim(_trimmer(TRIM_BUCKETS, even), [784] * 41) == 39
    assert trim(_trimmer(TRIM_BUCKETS, uneven), [784] * 41) == 35
    assert trim(_trimmer(TRIM_BUCKETS, uneven), [784] * 30) == 30  # 23,552 rows: not that bucket


def test_the_forward_trace_has_a_line_per_forward_with_its_pack_and_times(tiny, tmp_path):
    """`forward_trace`: a CSV line per forward: its items and patches as packed, its device time (the simulated
    device's) and launch-to-outputs time, appended to what the file held."""
    items = [tiny.preprocess(i) for i in random_pngs(5, seed=8)]
    device = SimulatedDevice(tiny, seconds=0.05, keep=items)
    trace = tmp_path / "forwards.csv"
    trace.write_text("earlier line\n")

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=2, trace=str(trace))
        await eng.start()
        await eng.submit(items, timeout_s=10)
        await eng.stop()

    asyncio.run(go())
    lines = trace.read_text().splitlines()
    assert lines[0] == "earlier line" and len(lines) == 1 + len(device.packs) == 4  # packs of 2, 2, 1
    rows = [line.split(",") for line in lines[1:]]
    assert [int(r[2]) for r in rows] == device.packs == [2, 2, 1]
    assert sum(int(r[3]) for r in rows) == sum(it.num_patches for it in items)
    assert all(r[1] == "cpu" and float(r[4]) == 50.0 and float(r[5]) >= 45.0 for r in rows), rows


def test_the_trace_splits_each_launch_s_host_time_into_its_inputs_forward_and_outputs(tiny, tmp_path):
    """The real encoder gives its launch's host time in parts (`Pending.host_s`), the last three columns of a
    trace line: each at least 0, together within the launch's ms that the batcher measured around the call (which
    adds the hop to the forward thread); on the CPU the forward itself runs in the launch, so it takes more than
    the inputs' patchify."""
    items = [tiny.preprocess(i) for i in random_pngs(5, seed=12)]
    trace = tmp_path / "forwards.csv"

    async def go():
        eng = _engine(tiny, max_wait_ms=0, max_batch_items=2, trace=str(trace))
        await eng.start()
        await eng.submit(items, timeout_s=30)
        await eng.stop()

    asyncio.run(go())
    rows = [[float(x) for x in line.split(",")[2:]] for line in trace.read_text().splitlines()]
    assert [int(r[0]) for r in rows] == [2, 2, 1]
    for r in rows:
        launch, (inputs, forward, outputs) = r[4], r[9:12]
        assert min(inputs, forward, outputs) >= 0 and inputs + forward + outputs <= launch + 0.01, r
        assert forward > inputs, r


def test_the_trace_says_how_long_the_gpu_idled_before_each_forward_and_how_late_its_end_was_predicted(tiny, tmp_path):
    """Where the GPU's times can be read (CUDA events; here the simulated device's), a forward's trace line adds its
    launch's host ms, the GPU's idle ms between the previous forward's end and its start, and how many ms after its
    end the batcher had predicted at its launch that it would end: a forward launched on a GPU left idle for 0.2 s
    shows that idle time, forwards queued behind one another show none, and each end is predicted within a
    forward's time and a launch's of when it came (this device computes from the moment a launch begins; the
    batcher's model learns when it does: `Batcher._learn`)."""
    item = tiny.preprocess(random_pngs(1, seed=9)[0])
    device = SimulatedDevice(tiny, seconds=0.05, download_s=0.0, keep=[item])
    trace = tmp_path / "forwards.csv"

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=1, trace=str(trace))
        await eng.start()
        await eng.submit([item], timeout_s=10)  # the batcher learns a forward's time
        await asyncio.sleep(0.2)  # the GPU idles
        await eng.submit([item], timeout_s=10)
        await eng.submit([item] * 4, timeout_s=10)  # four packs of one, each queued behind the one before
        await eng.stop()

    asyncio.run(go())
    rows = [line.split(",") for line in trace.read_text().splitlines()]
    assert len(rows) == len(device.packs) == 6 and all(len(r) == 15 and r[9] == "0" for r in rows)
    assert all(x == "nan" for r in rows for x in r[11:14])  # a launch's parts: this device does not give them
    assert all(0 <= float(r[10]) <= max(float(x[6]) for x in rows) for r in rows[1:])  # the wait: within a launch
    launch, idle, late = ([float(r[i]) for r in rows] for i in (6, 7, 8))
    assert all(0 <= x < 50 for x in launch), launch
    assert math.isnan(idle[0]) and 195 <= idle[1] <= 320, idle  # the first has no forward before it
    assert all(abs(x) <= 10 for x in idle[3:]), idle  # queued: started as the one before ended (10 ms: wake-ups)
    assert all(abs(x) <= 50 + max(launch) for x in late[1:]), (late, launch)
    # the last column: how long after the GPU's previous end a launch returned; the one on the idle GPU, all of
    # its idle time; those queued behind another, none (nan: returned in time; 10 ms: wake-ups)
    exposed = [float(r[14]) for r in rows]
    assert math.isnan(exposed[0]) and abs(exposed[1] - idle[1]) <= launch[1] + 1, (exposed, idle)
    assert all(math.isnan(x) or x <= 10 for x in exposed[3:]), exposed


def test_clients_take_turns_in_a_pack_so_a_large_request_cannot_hold_a_lone_image_behind_it(tiny):
    """One client's request of 12 images is queued, then another client's single image: with room for 4 items a
    pack, the single image goes in the very next pack (turns between clients), not after the 12; each client's items
    keep their order, and every result is what encoding it alone gives."""
    img = Image.fromarray(np.random.default_rng(6).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    big = [tiny.preprocess(i) for i in random_pngs(12, seed=7)]
    lone = tiny.preprocess(img)
    device = SimulatedDevice(tiny, seconds=0.1, keep=big + [lone])
    order: list[str] = []

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=4)
        await eng.start()
        await eng.submit([lone], timeout_s=10)  # the engine learns how long a forward takes
        device.packs.clear()
        blocker = asyncio.create_task(eng.submit([lone], timeout_s=10, client="c"))  # keeps the GPU busy
        await asyncio.sleep(0.01)
        many = asyncio.create_task(eng.submit(big, timeout_s=10, client="a"))
        await asyncio.sleep(0.01)
        one = asyncio.create_task(eng.submit([lone], timeout_s=10, client="b"))
        one.add_done_callback(lambda _: order.append("b"))
        many.add_done_callback(lambda _: order.append("a"))
        await asyncio.gather(blocker, many, one)
        await eng.stop()
        return many.result(), one.result()

    many, one = asyncio.run(go())
    assert device.packs[0] == 1 and sum(device.packs) == 14, device.packs
    assert device.packs[1] == 4 and order[0] == "b", (device.packs, order)  # the lone image went in the next pack
    for item, result in zip(big + [lone], many.results + one.results):
        ref = tiny.encode([item])[0]
        assert rel_err(result.embeds, ref.embeds) <= 1e-5


def test_one_client_alone_gets_the_queue_in_order(tiny):
    items = [tiny.preprocess(i) for i in random_pngs(6, seed=8)]
    device = SimulatedDevice(tiny, seconds=0.05, keep=items)

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=4)
        await eng.start()
        blocker = asyncio.create_task(eng.submit(items[:1], timeout_s=10, client="a"))
        await asyncio.sleep(0.01)
        rest = [asyncio.create_task(eng.submit([it], timeout_s=10, client="a")) for it in items[1:]]
        done = await asyncio.gather(blocker, *rest)
        await eng.stop()
        return done

    done = asyncio.run(go())
    assert device.packs == [1, 4, 1], device.packs
    for item, d in zip(items, done):
        assert rel_err(d.results[0].embeds, tiny.encode([item])[0].embeds) <= 1e-5


def test_abandoned_items_are_dropped_before_compute(tiny):
    enc = RecordingEncoder(tiny)
    items = [tiny.preprocess(img) for img in random_pngs(3, seed=2)]

    async def go():
        eng = _engine(enc)
        await eng.start()
        gone = asyncio.create_task(eng.submit(items[:2], timeout_s=10, abandoned=lambda: True))
        kept = await eng.submit(items[2:], timeout_s=10)
        gone.cancel()
        await eng.stop()
        return kept

    results = asyncio.run(go()).results
    assert len(results) == 1 and enc.batches == [1]  # the abandoned request's 2 items never reached a forward


def test_a_lone_pack_launches_on_the_event_loop_and_packs_behind_others_on_the_forward_thread(tiny):
    """With `inline_launch` (on by default with CUDA, where a launch returns before the GPU is done), a pack of one
    item with nothing in flight and nothing queued behind it is dispatched from the event loop's thread, and the
    loop polls for its end until other work arrives (then the finisher thread waits); while one is in flight, packs
    go to the forward thread and the finisher thread, and so does a pack of several items on an idle GPU (its
    launch would hold the loop). Results are the same either way."""
    items = [tiny.preprocess(img) for img in random_pngs(6, seed=6)]
    device = SimulatedDevice(tiny, seconds=0.2, keep=items)
    threads, finished_on = [], []
    launch, finish = device.launch, device.finish

    def recording(batch, deepstack=True, tokens=True):
        threads.append(threading.current_thread() is threading.main_thread())
        return launch(batch, deepstack, tokens)

    def finishing(pending):
        finished_on.append(threading.current_thread() is threading.main_thread())
        return finish(pending)

    device.launch, device.finish = recording, finishing

    async def go():
        eng = _engine(device, max_wait_ms=0)
        assert not eng.inline_launch  # a CPU encoder: a launch there is the whole forward
        eng.inline_launch = True
        await eng.start()
        alone = await eng.submit(items[:1], timeout_s=10)
        first = asyncio.create_task(eng.submit(items[1:2], timeout_s=10))
        await asyncio.sleep(0.05)
        behind = await eng.submit(items[2:4], timeout_s=10)  # arrives while `first` computes
        await first
        several = await eng.submit(items[4:], timeout_s=10)  # two items on an idle GPU
        await eng.stop()
        return alone, behind, several

    alone, behind, several = asyncio.run(go())
    assert threads == [True, True, False, False]
    assert finished_on == [True, False, False, False]  # `first` stopped being polled when `behind` arrived
    for it, r in zip(items[:1] + items[2:], alone.results + behind.results + several.results):
        assert rel_err(r.embeds, tiny.encode([it])[0].embeds) <= 1e-5


@pytest.mark.parametrize("inline", [False, True])
def test_oom_splits_the_batch_and_a_failing_item_fails_alone(tiny, inline):
    """A pack that runs out of device memory is split down until its parts fit; an item that fails alone gets a
    503-class `InferenceFailed` (out of memory even alone, or any other exception) and nothing else is affected."""
    items = [tiny.preprocess(img) for img in random_pngs(7, seed=3)]
    poison, hog = items[4], items[6]

    def fail(batch):
        if len(batch) > 2 or any(it is hog for it in batch):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        if any(it is poison for it in batch):
            raise RuntimeError("kernel exploded")

    enc = RecordingEncoder(tiny, fail=fail)

    async def go():
        eng = _engine(enc)
        eng.inline_launch = inline
        await eng.start()
        outs = await asyncio.gather(*(eng.submit([it], timeout_s=10) for it in items), return_exceptions=True)
        await eng.stop()
        return outs

    outs = asyncio.run(go())
    for it, out in zip(items, outs):
        if it is poison:
            assert isinstance(out, InferenceFailed) and "kernel exploded" in str(out)
        elif it is hog:
            assert isinstance(out, InferenceFailed) and "out of device memory" in str(out) and out.retry_after
        else:
            assert rel_err(out.results[0].embeds, tiny.encode([it])[0].embeds) <= 1e-5
    assert max(enc.batches) == 7 and 1 in enc.batches  # tried whole, then split down


def test_device_fault_fails_the_pack_and_queue_and_reports_once(tiny):
    """A CUDA error other than out-of-memory poisons the context: no split and retry; the pack and everything
    queued fail with `EngineUnavailable` (503), later submits too, and `on_fault` fires once (the engine process
    exits there and is restarted)."""
    items = [tiny.preprocess(img) for img in random_pngs(6, seed=8)]

    def fail(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    faults = []
    enc = RecordingEncoder(tiny, fail=fail, delay_s=0.05)

    async def go():
        eng = _engine(enc, max_batch_items=2, max_wait_ms=0)
        eng.on_fault = faults.append
        await eng.start()
        outs = await asyncio.gather(*(eng.submit([it], timeout_s=10) for it in items), return_exceptions=True)
        later = await asyncio.gather(eng.submit(items[:1], timeout_s=10), return_exceptions=True)
        await eng.stop()
        return outs + later

    outs = asyncio.run(go())
    assert all(isinstance(o, EngineUnavailable) for o in outs), outs
    assert len(faults) == 1 and enc.batches == [2]


def test_a_device_fault_takes_a_single_process_server_out_of_service(tiny):
    """With no engine process (`http_workers=0`) nothing replaces the engine after a device fault: the request that
    hit it gets 503, /ready turns 503 (an orchestrator restarts the container), and every later request gets 503
    naming the fault, with Retry-After."""
    def fail(batch):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    image = {"content": random_pngs(1)[0], "headers": {"content-type": "image/png"}, "timeout": 30}
    with serve(RecordingEncoder(tiny, fail=fail), warmup=False) as (url, _):
        assert httpx.get(f"{url}/ready").status_code == 200
        first = httpx.post(f"{url}/embed", **image)
        ready = httpx.get(f"{url}/ready")
        later = httpx.post(f"{url}/embed", **image)
        info = httpx.get(f"{url}/info").json()
    assert first.status_code == 503 and first.json()["error"]["type"] == "engine_unavailable"
    assert ready.status_code == 503 and info["engine"]["state"] == "failed"
    assert later.status_code == 503 and "device fault" in later.json()["error"]["message"]
    assert int(later.headers["retry-after"]) > 0


def test_engine_overload_and_deadline(tiny):
    enc = RecordingEncoder(tiny, delay_s=0.5)
    items = [tiny.preprocess(img) for img in random_pngs(4, seed=4)]

    async def go():
        eng = _engine(enc, max_queue_items=2, max_wait_ms=0)
        await eng.start()
        first = asyncio.create_task(eng.submit(items[:2], timeout_s=10))
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):
            await eng.submit(items[2:], timeout_s=10)
        await first
        with pytest.raises(DeadlineExceeded):
            await eng.submit(items[:1], timeout_s=0.05)
        await eng.stop()

    asyncio.run(go())


def test_the_warm_up_compiles_what_videos_and_odd_sized_packs_meet(tiny):
    """Triton compiles a kernel anew per specialisation of its integer arguments (1, divisible by 16, neither): a
    first video or a first pack of equal odd-length segments compiled for seconds while every request waited (the
    soak's stalls). On a GPU the warm-up runs, per length class, a lone image and a full pack of one size for a
    patch count divisible by 16 and one that is not, a few images of the first (a pack that does not fill the GPU,
    of several segments: a 4-GPU node's packs of five 448 px images compiled mid-traffic), a two-frame video alone,
    two in a row, and among images; each pack is one the tower encodes."""
    from service.engine.build import _warm_packs
    from service.settings import Settings

    packs = []

    class OnCuda:  # the warm-up's view of a CUDA encoder; its packs run on the CPU tower
        device = torch.device("cuda", 0)
        preprocessor = tiny.preprocessor
        preprocess = staticmethod(tiny.preprocess)

        @staticmethod
        def encode(items):
            packs.append([(it.kind, it.grid_thw) for it in items])
            assert len(tiny.encode(items)) == len(items)

    _warm_packs(OnCuda(), Settings(max_batch_patches=4096, max_batch_items=16))
    lone = {p[0] for p in packs if len(p) == 1}
    uniform = {p[0] for p in packs if len(p) > 1 and len(set(p)) == 1 and p[0][0] == "image"}
    for counts in (lone, uniform):
        sizes = {t * h * w for kind, (t, h, w) in counts if kind == "image"}
        assert any(n % 16 == 0 for n in sizes) and any(n % 16 for n in sizes), sizes
    few = {(len(p), p[0]) for p in packs if 1 < len(p) < max(len(q) for q in packs if q[0] == p[0])
           and len(set(p)) == 1 and p[0][0] == "image" and p[0][1][1] * p[0][1][2] % 16 == 0}
    assert {n for n, _ in few} >= {2, 3}, few
    videos = [p for p in packs if any(kind == "video" and grid[0] == 2 for kind, grid in p)]
    assert any(len(p) == 1 for p in videos)  # alone
    assert any(len(p) == 2 and p[0] == p[1] for p in videos)  # two in a row: one patchify run of two
    assert any(any(kind == "image" for kind, _ in p) for p in videos)  # among images
    assert max(sum(t * h * w for _, (t, h, w) in p) for p in packs) <= 4096


def test_the_warm_up_covers_every_attention_specialisation_a_served_pack_meets():
    """What the varlen attention kernel is specialised on, as a model: the tuner's key (the longest segment's
    length class and whether the pack fills the GPU, `kernels.attention.tiles`), whether every segment has the
    longest one's length (`UNIFORM`: never for a pack padded into a graph bucket) and whether the longest one's
    length is divisible by 16 (Triton's specialisation of an integer argument). Random packs of photos of 224 to
    1536 px and of videos, at the default budget, as the 2B serves them (padded into a bucket; eager and unpadded
    past the whole-forward limit; a lone frame within it runs a captured whole forward) meet only what the
    warm-up's packs (eager, unpadded) compiled: the first mixed photos compiled twice mid-traffic without it."""
    from kernels.attention.tiles import load_class, seq_bucket
    from service.engine.build import _warm_packs
    from service.model.graphs import WHOLE_MAX_TOKENS
    from service.model.loader import model_configs
    from service.model.preprocess import Preprocessor
    from service.settings import Settings

    cfg, pre_cfg = model_configs("random:qwen3-vl-2b")
    settings = Settings()
    budget, cap, heads = settings.max_batch_patches, settings.max_batch_items, cfg.num_heads

    def specialisation(segments: list[int], padded: bool) -> tuple:
        longest = max(segments)
        return (seq_bucket(longest), load_class(sum(segments), heads),
                not padded and all(n == longest for n in segments), longest % 16 == 0)

    def segments(grids) -> list[int]:  # a frame per segment
        return [h * w for t, h, w in grids for _ in range(t)]

    warmed = []

    class OnCuda:  # the warm-up's view of the 2B on a GPU: its packs recorded, not run
        device = torch.device("cuda", 0)
        preprocessor = Preprocessor(pre_cfg)
        preprocess = preprocessor

        @staticmethod
        def encode(items):
            warmed.append([it.grid_thw for it in items])

    _warm_packs(OnCuda(), settings)
    covered = {specialisation(segments(p), padded=False) for p in warmed}
    rng = np.random.default_rng(11)
    met = set()
    for _ in range(3000):
        grids, tokens = [], 0
        top = int(rng.integers(7, 49))  # the pack's largest side (small photos come in packs of their own too)
        for _ in range(int(rng.integers(1, cap + 1))):
            h, w = (2 * int(x) for x in rng.integers(7, top + 1, size=2))  # 224-1536 px: 14-96 patches, even
            t = int(rng.integers(1, 5)) if rng.random() < 0.1 else 1  # a video's frames now and then
            if grids and tokens + t * h * w > budget:
                break
            grids.append((t, h, w))
            tokens += t * h * w
        segs = segments(grids)
        if tokens > WHOLE_MAX_TOKENS:
            met.add(specialisation(segs, padded=False))  # past the whole-forward limit a pack may run eagerly
        if len(segs) > 1 or tokens > WHOLE_MAX_TOKENS:
            met.add(specialisation(segs, padded=True))
    assert met - covered == set(), sorted(met - covered)


def test_a_client_flooding_the_queue_is_refused_while_another_still_gets_in(tiny):
    """Past `max_queue_items`, a client is admitted only within an equal share of the queue: one client's flood
    fills it, then that client gets 429s while another client's request is queued and served (up to twice the
    bound in all); a single client alone still has the whole queue."""
    items = [tiny.preprocess(i) for i in random_pngs(4, seed=9)]
    device = SimulatedDevice(tiny, seconds=0.2, keep=items)

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=2, max_queue_items=8)
        await eng.start()
        busy = asyncio.create_task(eng.submit(items[:2], timeout_s=10, client="flood"))  # holds the device
        await asyncio.sleep(0.02)
        flood = [asyncio.create_task(eng.submit(items, timeout_s=10, client="flood")) for _ in range(2)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded, match="this client's"):  # the queue is full, with this client's items
            await eng.submit(items[:1], timeout_s=10, client="flood")
        other = asyncio.create_task(eng.submit(items[:1], timeout_s=10, client="other"))  # within its share
        await asyncio.sleep(0)
        with pytest.raises(Overloaded):  # three clients: a share is 8 // 3 = 2 items
            await eng.submit(items[:3], timeout_s=10, client="third")
        third = asyncio.create_task(eng.submit(items[:2], timeout_s=10, client="third"))
        done = await asyncio.gather(busy, *flood, third)
        other = await other
        await eng.stop()
        return other, done

    other, done = asyncio.run(go())
    assert rel_err(other.results[0].embeds, tiny.encode(items[:1])[0].embeds) <= 1e-5
    assert sum(len(d.results) for d in done) == 12


def test_a_requests_timing_says_how_many_items_shared_its_pack(tiny):
    """`Timing.pack_items`: the most items in a pack that computed one of the request's (what the engine process's
    latency policy reads to copy a lone pack's result on its loop): 1 for a request alone, the pack's size for
    requests that shared one."""
    items = [tiny.preprocess(img) for img in random_pngs(4, seed=3)]

    async def go():
        batcher = _engine(tiny, max_wait_ms=50)
        await batcher.start()
        try:
            alone = await batcher.submit(items[:1], timeout_s=30)
            together = await asyncio.gather(batcher.submit(items[1:3], timeout_s=30),
                                            batcher.submit(items[3:], timeout_s=30))
        finally:
            await batcher.stop()
        return alone, together

    alone, together = asyncio.run(go())
    assert alone.timing.pack_items == 1
    assert [e.timing.pack_items for e in together] == [3, 3]


def test_the_launch_model_learns_the_gpu_compute_and_apart_the_wait_and_counts_the_gpu_s_wait_for_launches(tiny):
    """A forward's CUDA-event time counts from its launch's start: on a GPU left idle, its wait for the launch's host
    work too. The batcher's model learns the compute per patch from forwards the GPU reached with their work all
    queued, and the wait from those that found it idle (`Batcher._learn`), so a launch's host time does not push
    the predicted end of a queued forward later (the 64-client slow mode), and a starved one's end is still right.

    `launch_wait_s` (exported as `qwen3vl_gpu_launch_wait_seconds`): a launch onto an idle GPU is the request's
    latency, not counted; launches dispatched while a forward computes that return after it ended (0.1 s of host
    work against 0.05 s forwards) left the GPU waiting about 0.05 s each, counted, part of the GPU time; launches
    quicker than a forward add nothing."""
    item = tiny.preprocess(random_pngs(1, seed=10)[0])
    device = SimulatedDevice(tiny, seconds=0.05, download_s=0.0, launch_s=0.1, keep=[item])

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=1)
        await eng.start()
        for _ in range(4):  # one at a time: each launch finds the GPU idle
            await eng.submit([item], timeout_s=10)
        starved = eng._s_per_patch * item.num_patches, eng._wait_s, eng.launch_wait_s
        await eng.submit([item] * 6, timeout_s=10)  # packs of one, each dispatched while the one before computes
        slow = eng.launch_wait_s
        device.launch_s = 0.0  # launches quicker than a forward: packs of one queued behind one another
        await eng.submit([item] * 6, timeout_s=10)
        await eng.stop()
        return eng, starved, slow

    eng, (compute, wait, alone), slow = asyncio.run(go())
    assert eng.gpu_busy_s >= 4 * 0.14  # the events' count: the launches' 0.1 s included
    assert 0.045 <= compute <= 0.07, compute  # 0.05 s (the finisher's wake-up adds a little)
    assert 0.09 <= wait <= 0.15, wait  # the 0.1 s launch
    assert 0.045 <= eng._s_per_patch * item.num_patches <= 0.07  # queued forwards: the compute again
    assert alone == 0.0 and 5 * 0.03 <= slow <= 5 * 0.1 and slow < eng.gpu_busy_s, (alone, slow)
    assert eng.launch_wait_s - slow <= 0.02 and eng.stats().launch_wait_s == eng.launch_wait_s


async def _closed_loop(eng, item, clients: int, each: int) -> None:
    """`clients` closed-loop clients, each submitting `item` alone `each` times, one request after the other."""
    async def client():
        for _ in range(each):
            await eng.submit([item], timeout_s=10)

    await asyncio.gather(*(client() for _ in range(clients)))


def test_a_compute_estimate_from_a_small_pack_is_mended_and_never_holds_launches_behind_the_gpus_end(tiny):
    """A pack costs much the same GPU time whatever its size here (as a small pack does on a GPU: per patch, more),
    so the first forward, a lone image, teaches a GPU time per patch four times what the packs of four then cost.
    Predicted from it, and each prediction stacked on the last, the GPU's end ran ahead of the GPU, every pack
    waited for the one before to be answered, and the GPU idled through each launch, for good: no forward then
    found its work queued, which is where the compute is learned. Re-anchored on each measured end and bounded by
    what a forward that found the GPU idle shows, the model comes back: launches overlap the forward before and
    the device stays busy (`Batcher._learn`, `Batcher._reanchor`)."""
    item = tiny.preprocess(random_pngs(1, seed=11)[0])
    device = SimulatedDevice(tiny, seconds=0.06, download_s=0.0, launch_s=0.02, keep=[item])

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=4)
        await eng.start()
        await eng.submit([item], timeout_s=10)  # the lone first pack
        await _closed_loop(eng, item, clients=8, each=8)  # two packs of four, one computing while the other launches
        await eng.stop()
        return eng

    eng = asyncio.run(go())
    spans = device.spans[-8:]
    busy = sum(e - s for s, e in spans) / (spans[-1][1] - spans[0][0])
    assert busy >= 0.85, (busy, device.packs)  # serialised launches: at most 0.06 / (0.06 + 0.02 + the rest) = 0.75
    assert eng._s_per_patch * 4 * item.num_patches <= 0.075  # a pack of four: 0.06 s of compute
    assert eng._gpu_free_at <= time.perf_counter()  # nothing in flight: predicted from where the last forward ended


def test_a_forward_that_fails_while_finishing_leaves_the_launch_model_clean(tiny):
    """A pack whose outputs cannot be read fails its items (503-class `InferenceFailed`), and the launch model forgets
    it: the packs after it are served, and with nothing in flight the GPU is predicted free, not waiting for it."""
    item = tiny.preprocess(random_pngs(1, seed=12)[0])

    class FailsOnce(SimulatedDevice):
        failed = False

        def finish(self, pending):
            if not self.failed:
                self.failed = True
                raise RuntimeError("outputs unreadable")
            return super().finish(pending)

    device = FailsOnce(tiny, seconds=0.03, download_s=0.0)

    async def go():
        eng = _engine(device, max_wait_ms=0)
        await eng.start()
        with pytest.raises(InferenceFailed, match="outputs unreadable"):
            await eng.submit([item], timeout_s=10)
        done = await asyncio.gather(*(eng.submit([item], timeout_s=10) for _ in range(6)))
        await eng.stop()
        return eng, done

    eng, done = asyncio.run(go())
    (want,) = tiny.encode([item])
    assert all(rel_err(d.results[0].embeds, want.embeds) <= 1e-5 for d in done)  # packed or not
    assert not eng._flight and eng._gpu_free_at <= time.perf_counter()


def test_the_closed_loop_simulator_drives_the_real_batcher_over_graph_buckets():
    """`tools.sim_closed_loop` (what the launch model's fixes were reproduced with) runs the real `Batcher` against
    its simulated GPU, which must answer what the batcher asks an encoder (`computed_tokens`, `forward_ms`): 32
    closed-loop clients over the default buckets keep the simulated GPU busy, in packs of more than one image."""
    from service.settings import DEFAULT_GRAPH_BUCKETS
    from tools.sim_closed_loop import SimulatedGPU, run

    gpu = SimulatedGPU(a_s=0.001, b_s=0.002, launch_s=0.002, buckets=DEFAULT_GRAPH_BUCKETS)
    out = asyncio.run(run(clients=32, frontends=4, frontend_s=0.002, network_s=0.0005, gpu=gpu, seconds=1.0,
                          warmup_s=0.3, max_items=64))
    assert out["gpu_busy"] >= 0.5 and out["images_per_forward"] > 1 and out["images_per_s"] > 0, out
    assert gpu.forward_ms(784 * 30) == pytest.approx((0.001 + 0.002 * 23552 / 784) * 1000)


def test_a_slow_first_launch_does_not_leave_every_later_end_predicted_late(tiny, tmp_path):
    """A cold start's first launch takes the host long (here 0.3 s: on a GPU, a 256-client burst's first packs), and
    the idle GPU's wait for it is what the model learns as an idle GPU's wait. Under load every later forward is
    queued behind a busy GPU, so none teaches the wait again: predicted from it, each end came a first launch late
    (on an H200 at 256 clients 125-250 ms, `ab_served_defaults.json`), and a pack filling for a lighter load after
    would wait that long past the GPU's real end. An idle GPU waits for at most the launch's own host time: the ends
    of the busy forwards are predicted within a forward of when they came (`Batcher._predicted_end`)."""
    item = tiny.preprocess(random_pngs(1, seed=13)[0])

    class ColdStart(SimulatedDevice):
        def launch(self, items, deepstack=True, tokens=True):
            self.launch_s = 0.4 if len(self.packs) < 3 else 0.0
            return super().launch(items, deepstack, tokens)

    # a pack's compute (0.12 s) above a warm launch's host time (none: the device keeps the item's result)
    device = ColdStart(tiny, seconds=0.12, download_s=0.0, launch_s=0.4)
    trace = tmp_path / "forwards.csv"

    async def go():
        eng = _engine(device, max_wait_ms=0, max_batch_items=4, trace=str(trace))
        await eng.start()
        for _ in range(3):  # the cold first launches, each on an idle GPU
            await eng.submit([item], timeout_s=10)
        await _closed_loop(eng, item, clients=16, each=4)  # packs of four: the GPU never idles again
        await eng.stop()
        return eng

    eng = asyncio.run(go())
    assert eng._wait_s is not None and eng._wait_s >= 0.15  # learned from the cold launches, kept while busy
    late = [float(line.split(",")[8]) for line in trace.read_text().splitlines()[6:]]  # ms, the busy forwards
    assert len(late) >= 10 and statistics.median(late) <= 60, late  # half a forward at most, not a cold launch
