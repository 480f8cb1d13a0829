"""Where the served path's forward (`BucketedTower`, what the engine runs) loses time against the eager forward of the
same pack: for packs of N 448 px images, the tower run eagerly, on the server's buckets, and on a bucket of exactly
the pack's tokens (no padding), each timed (median of CUDA-event timings, the variants interleaved so that they share
the GPU's clock) and profiled (GPU time per kernel category, and the timeline's idle time between kernels).

Usage: python -m tools.profile_served [--model random:qwen3-vl-2b] [--packs 32,41] [--out DIR]
Writes profile_served.json.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch

from benchmarks.bench_service import served_encoder
from benchmarks.common import ClockLog, bench, environment, write_results
from service.model.graphs import BucketedTower
from tools.profile_tower import kernel_table, timeline


def by_category(rows: list[dict]) -> dict[str, float]:
    cats = defaultdict(float)
    for r in rows:
        cats[r["category"]] += r["us_per_forward"]
    return {k: round(v, 1) for k, v in sorted(cats.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--packs", default="32,41")
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings, enc = served_encoder(args.model)
    tower, cfg = enc.tower, enc.tower.config
    side = args.side // (cfg.patch_size * cfg.spatial_merge_size) * cfg.spatial_merge_size
    grid = (1, side, side)
    packs = [int(p) for p in args.packs.split(",")]
    result = {"model": args.model, "grid": grid, "buckets": settings.graph_buckets(), "packs": {}}
    with torch.inference_mode():
        served = BucketedTower(tower, settings.graph_buckets(), settings.graph_eager_margin())
        served.capture()
        result["bucket_ms"] = {t: round(ms, 3) for t, ms in served.bucket_ms.items()}
        result["routes"] = served.routes
        print(f"bucket forwards, GPU ms: {result['bucket_ms']}; routes {served.routes}", flush=True)
        eager = BucketedTower(tower)
        for n in packs:
            grids = [grid] * n
            tokens = n * side * side
            pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=tower.dtype)
            exact = BucketedTower(tower, (tokens,))
            exact.capture()
            variants = {"eager": eager, "served": served, "exact_bucket": exact}
            for fn in variants.values():
                fn(pixels, grids)
            torch.cuda.synchronize()
            times = defaultdict(list)
            with ClockLog() as clocks:
                for _ in range(args.rounds):  # interleaved: the variants see the same clocks
                    for name, fn in variants.items():
                        times[name].append(bench(lambda fn=fn: fn(pixels, grids), warmup_ms=100, rep_ms=400))
            row = {"tokens": tokens, "bucket": served.bucket_for(tokens), "gpu": clocks.summary()}
            for name, fn in variants.items():
                ms = statistics.median(times[name])
                table = kernel_table(lambda fn=fn: fn(pixels, grids), 3)
                tl = timeline(lambda fn=fn: fn(pixels, grids), 3)
                row[name] = {"ms": round(ms, 3), "ms_per_image": round(ms / n, 4),
                             "all_ms": [round(t, 3) for t in times[name]],
                             "kernel_us": round(sum(r["us_per_forward"] for r in table), 1),
                             "by_category_us": by_category(table),
                             "top_kernels": [{k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items()}
                                             for r in table[:20]],
                             "timeline": {k: v for k, v in tl.items() if k != "largest_gaps_us"},
                             "largest_gaps_us": tl["largest_gaps_us"][:8]}
                print(f"{n} x {args.side} px ({tokens} tokens) {name}: {ms:.2f} ms, kernels "
                      f"{row[name]['kernel_us'] / 1000:.2f} ms, idle {tl['idle_us_per_forward'] / 1000:.2f} ms; "
                      f"{row[name]['by_category_us']}", flush=True)
            result["packs"][str(n)] = row
            del exact
            torch.cuda.empty_cache()
    result["env"] = environment()
    write_results("profile_served", result, args.out)


if __name__ == "__main__":
    main()
