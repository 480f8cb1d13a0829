"""Every GPU of the host: wherever two or more are visible, the same inputs through each GPU's engine give GPU 0's
results, and each engine process of `serve` holds memory on its own GPU alone.

The first test starts each engine, one process per GPU with every GPU visible, from threads whose current device is
CUDA's default, GPU 0 (before the engine's threads bound to their device, Triton then refused every tensor on another
GPU, and each engine created a context on GPU 0). The server test
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
from servers import free_port
from tools.ready import wait_until_ready

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


ENCODE_ON = """
import asyncio, io, json, os, subprocess, sys, time
import torch
from service.engine.local import LocalEngine
from service.settings import Settings

index, cache, bodies_path, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
bodies = torch.load(bodies_path, weights_only=False)
settings = Settings(model=MODEL, device=f"cuda:{index}", cache_dir=cache, **SMALL)

async def main():
    # this thread, and every worker thread the engine starts, begins on CUDA's default device, GPU 0
    engine = LocalEngine(settings)
    await engine.start()
    items = await engine.preprocess(bodies)
    done = await engine.submit(items, time.monotonic() + 60)
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    mine = sorted({line.split(",")[1].strip() for line in apps.splitlines() if line.split(",")[0].strip() == str(os.getpid())})
    torch.save({"results": [(r.embeds, r.deepstack, r.pooled) for r in done.results], "gpus": mine,
                "uuid": "GPU-" + str(torch.cuda.get_device_properties(index).uuid)}, out)
    await engine.stop()

asyncio.run(main())
"""


def test_each_gpu_engine_gives_gpu0s_results(tmp_path):
    """One process per GPU, each serving one device given as cuda:N with every GPU visible (the single-process
    server's `--device cuda:N`): its threads launch on its own GPU, it holds memory there alone, and its results
    equal GPU 0's."""
    bodies = tmp_path / "bodies.pt"
    torch.save(_jpegs(6, seed=5), bodies)
    script = f"MODEL = {MODEL!r}\nSMALL = {SMALL!r}\n" + ENCODE_ON
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    outputs = []
    for index in range(torch.cuda.device_count()):
        out = tmp_path / f"out{index}.pt"
        done = subprocess.run([sys.executable, "-c", script, str(index), str(tmp_path / "cache"), str(bodies),
                               str(out)], env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-4000:]
        outputs.append(torch.load(out, weights_only=False))
    for index, got in enumerate(outputs):
        assert got["gpus"] == [got["uuid"]], (index, got["gpus"], got["uuid"])  # no context on another GPU
        for (e, d, p), (re, rd, rp) in zip(got["results"], outputs[0]["results"]):
            assert rel_err(e.float(), re.float()) <= 1e-3, index
            assert rel_err(d.float(), rd.float()) <= 1e-3, index
            assert rel_err(p, rp) <= 1e-3, index


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
