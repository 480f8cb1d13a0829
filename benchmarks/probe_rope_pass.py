"""The in-place RoPE pass's launch (pairs per program, warps) at the towers' 32x448px shapes, against a
same-size copy as the bandwidth reference.

Usage: python -m benchmarks.probe_rope_pass  ->  rope_pass_probe.json under $OUT or benchmarks/results
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.common import bench, environment, print_table, write_results
from kernels.qkv_rope import qkv_rope_
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq
from service.config import PRESETS


def main():
    rows = []
    for preset in ("qwen3-vl-2b", "qwen3-vl-8b"):
        cfg, tokens = PRESETS[preset], 32 * 784
        heads, head_dim = cfg.num_heads, cfg.head_dim
        qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        cos, sin = vision_rope_cos_sin(torch.randint(0, 64, (tokens, 2), device="cuda"),
                                       vision_rope_inv_freq(head_dim, device="cuda"))
        moved = 4 * qkv[:, :2].numel() + 2 * cos.numel() * 4  # Q and K read and written (bf16), cos and sin read
        src = torch.randn(moved // 4, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        t = bench(lambda: dst.copy_(src))
        rows.append({"preset": preset, "launch": "copy (reference)", "ms": t, "GB/s": moved / t / 1e6})
        for pairs, warps in itertools.product((1024, 2048, 4096, 8192), (4, 8)):
            t = bench(lambda: qkv_rope_(qkv, cos, sin, use_triton=True, pairs_per_program=pairs, num_warps=warps))
            rows.append({"preset": preset, "launch": f"{pairs} pairs, {warps} warps", "ms": t, "GB/s": moved / t / 1e6})
    print_table(rows, ["preset", "launch", "ms", "GB/s"])
    write_results("rope_pass_probe", {"benchmark": "probe_rope_pass", "env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
