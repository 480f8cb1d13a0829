"""GPU time of head_dim 72's transposed K/V remainder copy (`kv_remainder_t`), the step the Hopper kernel
needs before it can read the remainder columns by TMA, per attention case (µs per call inside a CUDA graph:
no host time). `--compare MODULE` times another module's `kv_remainder_t` beside it on the same inputs
(e.g. an earlier revision's kernels/varlen_attention.py saved as a module).

Usage: python -m benchmarks.probe_remainder [--compare kernels.old_varlen_attention] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from benchmarks.common import ATTENTION_CASES, RESULTS, environment, packed_qkv
from benchmarks.profile_launch import gpu_us

va = importlib.import_module("kernels.varlen_attention")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compare", default=None)
    ap.add_argument("--head-dim", type=int, default=72)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    other = importlib.import_module(args.compare) if args.compare else None
    rows = []
    for case, lengths in ATTENTION_CASES.items():  # 32x784 is the 8B tower's 32x448px pack
        qkv, cu = packed_qkv(lengths, args.head_dim, torch.Generator(device="cuda").manual_seed(0))
        _, k, v = qkv.unbind(1)
        m = max(lengths)
        row = {"case": case, "tokens": sum(lengths), "us": gpu_us(lambda: va.kv_remainder_t(k, v, cu, m))}
        r = va.kv_remainder_t(k, v, cu, m)
        row["bytes_written"] = r.numel() * r.element_size()
        if other is not None:
            row["compare_us"] = gpu_us(lambda: other.kv_remainder_t(k, v, cu, m))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(args.out) / "remainder_probe.json"
    out.write_text(json.dumps({"benchmark": "probe_remainder", "head_dim": args.head_dim, "compare": args.compare,
                               "env": environment(), "rows": rows}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
