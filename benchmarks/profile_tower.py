"""Where one tower forward's time goes: per-kernel CUDA times (torch.profiler) plus micro-benchmarks
of each GEMM shape and memory-bound pass, so the breakdown can be set against the GEMM floor.

Usage: python -m benchmarks.profile_tower [--preset qwen3-vl-2b] [--workload 32x448px] [--out DIR]
Writes profile_<preset>_<workload>.json.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import torch
import torch.nn.functional as F

from benchmarks.bench_tower import WORKLOADS
from benchmarks.common import bench, environment, write_results
from kernels.add_layernorm import add_layernorm
from kernels.qkv_rope import qkv_rope_, qkv_rope_linear
from service.config import preset
from service.loader import random_tower

CATEGORIES = [  # first match wins
    ("attention", r"varlen_attn|flash|fmha|cudnn|attention"),
    ("add+layernorm", r"add_layernorm"),
    ("qkv gemm+rope (triton)", r"qkv_rope_gemm"),
    ("rope", r"rope"),
    ("gemm", r"gemm|nvjet|sm90_xmma|cutlass|cublas|matmul|splitK"),
    ("layernorm (torch)", r"layer_norm|LayerNorm"),
    ("gelu", r"gelu|GeLU"),
    ("copy/cast", r"copy|cast|Copy"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
    ("reduce", r"reduce"),
]


def category(name: str) -> str:
    for cat, pat in CATEGORIES:
        if re.search(pat, name):
            return cat
    return "other"


def kernel_table(fn, iters: int) -> list[dict]:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if us <= 0:
            continue
        rows.append({"kernel": e.key[:160], "category": category(e.key), "us_per_forward": us / iters,
                     "calls_per_forward": e.count / iters})
    return sorted(rows, key=lambda r: -r["us_per_forward"])


def micro(cfg, tokens: int) -> dict:
    """Each GEMM shape and memory-bound pass of one block, alone."""
    h, inter, dt = cfg.hidden_size, cfg.intermediate_size, torch.bfloat16
    x = torch.randn(tokens, h, device="cuda", dtype=dt)
    y = torch.randn_like(x)
    mid = torch.randn(tokens, inter, device="cuda", dtype=dt)
    w = {n: torch.randn(o, i, device="cuda", dtype=dt) * 0.02 for n, (o, i) in
         {"qkv": (3 * h, h), "proj": (h, h), "fc1": (inter, h), "fc2": (h, inter)}.items()}
    b = {n: torch.randn(t.shape[0], device="cuda", dtype=dt) * 0.02 for n, t in w.items()}
    ln_w, ln_b = torch.ones(h, device="cuda", dtype=dt), torch.zeros(h, device="cuda", dtype=dt)
    qkv = torch.randn(tokens, 3, cfg.num_heads, cfg.head_dim, device="cuda", dtype=dt)
    cos = torch.rand(tokens, cfg.head_dim // 2, device="cuda")
    sin = torch.rand_like(cos)
    res = {}

    def gemm(name, fn, m, n, k):
        ms = bench(fn, warmup_ms=50, rep_ms=300)
        res[name] = {"ms": ms, "tflops": 2 * m * n * k / ms / 1e9}

    gemm("qkv (bias)", lambda: F.linear(x, w["qkv"], b["qkv"]), tokens, 3 * h, h)
    gemm("qkv (no bias)", lambda: F.linear(x, w["qkv"]), tokens, 3 * h, h)
    if cfg.head_dim & (cfg.head_dim - 1) == 0:
        gemm("qkv + rope (triton, fused epilogue)",
             lambda: qkv_rope_linear(x, w["qkv"], b["qkv"], cos, sin, cfg.num_heads), tokens, 3 * h, h)
    gemm("proj (bias)", lambda: F.linear(x, w["proj"], b["proj"]), tokens, h, h)
    gemm("proj (+residual, addmm beta=1)", lambda: torch.addmm(y, x, w["proj"].t()), tokens, h, h)
    gemm("fc1 (bias+gelu epilogue)", lambda: torch._addmm_activation(b["fc1"], x, w["fc1"].t(), use_gelu=True),
         tokens, inter, h)
    gemm("fc1 (bias)", lambda: F.linear(x, w["fc1"], b["fc1"]), tokens, inter, h)
    gemm("fc2 (bias)", lambda: F.linear(mid, w["fc2"], b["fc2"]), tokens, h, inter)
    gemm("fc2 (+residual, addmm beta=1)", lambda: torch.addmm(y, mid, w["fc2"].t()), tokens, h, inter)

    def passes(name, fn, nbytes):
        ms = bench(fn, warmup_ms=50, rep_ms=300)
        res[name] = {"ms": ms, "GB/s": nbytes / ms / 1e6}

    act = tokens * h * 2
    passes("add+layernorm (triton)", lambda: add_layernorm(x, y, ln_w, ln_b, 1e-6), 4 * act)
    passes("layernorm (torch)", lambda: F.layer_norm(x, (h,), ln_w, ln_b, 1e-6), 2 * act)
    passes("qkv rope (triton, in place)", lambda: qkv_rope_(qkv, cos, sin), 4 * act + 2 * cos.numel() * 4)
    passes("copy (torch, reference bandwidth)", lambda: y.copy_(x), 2 * act)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-vl-2b")
    ap.add_argument("--workload", default="32x448px")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = preset(args.preset)
    grids = WORKLOADS[args.workload]
    tokens = sum(t * h * w for t, h, w in grids)
    tower = random_tower(cfg, "cuda", torch.bfloat16)
    pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return tower(pixels, tower.plan(grids))

    with torch.inference_mode():
        fwd()
        torch.cuda.synchronize()
        wall = bench(fwd, warmup_ms=200, rep_ms=1000)
        table = kernel_table(fwd, args.iters)
        by_cat = defaultdict(float)
        for r in table:
            by_cat[r["category"]] += r["us_per_forward"]
        micro_res = micro(cfg, tokens)
        # A/B of the QKV projection's RoPE: in its epilogue (served), by the pass, Q in the attention kernel
        from service.tower import Attention

        micro_res["tower wall, Q and K rotated in the QKV projection"] = {"ms": wall}
        Attention.fused_qkv_rope = False
        micro_res["tower wall, Q and K rotated by the pass"] = {"ms": bench(fwd, warmup_ms=200, rep_ms=1000)}
        Attention.rope_q_in_kernel = True
        micro_res["tower wall, Q rotated in the attention kernel"] = {"ms": bench(fwd, warmup_ms=200, rep_ms=1000)}
        Attention.rope_q_in_kernel, Attention.fused_qkv_rope = False, True
    busy = sum(by_cat.values()) / 1000
    print(f"{args.preset} {args.workload}: wall {wall:.2f} ms, GPU busy {busy:.2f} ms")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:24s} {us / 1000:7.2f} ms")
    for r in table[:25]:
        print(f"  {r['us_per_forward']:9.1f} us  x{r['calls_per_forward']:<5.0f} {r['category']:16s} {r['kernel'][:90]}")
    for k, v in micro_res.items():
        print(f"  micro {k:36s} {v}")
    write_results(f"profile_{args.preset}_{args.workload}", {
        "benchmark": "profile_tower", "env": environment(), "preset": args.preset, "workload": args.workload,
        "tokens": tokens, "wall_ms": wall, "gpu_busy_ms": busy, "by_category_ms": {k: v / 1000 for k, v in by_cat.items()},
        "kernels": table, "micro": micro_res}, args.out)


if __name__ == "__main__":
    main()
