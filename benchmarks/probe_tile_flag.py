"""Hopper attention tiles, GPU time only: the TMA candidates plus any `--tiles`, and optionally one boolean
option (a `TileConfig` field) off against on.

For each attention case, head dim and tile, the probe times the kernel (µs per call inside a CUDA graph of
20 calls, median of 20 replays: no host time) beside batched cuDNN where the lengths are equal, and checks
every output against the SDPA fallback. Used for `sum_mma` (P's row sums on the tensor cores), rev
aeff412's `exp_fma` (half the exp2 on the FMA pipes) and 256-key tiles.

Usage: python -m benchmarks.probe_tile_flag [--flag FIELD[=VALUE]] [--tiles 64/256/4/2 ...] [--head-dims 64 72]
       [--out DIR]
(a boolean field is timed False and True; FIELD=VALUE times 0 and VALUE, as rev 4b9e864's prefetch=256)
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path

import torch

from benchmarks.common import ATTENTION_CASES, RESULTS, attention_flops, batched_cudnn, environment, packed_qkv
from benchmarks.profile_launch import gpu_us

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name

CASES = ["1x4096", "1x16384", "8x1024", "64x256", "mixed8", "32x784"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", default=None,
                    help="a TileConfig field to time off and on: a boolean (sum_mma) or an int, FIELD=VALUE")
    ap.add_argument("--tiles", nargs="*", default=[], help="more tiles, block_m/block_n/warps/stages")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72])
    ap.add_argument("--cases", nargs="+", default=CASES)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    field, _, value = (args.flag or "").partition("=")
    on_off = (int(value), 0) if value else (True, False)
    rows = []
    for head_dim in args.head_dims:
        for case in args.cases:
            lengths = ATTENTION_CASES[case]
            m = max(lengths)
            flops = attention_flops(lengths, head_dim)
            qkv, cu = packed_qkv(lengths, head_dim, torch.Generator(device="cuda").manual_seed(0))
            q, k, v = qkv.unbind(1)
            ref = va.sdpa_varlen_attention(q, k, v, cu, m, seqlens=lengths).float()
            row = {"case": case, "head_dim": head_dim, "flops": flops, "us": {}, "rel_err": {}}
            cudnn = batched_cudnn(q, k, v, lengths)
            if cudnn is not None:
                row["us"]["cudnn (batched)"] = gpu_us(cudnn)
            extra = [dataclasses.replace(va.tma_candidates(head_dim)[0], block_m=bm, block_n=bn, num_warps=w,
                                         num_stages=s, q_tail=bm >= 128)
                     for bm, bn, w, s in (map(int, t.split("/")) for t in args.tiles)]
            flag_on = {}  # timed name -> whether the flag was on
            for base in va.tma_candidates(head_dim) + extra:
                tile = f"{base.block_m}/{base.block_n}/{base.num_warps}/{base.num_stages}"
                for on in ((False, True) if args.flag else (False,)):
                    cfg = dataclasses.replace(base, device_desc=False,
                                              **({field: on_off[0] if on else on_off[1]} if field else {}))
                    name = f"{tile}{' ' + args.flag if on else ''}"
                    flag_on[name] = on

                    def fn(cfg=cfg):
                        return va.triton_varlen_attention(q, k, v, cu, m, config=cfg)
                    try:
                        out = fn().float()
                        row["rel_err"][name] = ((out - ref).norm() / ref.norm()).item()
                        row["us"][name] = gpu_us(fn)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile or launch is a result
                        row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:160]}"
            best = {on: min((t, n) for n, t in row["us"].items() if flag_on.get(n) is on)
                    for on in set(flag_on.values())}
            row["best"] = {(args.flag if on else "off"): {"tile": n, "us": t, "tflops": flops / t / 1e6}
                           for on, (t, n) in best.items()}
            rows.append(row)
            print(json.dumps({"case": case, "head_dim": head_dim, "best": row["best"],
                              "cudnn_us": row["us"].get("cudnn (batched)"),
                              "max_rel_err": max(row["rel_err"].values()), "us": row["us"]}), flush=True)
    out = Path(args.out) / f"{field or 'tiles'}_probe.json"
    out.write_text(json.dumps({"benchmark": "probe_tile_flag", "flag": args.flag, "env": environment(), "rows": rows},
                              indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
