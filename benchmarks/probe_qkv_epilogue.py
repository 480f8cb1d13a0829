"""Probe: what the QKV GEMM's RoPE epilogue costs, and which alternatives would cost less.

Times variants of one persistent TMA GEMM (the served kernel's structure) that differ only in the
epilogue, at the 2B and 8B QKV shapes (32x448px), and reports registers and spills of each:
  bias      bias only, no rotation;
  halves    rotate-half (power-of-two head dims; the served path);
  pairs     pair order (Q/K rows permuted so partners are adjacent columns, which any even head dim
            allows): reshape/split/join + a cos/sin gather [BM, BN/2] (tried at rev 476a548);
  pairs-c1  pair order, reshape/split/join only (angle 0: no cos/sin loads);
  gather    the cos/sin gather at full width, no reshape (wrong result: cost only);
  *-early   bias (and cos/sin) loaded before the tile's K loop, so their latency hides under the MMAs;
  halves-lastk  the served epilogue, its cos/sin loaded inside the K loop on the last iteration
            (masked off before), so the load overlaps the last MMAs instead of following them;
  ln-halves the served epilogue, with the block's first LayerNorm applied to A as it is loaded (per-row
            mean and rstd from the add+LayerNorm pass, per-column weight and bias), so that pass need
            not write the normalised activations;
  two-acc   two accumulators, one per pair member (weight rows split even/odd), rotation elementwise,
            two column-strided stores.
Usage: python -m benchmarks.probe_qkv_epilogue  ->  qkv_epilogue_probe.json under $OUT or benchmarks/results
(EPILOGUE_PROBE_MODES=bias,halves,... picks modes; EPILOGUE_PROBE_FULL=1 adds two 128x128 tiles).
Results: docs/PERFORMANCE.md, "Tried and dropped: the QKV projection's epilogue".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.common import bench, environment, print_table, write_results
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq
from service.config import PRESETS


def qk_pair_order(heads: int, head_dim: int) -> torch.Tensor:
    """QKV projection row order with each Q and K head's rotate-half partners (i, i + D/2) side by side."""
    half = head_dim // 2
    within = torch.stack((torch.arange(half), torch.arange(half) + half), 1).flatten()
    order = torch.arange(3 * heads * head_dim).view(3, heads, head_dim)
    order[:2] = order[:2, :, within]
    return order.flatten()


MODES = {"bias": 0, "halves": 1, "pairs": 2, "pairs-c1": 3, "gather": 4, "bias-early": 5, "halves-early": 6,
         "ln-halves": 7, "halves-lastk": 8}


