"""What the GPU's forward delivers to an HTTP user, with the server's default settings, in one run.

The same images go through two paths:
1. Forward: the served model path in this process over pixels already on the GPU (what `bench_tower` times as
   "ours"), packs of the server's patch budget, each pack timed as a CUDA graph, eagerly and on the served path,
   and counted at the fastest: the ceiling the service can reach (`forward_best_images_per_s`). Those are bursts
   of 300 ms with the GPU idle between them, at the clock it reaches before its power cap pulls it down; the
   uniform packs are then also run back to back for 15 s after 8 s of the same, on the served path and on the
   faster of the other two, with the SM clock and power sampled (`forward_sustained_images_per_s`): the forward
   at the clock a server under load runs at. Ratios are given against both.
2. Service: `qwen3vl-encoder serve` with nothing but the model, host and port set (every other setting its
   default, QWEN3VL_QUANTIZATION=fp8 included where the environment sets it), and a fresh cache directory. Every
   request POSTs one JPEG to /embed (format=safetensors, deepstack=false), its bytes its own (a JPEG comment holding
   a counter: `unique`), so that nothing is answered from the server's embedding cache.

Runs, each within one device call (10 minutes), each against a server of its own:
- the headline (no flag): uniform 448 px photos from the compiled closed-loop generator (`tools/openloop`) with 64
  and with 256 clients, then from the aiohttp generator (64 clients in 4 processes); 10 s warm-up, 20 s measured
  each. The compiled generator's figures are the headline (`compiled_ratio_c64`, `compiled_ratio_c256`), the
  aiohttp one's beside them (`aiohttp_ratio`), each with the generator's achieved rate and CPU, and the server's
  forward trace over each compiled window (packs, the GPU's idle time, launches). `service.json`, or
  `service_<quantization>.json` for a quantized tower (`service_fp8.json`);
- `--mixed`: mixed photos (224-1536 px per side, fixed seed) from the aiohttp generator: the first 30 s after ready
  (cold window: kernels the warm-up did not cover compile here), then 10 s of warm-up and 20 s measured (warm
  window), latency percentiles per size class; patches/s over the forward's on the same photos packed in order to
  the same budget (`mixed_ratio_to_forward`). `service_mixed.json` and its plot;
- `--startup-only`: seconds from launch to /ready on an empty cache and on the same cache again (`ready_s_first`,
  `ready_s_second`); one client, curl, one 448 px JPEG on the second, fresh server: /v1/embeddings and
  /embed?embeddings=false&pooling=mean, p50 of 40 requests (`single_image_fresh_p50_ms`: the slower route), and the
  pooled route from a keep-alive client, and kept alive on eight connections with the front-end each reached
  (`single_image_by_frontend`); then, twice, SIGKILL of the engine process and the seconds until /ready
  answers 200 again and an image is served (`recovery_s`, the front-ends up throughout); then that image's forward
  in-process. `service_startup.json`.
The encoder tier's layouts (vLLM's, SGLang's) and the embedding cache's latency: `benchmarks.bench_epd`.

Usage: python -m benchmarks.bench_service [--mixed | --startup-only] [--model random:qwen3-vl-2b] [--out DIR] (the
compiled generator built: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import csv
import io
import json
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import environment, forward_gaps, read_forward_trace, write_results
from tools.ready import wait_until_ready

CLIENTS, PROCS = 64, 4
OPENLOOP = ".bin/openloop"  # the compiled generator: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go
PARAMS = {"format": "safetensors", "deepstack": "false"}
# the encoder tier: vLLM's layout (bfloat16, the merged tokens and DeepStack levels; `bench_epd`): each reply is 4x
# the bytes of the merged tokens alone
EPD_PARAMS = {"format": "vllm"}
# the server's own account of a request's time (X-*-Time-Ms), recorded per request
TIMING_HEADERS = {name: f"x-{name}-time-ms" for name in ("preprocess", "queue", "inference", "total")}
SIZE_CLASSES = (("small", 512), ("medium", 1024), ("large", 1 << 30))  # by the longer side, in pixels


def photo_jpegs(sizes, seed=0) -> list[bytes]:
    """Photographs (scikit-image's) resized to each (width, height), JPEG quality 90."""
    import skimage.data as data
    from PIL import Image

    base = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    rng = np.random.default_rng(seed)
    out = []
    for i, (w, h) in enumerate(sizes):
        img = Image.fromarray(base[i % len(base)]).resize((w, h), Image.Resampling.BICUBIC)
        img = img.rotate(int(rng.integers(0, 360)))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def unique(jpeg: bytes, n: int) -> bytes:
    """`jpeg` with a comment segment holding `n`: the same pixels in other bytes, so that no request is answered
    from the server's embedding cache (what a stream of distinct photos gets)."""
    text = b"request %d" % n
    return jpeg[:2] + b"\xff\xfe" + (len(text) + 2).to_bytes(2, "big") + text + jpeg[2:]


def mixed_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    return [(int(w), int(h)) for w, h in rng.integers(224, 1537, size=(n, 2))]


def size_class(w: int, h: int) -> str:
    return next(name for name, limit in SIZE_CLASSES if max(w, h) <= limit)


# -- the forward -----------------------------------------------------------------------------------------------------


def served_encoder(model: str):
    """(settings, encoder) as the server builds them from this environment (QWEN3VL_QUANTIZATION=fp8 included), on
    the GPU in bf16."""
    from service.engine.build import configure_runtime, tower_options
    from service.model.encoder import Encoder
    from service.settings import Settings

    settings = Settings(model=model)
    configure_runtime(settings)
    return settings, Encoder.load(model, "cuda", "bfloat16", tower_options(settings))


def forward_rates(model: str, sets: dict[str, list[bytes]], budget: int, items_cap: int, rep_ms: float = 300.0):
    """Per image set: images/s and patches/s of the forward over packs of the server's budget. Each pack is timed as
    a CUDA graph of its own signature (what `bench_tower` times), eagerly, and on the served path (`BucketedTower`:
    padded to a token bucket, graph pieces captured at start-up; eager beyond the largest bucket). The ratio's
    reference is the fastest of the three per pack: the ceiling the service can reach on those packs. Small packs of
    448 px images and one image alone give the cost of the buckets' padding against their own graphs (with the
    "uniform" set)."""
    import torch

    from service.model.results import pack_by_budget
    from service.model.graphs import BucketedTower, signature

    settings, enc = served_encoder(model)
    eager = BucketedTower(enc.tower)  # no buckets: the engine's eager path
    served = BucketedTower(enc.tower, settings.graph_buckets(), settings.graph_eager_margin())
    with torch.inference_mode():
        served.capture()
    out = {}

    def rates(items, packs):
        total = {"graph": 0.0, "eager": 0.0, "served": 0.0, "best": 0.0}
        for p in packs:
            px, grids = enc.pixels([items[i] for i in p]), [items[i].grid_thw for i in p]
            ms = _pack_ms(enc.tower, {"eager": eager, "served": served}, px, grids, rep_ms)
            for k in total:
                total[k] += ms[k]
        return total

    def sustain(items, packs, total):
        """The served path and the fastest of eager and graph (by the bursts' totals) over the same packs back to
        back, as the server's GPU works under load (`sustained`)."""
        inputs = [(enc.pixels([items[i] for i in p]), [items[i].grid_thw for i in p]) for p in packs]
        fastest = min(("graph", "eager"), key=total.get)
        if fastest == "graph":
            from benchmarks.graphed import GraphedTower

            path = GraphedTower(enc.tower, max_graphs=len({signature(g) for _, g in inputs}), capture_after=1)
        else:
            path = eager
        runs = {"served": served, fastest: path}
        return {name: sustained([lambda px=px, g=g, f=f: f(px, g) for px, g in inputs], len(items))
                for name, f in runs.items()}

    with torch.inference_mode():
        for name, images in sets.items():
            items = [enc.preprocess(b) for b in images]
            packs = pack_by_budget([it.num_patches for it in items], budget, items_cap)
            total = rates(items, packs)
            patches = sum(it.num_patches for it in items)
            out[name] = {"images_per_s": len(items) * 1000 / total["best"],
                         "patches_per_s": patches * 1000 / total["best"],
                         **{f"{k}_images_per_s": len(items) * 1000 / total[k] for k in ("graph", "eager", "served")},
                         "packs": len(packs), "images": len(items), "patches": patches,
                         "pack_ms": total["best"] / len(packs)}
            if name == "uniform":
                runs = sustain(items, packs, total)
                out[name]["sustained"] = runs
                out[name]["sustained_images_per_s"] = max(r["images_per_s"] for r in runs.values())
            print(f"forward {name}: {out[name]}", flush=True)
            torch.cuda.empty_cache()
        if "uniform" not in sets:
            return out
        one = enc.preprocess(sets["uniform"][0])
        padding = {}
        for n in (1, 2, 4, 8, 23):
            ms = rates([one] * n, [list(range(n))])
            padding[f"{n}x448"] = {"tokens": n * one.num_patches, "bucket": served.bucket_for(n * one.num_patches),
                                   "graph_ms": ms["graph"], "served_ms": ms["served"], "eager_ms": ms["eager"]}
        out["padding"] = padding
        print(f"padding: {padding}", flush=True)
        out["single_image_forward_ms"] = padding["1x448"]["graph_ms"]
        out["single_image_served_ms"] = padding["1x448"]["served_ms"]
    return out


def sustained(calls: list, images: int, warmup_s: float = 8.0, seconds: float = 15.0) -> dict:
    """images/s of `calls` (one forward per pack, `images` images together) run back to back for `seconds`, after
    `warmup_s` of the same, with the SM clock and power sampled meanwhile (`ClockLog`'s medians). The bursts of
    `_pack_ms` (300 ms each, the GPU idle between them) run at the clock the GPU reaches before its power cap
    pulls it down; a server under load runs at the capped clock, and this is the forward at that clock."""
    import torch

    from benchmarks.common import ClockLog

    def cycle() -> None:
        for call in calls:
            call()
        torch.cuda.synchronize()

    end = time.perf_counter() + warmup_s
    while time.perf_counter() < end:
        cycle()
    with ClockLog(interval_ms=500) as clocks:
        cycles, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            cycle()
            cycles += 1
        elapsed = time.perf_counter() - t0
    gpu = clocks.summary()
    row = {"images_per_s": round(cycles * images / elapsed, 1), "seconds": round(elapsed, 2),
           "sm_clock_mhz": gpu.get("sm_mhz_median"), "power_w": gpu.get("power_w_median")}
    print(f"sustained forward: {row}", flush=True)
    return row


def _pack_ms(tower, paths: dict, px, grids, rep_ms: float) -> dict[str, float]:
    """One pack's forward, ms: as a CUDA graph of its signature (captured first, the only graph held), on each of
    `paths`, and the fastest."""
    from benchmarks.common import bench
    from benchmarks.graphed import GraphedTower

    graphed = GraphedTower(tower, max_graphs=1, capture_after=1)
    graphed(px, grids)
    ms = {"graph": bench(lambda: graphed(px, grids), warmup_ms=50, rep_ms=rep_ms)}
    for name, path in paths.items():
        ms[name] = bench(lambda: path(px, grids), warmup_ms=50, rep_ms=rep_ms)
    return {**ms, "best": min(ms.values())}


# -- load ------------------------------------------------------------------------------------------------------------


def _client_proc(url, bodies, tags, clients, phases, conn, params, proc):
    """Closed-loop clients; `phases` is [(name, seconds)] run back to back from the start time the parent sends once
    every generator process is up (`time.time()`: one instant in all of them, so that each phase's window is one
    window of the whole load. Windows of each process's own start, seconds apart where spawning takes seconds, span
    more than the phase between them, and each process counts its window's requests at a server that its late or
    early peers left partly idle: up to twice the server's rate was counted so), each request's body one of `bodies`
    made unique (`unique`). Sends back, per phase, the (tag, latency) of every 200 completed inside it, the count of
    every other status, this process's CPU seconds and reply bytes (the generator's own load), and when its first
    phase began."""
    import aiohttp

    conn.send("ready")
    start_at = conn.recv()

    async def run():
        records = {name: {"ok": [], "errors": {}, "cpu_s": 0.0, "bytes": 0} for name, _ in phases}
        await asyncio.sleep(max(0.0, start_at - time.time()))
        records["_began"] = time.time()
        bounds, t = [], time.perf_counter()
        for name, seconds in phases:
            bounds.append((name, t, t + seconds))
            t += seconds
        end = bounds[-1][2]
        connector = aiohttp.TCPConnector(limit=clients)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as s:
            async def loop(k):
                i = k
                while time.perf_counter() < end:
                    body = unique(bodies[i % len(bodies)], proc * 10**9 + i)
                    t0 = time.perf_counter()
                    size = 0
                    try:
                        async with s.post(f"{url}/embed", params=params, data=body,
                                          headers={"content-type": "image/jpeg"}) as r:
                            size = len(await r.read())
                            status = r.status
                            timing = [float(r.headers.get(h, "nan")) for h in TIMING_HEADERS.values()]
                    except aiohttp.ClientError as e:
                        status = type(e).__name__
                    t1 = time.perf_counter()
                    for name, start, stop in bounds:
                        if start <= t0 and t1 <= stop:
                            rec = records[name]
                            rec["bytes"] += size
                            if status == 200:
                                rec["ok"].append((tags[i % len(bodies)], t1 - t0, *timing))
                            else:
                                rec["errors"][str(status)] = rec["errors"].get(str(status), 0) + 1
                    i += clients

            async def cpu_clock():  # this process's CPU seconds within each phase
                for name, start, stop in bounds:
                    await asyncio.sleep(max(0.0, start - time.perf_counter()))
                    c0 = time.process_time()
                    await asyncio.sleep(max(0.0, stop - time.perf_counter()))
                    records[name]["cpu_s"] = time.process_time() - c0

            await asyncio.gather(cpu_clock(), *(loop(k) for k in range(clients)))
        return records

    conn.send(asyncio.run(run()))


def sm_clock() -> str:
    """The SM clock and power draw now (nvidia-smi; empty without one)."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader"],
                              capture_output=True, text=True).stdout.strip()
    except FileNotFoundError:
        return ""


def write_bodies(photos: list[bytes], work: Path) -> Path:
    """The photos as files, the compiled generator's bodies."""
    bodies = work / "bodies"
    bodies.mkdir(exist_ok=True)
    for i, b in enumerate(photos):
        (bodies / f"{i:03d}.jpg").write_bytes(b)
    return bodies


def compiled(url: str, bodies: Path, clients: int, warmup_s: float, seconds: float, work: Path,
             params: dict = PARAMS, trace: Path | None = None) -> dict:
    """`clients` closed-loop clients of the compiled generator (`tools/openloop`, each request's bytes its own) for
    `warmup_s` then `seconds`: images/s completed in the measured window, images per forward and GPU-busy time per
    image from the engine's counters, the SM clock, and the generator's achieved rate and CPU (is it the limit?);
    with the server's forward `trace` (`start_server(trace=)`), what its forwards in the window say
    (`common.forward_gaps`: the packs, the GPU's idle time, the launches and the GPU's wait for them)."""
    if not Path(OPENLOOP).exists():
        raise SystemExit(f"{OPENLOOP} missing: CGO_ENABLED=0 go build -o {OPENLOOP} tools/openloop/main.go")
    csv_path = work / f"c{clients}.csv"
    query = "&".join(f"{k}={v}" for k, v in params.items())
    gen = subprocess.Popen([OPENLOOP, "-url", f"{url}/embed?{query}", "-bodies",
                            str(bodies), "-concurrency", str(clients), "-duration", f"{warmup_s + seconds}s",
                            "-unique", "-out", str(csv_path)], stdout=subprocess.PIPE, text=True)
    time.sleep(warmup_s)
    t0 = time.time()
    a = _engine_counters(url)
    time.sleep(seconds)
    b = _engine_counters(url)
    clock = sm_clock()
    summary = json.loads(gen.communicate()[0])
    with open(csv_path, newline="") as f:
        done = [r for r in csv.DictReader(f) if r["status"] == "200"
                and warmup_s <= (int(r["due_ns"]) + int(r["latency_ns"])) / 1e9 < warmup_s + seconds]
    row = _row(len(done) / seconds, a, b, clock, {"achieved_requests_per_s": summary["achieved_per_s"],
                                                  "cpu_cores": summary["generator_cpu_s"] / summary["wall_s"],
                                                  "reply_bytes_per_s": sum(int(r["bytes"]) for r in done) / seconds})
    row["timing_p50_ms"] = request_times(done)
    if trace is not None and (forwards := read_forward_trace(trace, t0, t0 + seconds)):
        row["forwards"] = forward_gaps(forwards, seconds)
    return row


def request_times(rows: list[dict]) -> dict:
    """Medians (ms) of the generator's latency and of the server's timing headers over `rows` (the compiled
    generator's CSV rows), and of the part of each request outside the server's own account (latency minus its
    total: the client, the connection, and the front-end's read of the body and write of the reply)."""
    def median(values):
        return round(float(np.median(values)), 2) if values else None

    timed = [r for r in rows if r.get("server_ms")]
    out = {"latency": median([int(r["latency_ns"]) / 1e6 for r in rows])}
    for name in ("preprocess", "queue", "inference", "server"):
        out[name] = median([float(r[f"{name}_ms"]) for r in timed])
    out["outside_server"] = median([int(r["latency_ns"]) / 1e6 - float(r["server_ms"]) for r in timed])
    return out


def _row(images_per_s: float, a, b, clock: str, generator: dict) -> dict:
    (t0, f0, busy0), (t1, f1, busy1) = a, b
    per_s = (f1 - f0) / (t1 - t0)
    row = {"images_per_s": round(images_per_s, 1), "images_per_forward": round(images_per_s / max(per_s, 1e-9), 1),
           "gpu_busy_fraction": round((busy1 - busy0) / (t1 - t0), 4),
           "gpu_busy_ms_per_image": round((busy1 - busy0) / (t1 - t0) / images_per_s * 1e3, 4),
           "sm_clock_power": clock, "generator": generator}
    print(json.dumps(row), flush=True)
    return row


def _engine_counters(url) -> tuple[float, int, float]:
    import httpx

    engine = httpx.get(f"{url}/info", timeout=10).json()["engine"]
    return time.perf_counter(), engine["forwards"], engine["gpu_busy_s"]


def load(url, bodies, tags, patches, phases) -> dict:
    """CLIENTS closed-loop clients over PROCS processes, each request with the tokens-only PARAMS, through `phases`;
    per measured phase images/s, patches/s, p50/p99 overall and per tag, errors, the medians of the server's timing
    headers, the engine's forwards and GPU busy fraction (from /info at the phase's bounds, as this process sees
    them), and the load generator's own CPU (the busiest process's fraction of a core) and reply bytes/s."""
    ctx = mp.get_context("spawn")
    pipes, workers = [], []
    for p in range(PROCS):
        a, b = ctx.Pipe()
        w = ctx.Process(target=_client_proc, args=(url, bodies[p::PROCS], tags[p::PROCS], CLIENTS // PROCS, phases,
                                                   b, PARAMS, p))
        w.start()
        pipes.append(a)
        workers.append(w)
    for a, w in zip(pipes, workers):  # every process spawned and its imports done
        while not a.poll(1.0):
            if not w.is_alive():
                raise RuntimeError(f"a load generator process exited with code {w.exitcode} before it was ready")
        assert a.recv() == "ready"
    start_at = time.time() + 0.5
    for a in pipes:
        a.send(start_at)
    time.sleep(max(0.0, start_at - time.time()))
    counters, t = {}, time.perf_counter()
    for name, seconds in phases:
        if not name.startswith("_"):
            time.sleep(max(0.0, t - time.perf_counter()))
            counters[name] = [_engine_counters(url)]
            time.sleep(max(0.0, t + seconds - time.perf_counter()))
            counters[name].append(_engine_counters(url))
        t += seconds
    outs = [a.recv() for a in pipes]
    for w in workers:
        w.join()
    began = [o.pop("_began") for o in outs]
    if max(began) - min(began) > 0.05:
        raise RuntimeError(f"the generator processes began {max(began) - min(began):.3f} s apart: their windows are "
                           "not one window")
    size = dict(zip(tags, patches)) if len(set(tags)) == len(tags) else None
    result = {}
    for name, seconds in phases:
        if name.startswith("_"):
            continue
        ok = [x for o in outs for x in o[name]["ok"]]
        errors: dict[str, int] = {}
        for o in outs:
            for k, v in o[name]["errors"].items():
                errors[k] = errors.get(k, 0) + v
        lat = np.array([r[1] for r in ok]) * 1000
        (t0, f0, b0), (t1, f1, b1) = counters[name]
        row = {"seconds": seconds, "requests": len(ok), "images_per_s": len(ok) / seconds, "errors": errors,
               "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
               "server_p50_ms": {name: float(np.nanmedian([r[2 + k] for r in ok]))
                                 for k, name in enumerate(TIMING_HEADERS)},
               "forwards": f1 - f0, "images_per_forward": len(ok) / max(1, f1 - f0),
               "gpu_busy_fraction": (b1 - b0) / (t1 - t0),
               "generator": {"processes": PROCS, "reply_bytes_per_s": sum(o[name]["bytes"] for o in outs) / seconds,
                             "max_cpu_fraction": max(o[name]["cpu_s"] for o in outs) / seconds,
                             "cpu_fraction_per_process": [o[name]["cpu_s"] / seconds for o in outs]}}
        if size is not None:
            row["patches_per_s"] = sum(size[r[0]] for r in ok) / seconds
            by_class: dict[str, list[float]] = {}
            for tag, t, *_ in ok:
                by_class.setdefault(tag.split(":")[0], []).append(t * 1000)
            row["by_size"] = {c: {"requests": len(v), "p50_ms": float(np.percentile(v, 50)),
                                  "p99_ms": float(np.percentile(v, 99))} for c, v in sorted(by_class.items())}
        result[name] = row
        print(f"{name}: {json.dumps(row)}", flush=True)
    return result


def _p50s(send, n: int, cache: str | None) -> dict:
    """p50/p99 of `n` requests' times (after 5 unmeasured) and the medians of the server's timing headers: where the
    time goes. `send(i)` makes request i and returns (status, its time in ms, its headers, lower-cased); `cache`: the
    X-Cache every measured reply must carry."""
    times, headers = [], {name: [] for name in TIMING_HEADERS}
    for i in range(n + 5):
        status, ms, got = send(i)
        assert status == 200, (status, got)
        assert i < 5 or cache is None or got.get("x-cache") == cache, got
        if i >= 5:
            times.append(ms)
            for name, h in TIMING_HEADERS.items():
                headers[name].append(float(got[h]))
    return {"p50_ms": float(np.median(times)), "p99_ms": float(np.percentile(times, 99)), "requests": n,
            "server_p50_ms": {name: float(np.median(v)) for name, v in headers.items()}}


def curl_p50(url: str, path: str, body_files: list[str], ctype: str, n: int = 40, cache: str | None = "miss") -> dict:
    """`_p50s` of curl's total time, a process and a connection per request, request i sending
    `body_files[i % len]`."""
    def send(i):
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-D", "-", "-w", "%{http_code} %{time_total}", "-X",
                              "POST", "-H", f"content-type: {ctype}", "--data-binary",
                              f"@{body_files[i % len(body_files)]}", f"{url}{path}"],
                             capture_output=True, text=True, check=True).stdout
        code, total = out.rsplit("\n", 1)[-1].split()
        got = dict(line.lower().split(": ", 1) for line in out.splitlines() if ": " in line)
        return int(code), float(total) * 1000, {k: v.strip() for k, v in got.items()}

    return _p50s(send, n, cache)


