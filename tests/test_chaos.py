"""Chaos against the real server processes on the CPU: under steady load the engine process is SIGKILLed twice,
then the server gets SIGTERM.

Asserted, with clients on keep-alive connections: every response is 200, 429 or 503; no request started before
SIGTERM loses its connection, and none sent on a reused connection after it; none outlives its deadline; the server exits 0 after answering everything it accepted; the front-ends' memory stays
flat over the run."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import numpy as np
import psutil
from PIL import Image

from conftest import encode_bytes
from servers import KeepAliveClient
from test_engine_process import _wait_for_engine, server

DEADLINE_S = 10.0
CLIENTS = 8


def _frontend_rss(output: list[str]) -> dict[int, int]:
    """RSS of the uvicorn front-end processes (their pids from uvicorn's "Started server process" lines)."""
    pids = [int(line.rsplit("[", 1)[1].split("]")[0]) for line in output if "Started server process" in line]
    return {pid: psutil.Process(pid).memory_info().rss for pid in pids if psutil.pid_exists(pid)}


def test_engine_kills_and_sigterm_under_load():
    rng = np.random.default_rng(0)
    images = [encode_bytes(Image.fromarray(rng.integers(0, 256, (48 + 8 * i, 64, 3), dtype=np.uint8)))
              for i in range(8)]
    log: list[tuple[float, float, object]] = []  # (start, end, status code or exception)
    with server(2, QWEN3VL_REQUEST_TIMEOUT_S=str(DEADLINE_S), QWEN3VL_MAX_QUEUE_ITEMS="16") as (url, proc):
        async def client(i: int, c: httpx.AsyncClient, stop: asyncio.Event):
            user = KeepAliveClient(c, url, images, i)
            while not stop.is_set():
                start, end, outcome, _, fresh = await user.post()
                log.append((start, end, outcome, fresh))
                if not isinstance(outcome, int):
                    if sigterm_at is None:
                        await asyncio.sleep(0.05)
                    else:
                        return  # the server is going away

        sigterm_at = None

        async def go():
            nonlocal sigterm_at
            stop = asyncio.Event()
            # keep-alive connections, as real clients keep them: the drain closes each after its response
            async with httpx.AsyncClient(timeout=DEADLINE_S + 30) as c:
                tasks = [asyncio.create_task(client(i, c, stop)) for i in range(CLIENTS)]
                pid = (await asyncio.to_thread(_wait_for_engine, url, None))["engine"]["pid"]
                await asyncio.sleep(3)
                rss_start = _frontend_rss(proc.output)
                for _ in range(2):
                    os.kill(pid, signal.SIGKILL)
                    pid = (await asyncio.to_thread(_wait_for_engine, url, pid))["engine"]["pid"]
                    await asyncio.sleep(3)
                rss_end = _frontend_rss(proc.output)
                sigterm_at = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                code = await asyncio.to_thread(proc.wait, 120)
                stop.set()
                await asyncio.gather(*tasks)
                return code, rss_start, rss_end

        code, rss_start, rss_end = asyncio.run(go())
        time.sleep(0.2)
        out = "".join(proc.output)

    assert code == 0, out[-3000:]
    statuses = [o for _, _, o, _ in log if isinstance(o, int)]
    assert set(statuses) <= {200, 429, 503}, sorted(set(statuses))
    assert statuses.count(200) > 50 and 503 in statuses, (statuses.count(200), statuses.count(503))
    dropped = [(s, o) for s, _, o, _ in log if not isinstance(o, int) and s < sigterm_at]
    assert not dropped, dropped[:5]
    late = [e - s for s, e, o, _ in log if isinstance(o, int) and e - s > DEADLINE_S + 2]
    assert not late, late
    # Started after SIGTERM: answered, or, once the server stopped listening, refused. A connection the kernel
    # queued in the instant the listening sockets closed, which no process ever accepted, is reset (ReadError) at
    # its first read: never a reused one, which the server had accepted.
    after = [(o, fresh) for s, _, o, fresh in log if s >= sigterm_at and not isinstance(o, int)]
    assert all(fresh for _, fresh in after), [repr(o) for o, fresh in after if not fresh][:5]
    odd = [o for o, _ in after if not isinstance(o, (httpx.ConnectError, httpx.ReadError))]
    assert not odd, odd[:5]
    assert rss_start.keys() == rss_end.keys() and len(rss_start) == 2, (rss_start, rss_end)
    for pid in rss_start:
        assert rss_end[pid] - rss_start[pid] < 30 * 2**20, (rss_start, rss_end)
    assert "Traceback" not in out and "never retrieved" not in out, out[-3000:]
