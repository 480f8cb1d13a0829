"""What glibc's malloc thresholds cost a front-end per reply: a vLLM-layout reply (`format=vllm`: the tokens and
DeepStack levels of one image, `torch.save`d and base64-encoded in JSON, as `service.http.output` builds it) built
again and again in a fresh process whose mmap and trim thresholds are fixed at each size (`runtime.MALLOC_RETURN_BYTES`
is the served one), and in one with glibc's own. A block past the threshold is mapped for itself and unmapped when
freed, so each reply's multi-megabyte buffers come as fresh pages, faulted in and zeroed, at every reply.

Usage: python -m benchmarks.bench_reply_malloc [--thresholds-mib 4 8 0] [--out DIR]   (0: glibc's own)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from benchmarks.common import environment, write_results

CHILD = r"""
import ctypes, json, sys, time
import orjson, torch
mib, rows, width = (int(a) for a in sys.argv[1:4])
if mib:
    libc = ctypes.CDLL("libc.so.6")
    assert libc.mallopt(-3, mib << 20) and libc.mallopt(-1, mib << 20)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
torch.serialization.set_crc32_options(False)  # as the front-ends save (runtime.configure_process)
from service.http.output import torch_base64
feature, grid = torch.randn(rows, width).to(torch.bfloat16), torch.tensor([[1, 28, 28]])
def reply():
    return orjson.dumps({"data": [{"image_embeds": torch_base64(feature).decode(),
                                   "image_grid_thw": torch_base64(grid).decode()}]})
for _ in range(20):
    reply()
times = []
for _ in range(200):
    t0 = time.perf_counter()
    reply()
    times.append(time.perf_counter() - t0)
print(json.dumps({"reply_mb": len(reply()) / 1e6, "median_ms": 1e3 * sorted(times)[len(times) // 2]}))
"""

# (rows, width): a 448 px image's 196 tokens and its three DeepStack levels, 2B (2048 wide) and 8B (4096)
SHAPES = {"2B, 448 px": (4 * 196, 2048), "8B, 448 px": (4 * 196, 4096)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--thresholds-mib", type=int, nargs="+", default=[4, 8, 0])
    ap.add_argument("--runs", type=int, default=3, help="fresh processes per threshold and shape")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for shape, (n, width) in SHAPES.items():
        for mib in args.thresholds_mib:
            runs = [json.loads(subprocess.run([sys.executable, "-c", CHILD, str(mib), str(n), str(width)],
                                              capture_output=True, text=True, check=True).stdout)
                    for _ in range(args.runs)]
            row = {"shape": shape, "thresholds": f"{mib} MiB" if mib else "glibc's own",
                   "reply_mb": runs[0]["reply_mb"], "median_ms": statistics.median(r["median_ms"] for r in runs),
                   "runs_ms": [r["median_ms"] for r in runs]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    write_results("reply_malloc", {"benchmark": "reply_malloc", "env": environment(), "rows": rows}, args.out)


if __name__ == "__main__":
    main()