def keepalive_p50(url: str, path: str, body_files: list[str], ctype: str, n: int = 40,
                  cache: str | None = "miss", frontend: bool = False, idle_s: float = 0.0) -> dict:
    """`curl_p50`'s figures from one client that keeps its connection open, as an application's HTTP client does
    (curl opens one per request and adds its own start-up to each): the wall time of each request on one
    `http.client` connection; `frontend`: with the front-end process the connection reached (`http_process`, from
    `/info` asked on it first); `idle_s`: the client waits that long before each request (a server idle between
    requests, as it is between curl's: its processes asleep and its caches cold, which costs each request time)."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=60)

    def send(i):
        with open(body_files[i % len(body_files)], "rb") as f:
            body = f.read()
        time.sleep(idle_s)
        start = time.perf_counter()
        conn.request("POST", path, body, {"content-type": ctype})
        reply = conn.getresponse()
        reply.read()
        ms = (time.perf_counter() - start) * 1000
        return reply.status, ms, {k.lower(): v.lower() for k, v in reply.getheaders()}

    try:
        reached = {}
        if frontend:
            conn.request("GET", "/info")
            reached["http_process"] = json.loads(conn.getresponse().read()).get("http_process")
        return {**reached, **_p50s(send, n, cache)}
    finally:
        conn.close()


def unique_files(directory: str, jpeg: bytes, first: int, n: int, prefix: str = "") -> list[str]:
    """`n` files in `directory` (named `prefix` and the index) of `jpeg` in bytes of its own each (`unique`, numbers
    from `first`: callers keep their ranges apart, so that none is answered from another's cache entry)."""
    files = [os.path.join(directory, f"{prefix}{i}.jpg") for i in range(n)]
    for i, name in enumerate(files):
        with open(name, "wb") as f:
            f.write(unique(jpeg, first + i))
    return files


def lone_bodies(directory: str, jpeg: bytes, n: int) -> tuple[list[str], list[str]]:
    """`n` request bodies of `jpeg` for each route, every one with bytes of its own (`unique`: none answered from
    the cache; the two routes' results would be the same cache entries, so theirs differ too), as files in
    `directory`: (the raw JPEGs for `/embed`, the OpenAI JSON bodies for `/v1/embeddings`)."""
    jpgs, jsons = unique_files(directory, jpeg, 7_000_000, n), []
    for i in range(n):
        jsons.append(os.path.join(directory, f"{i}.json"))
        with open(jsons[-1], "wb") as f:
            body = base64.b64encode(unique(jpeg, 7_500_000 + i)).decode()
            f.write(json.dumps({"input": "data:image/jpeg;base64," + body}).encode())
    return jpgs, jsons


def lone_by_frontend(url: str, jpeg: bytes, connections: int = 8, n: int = 20) -> list[dict]:
    """The pooled vector of `jpeg` (bytes of its own each request) kept alive on `connections` connections one after
    another (`keepalive_p50`), each with the front-end process it reached: whether a lone request's time depends on
    the front-end that serves it."""
    pooled = "/embed?embeddings=false&pooling=mean"
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for c in range(connections):
            files = unique_files(d, jpeg, 6_000_000 + 1000 * c, n + 5, prefix=f"{c}-")
            rows.append(keepalive_p50(url, pooled, files, "image/jpeg", n, frontend=True))
    return rows


def single_image(url: str, jpeg: bytes, n: int = 40) -> dict:
    """One client posting one JPEG at a time, each request's bytes its own (`lone_bodies`): `curl_p50` of
    `/v1/embeddings` and of the pooled-only `/embed`, and the latter from a client keeping its connection
    (`keepalive_p50`, other bytes again), sending back to back and 20 ms after its last reply (about the gap
    between two curl processes' requests: what of curl's figure the server's idling costs)."""
    with tempfile.TemporaryDirectory() as d:
        jpgs, jsons = lone_bodies(d, jpeg, 3 * (n + 5))
        pooled, m = "/embed?embeddings=false&pooling=mean", n + 5
        return {"v1_embeddings": curl_p50(url, "/v1/embeddings", jsons[:m], "application/json", n),
                "embed_pooled": curl_p50(url, pooled, jpgs[:m], "image/jpeg", n),
                "embed_pooled_keepalive": keepalive_p50(url, pooled, jpgs[m:2 * m], "image/jpeg", n),
                "embed_pooled_keepalive_idle": keepalive_p50(url, pooled, jpgs[2 * m:], "image/jpeg", n,
                                                             idle_s=0.02)}


def cache_latency(url: str, jpeg: bytes, n: int = 40) -> dict:
    """One client, a 448 px JPEG, the pooled vector alone: the same bytes again and again (`hit`: answered from the
    embedding cache), and the same image in bytes of its own each time (`miss`); from curl, a connection a request,
    and from a client keeping its connection (`*_keepalive`)."""
    path = "/embed?embeddings=false&pooling=mean"
    with tempfile.TemporaryDirectory() as d:
        files = unique_files(d, jpeg, 8_000_000, 2 * (n + 5))
        return {"hit": curl_p50(url, path, files[:1], "image/jpeg", n, cache="hit"),
                "miss": curl_p50(url, path, files[:n + 5], "image/jpeg", n, cache="miss"),
                "hit_keepalive": keepalive_p50(url, path, files[:1], "image/jpeg", n, cache="hit"),
                "miss_keepalive": keepalive_p50(url, path, files[n + 5:], "image/jpeg", n, cache="miss")}


def start_server(model: str, port: int, cache_dir: str, tree: str | None = None, trace: Path | None = None):
    """The server at its defaults (this tree's, or the one at `tree`: another revision's), its URL and seconds to
    ready; `trace`: the file its engines append a line per forward to (`Settings.forward_trace`)."""
    env = {**os.environ, "QWEN3VL_MODEL": model, "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_CACHE_DIR": cache_dir}
    if trace is not None:
        env["QWEN3VL_FORWARD_TRACE"] = str(trace)
    env = {k: v for k, v in env.items() if not k.startswith("TRITON_CACHE")}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(tree)] + [
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != os.getcwd()])
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, cwd=tree)
    url = f"http://127.0.0.1:{port}"
    if not wait_until_ready(url, server, timeout_s=600, interval_s=0.2):
        server.kill()
        raise RuntimeError("server did not become ready")
    return server, url, time.perf_counter() - t0


