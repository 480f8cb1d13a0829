"""Every GPU of the host: wherever two or more are visible, the same inputs through each GPU's engine give GPU 0's
results, and each engine process of `serve` holds memory on its own GPU alone.

The in-process test starts each engine from a thread whose current device is cuda:0 (what the engine's worker
threads had before they bound to their device: Triton then refused every tensor on another GPU). The server test
runs `qwen3vl-encoder serve` at its defaults (every visible GPU) and reads `nvidia-smi`'s compute processes.
Tolerance: none beyond bfloat16's: the same weights (drawn on each device from one seed), the same kernels and the
same tuning (shared through the cache) give results equal to GPU 0's within 1e-3 relative error (bf16 rounding of
different pack paddings would show as about 4e-3)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from conftest import rel_err
from servers import free_port, wait_until_ready
from service.engine.local import LocalEngine
from service.settings import Settings

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two or more CUDA GPUs")]

MODEL = "random:qwen3-vl-2b"
SMALL = {"max_batch_patches": 4096, "cuda_graphs": True, "cuda_graph_buckets": "1024,2048,4096"}


def _jpegs(n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        h, w = (448, 448) if i % 3 else (224 + 32 * (i % 5), 320)
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def test_each_gpu_engine_gives_gpu0s_results(tmp_path):
    bodies = _jpegs(6, seed=5)

    async def encode_on(index: int):
        torch.cuda.set_device(0)  # the starting thread's device is GPU 0's, whatever the engine's
        settings = Settings(model=MODEL, device=f"cuda:{index}", cache_dir=str(tmp_path), **SMALL)
        engine = LocalEngine(settings)
        await engine.start()
        try:
            items = [await engine.preprocess(b) for b in bodies]
            done = await engine.submit(items, timeout_s=60)
            assert engine.batcher.forwards >= 1
            return [(r.embeds.float(), r.deepstack.float(), r.pooled) for r in done.results]
        finally:
            await engine.stop()

    reference = asyncio.run(encode_on(0))
    for index in range(1, torch.cuda.device_count()):
        before = torch.cuda.memory_allocated(0)
        got = asyncio.run(encode_on(index))
        assert torch.cuda.memory_allocated(0) == before, "an engine on another GPU allocated on GPU 0"
        for (e, d, p), (re, rd, rp) in zip(got, reference):
            assert rel_err(e, re) <= 1e-3 and rel_err(d, rd) <= 1e-3 and rel_err(p, rp) <= 1e-3, index


def _compute_apps() -> dict[int, set[str]]:
    """pid -> the GPUs (UUIDs) on which it holds memory, from nvidia-smi."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=True).stdout
    apps: dict[int, set[str]] = {}
    for line in out.splitlines():
        if line.strip():
            pid, uuid = (part.strip() for part in line.split(","))
            apps.setdefault(int(pid), set()).add(uuid)
    return apps


def test_serve_uses_every_gpu_each_engine_on_its_own(tmp_path):
    port, gpus = free_port(), torch.cuda.device_count()
    env = {**os.environ, "QWEN3VL_MODEL": MODEL, "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_CACHE_DIR": str(tmp_path), "QWEN3VL_HTTP_WORKERS": "2",
           **{f"QWEN3VL_{k.upper()}": str(v).lower() for k, v in SMALL.items()}}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, proc, timeout_s=600), "".join(lines)[-4000:]
        info = httpx.get(f"{url}/info").json()["engine"]
        assert info["engines_up"] == info["engines_configured"] == gpus, info
        engines = info["engines"]
        assert [e["device"] for e in engines] == [f"cuda:{i}" for i in range(gpus)]

        bodies = _jpegs(16 * gpus, seed=9)

        async def post_all():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(f"{url}/embed", content=b, params={"pooling": "mean"},
                                                     headers={"content-type": "image/jpeg"}) for b in bodies))

        for _ in range(3):  # least-loaded routing: every engine takes some of three bursts
            replies = asyncio.run(post_all())
            assert [r.status_code for r in replies] == [200] * len(bodies)
        served = [e["forwards"] for e in httpx.get(f"{url}/info").json()["engine"]["engines"]]
        assert all(f > 0 for f in served), served

        # each engine process on its own GPU, nothing of the front-ends or the main process on any
        apps = _compute_apps()
        engine_pids = {e["pid"] for e in httpx.get(f"{url}/info").json()["engine"]["engines"]}
        on_gpu = {pid: uuids for pid, uuids in apps.items() if pid in engine_pids}
        assert len(on_gpu) == gpus and all(len(u) == 1 for u in on_gpu.values()), apps
        assert len(set().union(*on_gpu.values())) == gpus, apps
        import psutil

        others = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} - engine_pids
        assert not (others | {proc.pid}) & set(apps), apps
        assert sum("waited" in line and "tune the kernels" in line for line in lines) <= gpus - 1
    finally:
        proc.terminate()
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
    time.sleep(0.1)
    assert proc.returncode == 0, "".join(lines)[-4000:]
