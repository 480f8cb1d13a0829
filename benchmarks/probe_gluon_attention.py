"""The Gluon attention kernel (kernels/gluon_attention.py) against the Triton TMA kernel and cuDNN.

For each case of the attention benchmark (plus awkward packs: lengths 1, 7, 131, 1023, many short
segments) and each Gluon tile: the error against a float32 reference (per-segment matmuls, on cases
up to 4096 tokens) next to the Triton kernel's error, then the GPU time per call with no host in the
loop (20 calls captured in one CUDA graph, replayed) and do_bench's time, with the Triton kernel
(automatic choice) and the best cuDNN path (batched when lengths are equal, else a per-segment loop)
in the same run.

Usage: python -m benchmarks.probe_gluon_attention [--head-dim 64] [--cases 1x16384 64x256]
Writes gluon_attention_probe_d<head dim>.json under $OUT or benchmarks/results.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import ATTENTION_CASES, HEADS, bench, environment, print_table, write_results
from benchmarks.profile_launch import gpu_us
from kernels.gluon_attention import GLUON_TILES, gluon_varlen_attention
from kernels.varlen_attention import reference_varlen_attention, triton_varlen_attention

AWKWARD = {"1": [1], "7": [7], "131": [131], "1023": [1023], "awkward": [1, 7, 131, 1023, 64, 129, 1, 300],
           "48x33": [33] * 48}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cases", nargs="+", default=list(AWKWARD) + list(ATTENTION_CASES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    d = args.head_dim
    cases = {**AWKWARD, **ATTENTION_CASES}
    rows = []
    for case in args.cases:
        lengths = cases[case]
        total = sum(lengths)
        flops = 4 * sum(n * n for n in lengths) * HEADS * d
        gen = torch.Generator(device="cuda").manual_seed(0)
        qkv = torch.randn(total, 3, HEADS, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q, k, v = qkv.unbind(1)
        cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
        maxlen = max(lengths)
        ref = reference_varlen_attention(q, k, v, cu) if maxlen <= 4096 else None
        fns = {"triton": lambda: triton_varlen_attention(q, k, v, cu, maxlen)}
        for tile in GLUON_TILES:
            fns["gluon " + "/".join(map(str, tile))] = lambda tile=tile: gluon_varlen_attention(q, k, v, cu, maxlen,
                                                                                                tile=tile)
        if len(set(lengths)) == 1:
            qb, kb, vb = (t.view(len(lengths), lengths[0], HEADS, d).transpose(1, 2).contiguous() for t in (q, k, v))

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qb, kb, vb)
        else:
            segs = [tuple(t[s:s + n].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
                    for s, n in zip(cu[:-1].tolist(), lengths)]

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return [F.scaled_dot_product_attention(*s) for s in segs]
        if len(lengths) <= 64 and min(lengths) >= 8:
            fns["cudnn"] = cudnn
        row = {"case": case, "lengths": lengths, "flops": flops}
        for name, fn in fns.items():
            r = {}
            try:
                o = fn()
                torch.cuda.synchronize()
                if ref is not None and name != "cudnn":
                    r["max_err"] = (o.float() - ref).abs().max().item()
                    r["rel_err"] = ((o.float() - ref).norm() / ref.norm()).item()
                r["gpu_us"] = gpu_us(fn)
                r["bench_us"] = bench(fn) * 1e3
                r["tflops_gpu"] = flops / r["gpu_us"] / 1e6
            except Exception as e:  # noqa: BLE001 - a failing tile is reported, the others still run
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            row[name] = r
        rows.append(row)
        print(case, {n: (round(r.get("gpu_us", -1), 1), round(r.get("tflops_gpu", 0)), r.get("max_err"),
                         r.get("error")) for n, r in row.items() if isinstance(r, dict)}, flush=True)
    names = [n for n in rows[0] if isinstance(rows[0][n], dict)]
    print_table([{"case": r["case"], **{n: r.get(n, {}).get("tflops_gpu") for n in names}} for r in rows],
                ["case", *names])
    write_results(f"gluon_attention_probe_d{d}", {"benchmark": "gluon_attention_probe", "unit": "TFLOPS (GPU only)",
                                                   "env": environment(), "head_dim": d, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