def recovery_s(url: str, body: bytes, kills: int = 2, settle_s: float = 10.0) -> list[float]:
    """SIGKILL the engine process `kills` times, each `settle_s` after it became ready (a death in steady state,
    not a crash loop); each time, seconds until /ready is 200 and `body` is served."""
    import httpx

    times, sent = [], 0
    for _ in range(kills):
        time.sleep(settle_s)
        pid = httpx.get(f"{url}/info").json()["engine"]["pid"]
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        while True:
            try:
                sent += 1
                if httpx.get(f"{url}/ready", timeout=2).status_code == 200 and httpx.post(
                        f"{url}/embed", content=unique(body, 9_000_000 + sent), headers={"content-type": "image/jpeg"},
                        params={"embeddings": "false", "pooling": "mean"}, timeout=30).status_code == 200:
                    break
            except httpx.TransportError as e:
                raise RuntimeError(f"the front-end went away during the engine's restart: {e}") from e
            time.sleep(0.05)
        times.append(time.perf_counter() - t0)
        print(f"recovered in {times[-1]:.1f} s after SIGKILL of engine {pid}", flush=True)
    return times


def startup(model: str, port: int, body: bytes) -> dict:
    """Two starts on one cache directory, the single image on the second (fresh) server, the engine's recoveries;
    then, the server gone, that image's forward in this process (as `forward_rates` times it)."""
    cache_dir = tempfile.mkdtemp(prefix="qwen3vl-cache-")
    server, url, first = start_server(model, port, cache_dir)
    print(f"ready after {first:.1f} s (empty cache)", flush=True)
    stop_server(server)
    server, url, second = start_server(model, port, cache_dir)
    print(f"ready after {second:.1f} s (second start, same cache)", flush=True)
    try:
        single_fresh = single_image(url, body)
        print(f"single image, fresh server: {single_fresh}", flush=True)
        by_frontend = lone_by_frontend(url, body)
        print(f"kept alive, by front-end: {[(r['http_process'], round(r['p50_ms'], 2)) for r in by_frontend]}",
              flush=True)
        recoveries = recovery_s(url, body)
    finally:
        stop_server(server)
    forward_ms = single_forward_ms(model, body)
    fresh_p50 = max(single_fresh["v1_embeddings"]["p50_ms"], single_fresh["embed_pooled"]["p50_ms"])
    return {"ready_s_first": first, "ready_s_second": second, "recovery_s": recoveries,
            "single_image_fresh": single_fresh, "single_image_fresh_p50_ms": fresh_p50,
            "single_image_fresh_keepalive_p50_ms": single_fresh["embed_pooled_keepalive"]["p50_ms"],
            "single_image_fresh_keepalive_idle_p50_ms": single_fresh["embed_pooled_keepalive_idle"]["p50_ms"],
            "single_image_by_frontend": by_frontend, "single_image_forward_ms": forward_ms}


