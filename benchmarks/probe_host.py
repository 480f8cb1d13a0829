"""Why `bench_attention`'s process pays more host time per call than `profile_launch`'s.

Measures, in one process, the host time per call (back-to-back, no synchronisation) and the do_bench
time of the automatic Triton path, batched cuDNN and two trivial PyTorch ops, at each stage of what
`bench_attention` does before it times a case: fresh; after the SDPA baselines of one case; after
compiling and running FlexAttention; after `torch._dynamo.reset()`; after `gc.collect()`. With each
stage it records the process state that could slow every call down (Python trace/profile hooks,
torch function and dispatch modes, threads, live objects).

Usage: python -m benchmarks.probe_host [--shape 1x1024] [--head-dim 64]
Writes host_probe_d<head dim>_<shape>.json under $OUT or benchmarks/results (the committed ones are in
benchmarks/results/launch).
"""

from __future__ import annotations

import argparse
import gc
import sys
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.bench_attention import _flex_fn, host_us, run_case
from benchmarks.common import ATTENTION_CASES, HEADS, bench, environment, packed_qkv, write_results
from kernels.varlen_attention import triton_varlen_attention


def process_state() -> dict:
    return {
        "sys_gettrace": repr(sys.gettrace()), "sys_getprofile": repr(sys.getprofile()),
        "threads": [t.name for t in threading.enumerate()],
        "torch_function_mode": torch._C._is_torch_function_mode_enabled(),
        "dispatch_stack": torch._C._len_torch_dispatch_stack(),
        "grad_enabled": torch.is_grad_enabled(),
        "gc_objects": len(gc.get_objects()), "gc_count": gc.get_count(),
        "cuda_allocated_mb": torch.cuda.memory_allocated() / 2**20,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1x1024")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lengths = ATTENTION_CASES[args.shape]
    d = args.head_dim
    qkv, cu = packed_qkv(lengths, d, torch.Generator(device="cuda").manual_seed(0))
    q, k, v = qkv.unbind(1)
    maxlen = max(lengths)
    qb, kb, vb = (t.view(len(lengths), lengths[0], HEADS, d).transpose(1, 2).contiguous() for t in (q, k, v))
    x = torch.randn(1024, device="cuda")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qb, kb, vb)

    fns = {"triton": lambda: triton_varlen_attention(q, k, v, cu, maxlen), "batched-cudnn": cudnn,
           "torch.empty": lambda: torch.empty(1024, device="cuda"), "add_": lambda: x.add_(1.0)}

    stages = []

    def measure(stage):
        row = {"stage": stage, "state": process_state()}
        for name, fn in fns.items():
            row[name] = {"host_us": host_us(fn, calls=500), "bench_us": bench(fn) * 1e3}
        stages.append(row)
        print(stage, {n: (round(row[n]["host_us"], 1), round(row[n]["bench_us"], 1)) for n in fns}, flush=True)

    measure("fresh")
    run_case(lengths, d, flex=False)
    measure("after baselines (run_case without flex)")
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
    flex = _flex_fn(lengths, q4, k4, v4)
    flex()
    torch.cuda.synchronize()
    measure("after FlexAttention compile")
    torch._dynamo.reset()
    measure("after torch._dynamo.reset()")
    gc.collect()
    measure("after gc.collect()")
    with torch.inference_mode():
        measure("inside torch.inference_mode()")
    write_results(f"host_probe_d{d}_{args.shape}", {"benchmark": "host_probe", "env": environment(),
                                                    "shape": args.shape, "head_dim": d, "stages": stages},
                  args.out)


if __name__ == "__main__":
    main()
