"""Varlen attention TFLOPS on the GPU: our Triton kernel against every PyTorch path, in one run.

TFLOPS = 4 * sum(n_i^2) * heads * head_dim / time (non-causal forward).
Baselines, each given its preferred layout outside the timed region:
  loop-{flash,cudnn,efficient}: transformers' way, one SDPA call per segment;
  batched-{flash,cudnn}: one (B, H, L, D) SDPA call, only where all lengths are equal;
  varlen_attn: torch.nn.attention.varlen.varlen_attn on packed (T, H, D);
  flex: compiled FlexAttention with a document mask.
Ours reads q/k/v as strided views of one fused (T, 3, H, D) QKV buffer, as the tower produces them (Q and K
rotated by the QKV projection's epilogue); on Hopper the Gluon kernel, its tile picked by the tuner.

Usage: python -m benchmarks.bench_attention [--head-dims 64 72] [--cases 1x16384 mixed8] [--no-flex]
Prints a table, then one JSON line; writes attention.json (+ attention.png) under $OUT or benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import (ATTENTION_CASES, HEAD_DIMS, HEADS, attention_flops, bench, environment, packed_qkv,
                               print_table, write_results)
from kernels.attention.launch import triton_varlen_attention
from kernels.runtime import tuned_choices

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION}


def _flex_fn(lengths, q4, k4, v4):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"), torch.tensor(lengths, device="cuda"))

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    total = sum(lengths)
    mask = create_block_mask(same_doc, None, None, total, total, device="cuda")
    # every case compiles for its own shapes; past dynamo's recompile limit (8) flex_attention would run
    # its unfused eager version for the remaining cases
    torch._dynamo.reset()
    compiled = torch.compile(flex_attention, dynamic=False)
    return lambda: compiled(q4, k4, v4, block_mask=mask)


def run_case(lengths, head_dim, flex=True):
    heads = HEADS
    flops = attention_flops(lengths, head_dim)
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv, cu = packed_qkv(lengths, head_dim, gen)
    q, k, v = qkv.unbind(1)
    maxlen = max(lengths)
    fns = {"triton": lambda: triton_varlen_attention(q, k, v, cu, maxlen)}
    segs = [tuple(t[s:s + n].transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
            for s, n in zip(cu[:-1].tolist(), lengths)]

    def loop(backend):
        def fn():
            with sdpa_kernel(backend):
                return [F.scaled_dot_product_attention(*s) for s in segs]
        return fn

    for name, backend in SDPA.items():
        fns[f"loop-{name}"] = loop(backend)
    if len(set(lengths)) == 1:
        qb, kb, vb = (t.view(len(lengths), lengths[0], heads, head_dim).transpose(1, 2).contiguous() for t in (q, k, v))
        for name in ("flash", "cudnn"):
            def batched(backend=SDPA[name]):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(qb, kb, vb)
            fns[f"batched-{name}"] = batched
    try:
        from torch.nn.attention.varlen import varlen_attn

        qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
        fns["varlen_attn"] = lambda: varlen_attn(qc, kc, vc, cu, cu, maxlen, maxlen)  # non-causal by default
    except ImportError:
        pass
    if flex:
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0).contiguous() for t in (q, k, v))
        try:
            fns["flex"] = _flex_fn(lengths, q4, k4, v4)
        except Exception as e:  # noqa: BLE001 - a missing baseline is reported, not fatal
            print(f"flex unavailable: {e}")

    # correctness of ours against the flash loop, on the benchmark data itself
    ref = torch.cat([o.squeeze(0).transpose(0, 1) for o in fns["loop-flash"]()])
    ours = fns["triton"]()
    check = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()

    results = {}
    for name, fn in fns.items():
        try:
            fn()
            torch.cuda.synchronize()
            ms = bench(fn)
            results[name] = {"ms": ms, "tflops": flops / ms / 1e9}
        except Exception as e:  # noqa: BLE001
            results[name] = {"ms": None, "tflops": None, "error": f"{type(e).__name__}: {str(e)[:160]}"}
    baselines = {k: r for k, r in results.items() if not k.startswith("triton") and r["ms"] is not None}
    best = min(baselines, key=lambda k: baselines[k]["ms"])
    for name in ("triton", best):
        results[name]["host_us"] = host_us(fns[name])
    return {
        "lengths": lengths, "head_dim": head_dim, "heads": heads, "flops": flops, "check_rel_err": check,
        "results": results, "best_baseline": best,
        "ratio_vs_best": baselines[best]["ms"] / results["triton"]["ms"],
    }


def host_us(fn, calls=200) -> float:
    """Host microseconds per call: back-to-back calls without synchronising, so the GPU never makes the
    host wait (the launch queue holds them); a kernel shorter than this is launch-bound."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = sorted({r["head_dim"] for r in rows})
    fig, axes = plt.subplots(1, len(dims), figsize=(8 * len(dims), 5), squeeze=False)
    for ax, d in zip(axes[0], dims):
        sub = [r for r in rows if r["head_dim"] == d]
        names = sorted({n for r in sub for n in r["results"]})
        width = 0.8 / len(names)
        for j, n in enumerate(names):
            ys = [r["results"].get(n, {}).get("tflops") or 0 for r in sub]
            ax.bar([i + j * width for i in range(len(sub))], ys, width, label=n)
        ax.set_xticks([i + 0.4 for i in range(len(sub))], [r["case"] for r in sub], rotation=20)
        ax.set_ylabel("TFLOPS (bf16)")
        ax.set_title(f"varlen attention, 16 heads, head_dim {d}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", type=int, nargs="+", default=sorted(set(HEAD_DIMS.values())))
    ap.add_argument("--cases", nargs="+", default=list(ATTENTION_CASES))
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for d in args.head_dims:
        for case in args.cases:
            t0 = time.time()
            r = run_case(ATTENTION_CASES[case], d, flex=not args.no_flex)
            r["case"] = case
            rows.append(r)
            print(f"d{d} {case}: ours {r['results']['triton']['tflops']:.0f} TFLOPS, best baseline "
                  f"{r['best_baseline']} {r['results'][r['best_baseline']]['tflops']:.0f}, ratio "
                  f"{r['ratio_vs_best']:.2f}; host us/call ours {r['results']['triton']['host_us']:.0f}, baseline "
                  f"{r['results'][r['best_baseline']]['host_us']:.0f} (check {r['check_rel_err']:.1e}, "
                  f"{time.time() - t0:.0f}s)", flush=True)
    names = ["triton", "loop-flash", "loop-cudnn", "loop-efficient", "batched-flash",
             "batched-cudnn", "varlen_attn", "flex"]
    table = [{"d": r["head_dim"], "case": r["case"], **{n: r["results"].get(n, {}).get("tflops") for n in names},
              "best": r["best_baseline"], "ratio": r["ratio_vs_best"]} for r in rows]
    print_table(table, ["d", "case", *names, "best", "ratio"])
    payload = {"benchmark": "varlen_attention", "unit": "TFLOPS", "env": environment(), "rows": rows,
               "choices": {str(k): str(v) for k, v in tuned_choices().items()}}  # the tuner's pick per size class
    path = write_results("attention", payload, args.out)
    try:
        plot(rows, path.with_suffix(".png"))
    except ImportError:
        pass
    print(json.dumps({"benchmark": "varlen_attention", "min_ratio": min(r["ratio_vs_best"] for r in rows),
                      "rows": [(r["head_dim"], r["case"], round(r["ratio_vs_best"], 3)) for r in rows]}))


if __name__ == "__main__":
    main()
