"""Fused residual add + LayerNorm: `s = x + y; return s, layer_norm(s)` in one pass.

Each block of the tower ends its attention and its MLP with a residual add followed by a LayerNorm
(the next one's input). Unfused that is five passes over the [T, hidden] activations; fused, four.
Statistics in float32; the sum is rounded to the activations' dtype before normalising, exactly as
the unfused PyTorch code does.

Where a block's output also feeds a DeepStack merger, the same pass computes that merger's post-shuffle
LayerNorm too (over groups of `merge_unit` consecutive rows, one merged token each), so the merger does
not read the block's output again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def reference_add_layernorm(x, y, weight, bias, eps, merged_norm=None):
    s = x + y
    out = s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)
    if merged_norm is None:
        return out
    w2, b2, eps2 = merged_norm
    return *out, F.layer_norm(s.view(-1, w2.numel()), (w2.numel(),), w2, b2, eps2)


if triton is not None:

    @triton.jit
    def _add_layernorm_kernel(X, Y, W, B, S, OUT, W2, B2, OUT2, n_rows, n_cols, eps, eps2,
                              BLOCK_N: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
        # ROWS rows per program as one 2-D tile: all their loads are in flight at once. GROUP > 0: OUT2 is
        # the LayerNorm (W2, B2, eps2) of each GROUP consecutive rows taken as one row (ROWS % GROUP == 0).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(X + offs, mask=mask, other=0.0) + tl.load(Y + offs, mask=mask, other=0.0)
        tl.store(S + offs, s, mask=mask)
        sf = s.to(tl.float32)
        mean = tl.sum(sf, 1) / n_cols
        diff = tl.where(mask, sf - mean[:, None], 0.0)
        var = tl.sum(diff * diff, 1) / n_cols
        w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = diff * tl.math.rsqrt(var + eps)[:, None] * w[None, :] + b[None, :]
        tl.store(OUT + offs, y.to(OUT.dtype.element_ty), mask=mask)
        if GROUP > 0:
            G: tl.constexpr = ROWS // GROUP
            n2 = n_cols * GROUP
            mean2 = tl.sum(tl.reshape(tl.sum(sf, 1), [G, GROUP]), 1) / n2  # masked elements are 0
            mean2 = tl.reshape(tl.broadcast_to(mean2[:, None], [G, GROUP]), [ROWS])
            diff2 = tl.where(mask, sf - mean2[:, None], 0.0)
            var2 = tl.sum(tl.reshape(tl.sum(diff2 * diff2, 1), [G, GROUP]), 1) / n2
            rstd2 = tl.reshape(tl.broadcast_to(tl.math.rsqrt(var2 + eps2)[:, None], [G, GROUP]), [ROWS])
            wcols = ((rows % GROUP) * n_cols)[:, None] + cols[None, :]  # a row's place in its merged row
            w2 = tl.load(W2 + wcols, mask=mask, other=0.0).to(tl.float32)
            b2 = tl.load(B2 + wcols, mask=mask, other=0.0).to(tl.float32)
            tl.store(OUT2 + offs, (diff2 * rstd2[:, None] * w2 + b2).to(OUT2.dtype.element_ty), mask=mask)


def add_layernorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                  use_triton: bool | None = None, merged_norm: tuple | None = None) -> tuple[torch.Tensor, ...]:
    """x, y `[T, N]` (same dtype, contiguous) -> (x + y, LayerNorm(x + y)); Triton on CUDA.

    `merged_norm` = (weight, bias, eps) of a LayerNorm over G * N features (G = weight.numel() // N, a
    power of two dividing T): also returns that norm of `(x + y).view(T / G, G * N)`."""
    if x.shape != y.shape or x.dim() != 2 or x.dtype != y.dtype:
        raise ValueError(f"x and y must be 2-D of one shape and dtype; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(y.shape)} {y.dtype}")
    rows, cols = x.shape
    group = 0
    if merged_norm is not None:
        group = merged_norm[0].numel() // cols
        if group < 1 or group & (group - 1) or group * cols != merged_norm[0].numel() or rows % group:
            raise ValueError(f"merged norm of {merged_norm[0].numel()} features over rows of {cols}: needs a "
                             f"power-of-two multiple dividing the {rows} rows")
    if use_triton is None:
        use_triton = triton is not None and x.is_cuda
    if not use_triton:
        return reference_add_layernorm(x, y, weight, bias, eps, merged_norm)
    x, y = x.contiguous(), y.contiguous()
    s, out = torch.empty_like(x), torch.empty_like(x)
    out2 = torch.empty_like(x) if group else out  # a placeholder without the merged norm
    w2, b2, eps2 = merged_norm if group else (weight, bias, eps)
    block_n = triton.next_power_of_2(cols)
    rows_per_prog = max(1, group, min(8, 8192 // block_n))  # ~16 KB of each input in flight per program
    _add_layernorm_kernel[(triton.cdiv(rows, rows_per_prog),)](
        x, y, weight, bias, s, out, w2, b2, out2, rows, cols, eps, eps2, BLOCK_N=block_n, ROWS=rows_per_prog,
        GROUP=group, num_warps=8)
    return (s, out, out2.view(rows // group, group * cols)) if group else (s, out)
