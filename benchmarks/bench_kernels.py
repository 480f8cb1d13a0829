"""One benchmark per small kernel, each against its PyTorch baseline in the same run, at the served towers' shapes.

- `add_layernorm`: x + y and the LayerNorm of the sum in one pass, against `torch` (the add, then `F.layer_norm`);
  with `quantize=True` (the FP8 tower's form: e4m3 rows with their scales), against the same plus
  `fp8.quantize_rows`.
- `act_quantize`: the MLP's activation written as e4m3 rows (GELU-tanh for Qwen3-VL, SwiGLU for Qwen2.5-VL), against
  `reference_act_quantize` (the activation, then the rows' quantisation, in PyTorch).
- `fp8_gemm`: `x @ W^T + bias` from e4m3 codes, against cuBLASLt's scaled GEMM (`torch._scaled_mm` through
  `fp8.scaled_linear`) and the bf16 `F.linear` of the same shape.

Rows: a pack of 32 images of 448 px (25,088 patches), the 2B's width (1024, MLP 4096) and the 8B's (1152, 4304).
Median ms of `triton.testing.do_bench` (CUDA events), the bytes or FLOPs it moves, and ours over the baseline.

Usage: python -m benchmarks.bench_kernels [--out DIR] -> kernels.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.common import bench, environment, print_table, write_results

ROWS = 32 * 28 * 28
WIDTHS = {"2b": (1024, 4096), "8b": (1152, 4304)}


def _row(kernel: str, shape: str, ours_ms: float, base: str, base_ms: float, work: str, amount: float) -> dict:
    per_s = amount / (ours_ms * 1e-3)
    return {"kernel": kernel, "shape": shape, "ours_ms": round(ours_ms, 4), "baseline": base,
            "baseline_ms": round(base_ms, 4), "speedup": round(base_ms / ours_ms, 3),
            work: round(per_s / (1e9 if work == "GB/s" else 1e12), 1)}


def add_layernorm_rows(hidden: int, name: str) -> list[dict]:
    from kernels.add_layernorm import add_layernorm
    from kernels.fp8 import quantize_rows

    x, y = (torch.randn(ROWS, hidden, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w, b = torch.randn(hidden, device="cuda", dtype=torch.bfloat16), torch.randn(hidden, device="cuda",
                                                                                   dtype=torch.bfloat16)

    def torch_norm():
        s = x + y
        return s, F.layer_norm(s, (hidden,), w, b, 1e-6)

    moved = 4 * ROWS * hidden * 2  # read x, y; write the sum and the norm
    rows = [_row("add_layernorm", f"{name} {ROWS}x{hidden}", bench(lambda: add_layernorm(x, y, w, b, 1e-6)),
                 "add + F.layer_norm", bench(torch_norm), "GB/s", moved)]
    rows.append(_row("add_layernorm quantize", f"{name} {ROWS}x{hidden}",
                     bench(lambda: add_layernorm(x, y, w, b, 1e-6, quantize=True)),
                     "add + F.layer_norm + quantize_rows", bench(lambda: quantize_rows(torch_norm()[1])), "GB/s",
                     ROWS * hidden * (2 + 2 + 2 + 1)))
    return rows


def act_quantize_rows(mlp: int, name: str) -> list[dict]:
    from kernels.act_quant import act_quantize, reference_act_quantize

    h, up = (torch.randn(ROWS, mlp, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    moved = ROWS * mlp * (2 + 1)
    rows = [_row("act_quantize gelu", f"{name} {ROWS}x{mlp}", bench(lambda: act_quantize(h, "gelu_pytorch_tanh")),
                 "reference_act_quantize", bench(lambda: reference_act_quantize(h, "gelu_pytorch_tanh")), "GB/s",
                 moved)]
    rows.append(_row("act_quantize swiglu", f"{name} {ROWS}x{mlp}", bench(lambda: act_quantize(h, "silu", up)),
                     "reference_act_quantize", bench(lambda: reference_act_quantize(h, "silu", up)), "GB/s",
                     moved + ROWS * mlp * 2))
    return rows


def fp8_gemm_rows(hidden: int, mlp: int, name: str) -> list[dict]:
    from kernels.fp8 import Quantized, quantize_rows, quantize_weight, scaled_linear
    from kernels.fp8_gemm import fp8_gemm

    rows = []
    for label, k, n in (("fc1", hidden, mlp), ("fc2", mlp, hidden)):
        x = torch.randn(ROWS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        codes, scale = quantize_rows(x)
        xq = Quantized(codes, scale)
        wq, ws = quantize_weight(w)
        flops = 2 * ROWS * k * n
        ours = bench(lambda: fp8_gemm(xq, wq, ws, bias))
        rows.append(_row(f"fp8_gemm {label}", f"{name} {ROWS}x{k}x{n}", ours, "cuBLASLt scaled GEMM",
                         bench(lambda: scaled_linear(codes, scale, wq, ws, bias)), "TFLOPS", flops))
        rows.append(_row(f"fp8_gemm {label}", f"{name} {ROWS}x{k}x{n}", ours, "bf16 F.linear",
                         bench(lambda: F.linear(x, w, bias)), "TFLOPS", flops))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    with torch.inference_mode():
        for name, (hidden, mlp) in WIDTHS.items():
            rows += add_layernorm_rows(hidden, name) + act_quantize_rows(mlp, name) + fp8_gemm_rows(hidden, mlp, name)
    print_table(rows, ["kernel", "shape", "ours_ms", "baseline", "baseline_ms", "speedup", "GB/s", "TFLOPS"])
    write_results("kernels", {"benchmark": "kernels", "env": environment(), "rows": rows}, args.out)
    print(json.dumps({"min_speedup": min(r["speedup"] for r in rows)}))


if __name__ == "__main__":
    main()
