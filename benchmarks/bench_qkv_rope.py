"""The QKV projection with RoPE: cuBLAS (`F.linear`) plus the in-place Triton pass, against the fused
Triton GEMM (bias and rotation in its epilogue) at each candidate tile, at the towers' shapes.

Usage: python -m benchmarks.bench_qkv_rope  ->  qkv_rope.json under $OUT or benchmarks/results
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from benchmarks.common import bench, environment, print_table, write_results
from kernels.qkv_rope import gemm_candidates, qkv_rope_, qkv_rope_linear
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq
from service.model.config import PRESETS

SHAPES = {"2b 32x448px": ("qwen3-vl-2b", 32 * 784), "2b 8x448px": ("qwen3-vl-2b", 8 * 784),
          "2b 1x1024px": ("qwen3-vl-2b", 4096), "8b 32x448px": ("qwen3-vl-8b", 32 * 784)}


# Tiles to time beside the candidates: QKV_EXTRA_TILES="128,256,64,8,3,1;..." (block_m, block_n, block_k,
# warps, stages, persistent)
EXTRA_TILES = [tuple(int(x) for x in t.split(",")) for t in os.environ.get("QKV_EXTRA_TILES", "").split(";") if t]


def main():
    rows = []
    for name, (preset, tokens) in SHAPES.items():
        cfg = PRESETS[preset]
        hidden, heads, head_dim = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(3 * hidden, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        b = torch.randn(3 * hidden, device="cuda", dtype=torch.bfloat16)
        cos, sin = vision_rope_cos_sin(torch.randint(0, 64, (tokens, 2), device="cuda"),
                                       vision_rope_inv_freq(head_dim, device="cuda"))
        flops = 2 * tokens * hidden * 3 * hidden
        t_gemm = bench(lambda: F.linear(x, w, b))
        qkv = F.linear(x, w, b).view(tokens, 3, heads, head_dim)
        t_pass = bench(lambda: qkv_rope_(qkv, cos, sin, use_triton=True))
        t_base = bench(lambda: qkv_rope_(F.linear(x, w, b).view(tokens, 3, heads, head_dim), cos, sin, use_triton=True))
        moved = 4 * tokens * 2 * hidden + 2 * cos.numel() * 4  # Q and K read and written, cos and sin read
        rows.append({"shape": name, "path": "cublas + pass", "ms": t_base, "gemm ms": t_gemm, "pass ms": t_pass,
                     "pass GB/s": moved / t_pass / 1e6, "TFLOPS": flops / t_base / 1e9, "× base": 1.0})
        for tile in gemm_candidates(hidden, head_dim) + [t for t in EXTRA_TILES if t[1] % head_dim == 0
                                                         and hidden % t[1] == 0]:
            try:
                t = bench(lambda tile=tile: qkv_rope_linear(x, w, b, cos, sin, heads, tile=tile))
            except Exception as e:  # noqa: BLE001 - an extra tile that does not compile is a result
                rows.append({"shape": name, "path": f"fused {tile}", "error": f"{type(e).__name__}: {str(e)[:200]}"})
                continue
            rows.append({"shape": name, "path": f"fused {tile}", "ms": t, "TFLOPS": flops / t / 1e9,
                         "× base": t_base / t})
        t = bench(lambda: qkv_rope_linear(x, w, b, cos, sin, heads))
        rows.append({"shape": name, "path": "fused (tuned)", "ms": t, "TFLOPS": flops / t / 1e9, "× base": t_base / t})
    print_table(rows, ["shape", "path", "ms", "gemm ms", "pass ms", "pass GB/s", "TFLOPS", "× base"])
    write_results("qkv_rope", {"benchmark": "bench_qkv_rope", "env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
