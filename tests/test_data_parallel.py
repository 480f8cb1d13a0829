"""Several engine processes behind the front-ends (`QWEN3VL_DEVICES`), on the CPU: two engines on `cpu,cpu`.

Requests spread over both engines and their results are those of encoding alone; killing one engine under load
leaves the other serving, and the dead one is restarted without stopping it."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import torch

from conftest import rel_err
from conftest import random_pngs
from test_engine_process import _post_all, server
from service.model.encoder import Encoder


def _engines(url) -> list[dict]:
    return httpx.get(f"{url}/info").json()["engine"]["engines"]


def test_two_engines_share_the_load_and_survive_each_other():
    tiny = Encoder.load("random:tiny")
    images = random_pngs(24, seed=31)
    with server(2, engines=2, QWEN3VL_DEVICES="cpu,cpu", QWEN3VL_MAX_WAIT_MS="20") as (url, proc):
        deadline = time.time() + 60
        while not all(e["state"] == "up" for e in _engines(url)):  # /ready needs one; this test wants both
            assert time.time() < deadline, _engines(url)
            time.sleep(0.1)
        engines = _engines(url)
        assert [e["device"] for e in engines] == ["cpu", "cpu"] and engines[0]["pid"] != engines[1]["pid"]

        responses = asyncio.run(_post_all(url, images, {"format": "json"}))
        assert [r.status_code for r in responses] == [200] * len(images)
        for img, r in zip(images, responses):
            ref = tiny.encode([tiny.preprocess(img)])[0]
            assert rel_err(torch.tensor(r.json()["data"][0]["embeddings"]), ref.embeds) <= 1e-5
        forwards = [e["forwards"] for e in _engines(url)]
        assert all(f > 0 for f in forwards), forwards  # both engines served

        # kill engine 0 under load: the other keeps serving; the dead one comes back
        victim = _engines(url)[0]["pid"]

        async def load_while_killing():
            async with httpx.AsyncClient(timeout=60) as c:
                async def one(body):
                    return await c.post(f"{url}/embed", content=body, headers={"content-type": "image/png"})

                first = [asyncio.create_task(one(b)) for b in images[:12]]
                await asyncio.sleep(0.05)
                os.kill(victim, signal.SIGKILL)
                during = await asyncio.gather(*first)
                await asyncio.sleep(0.3)  # the front-ends have seen the connection close
                after = await asyncio.gather(*(one(b) for b in images[12:]))
                return during, after

        during, after = asyncio.run(load_while_killing())
        assert {r.status_code for r in during} <= {200, 503}, [r.text for r in during if r.status_code not in (200, 503)]
        assert [r.status_code for r in after] == [200] * len(after)  # the surviving engine took them all
        deadline = time.time() + 60
        while True:
            engines = _engines(url)
            if all(e["state"] == "up" for e in engines) and engines[0].get("pid") not in (None, victim):
                break
            assert time.time() < deadline, engines
            time.sleep(0.1)
        assert engines[0]["restarts"] == 1 and engines[1]["restarts"] == 0
        metrics = httpx.get(f"{url}/metrics").text
        assert 'qwen3vl_engine_restarts_total{device="cpu"} 1.0' in metrics
    assert proc.returncode == 0
