"""Where one tower forward's time goes: per-kernel CUDA times (torch.profiler) plus micro-benchmarks
of each GEMM shape and memory-bound pass, so the breakdown can be set against the GEMM floor.

With `--quantization fp8` the tower is the FP8 one the server loads with QUANTIZATION=fp8, and the micro-benchmarks
add each FP8 GEMM (cuBLASLt's scaled_mm, row-wise scales) beside its bf16 form, and the passes that quantise
activations: where the FP8 tower's time goes against the bf16 one's.

Usage: python -m tools.profile_tower [--preset qwen3-vl-2b] [--workload 32x448px] [--quantization none|fp8] [--out DIR]
Writes profile_<preset>_<workload>[_fp8].json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import time
from collections import defaultdict
from dataclasses import replace

import torch
import torch.nn.functional as F

import kernels.add_layernorm
from benchmarks.bench_tower import workload_grids
from benchmarks.common import ClockLog, bench, environment, write_results
from kernels.act_quant import act_quantize
from kernels.add_layernorm import add_layernorm, layernorm_offset
from kernels.fp8 import act_norms, fp8_gemm_shape, quantize_weight, scaled_linear
from kernels.fp8_gemm import FP8_TILES, UNFUSED, Rope, _rope_tiles, fp8_gemm
from kernels.qkv_rope import gemm_candidates, qkv_rope_, qkv_rope_linear
from service.model.config import preset
from benchmarks.graphed import GraphedTower
from service.model.loader import random_tower
from service.model.quant import ACT_HANDED
from service.model.tower import TowerOptions, padded_width

CATEGORIES = [  # first match wins
    ("attention", r"varlen_attn|flash|fmha|cudnn|attention"),
    ("activation quantise", r"act_quant"),
    ("add+layernorm", r"add_layernorm"),
    ("fp8 gemm", r"e4m3|f8f8|fp8|scaled_mm"),
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


def idle_gaps(ops):
    """ops: (start, stop, name) sorted by start -> (busy time, [(gap, op before, op after)])."""
    end, prev = ops[0][1], ops[0][2]
    busy, gaps = ops[0][1] - ops[0][0], []
    for start, stop, name in ops[1:]:
        if start > end:
            gaps.append((start - end, prev, name))
        busy += max(0.0, stop - max(start, end))
        if stop > end:
            end, prev = stop, name
    return busy, gaps


def timeline(fn, iters: int) -> dict:
    """The GPU timeline of `iters` calls (the served, graphed forward): the span from the first kernel's
    start to the last one's end, the time some kernel (or memset/memcpy) runs, and the largest idle
    gaps with the operations on either side, so launch and dependency latency show apart from kernels."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as exported:
            trace = json.load(exported)
    ops = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in trace["traceEvents"]
                 if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy"))
    busy, gaps = idle_gaps(ops)
    by_next = defaultdict(lambda: [0.0, 0])
    for gap, _, nxt in gaps:
        key = category(nxt) if category(nxt) != "other" else nxt[:40]
        by_next[key][0] += gap
        by_next[key][1] += 1
    span = max(stop for _, stop, _ in ops) - ops[0][0]
    return {"span_us_per_forward": span / iters, "busy_us_per_forward": busy / iters,
            "idle_us_per_forward": (span - busy) / iters, "ops_per_forward": len(ops) / iters,
            "idle_by_next_op_us_per_forward": {k: [v[0] / iters, v[1] / iters]
                                               for k, v in sorted(by_next.items(), key=lambda kv: -kv[1][0])},
            "largest_gaps_us": [(round(g, 1), a[:60], b[:60]) for g, a, b in sorted(gaps, reverse=True)[:15]]}


def block_gemms(cfg) -> dict[str, tuple[int, int]]:
    """A block's GEMMs as the loaded tower runs them (its MLP padded, `tower.pad_mlp`): name -> (out_features,
    in_features)."""
    h, inter = cfg.hidden_size, padded_width(cfg.intermediate_size)
    return {"qkv": (3 * h, h), "proj": (h, h), "fc1": (inter, h), "fc2": (h, inter)}


