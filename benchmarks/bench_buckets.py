"""Where a pack should leave the CUDA graph buckets: the served path (`BucketedTower`: padded to a token bucket, graph
pieces) against the eager forward at each pack size of 448 px images, and the eager forward's host time.

A bucketed pack pays its padding rows and a graph launch per piece; an eager one pays ~230 launches from Python. The
eager forward wins once its GPU work hides its launches. Each size: burst medians (`do_bench`), then at the sizes the
server forms under load each path sustained back to back, at the clock the GPU holds under its power cap.

    python -m benchmarks.bench_buckets [--model random:qwen3-vl-2b] [--sizes 4,8,...] [--out DIR]
    (buckets.json, or buckets_fp8.json)

QWEN3VL_QUANTIZATION=fp8 measures the FP8 tower; QWEN3VL_CUDA_GRAPH_BUCKETS sets the served buckets, as in the server.
"""

from __future__ import annotations

import argparse

from benchmarks.bench_service import photo_jpegs, served_encoder, sustained
from benchmarks.common import bench, environment, write_results


def main() -> None:
    import torch

    from service.model.graphs import BucketedTower, EagerChoice, issue_ms

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--sizes", default="1,2,4,8,12,16,20,24,28,32,36,41")
    ap.add_argument("--sustained-sizes", default="16,24,32,41")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    settings, enc = served_encoder(args.model)
    tower = enc.tower
    eager = BucketedTower(tower)
    served = BucketedTower(tower, settings.graph_buckets(), eager_margin=None)  # every bucket, for the table
    with torch.inference_mode():
        served.capture()
        choice = EagerChoice.measure(tower, served.buckets[-1])
        measured = {"limit_tokens": choice.limit, "eager_host_ms": round(choice.host_ms, 3),
                    "eager_gpu_ms": round(choice.gpu_ms_per_token * served.buckets[-1], 3),
                    "tokens": served.buckets[-1]}
        print(f"eager limit: {measured}", flush=True)
        one = enc.preprocess(photo_jpegs([(448, 448)])[0])
        rows = []
        for n in (int(s) for s in args.sizes.split(",")):
            px, grids = enc.pixels([one] * n), [one.grid_thw] * n
            row = {"images": n, "tokens": n * one.num_patches, "bucket": served.bucket_for(n * one.num_patches)}
            for name, path in (("served", served), ("eager", eager)):
                path(px, grids)
                row[f"{name}_ms"] = round(bench(lambda: path(px, grids), warmup_ms=50, rep_ms=300), 3)
                row[f"{name}_host_ms"] = round(issue_ms(lambda: path(px, grids), tower.device, 5), 3)
            if str(n) in args.sustained_sizes.split(","):
                for name, path in (("served", served), ("eager", eager)):
                    run = sustained([lambda: path(px, grids)], n, warmup_s=2.0, seconds=args.seconds)
                    row[f"{name}_sustained_images_per_s"] = run["images_per_s"]
                    row[f"{name}_sustained_mhz"] = run["sm_clock_mhz"]
            print(row, flush=True)
            rows.append(row)
    result = {"benchmark": "buckets", "env": environment(), "model": args.model,
              "quantization": settings.quantization, "buckets": list(served.buckets), "eager_limit": measured,
              "rows": rows}
    write_results("buckets" if settings.quantization == "none" else f"buckets_{settings.quantization}", result,
                  args.out)


if __name__ == "__main__":
    main()
