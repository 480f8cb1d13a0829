"""The encoder tier's reply under load: vLLM's layout (`format=vllm`: bfloat16 merged tokens and DeepStack levels,
3.2 MB of tensors and 4.3 MB of JSON a 448 px image) beside the merged tokens alone, from the compiled closed-loop
generator (`tools/openloop`, bytes of their own per request), at each `--shared-memory-mib` (a server per value,
every other setting its default), then one image alone and the embedding cache on the first server.

Each request holds room in its front-end's shared memory (`Settings.shared_memory_mib`) from its submission to its
reply; what does not fit goes over the engine's socket. This shows what that bound costs vLLM's layout.

Usage: python -m benchmarks.bench_epd [--shared-memory-mib 256,64] [--out DIR] -> epd.json (the compiled generator
built: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks import bench_service as b
from benchmarks.common import environment, write_results

LOADS = (("epd_c64", 64, b.EPD_PARAMS), ("epd_c256", 256, b.EPD_PARAMS), ("tokens_c64", 64, b.PARAMS),
         ("tokens_c256", 256, b.PARAMS))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--shared-memory-mib", default="256,64", help="a server per value, in order")
    ap.add_argument("--warmup-s", type=float, default=8)
    ap.add_argument("--measure-s", type=float, default=12)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    photos = b.photo_jpegs([(448, 448)] * 256)
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-epd-"))
    bodies = b.write_bodies(photos, work)
    runs: dict = {}
    try:
        for i, mib in enumerate(args.shared_memory_mib.split(",")):
            os.environ["QWEN3VL_SHARED_MEMORY_MIB"] = mib
            server, url, _ = b.start_server(args.model, 18555, str(work / f"cache{i}"))
            try:
                for name, clients, params in LOADS:
                    runs[f"shm{mib}_{name}"] = b.compiled(url, bodies, clients, args.warmup_s, args.measure_s, work,
                                                          params=params)
                if i == 0:
                    runs["single_image"] = b.single_image(url, photos[0])
                    runs["cache"] = b.cache_latency(url, photos[0])
            finally:
                b.stop_server(server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {"benchmark": "epd", "env": environment(), "model": args.model, "runs": runs}
    write_results("epd", payload, args.out)
    print(json.dumps({k: v["images_per_s"] if "images_per_s" in v else {case: r["p50_ms"] for case, r in v.items()}
                      for k, v in runs.items()}))


if __name__ == "__main__":
    main()
