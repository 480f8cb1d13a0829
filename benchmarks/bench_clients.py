"""Is the served throughput the server's, whatever the load generator? One GPU, one run, the same 448 px photos.

1. The forward, in this process, over packs of n of those images (n = 8 ... 41, the server's budget holding 41):
   each pack as a CUDA graph of its own signature, eagerly, and on the served path (`BucketedTower`: padded to its
   token bucket, graph pieces captured at start-up): ms per image by pack size and bucket.
2. `serve` at its defaults, then with graph buckets only up to 6,400 tokens (larger packs run eagerly at their own
   size: no bucket padding). Against each: the compiled closed-loop generator (`tools/openloop`, `-unique`) with 64
   and with 256 clients, and (defaults) `bench_service`'s aiohttp generator with 64 clients, its processes' windows
   aligned. Per load: images/s, the generator's achieved rate and CPU, images per forward, the engine's GPU-busy time
   per image, and the SM clock (nvidia-smi) at the end of the window.

Usage: python -m benchmarks.bench_clients [--out DIR] (the generator built:
CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_service import (PARAMS, _pack_ms, compiled, load, photo_jpegs, served_encoder, sm_clock,
                                      start_server, stop_server, unique, write_bodies)
from benchmarks.common import environment, metric_sums, read_forward_trace, write_results

PACKS = (8, 16, 20, 24, 28, 32, 41)
EAGER_ABOVE = 6400  # the second server's largest graph bucket


def forward_table(model: str, jpeg: bytes, packs: tuple[int, ...] = PACKS) -> dict:
    import torch

    from service.model.graphs import BucketedTower

    settings, enc = served_encoder(model)
    eager, served = BucketedTower(enc.tower), BucketedTower(enc.tower, settings.graph_buckets(), settings.graph_eager_margin())
    out = {}
    with torch.inference_mode():
        served.capture()
        one = enc.preprocess(jpeg)
        for n in packs:
            items = [one] * n
            ms = _pack_ms(enc.tower, {"eager": eager, "served": served}, enc.pixels(items), [one.grid_thw] * n, 300.0)
            out[str(n)] = {"tokens": n * one.num_patches, "bucket": served.bucket_for(n * one.num_patches),
                           **{f"{k}_ms_per_image": round(v / n, 4) for k, v in ms.items()}}
            print("forward", n, out[str(n)], flush=True)
    del enc, eager, served
    torch.cuda.empty_cache()
    return out


COUNTERS = ("qwen3vl_images_total", "qwen3vl_output_tokens_total", 'qwen3vl_embedding_cache_items_total{result="hit"}',
            'qwen3vl_embedding_cache_items_total{result="miss"}', 'qwen3vl_embedding_cache_items_total{result="shared"}',
            "qwen3vl_batch_items_sum", "qwen3vl_batch_items_count", "qwen3vl_batch_patches_sum",
            "qwen3vl_forward_seconds_sum", "qwen3vl_forward_seconds_count")


def counters(url: str) -> dict[str, float]:
    """The server's own counts: images encoded, tokens returned, cache outcomes, items and forwards."""
    return metric_sums(url, COUNTERS)


class Probe:
    """During a load: every 0.25 s, one more request for a known photo (bytes of its own: no cache hit), its tokens
    compared with the same photo's encoded when the server was idle (are the replies under load right?); and the
    GPU's SM clock and power, sampled every 0.2 s."""

    sent = 0  # probes sent by every Probe: each one's bytes its own

    def __init__(self, url: str, photo: bytes):
        import httpx
        import threading

        self.url, self.photo, self.client = url, photo, httpx.Client(timeout=60)
        self.reference = self._tokens(0)
        self.stop, self.rel_errors, self.samples = threading.Event(), [], []
        self.threads = [threading.Thread(target=f, daemon=True) for f in (self._probe, self._gpu)]

    def _tokens(self, n: int):
        from safetensors.torch import load

        r = self.client.post(f"{self.url}/embed", params={"format": "safetensors", "deepstack": "false"},
                             content=unique(self.photo, 10**12 + n), headers={"content-type": "image/jpeg"})
        r.raise_for_status()
        return load(r.content)["embeds.0"].float()

    def _probe(self):
        while not self.stop.wait(0.25):
            Probe.sent += 1
            got = self._tokens(Probe.sent)
            self.rel_errors.append(float((got - self.reference).abs().max() / self.reference.abs().max()))

    def _gpu(self):
        while not self.stop.wait(0.2):
            line = sm_clock().splitlines()[:1]
            if line:
                self.samples.append(line[0])

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()

    def summary(self) -> dict:
        clocks = [float(s.split(" MHz")[0]) for s in self.samples]
        power = [float(s.split(",")[1].strip().split(" ")[0]) for s in self.samples]
        errs = sorted(self.rel_errors)
        return {"probes": len(errs), "probe_max_rel_error": round(errs[-1], 4) if errs else None,
                "probes_over_5pct": sum(e > 0.05 for e in errs),
                "sm_clock_mhz_median": float(np.median(clocks)) if clocks else None,
                "power_w_median": float(np.median(power)) if power else None}


