"""The multi-process server (QWEN3VL_HTTP_WORKERS >= 1): HTTP front-end processes feeding one engine
process. Real `qwen3vl-encoder serve` subprocesses on loopback, tiny random preset on the CPU."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import psutil
import pytest
import torch
from PIL import Image
from safetensors.torch import load as safetensors_load

from conftest import encode_bytes, make_video, random_pngs, rel_err
from servers import KeepAliveClient, free_port
from tools.ready import wait_until_ready
from service.engine.protocol import read_message, write_message
from service.model.encoder import Encoder


@contextlib.contextmanager
def server(workers: int = 2, engines: int = 1, **env):
    port = free_port()
    full_env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICE": "cpu", "QWEN3VL_PORT": str(port),
                "QWEN3VL_HOST": "127.0.0.1", "QWEN3VL_HTTP_WORKERS": str(workers), **env}
    # a process group of its own, as a service manager starts it (tests send signals to the whole group)
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        # ready once every front-end has connected to every engine (one answering /ready is not enough for the tests
        # below); in one process, once it has started
        deadline = time.time() + 120
        connected = "Application startup complete" if workers == 0 else "connected (process"
        while not (wait_until_ready(url, proc, timeout_s=1, interval_s=0.1)
                   and sum(connected in line for line in lines) >= max(1, workers * engines)):
            if time.time() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("server did not become ready:\n" + "".join(lines)[-3000:])
        proc.output = lines
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


async def _post_all(url, bodies, params=None):
    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(c.post(f"{url}/embed", params=params, content=b,
                                             headers={"content-type": "image/png"}) for b in bodies))


@pytest.fixture(scope="module")
def tiny():
    return Encoder.load("random:tiny")


@pytest.fixture(scope="module")
def two_workers():
    with server(2, QWEN3VL_MAX_WAIT_MS="50") as running:
        yield running


def test_results_equal_in_process_encoding_and_forwards_are_shared(two_workers, tiny):
    """24 concurrent requests (22 images, 2 videos) spread over two front-end processes: every result
    (embeddings and DeepStack, through the safetensors format) equals encoding that input alone in this
    process, and the engine served them in fewer forwards than requests."""
    url, _ = two_workers
    before = httpx.get(f"{url}/info").json()["engine"]["forwards"]
    images = random_pngs(22, seed=11) + [make_video(30, 48, 32, seed=3), make_video(20, 32, 64, "webm", "libvpx-vp9")]
    responses = asyncio.run(_post_all(url, images, {"format": "safetensors"}))
    assert [r.status_code for r in responses] == [200] * 24
    for img, r in zip(images, responses):
        got = safetensors_load(r.content)
        ref = tiny.encode([tiny.preprocess(img)])[0]
        assert rel_err(got["embeds.0"], ref.embeds) <= 1e-5
        assert rel_err(got["deepstack.0"], ref.deepstack) <= 1e-5
        assert got["grid_thw.0"].tolist() == list(ref.grid_thw)
    info = httpx.get(f"{url}/info").json()
    assert info["engine"]["process"] == "separate" and info["http_workers"] == 2
    assert 0 < info["engine"]["forwards"] - before < 24


def test_a_front_end_never_loads_the_tower_its_kernels_or_triton(two_workers):
    """A front-end decodes, routes and formats; the model and its kernels live in the engine. Importing them (Triton
    above all) would cost every front-end seconds at start-up, beside the engines importing the same, and memory
    for as long as it runs. Read from the processes' memory maps after requests of each output format: Triton's
    library is mapped in the engine, in no front-end."""
    import re

    url, proc = two_workers
    image = random_pngs(1, seed=5)[0]
    for params in ({}, {"format": "safetensors"}, {"format": "vllm"}, {"format": "json", "deepstack": "false"}):
        r = httpx.post(f"{url}/embed", params=params, content=image, headers={"content-type": "image/png"},
                       timeout=60)
        assert r.status_code == 200, (params, r.text[:300])
    log = "".join(proc.output)
    frontends = {int(p) for p in re.findall(r"Started server process \[(\d+)\]", log)}
    engines = {int(p) for p in re.findall(r"engine process (\d+) on cpu ready", log)}
    assert len(frontends) == 2 and len(engines) == 1, log[-2000:]

    def maps(pid):
        with open(f"/proc/{pid}/maps") as f:
            return f.read()

    assert all("libtriton" in maps(pid) for pid in engines)
    assert not [pid for pid in frontends if "libtriton" in maps(pid)]


def test_pooled_only_and_tokens_in_one_pack_across_processes(two_workers, tiny):
    """Requests for the pooled vector alone and for every token, concurrent (so packed together): each gets what it
    asked for, and the pooled-only ones receive no token bytes (their bodies are a few hundred bytes)."""
    url, _ = two_workers
    images = random_pngs(6, seed=5)

    async def both():
        return await asyncio.gather(_post_all(url, images[:3], {"embeddings": "false", "pooling": "mean"}),
                                    _post_all(url, images[3:], {}))
    pooled, tokens = asyncio.run(both())
    for img, r in zip(images[:3], pooled):
        assert r.status_code == 200 and "embeddings" not in r.json()["data"][0]
        ref = tiny.encode([tiny.preprocess(img)])[0]
        assert rel_err(torch.tensor(r.json()["data"][0]["pooled"]), ref.embeds.mean(0)) <= 1e-5
        assert len(r.content) < 400 + 20 * ref.embeds.shape[1]
    for img, r in zip(images[3:], tokens):
        ref = tiny.encode([tiny.preprocess(img)])[0]
        assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5


def test_bad_item_fails_alone_across_processes(two_workers, tiny):
    url, _ = two_workers
    good = random_pngs(2, seed=3)
    files = [("file", ("a.png", good[0], "image/png")), ("file", ("b.png", b"\x89PNG broken", "image/png"))]
    bad = httpx.post(f"{url}/embed", files=files, timeout=60)
    ok = httpx.post(f"{url}/embed", content=good[1], headers={"content-type": "image/png"}, timeout=60)
    assert bad.status_code == 422 and bad.json()["error"]["index"] == 1
    assert "not a supported image" in bad.json()["error"]["message"]
    assert ok.status_code == 200
    ref = tiny.encode([tiny.preprocess(good[1])])[0]
    assert rel_err(torch.tensor(ok.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5


def test_a_burst_of_connections_spreads_over_every_front_end():
    """64 connections opened at once, then one request on each: every one of 4 front-ends serves at least 4 (each
    process listens on a SO_REUSEPORT socket of its own; with one shared socket the first process to wake accepts
    most of the burst). With a uniform hash, one front-end gets fewer than 4 of 64 with probability 7e-5."""
    import http.client
    import json

    with server(4) as (url, _):
        port = int(url.rsplit(":", 1)[1])
        conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(64)]
        for c in conns:
            c.connect()
        pids = []
        for c in conns:
            c.request("GET", "/info")
            pids.append(json.loads(c.getresponse().read())["http_process"])
            c.close()
    counts = sorted(pids.count(p) for p in set(pids))
    assert len(counts) == 4 and counts[0] >= 4, counts


def test_a_killed_front_end_is_replaced_in_its_slot_and_no_connection_is_refused():
    """SIGKILL one of two front-ends: every new connection still gets an answer (those the kernel hashes to the dead
    process's socket wait in its queue until the replacement, started in the same slot, accepts them), and the
    replacement serves."""
    import http.client
    import json

    def frontend_pids(port, n=32):
        pids = set()
        for _ in range(n):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", "/info")
            pids.add(json.loads(c.getresponse().read())["http_process"])
            c.close()
        return pids

    with server(2) as (url, proc):
        port = int(url.rsplit(":", 1)[1])
        before = frontend_pids(port)
        assert len(before) == 2
        victim = sorted(before)[0]
        os.kill(victim, signal.SIGKILL)
        codes = []
        for _ in range(32):  # fresh connections, right away: some land on the dead process's socket
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", "/health")
            codes.append(c.getresponse().status)
            c.close()
        assert codes == [200] * 32
        after = frontend_pids(port)
        assert victim not in after and len(after) == 2 and after & before


def test_metrics_merge_every_process(two_workers):
    """Whichever front-end answers /metrics, it reports the requests of all of them and the engine's forwards."""
    url, _ = two_workers
    n = 12
    asyncio.run(_post_all(url, random_pngs(n, seed=5)))
    text = httpx.get(f"{url}/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['qwen3vl_requests_total{route="/embed",status="200"}'] >= n
    assert samples['qwen3vl_forward_seconds_count{device="cpu"}'] >= 1
    assert samples['qwen3vl_batch_items_sum{device="cpu"}'] >= n
    assert samples['qwen3vl_engine_up{device="cpu"}'] == 1
    assert any(k.startswith("qwen3vl_model_info{") and v == 1 for k, v in samples.items())
    # the engine's device time, cumulative, sampled at the scrape: busy in its forwards (the wall time on the CPU,
    # which gives no events), and no wait for launches counted (that takes the GPU's event times)
    busy = httpx.get(f"{url}/info").json()["engine"]["gpu_busy_s"]
    assert 0 < samples['qwen3vl_gpu_busy_seconds{device="cpu"}'] <= busy
    assert samples['qwen3vl_gpu_launch_wait_seconds{device="cpu"}'] == 0


def test_overload_gets_429_and_every_accepted_request_is_answered():
    with server(2, QWEN3VL_MAX_QUEUE_ITEMS="2", QWEN3VL_MAX_BATCH_ITEMS="1", QWEN3VL_MAX_WAIT_MS="0") as (url, _):
        responses = asyncio.run(_post_all(url, random_pngs(40, seed=9)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["retry-after"] and "queue full" in r.json()["error"]["message"]


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_during_load_loses_no_accepted_request(workers):
    big = [encode_bytes(Image.fromarray(np.random.default_rng(i).integers(0, 256, (700, 900, 3), dtype=np.uint8)))
           for i in range(16)]
    with server(workers, QWEN3VL_MAX_BATCH_ITEMS="2", QWEN3VL_MAX_WAIT_MS="1") as (url, proc):
        async def go():
            async with httpx.AsyncClient(timeout=120) as c:
                tasks = [asyncio.create_task(c.post(f"{url}/embed", content=b, headers={"content-type": "image/png"}))
                         for b in big]
                await asyncio.sleep(0.5)  # requests are queued and in flight
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)

        outs = asyncio.run(go())
        code = proc.wait(120)
        time.sleep(0.2)  # the output reader drains the pipe
        out = "".join(proc.output)
    accepted = [o for o in outs if isinstance(o, httpx.Response)]
    refused = [o for o in outs if not isinstance(o, httpx.Response)]
    assert all(isinstance(e, httpx.ConnectError) for e in refused), refused  # refused before acceptance only
    assert accepted and all(r.status_code == 200 for r in accepted), [r.status_code for r in accepted]
    assert code == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def _metric(url, name) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _wait_for_engine(url, old_pid, timeout_s=90):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        info = httpx.get(f"{url}/info").json()
        if info["engine"]["state"] == "up" and info["engine"].get("pid") not in (None, old_pid):
            return info
        time.sleep(0.1)
    raise AssertionError("the engine did not come back")


def test_engine_death_is_survived(tiny):
    """SIGKILL of the engine under the front-ends: /health stays 200, /ready and /embed answer 503 with Retry-After
    while it is away (never 500, never a dropped connection), a new engine is started, the restart is counted,
    and results are the same as before."""
    image = random_pngs(1, seed=21)[0]
    ref = tiny.encode([tiny.preprocess(image)])[0]
    with server(2) as (url, proc):
        pid = httpx.get(f"{url}/info").json()["engine"]["pid"]
        os.kill(pid, signal.SIGKILL)
        seen = []
        while True:
            assert httpx.get(f"{url}/health").status_code == 200
            r = httpx.post(f"{url}/embed", content=image, headers={"content-type": "image/png"}, timeout=30)
            seen.append(r.status_code)
            if r.status_code == 200:
                break
            assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, (r.status_code, r.text)
            assert r.json()["error"]["type"] in ("engine_unavailable", "not_ready"), r.text
            assert httpx.get(f"{url}/ready").status_code in (200, 503)
            time.sleep(0.05)
        info = _wait_for_engine(url, pid)
        assert info["engine"]["restarts"] == 1
        assert 503 in seen and _metric(url, 'qwen3vl_engine_restarts_total{device="cpu"}') == 1
        assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5
        assert proc.poll() is None
        children = psutil.Process(proc.pid).children(recursive=True)  # front-ends, engine, standby engine
        assert len(children) >= 4
    assert proc.returncode == 0, "".join(proc.output)[-3000:]
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive  # the standby engine too


def test_crash_loop_gives_up_with_exit_code_3():
    with server(1, QWEN3VL_ENGINE_MAX_RESTARTS="1", QWEN3VL_ENGINE_RESTART_BACKOFF_S="0") as (url, proc):
        pid = httpx.get(f"{url}/info").json()["engine"]["pid"]
        os.kill(pid, signal.SIGKILL)
        pid = _wait_for_engine(url, pid)["engine"]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(60) == 3
        time.sleep(0.2)
    assert "giving up" in "".join(proc.output)


def test_load_error_exits_2_without_retrying(tmp_path, full_checkpoint):
    """A checkpoint whose config.json reads (so `serve` starts) but whose weights are missing: the engine's load
    error is the same on every try, so it is not retried."""
    import shutil

    for name in ("config.json", "preprocessor_config.json"):
        if (full_checkpoint / name).exists():
            shutil.copy(full_checkpoint / name, tmp_path / name)
    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": str(tmp_path), "QWEN3VL_DEVICE": "cpu",
           "QWEN3VL_PORT": str(port), "QWEN3VL_HTTP_WORKERS": "1"}
    out = subprocess.run([sys.executable, "-m", "service.cli", "serve"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert "could not start" in out.stderr and "restart" not in out.stderr.split("could not start")[0]


def test_wire_format_round_trip():
    """Headers and raw buffers (bfloat16 included, empty ones skipped) survive a socket unchanged."""
    a, b = socket.socketpair()

    async def go():
        _, writer = await asyncio.open_connection(sock=a)
        reader, _ = await asyncio.open_connection(sock=b)
        t = torch.randn(5, 7, dtype=torch.bfloat16)
        frames = np.random.default_rng(0).integers(0, 256, (1, 3, 5, 3), dtype=np.uint8)
        write_message(writer, {"op": "x", "id": 3, "shape": (5, 7)},
                      [t.view(torch.uint8).numpy().reshape(-1), np.empty(0, np.uint8), frames])
        await writer.drain()
        header, payload = await read_message(reader)
        writer.close()
        return t, frames, header, payload

    t, frames, header, payload = asyncio.run(go())
    assert header == {"op": "x", "id": 3, "shape": (5, 7)}
    got = torch.frombuffer(bytearray(payload[:t.numel() * 2]), dtype=torch.bfloat16).view(5, 7)
    assert torch.equal(got, t)
    assert payload[t.numel() * 2:] == frames.tobytes()


def test_a_lone_small_jpeg_is_decoded_on_the_event_loop_and_the_rest_in_the_pool():
    """`EnginePool.preprocess` (`latency.LatencyPolicy`, 1.): the only input of a request alone in its process, a
    JPEG of up to INLINE_MAX_PIXELS before and after resizing, is decoded on the loop's thread, the engine told to
    expect it first; a larger JPEG (or one resized larger), another format, an input with company in its request, or
    a request beside another in progress goes to the pool's threads. The result is the same either way; an
    unusable input is named by its position."""
    from types import SimpleNamespace

    from service.engine.api import Decoder
    from service.engine.latency import INLINE_MAX_PIXELS
    from service.engine.remote import EnginePool
    from service.errors import UnsupportedImage
    from service.model.preprocess import Preprocessor, PreprocessConfig

    pre = Preprocessor(PreprocessConfig())
    threads = []

    def recording(*args):
        threads.append(threading.current_thread() is threading.main_thread())
        return pre(*args)

    recording.target_size = pre.target_size
    expected = []  # the engine told to expect a submit, before each decode on the loop
    engine = SimpleNamespace(alive=True, load=0, model=SimpleNamespace(preprocessor=recording),
                             expect=lambda: expected.append(len(threads)))
    pool = EnginePool([engine], Decoder(2))
    rng = np.random.default_rng(8)
    small = encode_bytes(Image.fromarray(rng.integers(0, 256, (448, 320, 3), dtype=np.uint8)), "JPEG")
    side = int(INLINE_MAX_PIXELS ** 0.5) + 16
    large = encode_bytes(Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)), "JPEG")
    png = encode_bytes(Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "PNG")

    async def go():
        (lone,) = await pool.preprocess([small])
        with pool.latency.busy():  # another request's submission in progress
            (beside,) = await pool.preprocess([small])
        pair = await pool.preprocess([small, small])
        await pool.preprocess([large])
        await pool.preprocess([png])
        await pool.preprocess([small], min_pixels=INLINE_MAX_PIXELS * 2)  # resized beyond the bound
        with pytest.raises(UnsupportedImage) as bad:  # a JPEG signature on garbage: the pool's decoder names it
            await pool.preprocess([png, b"\xff\xd8 not a JPEG"])
        assert bad.value.index == 1
        return [lone, beside, *pair]

    try:
        items = asyncio.run(go())
    finally:
        pool._decode.close()
    assert threads == [True] + [False] * 8
    assert expected == [0]
    for item in items[1:]:
        np.testing.assert_array_equal(items[0].frames, item.frames)
        assert items[0].grid_thw == item.grid_thw


def test_the_pool_polls_for_a_reply_only_while_its_request_is_alone(monkeypatch):
    """`EnginePool.submit` (`latency.LatencyPolicy`, 2.): the engine client itself knows whether a request is alone
    in its process (no other decoding or submission in progress, and none beside another for QUIET_S), and the
    reply is polled for only then, for POLL_MAX_S at most; the HTTP layer passes no hint. The request goes to the
    least-loaded live engine with its deadline."""
    import time
    from types import SimpleNamespace

    from service.engine import latency
    from service.engine.api import Decoder, Encoded, Timing
    from service.engine.remote import EnginePool

    monkeypatch.setattr(latency, "QUIET_S", 0.2)
    monkeypatch.setattr(latency, "POLL_MAX_S", 0.05)
    seen = []

    async def submit(items, deadline, *, poll, **kwargs):
        await asyncio.sleep(0)  # the request is written; then the reply is awaited, polled while `poll()`
        alone = poll()
        if alone:  # polled for POLL_MAX_S at most
            await asyncio.sleep(0.06)
            assert not poll()
        seen.append((alone, deadline, kwargs))
        return Encoded([], Timing())

    busy = SimpleNamespace(alive=True, load=5, submit=None)
    idle = SimpleNamespace(alive=True, load=0, submit=submit)
    pool = EnginePool([busy, idle], Decoder(1))

    async def go():
        await pool.submit([], 123.0, client="a")
        with pool.latency.busy():  # another request's decoding in progress
            await pool.submit([], 456.0)
        await pool.submit([], 457.0)  # alone again, but within the quiet period after company
        await asyncio.sleep(0.25)
        await pool.submit([], 458.0)  # the quiet period has passed
        await asyncio.sleep(0.25)
        first = asyncio.create_task(pool.submit([], 789.0))
        second = asyncio.create_task(pool.submit([], 790.0))
        await asyncio.gather(first, second)
        await pool.submit([], 791.0)  # the first two had company: neither they nor this one is alone

    began = time.monotonic()
    try:
        asyncio.run(go())
    finally:
        pool._decode.close()
    assert time.monotonic() - began < 2.0
    assert seen[0] == (True, 123.0, {"client": "a"})
    assert [(alone, deadline) for alone, deadline, _ in seen[1:]] == [
        (False, 456.0), (False, 457.0), (True, 458.0), (False, 789.0), (False, 790.0), (False, 791.0)]
    assert pool.latency.in_progress == 0


def test_a_reply_is_awaited_polled_or_not_and_a_gone_client_or_a_silent_engine_cancels_it(tmp_path, monkeypatch):
    """`RemoteEngine.submit` against a scripted engine on a real socket: the reply's tensors come back whether the
    front-end polls (`poll`, a lone request: the loop keeps turning, other tasks still run) or sleeps; polling stops
    when `poll` turns false; a client that goes away (`abandoned`) and a reply that never comes (past the deadline
    and REPLY_GRACE_S) both end the wait and tell the engine to drop the request."""
    from service.engine import remote
    from service.errors import DeadlineExceeded
    from service.model.preprocess import Preprocessor, PreprocessConfig

    monkeypatch.setattr(remote, "REPLY_GRACE_S", 0.2)
    pre = Preprocessor(PreprocessConfig())
    item = pre(encode_bytes(Image.fromarray(np.zeros((64, 96, 3), np.uint8)), "PNG"))
    pooled = torch.randn(8)
    path = str(tmp_path / "engine.sock")
    seen: list[tuple[str, int]] = []
    hold: set[int] = set()  # submit ids the engine never answers

    async def engine(reader, writer):
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                header, _ = await read_message(reader)
                seen.append((header["op"], header["id"]))
                if header["op"] == "hello":
                    info = {"config": None, "preprocess": pre.config, "device": "cpu", "dtype": "float32",
                            "backend": "sdpa"}
                    write_message(writer, {"op": "hello", "id": header["id"], "info": info, "arena": False})
                elif header["op"] == "submit" and header["id"] not in hold:
                    await asyncio.sleep(0.05)  # the forward
                    write_message(writer, {"op": "result", "id": header["id"], "timing": (0.0, 0.05),
                                           "results": [(item.grid_thw, 12, "float32", (0, 8), (0, 12, 8), (8,))]},
                                  [pooled.numpy()])

    async def go():
        server = await asyncio.start_unix_server(engine, path)
        eng = remote.RemoteEngine(path)
        await eng.connect()
        turns = 0

        async def other():  # another task on the loop: it runs while a reply is polled for
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        ticker = asyncio.create_task(other())
        polls = 0

        def alone():
            nonlocal polls
            polls += 1
            return True

        polled = (await eng.submit([item], time.monotonic() + 5, poll=alone)).results
        busy_turns, turns = turns, 0
        ticker.cancel()
        done = await eng.submit([item], time.monotonic() + 5)
        slept, timing = done.results, done.timing
        stops = iter([True, True, False])
        stopped = (await eng.submit([item], time.monotonic() + 5, poll=lambda: next(stops))).results

        hold.update({4, 5})  # ids after the hello (0) and the three answered
        gone = asyncio.Event()
        asyncio.get_running_loop().call_later(0.05, gone.set)
        with pytest.raises(asyncio.CancelledError):
            await eng.submit([item], time.monotonic() + 5, abandoned=gone, poll=alone)
        with pytest.raises(DeadlineExceeded):
            await eng.submit([item], time.monotonic() + 0.05, abandoned=asyncio.Event())
        await asyncio.sleep(0.05)  # the cancels reach the engine
        await eng.stop()
        server.close()
        return polled, slept, stopped, timing, polls, busy_turns

    polled, slept, stopped, timing, polls, busy_turns = asyncio.run(go())
    for results in (polled, slept, stopped):
        assert torch.equal(results[0].pooled, pooled) and results[0].num_tokens == 12
        assert results[0].embeds.shape == (0, 8) and results[0].grid_thw == item.grid_thw
    assert timing.inference_s == 0.05
    assert polls > 10 and busy_turns > 10  # the loop turned while polling, and other tasks ran each turn
    assert [s for s in seen if s[0] == "cancel"] == [("cancel", 4), ("cancel", 5)]
    assert [s for s in seen if s[0] == "submit"] == [("submit", i) for i in range(1, 6)]


async def _connected(server):
    """An `EngineServer` serving one end of a socket pair: (its connection's task, the other end's reader, writer)."""
    a, b = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=b)
    served = asyncio.create_task(server._connection(reader, writer))
    client_reader, client = await asyncio.open_connection(sock=a)
    return served, client_reader, client


def _fake_engine_server(model, submit=None):
    """An `EngineServer` over a stand-in engine: an idle batcher, `model` (a `ModelInfo`) and `submit`."""
    from types import SimpleNamespace

    from service.engine import process

    batcher = SimpleNamespace(queue_depth=0, in_flight=0, queued_patches=0)
    return process.EngineServer(SimpleNamespace(batcher=batcher, model=model, submit=submit))


def test_an_idle_engine_told_to_expect_a_submit_turns_its_loop_until_it_comes(monkeypatch):
    """`EngineServer.expect`: an idle engine keeps its loop turning until the expected submit arrives (then stops at
    once, whatever is left of EXPECT_S) or until EXPECT_S passes without one; a busy engine does not spin."""
    from service.engine import process
    from service.engine.api import Encoded, ModelInfo, Timing
    from service.model.results import EncodeResult
    from service.model.preprocess import Preprocessor, PreprocessConfig

    pre = Preprocessor(PreprocessConfig())
    item = pre(encode_bytes(Image.fromarray(np.zeros((64, 64, 3), np.uint8)), "PNG"))

    async def submit(items, deadline, **kwargs):
        return Encoded([EncodeResult(torch.zeros(0, 4), torch.zeros(0, 4, 4), it.grid_thw, torch.ones(4), 4)
                        for it in items], Timing())

    server = _fake_engine_server(ModelInfo(None, pre, torch.device("cpu"), torch.float32, "sdpa"), submit)

    async def go():
        served, client_reader, client = await _connected(server)
        monkeypatch.setattr(process, "EXPECT_S", 5.0)
        write_message(client, {"op": "expect", "id": -1})
        for _ in range(100):
            await asyncio.sleep(0)
        spinning = server._spinner is not None and not server._spinner.done()
        started = time.perf_counter()
        frames = np.ascontiguousarray(item.frames)
        write_message(client, {"op": "submit", "id": 1, "timeout_s": 5, "deepstack": False, "tokens": False,
                               "items": [(frames.shape, item.grid_thw, item.meta, None)]}, [frames])
        reply, _ = await read_message(client_reader)
        await asyncio.wait_for(server._spinner, 1.0)  # the submit ended the spin long before EXPECT_S
        ended_s = time.perf_counter() - started
        monkeypatch.setattr(process, "EXPECT_S", 0.05)
        server.expect()
        await asyncio.wait_for(server._spinner, 1.0)  # no submit: EXPECT_S bounds it
        server.engine.batcher.in_flight = 1
        server.expect()
        busy_spinner = server._spinner
        client.close()
        await served
        return spinning, reply, ended_s, busy_spinner

    spinning, reply, ended_s, busy_spinner = asyncio.run(go())
    assert spinning and reply["op"] == "result" and ended_s < 1.0
    assert busy_spinner.done()  # the one that ran out of time; none new while busy


def test_a_hello_is_answered_before_the_arena_is_page_locked_and_unlocked_after_it(monkeypatch):
    """Every front-end connects to every engine at once (24 on 4 GPUs at start-up, all of them again after a restart),
    and the driver's registration of each 256 MiB arena takes tens of milliseconds: done on the event loop before
    the reply, it held the last connection ~2 s. The hello is answered while the lock is still being taken (on its
    own thread); a connection that closes meanwhile unlocks the arena once the lock is done, never before."""
    from service.engine import process
    from service.engine.api import ModelInfo
    from service.engine.shm import Arena, SHM_DIR
    from service.model.preprocess import Preprocessor, PreprocessConfig

    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR}")
    release = threading.Event()
    events = []

    def page_lock(mapping, device):
        events.append(("lock begins", len(mapping)))
        assert release.wait(10)
        events.append(("locked",))
        return 1234

    monkeypatch.setattr(process, "page_lock", page_lock)
    monkeypatch.setattr(process, "page_unlock", lambda address, device: events.append(("unlocked", address)))
    server = _fake_engine_server(ModelInfo(None, Preprocessor(PreprocessConfig()), torch.device("cuda", 0),
                                           torch.float32, "sdpa"))
    arena = Arena(1 << 20)

    async def go():
        served, client_reader, client = await _connected(server)
        write_message(client, {"op": "hello", "id": 0, "arena": arena.path})
        reply, _ = await asyncio.wait_for(read_message(client_reader), 5)
        answered = list(events)
        client.close()
        await asyncio.sleep(0.2)
        waiting = not served.done()  # the lock is still being taken: the unlock waits for it
        release.set()
        await asyncio.wait_for(served, 5)
        return reply, answered, waiting

    try:
        reply, answered, waiting = asyncio.run(go())
    finally:
        release.set()
        arena.unlink()
    assert reply["op"] == "hello" and reply["arena"] is True
    assert ("locked",) not in answered
    assert waiting
    assert events == [("lock begins", 1 << 20), ("locked",), ("unlocked", 1234)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_tensors_read_from_a_reply_equal_what_was_sent(dtype):
    """A message of several tensors back to back, as the engine writes them (`raw_bytes`, `write_message`), empty and
    non-contiguous ones included, read with `read_message` and `tensor_at`: each comes back with its dtype, shape and
    values, and the offsets line up."""
    from service.engine.protocol import raw_bytes, tensor_at

    g = torch.Generator().manual_seed(3)
    sent = [torch.randn(shape, generator=g).to(dtype) for shape in ((0, 8), (3, 5), (0, 3, 5), (7,), (1, 1, 1))]
    sent.append(torch.randn(4, 6, generator=g).to(dtype).t())  # a transposed view

    class Writer:
        data = b""

        def write(self, b):
            self.data += bytes(b)

    writer = Writer()
    write_message(writer, {"op": "result"}, [raw_bytes(t) for t in sent])

    async def read():
        reader = asyncio.StreamReader()
        reader.feed_data(writer.data)
        reader.feed_eof()
        return await read_message(reader)

    header, payload = asyncio.run(read())
    assert header == {"op": "result"}
    offset = 0
    for t in sent:
        got, offset = tensor_at(payload, offset, tuple(t.shape), dtype)
        assert got.dtype == dtype and got.shape == t.shape and torch.equal(got, t)
    assert offset == len(payload)


def test_the_embedding_cache_is_shared_by_every_front_end():
    """One image encoded once, then asked for again on 24 new connections, which the kernel spreads over 4 front-ends:
    every one a hit, and the engine ran no further forward; the cache's directory goes with the server."""
    import http.client

    body = random_pngs(1, seed=21)[0]
    with server(4) as (url, proc):
        port = int(url.rsplit(":", 1)[1])

        def post():
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/embed?pooling=mean", body, {"content-type": "image/png"})
            r = c.getresponse()
            reply = (r.status, r.getheader("x-cache"), r.read())
            c.close()
            return reply

        first = post()
        assert first[:2] == (200, "miss")
        forwards = httpx.get(f"{url}/info").json()["engine"]["forwards"]
        again = [post() for _ in range(24)]
        assert {(status, cache) for status, cache, _ in again} == {(200, "hit")}
        assert {data for _, _, data in again} == {first[2]}
        assert httpx.get(f"{url}/info").json()["engine"]["forwards"] == forwards
        path = httpx.get(f"{url}/info").json()["embedding_cache"]["path"]
        assert os.path.isdir(path) and os.listdir(path)
    assert not os.path.exists(path)


def test_ready_means_every_front_end_serves():
    """From the first /ready 200 on, every front-end a new connection reaches can serve: each one marks itself ready
    once connected to an engine, and /ready counts the marks of all of them."""
    import http.client
    import json

    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICE": "cpu", "QWEN3VL_PORT": str(port),
           "QWEN3VL_HOST": "127.0.0.1", "QWEN3VL_HTTP_WORKERS": "4"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)

    def get(path):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            c.request("GET", path)
            r = c.getresponse()
            return r.status, json.loads(r.read())
        finally:
            c.close()

    try:
        deadline = time.time() + 120
        while True:
            try:
                if get("/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline and proc.poll() is None, "never ready"
            time.sleep(0.02)
        infos = [get("/info")[1] for _ in range(32)]
        assert len({i["http_process"] for i in infos}) >= 2
        assert {i["engine"]["state"] for i in infos} == {"up"}, [(i["http_process"], i["engine"]) for i in infos]
    finally:
        proc.terminate()
        proc.wait(60)


@pytest.mark.parametrize("run,to_group,sig", [(0, False, signal.SIGTERM), (1, True, signal.SIGTERM),
                                            (2, True, signal.SIGINT)], ids=["main", "group-sigterm", "group-sigint"])
def test_sigterm_drains_keep_alive_connections(run, to_group, sig):
    """32 clients on keep-alive connections (httpx's pool, as locust, requests sessions and the OpenAI client keep
    them), SIGTERM under load, to the main process or to the whole process group (systemd's KillMode=control-group;
    SIGINT: Ctrl-C in a terminal), where every front-end gets it too and must leave the drain to the server: at once /ready is 503 and each response closes its connection, so that no request goes
    out on a connection the server is about to close. Every request sent on a connection the server had accepted is
    answered 200. The clients never stop (no load balancer takes them elsewhere), so they reconnect until the server
    stops listening: then their connections are refused, or, for one the kernel had queued but no process ever
    accepted, reset at its first read; a request on a reused connection never fails. Exit 0."""
    images = random_pngs(6, seed=run)
    with server(2, QWEN3VL_DRAIN_S="2") as (url, proc):
        async def go():
            outcomes, stop = [], asyncio.Event()
            async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as c:
                async def client(i):
                    user = KeepAliveClient(c, url, images, i)
                    while not stop.is_set():
                        t, _, outcome, connection, fresh = await user.post()
                        outcomes.append((t, outcome, connection, fresh))
                        if not isinstance(outcome, int):
                            await asyncio.sleep(0.05)

                tasks = [asyncio.create_task(client(i)) for i in range(32)]
                await asyncio.sleep(1.5)
                sigterm = time.monotonic()
                if to_group:
                    os.killpg(proc.pid, sig)
                else:
                    proc.send_signal(sig)
                await asyncio.sleep(0.3)
                ready = await c.get(f"{url}/ready")
                code = await asyncio.to_thread(proc.wait, 60)
                stop.set()
                await asyncio.gather(*tasks)
            return outcomes, sigterm, ready, code

        outcomes, sigterm, ready, code = asyncio.run(go())
        time.sleep(0.2)
        out = "".join(proc.output)
    assert code == 0, out[-3000:]
    assert ready.status_code == 503 and ready.headers["connection"] == "close"
    before = [o for t, o, _, _ in outcomes if t < sigterm]
    assert before and set(before) == {200}, before[:5]
    answered = [o for t, o, _, _ in outcomes if t >= sigterm and isinstance(o, int)]
    assert answered and set(answered) == {200}, answered[:5]
    # the front-ends start draining as soon as the SIGTERM arrives
    assert {conn for t, o, conn, _ in outcomes if t >= sigterm + 0.1 and isinstance(o, int)} == {"close"}
    failed = [(o, fresh) for t, o, _, fresh in outcomes if not isinstance(o, int)]
    assert all(fresh for _, fresh in failed), [repr(o) for o, fresh in failed if not fresh][:5]
    assert all(isinstance(o, (httpx.ConnectError, httpx.ReadError)) for o, _ in failed), [repr(o) for o, _ in failed]
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_submit_on_a_connection_the_engine_just_closed_is_a_503_not_a_crash(loop, tmp_path):
    """An engine killed under load: its connection's transport closes before the link's reader has seen the end,
    and a request sent in between must fail as `EngineUnavailable` (503), not as uvloop's RuntimeError ("the handler
    is closed", a 500: the 4-GPU fault test at 3f1bffc had three)."""
    from service import errors
    from service.engine.remote import RemoteEngine, _Link

    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        run = uvloop.run
    else:
        run = asyncio.run

    async def main():
        path = str(tmp_path / "engine.sock")
        server = await asyncio.start_unix_server(lambda r, w: w.close(), path)
        reader, writer = await asyncio.open_unix_connection(path)
        link = _Link(writer, None, RemoteEngine(path))
        await reader.read()  # the engine's end closed: at EOF (the link's reader task never ran)
        writer.transport.abort()  # what the event loop does to the transport of a connection lost
        await asyncio.sleep(0)
        with pytest.raises(errors.EngineUnavailable):
            link.send({"op": "submit", "id": 1}, [np.zeros(16, np.uint8)])
        assert not link.pending and link.broken
        server.close()

    run(main())


@pytest.mark.parametrize("pack_items, on_loop", [(1, True), (2, False), (31, False)])
def test_a_packs_results_are_copied_by_the_copier_threads_and_a_lone_ones_on_the_loop(monkeypatch, pack_items,
                                                                                       on_loop):
    """`LatencyPolicy.copy_inline`: a result of a pack of one item is written into its front-end's arena on the
    engine's event loop (no hand-off for a lone request); a pack's results, which land together, by the copier
    threads, so the loop reads the next submissions meanwhile. Either way the front-end reads what was sent."""
    from service.engine import process
    from service.engine.api import Encoded, ModelInfo, Timing
    from service.engine.protocol import tensor_at
    from service.engine.shm import SHM_DIR, Arena
    from service.model.preprocess import Preprocessor, PreprocessConfig
    from service.model.results import EncodeResult

    if not os.path.isdir(SHM_DIR):
        pytest.skip(f"no {SHM_DIR}")
    pre = Preprocessor(PreprocessConfig())
    item = pre(encode_bytes(Image.fromarray(np.zeros((64, 64, 3), np.uint8)), "PNG"))
    embeds = torch.randn(16, 8)
    writers = []
    write_tensors = process.write_tensors

    def recording(*args):
        writers.append(threading.current_thread() is threading.main_thread())
        return write_tensors(*args)

    monkeypatch.setattr(process, "write_tensors", recording)

    async def submit(items, deadline, **kwargs):
        return Encoded([EncodeResult(embeds, torch.zeros(0, 16, 8), it.grid_thw, torch.ones(8), 16) for it in items],
                       Timing(0.001, 0.002, pack_items))

    server = _fake_engine_server(ModelInfo(None, pre, torch.device("cpu"), torch.float32, "sdpa"), submit)
    arena = Arena(1 << 20)

    async def go():
        served, client_reader, client = await _connected(server)
        write_message(client, {"op": "hello", "id": 0, "arena": arena.path})
        hello, _ = await asyncio.wait_for(read_message(client_reader), 5)
        frames = np.ascontiguousarray(item.frames)
        write_message(client, {"op": "submit", "id": 1, "timeout_s": 5, "deepstack": True, "tokens": True,
                               "items": [(frames.shape, item.grid_thw, item.meta, None)], "out": (4096, 1 << 16)},
                      [frames])
        reply, _ = await asyncio.wait_for(read_message(client_reader), 5)
        client.close()
        await asyncio.wait_for(served, 5)
        return hello, reply

    try:
        hello, reply = asyncio.run(go())
        assert hello["arena"] is True and reply["op"] == "result" and reply["in_arena"] is True
        got, _ = tensor_at(arena._map, 4096, (16, 8), torch.float32, align=True)
        assert torch.equal(got, embeds)
    finally:
        arena.unlink()
    assert writers == [on_loop]
