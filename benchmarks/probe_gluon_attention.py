"""The Gluon attention kernel (kernels/gluon_attention.py) against the Triton TMA kernel and cuDNN, GPU time only.

For each case (the attention benchmark's, plus awkward packs: lengths 1, 7, 131, 1023, a mixed pack, 48x33) and
each Gluon tile: the relative error against a float32 reference next to the Triton kernel's, and the
GPU time per call (20 calls in one CUDA graph, median of 20 replays), with every Triton TMA candidate and batched
cuDNN (equal lengths) in the same run.

Usage: python -m benchmarks.probe_gluon_attention [--head-dim 64] [--cases 1x16384 64x256 64x256+0] [--tiles 128/128/8/2/128]
Writes gluon_attention_probe_d<head dim>.json under --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import importlib

import torch

from benchmarks.common import (ATTENTION_CASES, RESULTS, attention_flops, batched_cudnn, environment, packed_qkv,
                               print_table, write_results)
from benchmarks.profile_launch import gpu_us

va = importlib.import_module("kernels.varlen_attention")  # the package also exports a function of that name

AWKWARD = {"1": [1], "7": [7], "131": [131], "1023": [1023], "awkward": [1, 7, 131, 1023, 64, 129, 1, 300],
           "48x33": [33] * 48}


def tile_config(tile: str) -> va.TileConfig:
    """block_m/block_n/warps/ring/register cap[/rem_copy[/sum_mma[/ws]]] (rem_copy and sum_mma 0 or 1, default 1;
    ws: persistent warp-specialised programs per SM, default 0, the plain kernel)."""
    bm, bn, w, nbuf, cap, *flags = map(int, tile.split("/"))
    flags += [1, 1, 0][len(flags):]
    return va.TileConfig(bm, bn, w, nbuf, tma=True, gluon=True, maxnreg=cap, rem_copy=bool(flags[0]),
                         sum_mma=bool(flags[1]), ws=flags[2])


def tile_name(c: va.TileConfig) -> str:
    ws = f"/{int(c.ws)}" if c.ws else ""
    return f"{c.block_m}/{c.block_n}/{c.num_warps}/{c.num_stages}/{c.maxnreg}/{int(c.rem_copy)}/{int(c.sum_mma)}{ws}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cases", nargs="+", default=list(AWKWARD) + [c for c in ATTENTION_CASES if c != "1x1024"])
    ap.add_argument("--tiles", nargs="*", default=None, help="Gluon tiles (see tile_config)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    d = args.head_dim
    gluon = [tile_config(t) for t in args.tiles] if args.tiles else va.gluon_candidates(d)
    cases = {**AWKWARD, **ATTENTION_CASES}
    rows = []
    for case in args.cases:
        # NAME+0: the case with an empty segment appended, which takes the Gluon kernel off its path for packs of
        # equal lengths (cu_seqlens read by every program) at the same work
        lengths = cases[case.removesuffix("+0")] + [0] * case.endswith("+0")
        maxlen = max(lengths)
        qkv, cu = packed_qkv(lengths, d, torch.Generator(device="cuda").manual_seed(0))
        q, k, v = qkv.unbind(1)
        ref = (va.reference_varlen_attention(q, k, v, cu) if maxlen <= 4096
               else va.sdpa_varlen_attention(q, k, v, cu, maxlen, seqlens=lengths).float())
        fns = {}
        for c in va.tma_candidates(d):
            fns[f"triton {c.block_m}/{c.block_n}/{c.num_warps}/{c.num_stages}"] = (
                lambda c=c: va.triton_varlen_attention(q, k, v, cu, maxlen, config=c))
        for c in gluon:
            fns[f"gluon {tile_name(c)}"] = (
                lambda c=c: va.triton_varlen_attention(q, k, v, cu, maxlen, config=c))
        cudnn = batched_cudnn(q, k, v, lengths)
        if cudnn is not None:
            fns["cudnn"] = cudnn
        row = {"case": case, "lengths": lengths if len(lengths) <= 8 else f"{len(lengths)}x{lengths[0]}",
               "flops": attention_flops(lengths, d), "us": {}, "rel_err": {}, "errors": {}}
        for name, fn in fns.items():
            try:
                torch.cuda.synchronize()
                o = fn()
                torch.cuda.synchronize()
                if name != "cudnn":
                    o.fill_(float("nan"))  # poison: every element must be written again
                    o = fn()
                    row["rel_err"][name] = ((o.float() - ref).norm() / ref.norm()).item()
                row["us"][name] = gpu_us(fn)
            except Exception as e:  # noqa: BLE001 - a failing tile is reported, the others still run
                row["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
        for kind in ("triton", "gluon"):
            timed = {n: t for n, t in row["us"].items() if n.startswith(kind)}
            if timed:
                best = min(timed, key=timed.get)
                row[f"best {kind}"] = {"tile": best, "us": timed[best], "tflops": row["flops"] / timed[best] / 1e6}
        rows.append(row)
        print(case, {n: round(t, 1) for n, t in row["us"].items()},
              {n: f"{e:.1e}" for n, e in row["rel_err"].items()}, row["errors"] or "", flush=True)
    summary = []
    for r in rows:
        bt, bg, cu_us = r.get("best triton", {}), r.get("best gluon", {}), r["us"].get("cudnn")
        summary.append({"case": r["case"], "triton us": bt.get("us"), "triton tile": bt.get("tile", "")[7:],
                        "gluon us": bg.get("us"), "gluon tile": bg.get("tile", "")[6:], "cudnn us": cu_us,
                        "gluon/triton": bt["us"] / bg["us"] if bg and bt else None,
                        "gluon/cudnn": cu_us / bg["us"] if bg and cu_us else None,
                        "max rel err": max(r["rel_err"].values(), default=None)})
    print_table(summary, list(summary[0]))
    write_results(f"gluon_attention_probe_d{d}", {"benchmark": "gluon_attention_probe", "unit": "us per call (GPU only)",
                                                   "env": environment(), "head_dim": d, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