def micro(cfg, tokens: int) -> dict:
    """Each GEMM shape and memory-bound pass of one block, alone."""
    h, inter, dt = cfg.hidden_size, padded_width(cfg.intermediate_size), torch.bfloat16
    x = torch.randn(tokens, h, device="cuda", dtype=dt)
    y = torch.randn_like(x)
    mid = torch.randn(tokens, inter, device="cuda", dtype=dt)
    w = {n: torch.randn(o, i, device="cuda", dtype=dt) * 0.02 for n, (o, i) in block_gemms(cfg).items()}
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
    if gemm_candidates(h, cfg.head_dim):  # the fused projection runs (else it falls back to the pass)
        gemm("qkv + rope (triton, fused epilogue)",
             lambda: qkv_rope_linear(x, w["qkv"], b["qkv"], cos, sin, cfg.num_heads), tokens, 3 * h, h)
    gemm("proj (bias)", lambda: F.linear(x, w["proj"], b["proj"]), tokens, h, h)
    gemm("proj (+residual, addmm beta=1)", lambda: torch.addmm(y, x, w["proj"].t()), tokens, h, h)
    gemm("fc1 (bias+gelu epilogue)", lambda: torch._addmm_activation(b["fc1"], x, w["fc1"].t(), use_gelu=True),
         tokens, inter, h)
    gemm("fc1 (bias)", lambda: F.linear(x, w["fc1"], b["fc1"]), tokens, inter, h)
    gemm("fc2 (bias)", lambda: F.linear(mid, w["fc2"], b["fc2"]), tokens, h, inter)
    gemm("fc2 (+residual, addmm beta=1)", lambda: torch.addmm(y, mid, w["fc2"].t()), tokens, h, inter)
    acc = y.clone()  # the served form: the residual stream accumulates in place
    gemm("proj (+residual in place, addmm_)", lambda: acc.addmm_(x, w["proj"].t()), tokens, h, h)
    gemm("fc2 (+residual in place, addmm_)", lambda: acc.addmm_(mid, w["fc2"].t()), tokens, h, inter)
    default_blas = torch.backends.cuda.preferred_blas_library()
    res["preferred blas library"] = str(default_blas)
    try:  # cuBLASLt through PyTorch needs a workspace, which the tower turns off (CUBLASLT_WORKSPACE_SIZE)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        gemm("proj (+residual in place, addmm_, cuBLASLt)", lambda: acc.addmm_(x, w["proj"].t()), tokens, h, h)
        gemm("fc2 (+residual in place, addmm_, cuBLASLt)", lambda: acc.addmm_(mid, w["fc2"].t()), tokens, h, inter)
    except RuntimeError as e:
        res["proj (+residual in place, addmm_, cuBLASLt)"] = {"error": str(e)}
    finally:
        torch.backends.cuda.preferred_blas_library(default_blas)

    def passes(name, fn, nbytes):
        ms = bench(fn, warmup_ms=50, rep_ms=300)
        res[name] = {"ms": ms, "GB/s": nbytes / ms / 1e6}

    act = tokens * h * 2
    passes("add+layernorm (triton)", lambda: add_layernorm(x, y, ln_w, ln_b, 1e-6), 4 * act)
    offset = torch.randn(h, device="cuda")
    passes("layernorm + bias offset (triton)", lambda: layernorm_offset(x, offset, ln_w, ln_b, 1e-6), 2 * act)
    for rows, warps in itertools.product((2, 4, 8, 16), (4, 8)):
        passes(f"layernorm + bias offset (triton, {rows} rows, {warps} warps)",
               lambda rows=rows, warps=warps: kernels.add_layernorm._launch(x, None, offset, ln_w, ln_b, 1e-6, None, 0,
                                                                              rows, warps), 2 * act)
    passes("layernorm (torch)", lambda: F.layer_norm(x, (h,), ln_w, ln_b, 1e-6), 2 * act)
    rope_bytes = 4 * act + 2 * cos.numel() * 4
    passes("qkv rope (triton, in place)", lambda: qkv_rope_(qkv, cos, sin), rope_bytes)
    passes("copy (torch, reference bandwidth)", lambda: y.copy_(x), 2 * act)
    return res