def single_forward_ms(model: str, body: bytes, rep_ms: float = 300.0) -> float:
    """One image's forward, ms, as a CUDA graph of its signature: `forward_rates`' single_image_forward_ms."""
    import torch

    enc = served_encoder(model)[1]
    with torch.inference_mode():
        one = enc.preprocess(body)
        return _pack_ms(enc.tower, {}, enc.pixels([one]), [one.grid_thw], rep_ms)["graph"]


def stop_server(server):
    server.terminate()
    try:
        server.wait(90)
    except subprocess.TimeoutExpired:
        server.kill()


def plot(d: dict, path) -> None:
    """`--mixed`'s result. Left: the service's patches/s as a fraction of the forward's on the same photos, cold and
    warm (labels: the absolute figures). Right: p50 and p99 per size class, cold and warm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fwd = d["forward"]["mixed"]["patches_per_s"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.5))
    bars = [(f"mixed, {phase}", d["mixed"][phase]["patches_per_s"] / fwd,
             f"{d['mixed'][phase]['patches_per_s'] / 1e3:.0f}k / {fwd / 1e3:.0f}k patches/s")
            for phase in ("cold", "warm")]
    drawn = left.bar([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    left.bar_label(drawn, labels=[b[2] for b in bars], fontsize=8)
    left.axhline(0.9, color="grey", linestyle="--", linewidth=1)
    left.set_ylabel("service / forward (same photos, same run)")
    left.set_title(f"{d['model']}, default settings, {d['clients']} clients")
    groups = [(f"{phase}: {c}", d["mixed"][phase]["by_size"][c]) for phase in ("cold", "warm")
              for c in d["mixed"][phase]["by_size"]]
    xs = range(len(groups))
    right.bar([x - 0.2 for x in xs], [g[1]["p50_ms"] for g in groups], 0.4, label="p50")
    right.bar([x + 0.2 for x in xs], [g[1]["p99_ms"] for g in groups], 0.4, label="p99")
    right.set_xticks(list(xs), [g[0] for g in groups], rotation=20, fontsize=8)
    right.set_ylabel("ms per request")
    right.set_title("latency by size class (cold: first 30 s after ready)")
    right.legend(fontsize=8)
    env = d["env"]
    fig.suptitle(f"{env['gpu']}, rev {env['git_revision']}, {env['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compiled_loads(url: str, photos: list[bytes], warmup_s: float, seconds: float, trace: Path | None = None) -> dict:
    """The compiled generator with 64 and with 256 closed-loop clients, back to back on the server at `url`;
    `trace`: the server's forward trace (`compiled`)."""
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-openloop-"))
    bodies = write_bodies(photos, work)
    try:
        return {f"c{n}": compiled(url, bodies, n, warmup_s, seconds, work, trace=trace) for n in (64, 256)}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def generator_summary(comp: dict, aio: dict, fwd: dict) -> dict:
    """The uniform load's figures under each generator, over the forward's best on the same images: the compiled
    generator's (the headline) and the aiohttp one's beside them, each with what the generator itself used."""
    best = fwd["uniform"]["images_per_s"]
    held = fwd["uniform"].get("sustained_images_per_s")
    warm = aio["warm"]
    sustained = {} if not held else {
        "forward_sustained_images_per_s": held,
        "compiled_ratio_c64_sustained": comp["c64"]["images_per_s"] / held,
        "compiled_ratio_c256_sustained": comp["c256"]["images_per_s"] / held,
        "aiohttp_ratio_sustained": warm["images_per_s"] / held}
    return {"forward_best_images_per_s": best, **sustained,
            "compiled_images_per_s_c64": comp["c64"]["images_per_s"],
            "compiled_images_per_s_c256": comp["c256"]["images_per_s"],
            "compiled_ratio_c64": comp["c64"]["images_per_s"] / best,
            "compiled_ratio_c256": comp["c256"]["images_per_s"] / best,
            "compiled_generator_cpu_cores": max(c["generator"]["cpu_cores"] for c in comp.values()),
            "compiled_achieved_requests_per_s": {k: c["generator"]["achieved_requests_per_s"] for k, c in comp.items()},
            "aiohttp_images_per_s": warm["images_per_s"], "aiohttp_ratio": warm["images_per_s"] / best,
            "aiohttp_generator_max_cpu_fraction": warm["generator"]["max_cpu_fraction"],
            "aiohttp_p50_ms": warm["p50_ms"], "aiohttp_p99_ms": warm["p99_ms"]}


