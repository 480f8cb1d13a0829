"""Q rotated inside the Hopper attention kernel: this revision against an earlier one, GPU time only.

The TMA kernel rotates Q itself when given cos/sin (the tower's call: K rotated by its pass). Until rev
d530591 the rotated tile stayed in registers as the wgmma A operand; this revision rotates it into the
program's own output rows and loads it back, so that it is staged in shared memory. For each attention
case, head dim and TMA tile, the probe times (µs per call inside a CUDA graph of 20 calls, median of 20
replays: no host time) the kernel without RoPE, with in-kernel Q RoPE at this revision and at `--old`
(its kernels/ package taken from git), and batched cuDNN where the lengths are equal. Outputs are
checked against the SDPA fallback.

Usage: python -m benchmarks.probe_rope_q [--old d530591] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import ATTENTION_CASES, RESULTS, attention_flops, batched_cudnn, environment, packed_qkv
from benchmarks.profile_launch import gpu_us

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name

CASES = ["1x4096", "8x1024", "64x256", "mixed8", "32x784"]


def old_kernels(rev: str):
    """The kernels package at `rev`, imported as `kernels_<rev>`: from git into a temporary directory, or
    from a directory of that name in the working directory (machines with a copy of the tree and no git
    history: `mkdir kernels_<rev> && git archive <rev> kernels | tar -x --strip-components=1 -C kernels_<rev>`)."""
    name = f"kernels_{rev}"
    if not Path(name).is_dir():
        root = Path(tempfile.mkdtemp())
        (root / name).mkdir()
        files = subprocess.run(["git", "ls-tree", "--name-only", rev, "kernels/"], capture_output=True, text=True,
                               check=True).stdout.split()
        for path in files:
            if path.endswith(".py"):
                text = subprocess.run(["git", "show", f"{rev}:{path}"], capture_output=True, text=True,
                                      check=True).stdout
                (root / name / Path(path).name).write_text(text)
        sys.path.insert(0, str(root))
    else:
        sys.path.insert(0, str(Path.cwd()))
    return importlib.import_module(f"{name}.varlen_attention")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", default="d530591")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72])
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    old = old_kernels(args.old)
    rows = []
    for head_dim in args.head_dims:
        for case in args.cases:
            lengths = ATTENTION_CASES[case]
            total, m = sum(lengths), max(lengths)
            flops = attention_flops(lengths, head_dim)
            gen = torch.Generator(device="cuda").manual_seed(0)
            qkv, cu = packed_qkv(lengths, head_dim, gen)
            q, k, v = qkv.unbind(1)
            angles = torch.rand(total, head_dim // 2, device="cuda", generator=gen) * 6.3
            cos, sin = angles.cos(), angles.sin()
            ref = va.sdpa_varlen_attention(q, k, v, cu, m, cos=cos, sin=sin, rotate_k=False, seqlens=lengths).float()
            row = {"case": case, "head_dim": head_dim, "flops": flops, "us": {}, "rel_err": {}}
            cudnn = batched_cudnn(q, k, v, lengths)
            if cudnn is not None:
                row["us"]["cudnn (batched, no rope)"] = gpu_us(cudnn)
            for cfg in va.tma_candidates(head_dim):
                tile = f"{cfg.block_m}/{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}"
                old_cfg = old.TileConfig(cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, tma=True,
                                         tail_n=cfg.tail_n, q_tail=cfg.q_tail)
                paths = {
                    f"{tile} no rope": lambda: va.triton_varlen_attention(q, k, v, cu, m, config=cfg),
                    f"{tile} rope": lambda: va.triton_varlen_attention(q, k, v, cu, m, cos=cos, sin=sin,
                                                                       rotate_k=False, config=cfg),
                    f"{tile} rope {args.old}": lambda: old.triton_varlen_attention(q, k, v, cu, m, cos=cos, sin=sin,
                                                                                    rotate_k=False, config=old_cfg),
                }
                for name, fn in paths.items():
                    out = fn().float()
                    if "no rope" not in name:
                        row["rel_err"][name] = ((out - ref).norm() / ref.norm()).item()
                    row["us"][name] = gpu_us(fn)
            rows.append(row)
            print(json.dumps({"case": case, "head_dim": head_dim,
                              "us": {k: round(v, 1) for k, v in row["us"].items()},
                              "max_rel_err": max(row["rel_err"].values())}), flush=True)
    out = Path(args.out) / f"rope_q_probe_vs_{args.old}.json"
    out.write_text(json.dumps({"benchmark": "probe_rope_q", "env": environment(), "old": args.old, "rows": rows},
                              indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
