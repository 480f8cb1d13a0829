"""How the graphed tower's time splits between the GPU and the launch: host time of one replay, GPU
time per forward back to back, and with do_bench's cache flush between runs (the benchmark's method).

Usage: python -m benchmarks.probe_graph_launch [--preset qwen3-vl-2b] [--workload 32x448px]"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from triton.testing import do_bench

from benchmarks.bench_tower import WORKLOADS
from service.config import preset
from service.graphs import GraphedTower
from service.loader import random_tower


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-vl-2b")
    ap.add_argument("--workload", default="32x448px")
    args = ap.parse_args()
    cfg = preset(args.preset)
    grids = WORKLOADS[args.workload]
    tower = random_tower(cfg, "cuda", torch.bfloat16)
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
    graphed = GraphedTower(tower)
    res = {}
    with torch.inference_mode():
        for _ in range(4):
            graphed(pixels, grids)
        torch.cuda.synchronize()
        captured = next(iter(graphed._graphs.values()))
        host = []
        for _ in range(10):  # host time of one replay launch, GPU idle
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            captured.graph.replay()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        res["host ms per replay() call, GPU idle"] = statistics.median(host)
        host = []
        for _ in range(10):  # host time when the previous replay is still running
            t0 = time.perf_counter()
            captured.graph.replay()
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        res["host ms per replay() call, back to back"] = statistics.median(host)
        for name, fn in (("graphed", lambda: graphed(pixels, grids)), ("replay only", captured.graph.replay),
                         ("eager", lambda: tower(pixels, tower.plan(grids)))):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            fn()
            torch.cuda.synchronize()
            start.record()
            for _ in range(20):
                fn()
            end.record()
            torch.cuda.synchronize()
            res[f"{name}: ms per forward, 20 back to back"] = start.elapsed_time(end) / 20
            res[f"{name}: do_bench median ms"] = do_bench(fn, warmup=200, rep=1000, return_mode="median")
            res[f"{name}: per-call events, median ms"] = per_call_ms(fn, sync=False)
            res[f"{name}: per-call events after a sync, median ms"] = per_call_ms(fn, sync=True)
    print(json.dumps(res, indent=1))


def per_call_ms(fn, sync: bool, calls: int = 20) -> float:
    """Median of CUDA events around each call, no cache flush; `sync`: the host waits for the GPU before
    each call, so its launch latency lands inside the window."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if sync:
            torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


if __name__ == "__main__":
    main()
