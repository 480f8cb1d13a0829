"""Tile-configuration sweep for the varlen attention kernels, against the best PyTorch path.

For each case of the attention benchmark and each kernel variant (the pointer kernel autotuned, the Gluon kernel's
tiles: sizes, warps, ring depth, register cap, remainder copied or in place, persistent programs) it checks the
output against batched SDPA on the same data and times it (median, CUDA events). One JSON object per
(variant, case) is appended to the output file as it is measured, so a variant that crashes the
process (a miscompile) loses only itself: run risky groups in their own process.

Usage: python -m tools.sweep_attention --group gluon --head-dims 64 72 --out $OUT/sweep.jsonl
Groups: baseline (PyTorch paths), ptr (the pointer kernel, autotuned), gluon (the Gluon kernel's candidates, and
each with the remainder copied and in place), spec:<config> (one Gluon configuration, see parse_spec).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import ATTENTION_CASES, attention_flops, bench, packed_qkv
from kernels.attention import sdpa_varlen_attention, triton_varlen_attention
from kernels.attention.tiles import GluonTile, gluon_candidates


def parse_spec(spec: str) -> GluonTile:
    """'bm/bn/warps/ring[/register cap[/remainder copied[/sum_mma[/persistent]]]]', e.g. 128/128/8/2/128 (the
    order of `tools.inspect_sass --gluon`)."""
    fields = [int(x) for x in spec.split("/")]
    bm, bn, w, ring, cap, rem_copy, sum_mma, persistent = fields + [0, 1, 1, 0][len(fields) - 4:]
    return GluonTile(bm, bn, w, ring, persistent=persistent, maxnreg=cap, rem_copy=bool(rem_copy),
                     sum_mma=bool(sum_mma))


def variants(group: str, head_dim: int):
    if group.startswith("spec:"):
        cfg = parse_spec(group[5:])
        return [cfg]
    if group == "ptr":
        return [None]
    if group == "gluon":
        return list(dict.fromkeys(dataclasses.replace(c, rem_copy=r) for c in gluon_candidates(head_dim)
                                  for r in (False, True)))
    raise ValueError(group)


def baselines(q, k, v, lengths):
    heads, head_dim = q.shape[1:]
    segs = [tuple(t[s:s + n].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            for s, n in zip([0, *itertools.accumulate(lengths)][:-1], lengths)]
    fns = {}
    for name, backend in (("loop-flash", SDPBackend.FLASH_ATTENTION), ("loop-cudnn", SDPBackend.CUDNN_ATTENTION)):
        def loop(backend=backend):
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(*s) for s in segs]
        fns[name] = loop
    if len(set(lengths)) == 1:
        qb, kb, vb = (t.view(len(lengths), lengths[0], heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v))
        for name, backend in (("batched-flash", SDPBackend.FLASH_ATTENTION), ("batched-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def batched(backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qb, kb, vb)
            fns[name] = batched
    return fns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", required=True, help="a group name, or spec:<config> (see parse_spec)")
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 72])
    ap.add_argument("--cases", nargs="+", default=list(ATTENTION_CASES))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with open(args.out, "a") as out:
        for head_dim in args.head_dims:
            for case in args.cases:
                lengths = ATTENTION_CASES[case]
                flops = attention_flops(lengths, head_dim)
                gen = torch.Generator(device="cuda").manual_seed(0)
                qkv, cu = packed_qkv(lengths, head_dim, gen)
                q, k, v = qkv.unbind(1)
                ref = sdpa_varlen_attention(q, k, v, cu, max(lengths), seqlens=lengths).float()
                if args.group == "baseline":
                    fns = {name: (fn, None) for name, fn in baselines(q, k, v, lengths).items()}
                else:
                    fns = {repr(c): (lambda c=c: triton_varlen_attention(q, k, v, cu, max(lengths), config=c), c)
                           for c in variants(args.group, head_dim)}
                for name, (fn, cfg) in fns.items():
                    row = {"group": args.group, "variant": name, "case": case, "head_dim": head_dim}
                    try:
                        res = fn()
                        torch.cuda.synchronize()
                        if cfg is not None or args.group == "ptr":
                            row["rel_err"] = ((res.float() - ref).norm() / ref.norm()).item()
                        ms = bench(fn, warmup_ms=100, rep_ms=200)
                        row.update(ms=ms, tflops=flops / ms / 1e9)
                    except Exception as e:  # noqa: BLE001 - a variant that fails to compile is a result
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
