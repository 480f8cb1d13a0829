"""Launch-bound attention shapes: host time per call, GPU time per call, and where the host time goes.

For each shape and path it measures
- `host_us`: back-to-back calls without synchronising (the host's cost per call);
- `gpu_us`: the same call captured 20 times in one CUDA graph and replayed (the device's cost alone,
  no host in the loop);
- `bench_us`: `triton.testing.do_bench`, the timing bench_attention reports (L2 flushed before each
  call; a call whose host cost outlasts the flush shows host time here);
- `max_err`: against the float32 reference.
Paths: the automatic Triton path (replayed through its launch plan, through the full path at every call, and through
Triton's JIT launch), the TMA kernel with host- and with device-encoded descriptors at each TMA tile, the Gluon
kernel's tiles, the pointer kernel, batched cuDNN. Then the cProfile table of one path (`--profile-path`, default the automatic one) on the first
shape. Writes launch_profile_d<head dim>.json under $OUT or benchmarks/results.

Usage: python -m benchmarks.profile_launch [--calls 2000] [--shapes 1x1024 8x1024 64x256 1x4096] [--head-dim 72]
       [--no-tiles] [--profile-path "gluon 64x128 w4 s2 r0"]
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import io
import pstats

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_attention import host_us
from benchmarks.common import HEADS, environment, overriding, packed_qkv, write_results
import kernels.tuning as tuning
from kernels.varlen_attention import (
    TMA_TILES,
    TileConfig,
    gluon_candidates,
    reference_varlen_attention,
    triton_varlen_attention,
    tuned_choices,
)

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name


def gpu_us(fn, calls: int = 20, replays: int = 20) -> float:
    """Device microseconds per call: `calls` calls captured in one CUDA graph, replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return sorted(times)[len(times) // 2]


def shape_paths(lengths, d, tiles=True):
    qkv, cu = packed_qkv(lengths, d)
    q, k, v = qkv.unbind(1)
    maxlen = max(lengths)
    out = torch.empty_like(q)
    ref = reference_varlen_attention(q, k, v, cu, maxlen)
    fns = {"triton (automatic)": lambda: triton_varlen_attention(q, k, v, cu, maxlen, out=out)}

    def overridden(*settings):
        """The automatic call with (module, attribute, value) settings in force for its duration."""
        def call():
            with overriding(*settings):
                return triton_varlen_attention(q, k, v, cu, maxlen, out=out)
        return call

    # the full path at every call (launch plans off), and the same through Triton's own launch (tuning.launch's
    # lean path off too)
    fns["triton (automatic, no plan)"] = overridden((va, "LAUNCH_PLANS", False))
    fns["triton (automatic, JIT launch)"] = overridden((va, "LAUNCH_PLANS", False), (tuning, "_lean", False))
    for bm, bn, w, s in TMA_TILES if tiles else []:
        for device in (False, True):
            c = TileConfig(bm, bn, w, s, tma=True, device_desc=device)
            fns[f"tma {bm}x{bn} w{w} s{s} {'device' if device else 'host'} desc"] = (
                lambda c=c: triton_varlen_attention(q, k, v, cu, maxlen, out=out, config=c))
    for c in gluon_candidates(d) if tiles else []:
        rem = (" copy" if c.rem_copy else " in place") if d & (d - 1) else ""
        fns[f"gluon {c.block_m}x{c.block_n} w{c.num_warps} s{c.num_stages} r{c.maxnreg}{rem}"] = (
            lambda c=c: triton_varlen_attention(q, k, v, cu, maxlen, out=out, config=c))
    fns["pointer 128x64 w4 s3"] = lambda: triton_varlen_attention(q, k, v, cu, maxlen, out=out,
                                                                  config=TileConfig(128, 64, 4, 3))
    if len(set(lengths)) == 1:
        qb, kb, vb = (t.view(len(lengths), lengths[0], HEADS, d).transpose(1, 2).contiguous() for t in (q, k, v))

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qb, kb, vb)

        fns["sdpa cudnn (batched)"] = cudnn
    return fns, out, ref


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--shapes", nargs="+", default=["1x1024", "8x1024", "64x256", "1x4096"])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--no-tiles", action="store_true", help="only the automatic paths and cuDNN")
    ap.add_argument("--profile-path", default="triton (automatic)", help="the path whose host time cProfile splits")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    d = args.head_dim
    rows, profiled = [], None
    for shape in args.shapes:
        n, length = (int(x) for x in shape.split("x"))
        fns, out, ref = shape_paths([length] * n, d, tiles=not args.no_tiles)
        for name, fn in fns.items():
            row = {"shape": shape, "path": name}
            try:
                result = fn()
                torch.cuda.synchronize()
                if not name.startswith("sdpa"):
                    row["max_err"] = (out.float() - ref).abs().max().item()
                row["host_us"] = host_us(fn, args.calls)
                row["gpu_us"] = gpu_us(fn)
                row["bench_us"] = triton.testing.do_bench(fn) * 1000
            except Exception as e:  # noqa: BLE001 - a path that fails here is reported, not fatal
                row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"{shape:8s} {name:36s} " + (row.get("error") or
                  f"host {row['host_us']:7.1f}  gpu {row['gpu_us']:7.1f}  bench {row['bench_us']:7.1f} us"
                  + (f"  err {row['max_err']:.2e}" if "max_err" in row else "")), flush=True)
        if profiled is None:
            prof = cProfile.Profile()
            fn = fns[args.profile_path]
            prof.enable()
            for _ in range(args.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            profiled = buf.getvalue()
            print(profiled)
    write_results(f"launch_profile_d{d}", {"benchmark": "attention_launch_bound_shapes", "unit": "us/call",
                                     "env": environment(), "head_dim": d, "rows": rows,
                                     "choices": {str(k): str(v) for k, v in tuned_choices().items()},
                                     "cprofile": profiled}, args.out)


if __name__ == "__main__":
    main()