def micro_fp8(cfg, tokens: int) -> dict:
    """Each of a block's GEMMs in FP8 (e4m3 operands, row-wise scales, bias and bf16 out in cuBLASLt's epilogue) with
    its input quantised already, then in its served form (`fused_fp8`), and the passes the FP8 tower adds: quantising
    a bf16 activation alone (proj's input), the GELU with its e4m3 epilogue, and the residual add cuBLASLt leaves."""
    h, inter, dt = cfg.hidden_size, padded_width(cfg.intermediate_size), torch.bfloat16
    res = {}
    for name, (n, k) in block_gemms(cfg).items():
        if not fp8_gemm_shape(k, n):
            res[f"{name} fp8"] = {"skipped": f"{n} x {k}: not a width the FP8 GEMM takes"}
            continue
        x = torch.randn(tokens, k, device="cuda", dtype=dt)
        w = torch.randn(n, k, device="cuda", dtype=dt) * 0.02
        wq, ws = quantize_weight(w)
        bias = torch.randn(n, device="cuda", dtype=dt) * 0.02
        xq = act_quantize(x, "none")
        ms = bench(lambda: scaled_linear(xq.codes, xq.scale, wq, ws, bias, out_dtype=dt), warmup_ms=50, rep_ms=300)
        ms16 = bench(lambda: F.linear(x, w, bias), warmup_ms=50, rep_ms=300)
        res[f"{name} fp8"] = {"ms": ms, "tflops": 2 * tokens * n * k / ms / 1e9, "bf16_ms": ms16, "speedup": ms16 / ms}
        res[f"{name} fp8, fused epilogue"] = fused_fp8(cfg, name, xq, wq, ws, bias, x, w)
    act = tokens * h * 2
    x = torch.randn(tokens, h, device="cuda", dtype=dt)
    y = torch.randn_like(x)
    mid = torch.randn(tokens, inter, device="cuda", dtype=dt)
    for name, fn, nbytes in (
            ("quantise proj's input (act_quantize none)", lambda: act_quantize(x, "none"), act + act // 2),
            ("gelu + e4m3 epilogue (act_quantize)", lambda: act_quantize(mid, "gelu_pytorch_tanh"),
             tokens * inter * 3),
            ("residual add after the GEMM (add_)", lambda: y.add_(x), 3 * act)):
        ms = bench(fn, warmup_ms=50, rep_ms=300)
        res[name] = {"ms": ms, "GB/s": nbytes / ms / 1e6}
    return res


def fused_fp8(cfg, name, xq, wq, ws, bias, x, w) -> dict:
    """One block GEMM in the served FP8 form (`kernels.fp8_gemm`: RoPE for qkv, the residual in place for proj and
    fc2, the bias and the GELU in e4m3 for fc1) at each tile and as cuBLASLt plus the passes (`UNFUSED`), beside the
    bf16 GEMM the bf16 tower runs for it (qkv_rope_linear, addmm_, the GELU epilogue)."""
    tokens, k = x.shape
    heads = cfg.num_heads
    cos = torch.rand(tokens, cfg.head_dim // 2, device="cuda")
    sin = torch.rand_like(cos)
    acc = torch.randn(tokens, wq.shape[0], device="cuda", dtype=x.dtype)
    if name == "qkv":
        call = lambda tile: fp8_gemm(xq, wq, ws, bias, rope=Rope(cos, sin, heads), tile=tile)  # noqa: E731
        tiles = _rope_tiles(cfg.hidden_size, cfg.head_dim)
        bf16 = lambda: qkv_rope_linear(x, w, bias, cos, sin, heads)  # noqa: E731
    elif name in ("proj", "fc2"):
        call = lambda tile: fp8_gemm(xq, wq, ws, residual=acc, tile=tile)  # noqa: E731
        tiles = FP8_TILES
        bf16 = lambda: acc.addmm_(x, w.t())  # noqa: E731
    else:  # fc1: the GELU handed to fc2 in e4m3 (fp8.act_norms) where the tower does so, else the bias alone
        norms, bound = act_norms(wq.float() * ws[:, None], bias)
        act = (cfg.hidden_act, 1.0 / norms, bound) if cfg.hidden_act in ACT_HANDED else None
        call = lambda tile: fp8_gemm(xq, wq, ws, bias, act=act, tile=tile)  # noqa: E731
        tiles = FP8_TILES
        bf16 = lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)  # noqa: E731
    times = {}
    for tile in [*tiles, UNFUSED]:
        try:
            times[str(tile)] = bench(lambda: call(tile), warmup_ms=25, rep_ms=150)
        except Exception as e:  # noqa: BLE001 - a tile that does not compile here
            times[str(tile)] = f"{type(e).__name__}: {e}"[:200]
    timed = {t: ms for t, ms in times.items() if isinstance(ms, float)}
    fused = {t: ms for t, ms in timed.items() if t != UNFUSED}
    best = min(fused, key=fused.get) if fused else None
    ms16 = bench(bf16, warmup_ms=50, rep_ms=300)
    return {"best_tile": best, "best_ms": fused.get(best), "unfused_ms": timed.get(UNFUSED), "bf16_served_ms": ms16,
            "speedup_over_bf16": ms16 / min(timed.values()), "tiles_ms": times}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-vl-2b")
    ap.add_argument("--workload", default="32x448px")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--quantization", choices=("none", "fp8"), default="none")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = preset(args.preset)
    grids = workload_grids(cfg, args.workload)
    tokens = sum(t * h * w for t, h, w in grids)
    tower = random_tower(cfg, "cuda", torch.bfloat16, options=TowerOptions(quantization=args.quantization))
    pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)

    def fwd():
        return tower(pixels, tower.plan(grids))

    graphed = GraphedTower(tower)
    with torch.inference_mode():
        fwd()
        torch.cuda.synchronize()
        for _ in range(3):
            graphed(pixels, grids)  # captured on the third call
        with ClockLog() as sustained_clocks:
            graphed_wall = bench(lambda: graphed(pixels, grids), warmup_ms=200, rep_ms=1000)
        time.sleep(2)  # let the clock recover: the timeline is a burst of a few replays
        with ClockLog(interval_ms=10) as timeline_clocks:
            graph_timeline = timeline(lambda: graphed(pixels, grids), args.iters)
        graph_timeline["gpu"] = timeline_clocks.summary()
        wall = bench(fwd, warmup_ms=200, rep_ms=1000)
        table = kernel_table(fwd, args.iters)
        by_cat = defaultdict(float)
        for r in table:
            by_cat[r["category"]] += r["us_per_forward"]
        micro_res = micro(cfg, tokens)
        if args.quantization == "fp8":
            micro_res.update(micro_fp8(cfg, tokens))
        # A/B of the QKV projection's RoPE: in its epilogue (served), or by the pass
        served = tower.options
        micro_res["tower wall, Q and K rotated in the QKV projection"] = {"ms": wall}
        tower.options = replace(served, fused_qkv_rope=False)
        micro_res["tower wall, Q and K rotated by the pass"] = {"ms": bench(fwd, warmup_ms=200, rep_ms=1000)}
        # A/B of the residual add: in the output projections' GEMMs (served), or in the add+LayerNorm pass
        for in_gemm in (False, True):
            tower.options = replace(served, residual_in_gemm=in_gemm)
            ab = GraphedTower(tower)
            for _ in range(3):
                ab(pixels, grids)
            with ClockLog() as ab_clocks:
                ms = bench(lambda: ab(pixels, grids), warmup_ms=200, rep_ms=1000)
            where = "the output projections' GEMMs" if in_gemm else "the add+LayerNorm pass"
            micro_res[f"tower graphed, residual added in {where}"] = {"ms": ms, "gpu": ab_clocks.summary()}
            del ab
    busy = sum(by_cat.values()) / 1000
    print(f"{args.preset} {args.workload}: wall {wall:.2f} ms, GPU busy {busy:.2f} ms; graphed {graphed_wall:.2f} ms")
    print(f"  graphed timeline: {json.dumps(graph_timeline, indent=1)}")
    print(f"  GPU during the sustained graphed run: {sustained_clocks.summary()}")
    for cat, us in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        print(f"  {cat:24s} {us / 1000:7.2f} ms")
    for r in table[:25]:
        print(f"  {r['us_per_forward']:9.1f} us  x{r['calls_per_forward']:<5.0f} {r['category']:16s} {r['kernel'][:90]}")
    for k, v in micro_res.items():
        print(f"  micro {k:36s} {v}")
    suffix = "_fp8" if args.quantization == "fp8" else ""
    write_results(f"profile_{args.preset}_{args.workload}{suffix}", {
        "benchmark": "profile_tower", "env": environment(), "preset": args.preset, "workload": args.workload,
        "quantization": args.quantization,
        "tokens": tokens, "wall_ms": wall, "gpu_busy_ms": busy, "by_category_ms": {k: v / 1000 for k, v in by_cat.items()},
        "kernels": table, "micro": micro_res, "graphed_wall_ms": graphed_wall, "graphed_wall_gpu": sustained_clocks.summary(),
        "graphed_timeline": graph_timeline},
        args.out)


if __name__ == "__main__":
    main()