@triton.jit
def _probe_gemm(a_desc, b_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, ROPE_N,
                HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                K_TILES: tl.constexpr, NUM_SMS: tl.constexpr, MODE: tl.constexpr,
                MEAN=None, RSTD=None, LNW=None, LNB=None):
    grid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * grid_n
    if MODE == 8:
        c_keep = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
        s_keep = tl.zeros([BLOCK_M, HEAD_DIM // 2], tl.float32)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        off_m = (tile // grid_n) * BLOCK_M
        off_n = (tile % grid_n) * BLOCK_N
        cols = off_n + tl.arange(0, BLOCK_N)
        rows = off_m + tl.arange(0, BLOCK_M)
        HALF: tl.constexpr = HEAD_DIM // 2
        if MODE == 5 or MODE == 6:
            bias = tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)
        if MODE == 6:
            early = rows[:, None] * stride_c + tl.arange(0, HALF)[None, :]
            rope_rows = (rows < M)[:, None] & (off_n < ROPE_N)
            c_early = tl.load(COS + early, mask=rope_rows, other=0.0)
            s_early = tl.load(SIN + early, mask=rope_rows, other=0.0)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in range(K_TILES):
            a = a_desc.load([off_m, kt * BLOCK_K])
            if MODE == 7:
                ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)
                mu = tl.load(MEAN + rows, mask=rows < M, other=0.0)
                rs = tl.load(RSTD + rows, mask=rows < M, other=0.0)
                g = tl.load(LNW + ks).to(tl.float32)
                be = tl.load(LNB + ks).to(tl.float32)
                a = ((a.to(tl.float32) - mu[:, None]) * rs[:, None] * g[None, :] + be[None, :]).to(a.dtype)
            acc = tl.dot(a, b_desc.load([off_n, kt * BLOCK_K]).T, acc)
            if MODE == 8:
                last = kt == K_TILES - 1
                lm = (rows < M)[:, None] & (last & (off_n < ROPE_N))
                cs8 = rows[:, None] * stride_c + tl.arange(0, HALF)[None, :]
                c_keep = tl.where(last, tl.load(COS + cs8, mask=lm, other=0.0), c_keep)
                s_keep = tl.where(last, tl.load(SIN + cs8, mask=lm, other=0.0), s_keep)
        if MODE == 5 or MODE == 6:
            acc += bias[None, :]
        else:
            acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        if off_n < ROPE_N:
            if MODE == 1 or MODE == 6 or MODE == 7 or MODE == 8:  # rotate-half, cos/sin from where the mode says
                if MODE == 6:
                    c, s = c_early, s_early
                elif MODE == 8:
                    c, s = c_keep, s_keep
                else:  # loaded here, as the served epilogue does
                    cs = rows[:, None] * stride_c + tl.arange(0, HALF)[None, :]
                    c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)
                    s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)
                x1, x2 = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, BLOCK_N // HEAD_DIM, 2, HALF]), [0, 1, 3, 2]))
                c, s = c[:, None, :], s[:, None, :]
                y = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)
                acc = tl.reshape(tl.permute(y, [0, 1, 3, 2]), [BLOCK_M, BLOCK_N])
            elif MODE == 2:
                x1, x2 = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
                pair = ((off_n + 2 * tl.arange(0, BLOCK_N // 2)) % HEAD_DIM) // 2
                cs = rows[:, None] * stride_c + pair[None, :]
                c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)
                s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)
                acc = tl.reshape(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), [BLOCK_M, BLOCK_N])
            elif MODE == 3:
                x1, x2 = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
                acc = tl.reshape(tl.join(x1 - x2 * 0.5, x2 + x1 * 0.5), [BLOCK_M, BLOCK_N])
            elif MODE == 4:
                cs = rows[:, None] * stride_c + ((cols % HEAD_DIM) // 2)[None, :]
                c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)
                s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)
                acc = acc * c + s
        out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _probe_two_acc(a_desc, b1_desc, b2_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, ROPE_N,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   K_TILES: tl.constexpr, NUM_SMS: tl.constexpr):
    """Output columns off_n + 2j (acc1) and off_n + 2j + 1 (acc2); B1/B2 are the even/odd weight rows."""
    HN: tl.constexpr = BLOCK_N // 2
    grid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = tl.cdiv(M, BLOCK_M) * grid_n
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        off_m = (tile // grid_n) * BLOCK_M
        off_n = (tile % grid_n) * BLOCK_N
        acc1 = tl.zeros([BLOCK_M, HN], tl.float32)
        acc2 = tl.zeros([BLOCK_M, HN], tl.float32)
        for kt in range(K_TILES):
            a = a_desc.load([off_m, kt * BLOCK_K])
            acc1 = tl.dot(a, b1_desc.load([off_n // 2, kt * BLOCK_K]).T, acc1)
            acc2 = tl.dot(a, b2_desc.load([off_n // 2, kt * BLOCK_K]).T, acc2)
        c1 = off_n + 2 * tl.arange(0, HN)
        rows = off_m + tl.arange(0, BLOCK_M)
        acc1 += tl.load(BIAS + c1, mask=c1 < N, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(BIAS + c1 + 1, mask=c1 < N, other=0.0).to(tl.float32)[None, :]
        if off_n < ROPE_N:
            cs = rows[:, None] * stride_c + ((c1 % HEAD_DIM) // 2)[None, :]
            c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)
            s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)
            acc1, acc2 = acc1 * c - acc2 * s, acc2 * c + acc1 * s
        out = OUT + rows[:, None].to(tl.int64) * stride_om + c1[None, :]
        mask = (rows < M)[:, None] & (c1 < N)[None, :]
        tl.store(out, acc1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(out + 1, acc2.to(OUT.dtype.element_ty), mask=mask)


# the served 2B pick first; EPILOGUE_PROBE_FULL=1 adds the pair-order study's other tiles
TILES = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4)] + (
    [(128, 128, 64, 8, 4), (128, 128, 64, 4, 4)] if os.environ.get("EPILOGUE_PROBE_FULL") else [])
MODE_FILTER = os.environ.get("EPILOGUE_PROBE_MODES", "").split(",")


def main():
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (preset, tokens) in {"2b": ("qwen3-vl-2b", 25088), "8b": ("qwen3-vl-8b", 25088)}.items():
        cfg = PRESETS[preset]
        hidden, heads, hd = cfg.hidden_size, cfg.num_heads, cfg.head_dim
        n, k = 3 * hidden, hidden
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, hidden, device="cuda") / hidden**0.5).bfloat16()
        b = torch.randn(n, device="cuda").bfloat16()
        cos, sin = vision_rope_cos_sin(torch.randint(0, 64, (tokens, 2), device="cuda"),
                                       vision_rope_inv_freq(hd, device="cuda"))
        wp, bp = w[qk_pair_order(heads, hd).cuda()], b[qk_pair_order(heads, hd).cuda()]
        ln = (x.float().mean(1), torch.rsqrt(x.float().var(1, unbiased=False) + 1e-6),  # mean, rstd, weight, bias
              (1 + 0.1 * torch.randn(hidden, device="cuda")).bfloat16(),
              (0.1 * torch.randn(hidden, device="cuda")).bfloat16())
        flops = 2 * tokens * n * k
        for bm, bn, bk, warps, stages in TILES:
            tiles = triton.cdiv(tokens, bm) * triton.cdiv(n, bn)
            grid = (min(sms, tiles),)
            ref = None
            for mode, code in MODES.items():
                if MODE_FILTER != [""] and mode not in MODE_FILTER:
                    continue
                if mode in ("halves", "halves-early", "ln-halves", "halves-lastk") and (bn % hd or hd & (hd - 1)):
                    continue
                if mode in ("pairs", "pairs-c1", "gather") and (2 * hidden) % bn:
                    continue
                out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
                a_desc = TensorDescriptor(x, [tokens, k], [k, 1], [bm, bk])
                b_desc = TensorDescriptor(w if "halves" in mode else wp, [n, k], [k, 1], [bn, bk])
                bias = b if "halves" in mode else bp
                fn = lambda: _probe_gemm[grid](  # noqa: E731
                    a_desc, b_desc, bias, out, cos, sin, tokens, n, out.stride(0),
                                               cos.stride(0), 2 * hidden, HEAD_DIM=hd, BLOCK_M=bm, BLOCK_N=bn,
                                               BLOCK_K=bk, K_TILES=triton.cdiv(k, bk), NUM_SMS=grid[0], MODE=code,
                                               MEAN=ln[0], RSTD=ln[1], LNW=ln[2], LNB=ln[3],
                                               num_warps=warps, num_stages=stages)
                kern = fn()
                ms = bench(fn)
                if mode == "pairs":
                    ref = out.clone()
                if mode == "halves":
                    halves = out.clone()
                if mode in ("halves-early", "halves-lastk"):
                    assert torch.equal(out, halves), f"{mode} changed the result"
                if mode == "ln-halves":  # the same GEMM on the normalised activations, materialised
                    x_ln = ((x.float() - ln[0][:, None]) * ln[1][:, None] * ln[2].float() + ln[3].float()).bfloat16()
                    ref_desc = TensorDescriptor(x_ln, [tokens, k], [k, 1], [bm, bk])
                    ref_out = torch.empty_like(out)
                    _probe_gemm[grid](ref_desc, b_desc, bias, ref_out, cos, sin, tokens, n, out.stride(0),
                                      cos.stride(0), 2 * hidden, HEAD_DIM=hd, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                                      K_TILES=triton.cdiv(k, bk), NUM_SMS=grid[0], MODE=1, num_warps=warps,
                                      num_stages=stages)
                rows.append({"shape": name, "tile": f"{bm}x{bn}x{bk} w{warps} s{stages}", "epilogue": mode, "ms": ms,
                             "TFLOPS": flops / ms / 1e9, "regs": kern.n_regs, "spills": kern.n_spills})
                if mode == "ln-halves":
                    rows[-1]["max diff vs materialised LN"] = (out.float() - ref_out.float()).abs().max().item()
            if (2 * hidden) % bn == 0 and (MODE_FILTER == [""] or "two-acc" in MODE_FILTER):
                out = torch.empty(tokens, n, device="cuda", dtype=torch.bfloat16)
                w1, w2 = wp[0::2].contiguous(), wp[1::2].contiguous()
                a_desc = TensorDescriptor(x, [tokens, k], [k, 1], [bm, bk])
                b1 = TensorDescriptor(w1, [n // 2, k], [k, 1], [bn // 2, bk])
                b2 = TensorDescriptor(w2, [n // 2, k], [k, 1], [bn // 2, bk])
                fn = lambda: _probe_two_acc[grid](  # noqa: E731
                    a_desc, b1, b2, bp, out, cos, sin, tokens, n, out.stride(0),
                                                  cos.stride(0), 2 * hidden, HEAD_DIM=hd, BLOCK_M=bm, BLOCK_N=bn,
                                                  BLOCK_K=bk, K_TILES=triton.cdiv(k, bk), NUM_SMS=grid[0],
                                                  num_warps=warps, num_stages=stages)
                kern = fn()
                ms = bench(fn)
                err = (out.float() - ref.float()).abs().max().item() if ref is not None else None
                rows.append({"shape": name, "tile": f"{bm}x{bn}x{bk} w{warps} s{stages}", "epilogue": "two-acc",
                             "ms": ms, "TFLOPS": flops / ms / 1e9, "regs": kern.n_regs, "spills": kern.n_spills,
                             "max diff vs pairs": err})
        t = bench(lambda: torch.nn.functional.linear(x, w, b))
        rows.append({"shape": name, "tile": "cuBLAS", "epilogue": "bias", "ms": t, "TFLOPS": flops / t / 1e9})
    print_table(rows, ["shape", "tile", "epilogue", "ms", "TFLOPS", "regs", "spills", "max diff vs pairs",
                       "max diff vs materialised LN"])
    write_results("qkv_epilogue_probe", {"benchmark": "probe_qkv_epilogue", "env": environment(), "rows": rows})


if __name__ == "__main__":
    main()