def headline(args, settings, port: int, uniform: list[bytes]) -> None:
    """The uniform load under both generators against the forward, server and forward with the environment's
    settings: `service.json`, or `service_<quantization>.json` for a quantized tower."""
    import torch

    from service.model.loader import model_configs
    from service.model.preprocess import Preprocessor

    fwd = forward_rates(args.model, {"uniform": uniform}, settings.max_batch_patches, settings.max_batch_items)
    torch.cuda.empty_cache()  # the server gets the GPU's memory
    patches = Preprocessor(model_configs(args.model)[1])(uniform[0]).num_patches
    trace = Path(tempfile.mkdtemp(prefix="qwen3vl-trace-")) / "forwards.csv"
    server, url, ready = start_server(args.model, port, tempfile.mkdtemp(prefix="qwen3vl-cache-"), trace=trace)
    try:
        import httpx

        info = httpx.get(f"{url}/info").json()
        comp = compiled_loads(url, uniform, args.warmup_s, args.measure_s, trace=trace)
        res = load(url, uniform, [f"448:{i}" for i in range(len(uniform))], [patches] * len(uniform),
                   [("_warmup", args.warmup_s), ("warm", args.measure_s)])
    finally:
        stop_server(server)
    summary = {"quantization": info.get("quantization"), "forward_images_per_s": fwd["uniform"]["images_per_s"],
               **generator_summary(comp, res, fwd), "ready_s": ready}
    payload = {"benchmark": "service", "env": environment(), "model": args.model, "clients": CLIENTS,
               "load_processes": PROCS, "params": PARAMS, "summary": summary, "forward": fwd, "compiled": comp,
               "uniform": res,
               "server": {k: info.get(k) for k in ("http_workers", "cuda_graphs", "attention_backend", "limits")}}
    name = "service" if settings.quantization == "none" else f"service_{settings.quantization}"
    write_results(name, payload, args.out)
    print(json.dumps({"benchmark": name, **summary}))


