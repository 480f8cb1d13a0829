"""Host time per attention call, and where it goes (cProfile), on one launch-bound shape.

A 1x1024 d64 call takes ~20 us on an H100, so the host must launch it in less than that or the GPU
waits. Prints microseconds per call for each path, then the cProfile table of the automatic Triton
path. Writes launch_profile.json under $OUT or benchmarks/results.

Usage: python -m benchmarks.profile_launch [--calls 2000] [--lengths 1024]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_attention import host_us
from benchmarks.common import HEADS, environment, write_results
from kernels.varlen_attention import TileConfig, triton_varlen_attention, tuned_choices


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths, d = args.lengths, args.head_dim
    total = sum(lengths)
    qkv = torch.randn(total, 3, HEADS, d, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    maxlen = max(lengths)
    out = torch.empty_like(q)
    qb, kb, vb = (t.view(len(lengths), lengths[0], HEADS, d).transpose(1, 2).contiguous() for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qb, kb, vb)

    fns = {
        "triton (automatic)": lambda: triton_varlen_attention(q, k, v, cu, maxlen, out=out),
        "triton pointer kernel, pinned": lambda: triton_varlen_attention(q, k, v, cu, maxlen, out=out,
                                                                         config=TileConfig(128, 64, 4, 3)),
        "triton TMA kernel, pinned": lambda: triton_varlen_attention(q, k, v, cu, maxlen, out=out,
                                                                     config=TileConfig(128, 64, 4, 3, tma=True)),
        "sdpa cudnn (batched)": cudnn,
        "torch.empty (reference point)": lambda: torch.empty(16, device="cuda"),
    }
    us = {name: host_us(fn, args.calls) for name, fn in fns.items()}
    for name, t in us.items():
        print(f"{name:32s} {t:8.1f} us/call")
    prof = cProfile.Profile()
    fn = fns["triton (automatic)"]
    prof.enable()
    for _ in range(args.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
    print(buf.getvalue())
    write_results("launch_profile", {"benchmark": "attention_host_launch", "unit": "us/call", "env": environment(),
                                     "lengths": lengths, "head_dim": d, "us_per_call": us,
                                     "choices": {str(k): str(v) for k, v in tuned_choices().items()},
                                     "cprofile": buf.getvalue()}, args.out)


if __name__ == "__main__":
    main()
