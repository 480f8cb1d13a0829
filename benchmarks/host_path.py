"""Host time of the attention call's own Python path, on any machine: everything `triton_varlen_attention` does
before Triton's launch (input checks, layout checks, descriptors, arguments), with the launch itself stubbed out.

Triton's binder and launcher (specialisation, descriptor encoding) come on top and need a GPU: see
benchmarks/profile_launch.py for the whole call on one. CPU tensors stand in for the GPU's; the fused QKV layout
of the benchmark, a pinned configuration per kernel.

Usage: python -m benchmarks.host_path [--lengths 256x64] [--head-dims 64 72] [--calls 20000]
"""

from __future__ import annotations

import argparse
import importlib
import time

import torch

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name
ga = importlib.import_module("kernels.gluon_attention")


def per_call_us(fn, calls: int, rounds: int = 3) -> float:
    """Best of `rounds` averages over `calls` calls, microseconds."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="256x64", help="segment length x count")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72])
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    length, count = map(int, args.lengths.split("x"))
    stub = lambda *a, **k: None  # noqa: E731 - the launch, stubbed
    va.launch, ga.launch = stub, stub
    remainder_t = va.kv_remainder_t
    for head_dim in args.head_dims:
        qkv = torch.randn(length * count, 3, 16, head_dim, dtype=torch.bfloat16)
        q, k, v = qkv.unbind(1)
        cu = torch.arange(0, length * (count + 1), length, dtype=torch.int32)
        out = torch.empty_like(q)
        copy = remainder_t(k, v, cu, length) if head_dim & (head_dim - 1) else None
        va.kv_remainder_t = lambda *a, copy=copy, **kw: copy  # its launch stubbed too, its result kept
        for config in va.gluon_candidates(head_dim) + va.tma_candidates(head_dim)[:1]:
            us = per_call_us(lambda: va.triton_varlen_attention(q, k, v, cu, length, out=out, config=config),
                             args.calls)
            name = "gluon" if config.gluon else "tma"
            print(f"d{head_dim} {name} {config.block_m}/{config.block_n}/{config.num_warps}"
                  f"{' copy' if config.gluon and config.rem_copy and copy is not None else ''}: {us:.1f} us per call",
                  flush=True)


if __name__ == "__main__":
    main()