def mixed(args, settings, port: int) -> None:
    """Mixed photos from the aiohttp generator, cold and warm, against the forward on the same photos:
    `service_mixed.json` and its plot."""
    import torch

    from service.model.loader import model_configs
    from service.model.preprocess import Preprocessor

    sizes = mixed_sizes(args.images, seed=1)
    photos = photo_jpegs(sizes, seed=1)
    fwd = forward_rates(args.model, {"mixed": photos}, settings.max_batch_patches, settings.max_batch_items)
    torch.cuda.empty_cache()
    pre = Preprocessor(model_configs(args.model)[1])
    patches = [pre(b).num_patches for b in photos]
    tags = [f"{size_class(w, h)}:{i}" for i, (w, h) in enumerate(sizes)]
    server, url, ready = start_server(args.model, port, tempfile.mkdtemp(prefix="qwen3vl-cache-"))
    print(f"ready after {ready:.1f} s (empty cache)", flush=True)
    try:
        res = load(url, photos, tags, patches, [("cold", args.cold_s), ("_warmup", args.warmup_s),
                                                ("warm", args.measure_s)])
    finally:
        stop_server(server)
    summary = {"mixed_ratio_to_forward": res["warm"]["patches_per_s"] / fwd["mixed"]["patches_per_s"],
               "mixed_cold_ratio_to_forward": res["cold"]["patches_per_s"] / fwd["mixed"]["patches_per_s"],
               "mixed_warm_p99_over_p50": res["warm"]["p99_ms"] / res["warm"]["p50_ms"],
               "cold_p99_over_warm_p99": res["cold"]["p99_ms"] / res["warm"]["p99_ms"], "ready_s": ready}
    payload = {"benchmark": "service_mixed", "env": environment(), "model": args.model, "clients": CLIENTS,
               "load_processes": PROCS, "params": PARAMS, "summary": summary, "forward": fwd, "mixed": res}
    path = write_results("service_mixed", payload, args.out)
    try:
        plot(payload, path.with_suffix(".png"))
    except ImportError:  # matplotlib is optional: --plot draws it later from the JSON
        pass
    print(json.dumps({"benchmark": "service_mixed", **summary}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--cold-s", type=float, default=30)
    ap.add_argument("--warmup-s", type=float, default=10)
    ap.add_argument("--measure-s", type=float, default=20)
    ap.add_argument("--out", default=None)
    run = ap.add_mutually_exclusive_group()
    run.add_argument("--mixed", action="store_true", help="mixed photos, cold and warm: service_mixed.json")
    run.add_argument("--startup-only", action="store_true",
                     help="the starts, the lone image on a fresh server, the engine's recoveries: service_startup.json")
    run.add_argument("--plot", metavar="JSON", help="only draw the plot (PNG beside it) of a service_mixed.json")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(open(args.plot).read()), os.path.splitext(args.plot)[0] + ".png")
        return
    from service.settings import Settings

    defaults = Settings()
    port = 18777
    if args.startup_only:
        result = startup(args.model, port, photo_jpegs([(448, 448)])[0])
        payload = {"benchmark": "service_startup", "env": environment(), "model": args.model, **result}
        write_results("service_startup", payload, args.out)
        print(json.dumps(payload))
    elif args.mixed:
        mixed(args, defaults, port)
    else:
        headline(args, defaults, port, photo_jpegs([(448, 448)] * args.images))


if __name__ == "__main__":
    main()
