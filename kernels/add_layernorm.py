"""Fused residual add + LayerNorm: `s = x + y; return s, layer_norm(s)` in one pass.

Each block of the tower ends its attention and its MLP with a residual add followed by a LayerNorm
(the next one's input). Unfused that is five passes over the [T, hidden] activations; fused, four.
Statistics in float32; the sum is rounded to the activations' dtype before normalising, exactly as
the unfused PyTorch code does.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def reference_add_layernorm(x, y, weight, bias, eps):
    s = x + y
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


if triton is not None:

    @triton.jit
    def _add_layernorm_kernel(X, Y, W, B, S, OUT, n_rows, n_cols, eps,
                              BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
        # ROWS rows per program as one 2-D tile: all their loads are in flight at once
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


def add_layernorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float,
                  use_triton: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y `[T, N]` (same dtype, contiguous) -> (x + y, LayerNorm(x + y)); Triton on CUDA."""
    if x.shape != y.shape or x.dim() != 2 or x.dtype != y.dtype:
        raise ValueError(f"x and y must be 2-D of one shape and dtype; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(y.shape)} {y.dtype}")
    if use_triton is None:
        use_triton = triton is not None and x.is_cuda
    if not use_triton:
        return reference_add_layernorm(x, y, weight, bias, eps)
    x, y = x.contiguous(), y.contiguous()
    rows, cols = x.shape
    s, out = torch.empty_like(x), torch.empty_like(x)
    block_n = triton.next_power_of_2(cols)
    rows_per_prog = max(1, min(8, 8192 // block_n))  # ~16 KB of each input in flight per program
    _add_layernorm_kernel[(triton.cdiv(rows, rows_per_prog),)](
        x, y, weight, bias, s, out, rows, cols, eps, BLOCK_N=block_n, ROWS=rows_per_prog, num_warps=8)
    return s, out
