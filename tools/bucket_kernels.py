"""One image's forward as a CUDA graph of its own shape against the served path (`BucketedTower` with the server's
buckets: padded to its bucket, the bucket's whole-forward graph), timed and kernel by kernel: what the bucket costs
the image, and in which kernels. An image whose token count is a bucket's own shows the bucket's kernels without
padding.

Usage: python -m tools.bucket_kernels [--model random:qwen3-vl-2b] [--sizes 448x448 640x320] [--out DIR]
(CUDA; writes bucket_kernels.json)
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.bench_service import photo_jpegs, served_encoder
from benchmarks.common import bench, environment, write_results
from benchmarks.graphed import GraphedTower
from service.model.graphs import BucketedTower

FORWARDS = 20  # profiled per path


def kernels(fn) -> tuple[float, list[dict]]:
    """GPU ms of one call of `fn`, and its kernels (name, us a call, launches a call), the costliest first."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(FORWARDS):
            fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    rows = [{"kernel": e.key, "us": round(e.self_device_time_total / FORWARDS, 1), "launches": e.count // FORWARDS}
            for e in events if e.self_device_time_total > 0]
    return round(sum(r["us"] for r in rows) / 1000, 3), rows


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--sizes", nargs="+", default=["448x448", "640x320"], help="WIDTHxHEIGHT of each image")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings, enc = served_encoder(args.model)
    served = BucketedTower(enc.tower, settings.graph_buckets(), settings.graph_eager_margin())
    served.capture()
    out = []
    for size in args.sizes:
        width, height = map(int, size.split("x"))
        item = enc.preprocess(photo_jpegs([(width, height)])[0])
        px, grids = enc.pixels([item]), [item.grid_thw]
        graphed = GraphedTower(enc.tower, max_graphs=1, capture_after=1)
        graphed(px, grids)
        row = {"size": size, "tokens": item.num_patches, "bucket": served.bucket_for(item.num_patches),
               "graph_attention": graphed.attention(grids)}
        for name, fn in (("graph", lambda: graphed(px, grids)), ("served", lambda: served(px, grids))):
            row[f"{name}_ms"] = round(bench(fn, warmup_ms=50, rep_ms=300), 4)
            row[f"{name}_kernel_ms"], row[f"{name}_kernels"] = kernels(fn)
        print({k: v for k, v in row.items() if not k.endswith("_kernels")}, flush=True)
        for name in ("graph", "served"):
            for k in row[f"{name}_kernels"][:8]:
                print(f"  {name:6s} {k['us']:8.1f} us  x{k['launches']:3d}  {k['kernel'][:100]}")
        out.append(row)
    write_results("bucket_kernels", {"benchmark": "bucket_kernels", "env": environment(), "model": args.model,
                                     "rows": out}, args.out)


if __name__ == "__main__":
    main()