def forwards_by_bucket(trace: Path, t0: float, t1: float) -> dict:
    """The engine's forwards between unix times t0 and t1 (`Settings.forward_trace`), by the graph bucket their
    patches fall in: count, median items, GPU ms per image (CUDA events), median launch-to-outputs ms."""
    from service.settings import DEFAULT_GRAPH_BUCKETS

    rows = [r[1:] for r in read_forward_trace(trace, t0, t1)]
    by: dict[str, list] = {}
    for r in rows:
        bucket = next((b for b in DEFAULT_GRAPH_BUCKETS if r[1] <= b), None)
        by.setdefault(str(bucket) if bucket else "eager", []).append(r)
    out = {k: {"forwards": len(v), "items_median": float(np.median([r[0] for r in v])),
               "gpu_ms_per_image": round(sum(r[2] for r in v) / sum(r[0] for r in v), 4),
               "gpu_ms_median": round(float(np.median([r[2] for r in v])), 3),
               "launch_to_outputs_ms_median": round(float(np.median([r[3] for r in v])), 3)}
           for k, v in sorted(by.items(), key=lambda kv: (kv[0] == "eager", int(kv[0]) if kv[0] != "eager" else 0))}
    images = sum(r[0] for r in rows)
    out["all"] = {"forwards": len(rows), "images": images, "gpu_s": round(sum(r[2] for r in rows) / 1e3, 3),
                  "gpu_ms_per_image": round(sum(r[2] for r in rows) / max(images, 1), 4)}
    return out


def check(args, photos, bodies: Path, work: Path) -> dict:
    """The server's own counts around each generator's load: does every request of each cost one image's forward,
    are the replies right under load, and at what clocks and power?"""
    trace = work / "forwards.csv"
    os.environ["QWEN3VL_FORWARD_TRACE"] = str(trace)
    server, url, ready_s = start_server(args.model, 18779, tempfile.mkdtemp(prefix="qwen3vl-cache-"))
    os.environ.pop("QWEN3VL_FORWARD_TRACE")
    out = {"ready_s": round(ready_s, 1)}
    try:
        for name in ("aiohttp_c64", "compiled_c64"):
            before, t0, wall0 = counters(url), time.perf_counter(), time.time()
            with Probe(url, photos[1]) as probe:
                if name.startswith("aiohttp"):
                    a = load(url, photos, [f"448:{i}" for i in range(len(photos))], [0] * len(photos),
                             [("warm", args.seconds)])["warm"]
                    row = {"requests_in_window": a["requests"], "images_per_s": round(a["images_per_s"], 1),
                           "images_per_forward": round(a["images_per_forward"], 1),
                           "gpu_busy_fraction": round(a["gpu_busy_fraction"], 4), "generator": a["generator"]}
                else:
                    row = compiled(url, bodies, 64, 0.0, args.seconds, work)
            row["during_load"] = probe.summary()
            after = counters(url)
            row["counts_over_s"] = round(time.perf_counter() - t0, 1)
            row["server_counts"] = d = {k: after[k] - before[k] for k in COUNTERS}
            items = max(d["qwen3vl_batch_items_sum"], 1)
            row["server_images_per_s_over_counts"] = round(d["qwen3vl_images_total"] / row["counts_over_s"], 1)
            row["server_patches_per_image"] = round(d["qwen3vl_batch_patches_sum"] / items, 1)
            row["forwards"] = forwards_by_bucket(trace, wall0, time.time())
            out[name] = row
            print(name, json.dumps(row), flush=True)
    finally:
        stop_server(server)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--warmup-s", type=float, default=4)
    ap.add_argument("--seconds", type=float, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--check", action="store_true",
                    help="only the server's own counts (/metrics) around an aiohttp and a compiled load: clients_check.json")
    args = ap.parse_args()
    photos = photo_jpegs([(448, 448)] * 64)
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-clients-"))
    bodies = write_bodies(photos, work)
    if args.check:
        write_results("clients_check", {"benchmark": "clients_check", "env": environment(), "model": args.model,
                                        **check(args, photos, bodies, work)}, args.out)
        return
    result = {"benchmark": "clients", "env": environment(), "model": args.model, "params": PARAMS,
              "forward": forward_table(args.model, photos[0])}
    cache = tempfile.mkdtemp(prefix="qwen3vl-cache-")
    from service.settings import DEFAULT_GRAPH_BUCKETS

    configs = {"defaults": {},
               f"graphs_up_to_{EAGER_ABOVE}": {"QWEN3VL_CUDA_GRAPH_BUCKETS": ",".join(
                   str(b) for b in DEFAULT_GRAPH_BUCKETS if b <= EAGER_ABOVE)}}
    for name, env in configs.items():
        os.environ.update(env)
        server, url, ready_s = start_server(args.model, 18779, cache)
        try:
            runs = {"ready_s": round(ready_s, 1)}
            for clients in (64, 256):
                runs[f"compiled_c{clients}"] = compiled(url, bodies, clients, args.warmup_s, args.seconds, work)
            if name == "defaults":
                a = load(url, photos, [f"448:{i}" for i in range(len(photos))], [0] * len(photos),
                         [("_warmup", args.warmup_s), ("warm", args.seconds)])["warm"]
                runs["aiohttp_c64"] = {"images_per_s": round(a["images_per_s"], 1),
                                       "images_per_forward": round(a["images_per_forward"], 1),
                                       "gpu_busy_fraction": round(a["gpu_busy_fraction"], 4),
                                       "gpu_busy_ms_per_image": round(a["gpu_busy_fraction"] / a["images_per_s"] * 1e3,
                                                                      4),
                                       "sm_clock_power": sm_clock(), "generator": a["generator"]}
            result[name] = runs
        finally:
            stop_server(server)
            for k in env:
                os.environ.pop(k)
    best = max(v["images_per_s"] for k, v in result["defaults"].items() if isinstance(v, dict))
    forward_best = 1e3 / min(min(v["graph_ms_per_image"], v["eager_ms_per_image"], v["served_ms_per_image"])
                             for v in result["forward"].values())
    result["summary"] = {
        "forward_best_images_per_s": round(forward_best, 1),
        **{f"{cfg}_{k}_ratio": round(v["images_per_s"] / forward_best, 3)
           for cfg in configs for k, v in result[cfg].items() if isinstance(v, dict)},
        "best_served_images_per_s": best}
    write_results("clients", result, args.out)
    print(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
