"""Where a call loses time after another kernel's traffic: our attention against batched cuDNN, per case and tile.

`triton.testing.do_bench`, which the attention benchmark times with, zeroes a 256 MB buffer before every call, so
each call starts with an L2 full of someone else's (dirty) lines: the kernel's code, its launch parameters (TMA
descriptors) and its inputs all come from HBM. This probe times each call five ways, median of --reps:

- warm: 20 calls captured in one CUDA graph and replayed (GPU time only, everything in L2);
- cold: do_bench's way, the flush and then the call;
- data: the flush, then the inputs read (q, k, v's buffer), then the call: code and parameters cold;
- code: the flush, then the same call on a second buffer of the same layout, then the call: data and parameters
  cold, the kernel's code in L2;
- code+data: both, so that only the launch's own parameters are cold. (The twin's output takes the call's block
  from the caching allocator, so in both "code" modes the output's lines are in L2 too.)

The calls are launched eagerly, so a mode only measures the GPU while the host keeps ahead of it: the flush (a
256 MB memset) takes ~80 us, and the modes that run the twin first enqueue two calls after it. Batched cuDNN takes
50-70 us of host time per call, so its "code" and "code+data" cells often read high; ours replay their launch plan
(10-20 us per call). Tiles given with --tiles run as the automatic path's one candidate, so that they replay too.

Usage: python -m benchmarks.probe_cold [--head-dim 72] [--cases 1x1024 64x256] [--tiles 64/64/4/2/0/0 ...]
Writes probe_cold_d<head dim>.json under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import importlib
import statistics

import torch

from benchmarks.common import (ATTENTION_CASES, RESULTS, attention_flops, batched_cudnn, environment, overriding,
                               packed_qkv, print_table, write_results)
from benchmarks.probe_gluon_attention import tile_config, tile_name
from benchmarks.profile_launch import gpu_us
from kernels import tuning

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name

MODES = ("cold", "data", "code", "code+data")
_pinned_plans: dict = {}  # per configuration given with --tiles, its own launch plans


def only(config: va.TileConfig):
    """The automatic path with `config` its one candidate, under its own tuning table and launch plans."""
    return overriding((va, "hopper_candidates", lambda *args, **kwargs: [config]), (tuning, "_choices", {}),
                      (va, "_plans", _pinned_plans.setdefault(config, {})))


def timed_after(fn, prepare, flush, reps: int) -> float:
    """Median device microseconds of `fn` between two events, each call after `flush` and `prepare`."""
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(5):
        fn()
    for i in range(reps):
        flush.zero_()
        prepare()
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000 for s, e in zip(start, end))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=72)
    ap.add_argument("--cases", nargs="+", default=["1x1024", "64x256"])
    ap.add_argument("--tiles", nargs="*", default=[],
                    help="Gluon tiles besides the automatic choice (see tile_config), each as the one candidate")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    d = args.head_dim
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # do_bench's
    rows = []
    for case in args.cases:
        lengths = ATTENTION_CASES[case]
        maxlen = max(lengths)
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv, cu = packed_qkv(lengths, d, gen)
        other, _ = packed_qkv(lengths, d, gen)
        sink = torch.empty((), device="cuda")

        def ours(buf, config=None):
            """The automatic path (tuned choice, launch plan); with `config`, restricted to that one candidate,
            so that it replays as the automatic path does (a pinned configuration never does)."""
            q, k, v = buf.unbind(1)

            def call():
                if config is None:
                    return va.triton_varlen_attention(q, k, v, cu, maxlen)
                with only(config):
                    return va.triton_varlen_attention(q, k, v, cu, maxlen)
            return call

        def cudnn(buf):
            return batched_cudnn(*buf.unbind(1), lengths)

        fns = {"auto": (ours(qkv), ours(other))}
        for t in args.tiles:
            c = tile_config(t)
            fns[f"gluon {tile_name(c)}"] = (ours(qkv, c), ours(other, c))
        fns["cudnn"] = (cudnn(qkv), cudnn(other))
        row = {"case": case, "flops": attention_flops(lengths, d), "us": {}}
        for name, (fn, twin) in fns.items():
            if fn is None:
                continue
            read = lambda: torch.sum(qkv.view(-1), 0, dtype=torch.float32, out=sink)  # noqa: E731 - every input line into L2
            prepares = {"cold": lambda: None, "data": read, "code": twin, "code+data": lambda: (twin(), read())}
            row["us"][name] = {"warm": gpu_us(fn)}
            for mode in MODES:
                row["us"][name][mode] = timed_after(fn, prepares[mode], flush, args.reps)
            print(case, name, {m: round(t, 2) for m, t in row["us"][name].items()}, flush=True)
        row["choices"] = {str(k): str(c) for k, c in va.tuned_choices().items()}
        rows.append(row)
    summary = [{"case": r["case"], "fn": name, **{m: t for m, t in times.items()},
                "cold - warm": times["cold"] - times["warm"], "code+data - warm": times["code+data"] - times["warm"]}
               for r in rows for name, times in r["us"].items()]
    print_table(summary, list(summary[0]))
    write_results(f"probe_cold_d{d}", {"benchmark": "probe_cold", "unit": "us per call (device)", "env": environment(),
                                       "head_dim": d, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
