"""Residual add + LayerNorm in one pass: `s = x + y; return s, layer_norm(s)`, or, when the residual
add already happened in a GEMM's epilogue, `layer_norm(s + offset)` alone. With `bias=None` the norm is an
RMSNorm (Qwen2.5-VL's): no mean subtracted, no bias added.

Each block of the tower ends its attention and its MLP with a residual add followed by a LayerNorm
(the next one's input). Unfused that is five passes over the [T, hidden] activations; fused, four.
When the output projections add the residual themselves (cuBLAS `addmm`, beta = 1) this kernel only
normalises: two passes. Those GEMMs leave their bias out (a 2-D C and a bias vector do not go together
in PyTorch's GEMM), so the stored stream lacks the biases added so far; their running sum is a
per-column float32 `offset` that the LayerNorm adds back before normalising.

Statistics in float32. With `y` the sum is rounded to the activations' dtype before normalising,
exactly as the unfused PyTorch code does.

FP8 (`quantize=True`): the normalised rows leave as e4m3 with one float32 scale per row (absmax / 448) instead of
in the activations' dtype, the input that `kernels.fp8.scaled_linear` takes for the next GEMM (qkv, fc1): no
separate pass reads them again to quantise. Each value is rounded to the activations' dtype first, so the codes are
those `kernels.fp8.quantize_rows` gives the unfused output.

Where a block's output also feeds a DeepStack merger, the same pass computes that merger's post-shuffle
LayerNorm too (over groups of `merge_unit` consecutive rows, one merged token each), so the merger does
not read the block's output again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import E4M3, quantize_rows
from .runtime import cdiv, launch, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def rms_norm(s, weight, eps):
    """RMSNorm in float32, rounded once to the weight's dtype."""
    sf = s.float()
    return (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(weight.dtype)


def _norms(s, weight, bias, eps, merged_norm, offset):
    """LayerNorm (RMSNorm without `bias`) of `s` (+ float32 `offset`), and of its groups of rows taken as one
    with `merged_norm`."""
    if offset is not None:
        s = s.float() + offset
    if bias is None:
        return [rms_norm(s, weight, eps)]
    out = [F.layer_norm(s, (s.shape[-1],), weight.to(s.dtype), bias.to(s.dtype), eps).to(weight.dtype)]
    if merged_norm is not None:
        w2, b2, eps2 = merged_norm
        out.append(F.layer_norm(s.reshape(-1, w2.numel()), (w2.numel(),), w2.to(s.dtype), b2.to(s.dtype), eps2)
                   .to(w2.dtype))
    return out


def _quantized(norms, quantize):
    return (*quantize_rows(norms[0]), *norms[1:]) if quantize else tuple(norms)


def reference_add_layernorm(x, y, weight, bias, eps, merged_norm=None, quantize=False):
    s = x + y
    return (s, *_quantized(_norms(s, weight, bias, eps, merged_norm, None), quantize))


def reference_layernorm_offset(s, offset, weight, bias, eps, merged_norm=None, quantize=False):
    return _quantized(_norms(s, weight, bias, eps, merged_norm, offset), quantize)


if triton is not None:
    from .fp8 import TL_DTYPES, e4m3_rows

    @triton.jit
    def _add_layernorm_kernel(X, Y, OFFSET, W, B, S, OUT, SCALE, W2, B2, OUT2, n_rows, n_cols, eps, eps2,
                              BLOCK_N: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr,
                              HAS_Y: tl.constexpr, HAS_OFFSET: tl.constexpr, RMS: tl.constexpr,
                              QUANT: tl.constexpr, ACT: tl.constexpr):
        # ROWS rows per program as one 2-D tile: all their loads are in flight at once. HAS_Y: the sum
        # X + Y is stored to S and normalised; else X (+ OFFSET, float32 per column) is normalised.
        # GROUP > 0: OUT2 is the LayerNorm (W2, B2, eps2) of each GROUP consecutive rows taken as one row
        # (ROWS % GROUP == 0). RMS: an RMSNorm (no mean, no bias; not with GROUP). QUANT: OUT is e4m3, each
        # row's values rounded to ACT (the activations' dtype) and divided by the row's SCALE (absmax / 448).
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
        s = tl.load(X + offs, mask=mask, other=0.0)
        if HAS_Y:
            s += tl.load(Y + offs, mask=mask, other=0.0)
            tl.store(S + offs, s, mask=mask)
        sf = s.to(tl.float32)
        if HAS_OFFSET:
            sf = tl.where(mask, sf + tl.load(OFFSET + cols, mask=col_ok, other=0.0)[None, :], 0.0)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        if RMS:
            var = tl.sum(sf * sf, 1) / n_cols
            y = sf * tl.math.rsqrt(var + eps)[:, None] * w[None, :]
        else:
            mean = tl.sum(sf, 1) / n_cols
            diff = tl.where(mask, sf - mean[:, None], 0.0)
            var = tl.sum(diff * diff, 1) / n_cols
            b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
            y = diff * tl.math.rsqrt(var + eps)[:, None] * w[None, :] + b[None, :]
        if QUANT:
            q, scale = e4m3_rows(y, mask, ACT)
            tl.store(SCALE + rows, scale, mask=rows < n_rows)
            tl.store(OUT + offs, q.to(OUT.dtype.element_ty), mask=mask)
        else:
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


def _merged_group(rows: int, cols: int, merged_norm) -> int:
    if merged_norm is None:
        return 0
    if merged_norm[1] is None:
        raise ValueError("the merged norm is a LayerNorm (with bias)")
    group = merged_norm[0].numel() // cols
    if group < 1 or group & (group - 1) or group * cols != merged_norm[0].numel() or rows % group:
        raise ValueError(f"merged norm of {merged_norm[0].numel()} features over rows of {cols}: needs a "
                         f"power-of-two multiple dividing the {rows} rows")
    return group


def _launch(x, y, offset, weight, bias, eps, merged_norm, group, quantize=False, rows_per_prog=None,
            num_warps=None):
    rows, cols = x.shape
    s = torch.empty_like(x) if y is not None else x  # S is only written with Y
    out = torch.empty(x.shape, dtype=E4M3 if quantize else x.dtype, device=x.device)
    scale = torch.empty(rows if quantize else 0, dtype=torch.float32, device=x.device)
    out2 = torch.empty_like(x) if group else out  # a placeholder without the merged norm
    w2, b2, eps2 = merged_norm if group else (weight, bias, eps)
    block_n = next_power_of_2(cols)
    if rows_per_prog is None:  # ~16 KB of each input in flight per program
        rows_per_prog = max(1, group, min(8, 8192 // block_n))
    if num_warps is None:  # 4 warps: faster than 8 on the 8B tower's rows, even on the 2B's
        num_warps = 4
    launch(
        _add_layernorm_kernel, (cdiv(rows, rows_per_prog),), x, x if y is None else y,
        weight if offset is None else offset, weight, weight if bias is None else bias, s, out, scale, w2,
        weight if b2 is None else b2, out2, rows, cols, eps, eps2, BLOCK_N=block_n, ROWS=rows_per_prog, GROUP=group,
        HAS_Y=y is not None, HAS_OFFSET=offset is not None, RMS=bias is None, QUANT=quantize,
        ACT=TL_DTYPES[x.dtype], num_warps=num_warps)
    merged = (out2.view(rows // group, group * cols),) if group else ()
    return ((s,) if y is not None else ()) + (out, *((scale,) if quantize else ()), *merged)


def add_layernorm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                  use_triton: bool | None = None, merged_norm: tuple | None = None,
                  quantize: bool = False) -> tuple[torch.Tensor, ...]:
    """x, y `[T, N]` (same dtype, contiguous) -> (x + y, LayerNorm(x + y)) (RMSNorm with `bias` None); Triton on
    CUDA.

    `merged_norm` = (weight, bias, eps) of a LayerNorm over G * N features (G = weight.numel() // N, a
    power of two dividing T): also returns that norm of `(x + y).view(T / G, G * N)`. `quantize`: the norm as
    (e4m3 `[T, N]`, float32 scales `[T]`), as `kernels.fp8.quantize_rows` gives it."""
    if x.shape != y.shape or x.dim() != 2 or x.dtype != y.dtype:
        raise ValueError(f"x and y must be 2-D of one shape and dtype; got {tuple(x.shape)} {x.dtype}, "
                         f"{tuple(y.shape)} {y.dtype}")
    group = _merged_group(*x.shape, merged_norm)
    if use_triton is None:
        use_triton = triton is not None and x.is_cuda
    if not use_triton:
        return reference_add_layernorm(x, y, weight, bias, eps, merged_norm, quantize)
    return _launch(x.contiguous(), y.contiguous(), None, weight, bias, eps, merged_norm, group, quantize)


def layernorm_offset(s: torch.Tensor, offset: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None,
                     eps: float, use_triton: bool | None = None, merged_norm: tuple | None = None,
                     quantize: bool = False) -> tuple[torch.Tensor, ...]:
    """s `[T, N]`, float32 offset `[N]` (or None) -> (LayerNorm(s + offset),), computed in float32 and
    rounded once to the weight's dtype; with `merged_norm` and `quantize` as in `add_layernorm`."""
    if s.dim() != 2 or offset is not None and (offset.shape != (s.shape[1],) or offset.dtype != torch.float32):
        got = "no offset" if offset is None else f"offset {offset.dtype} {tuple(offset.shape)}"
        raise ValueError(f"s must be 2-D and offset float32 of its width; got {tuple(s.shape)}, {got}")
    group = _merged_group(*s.shape, merged_norm)
    if use_triton is None:
        use_triton = triton is not None and s.is_cuda
    if not use_triton:
        return reference_layernorm_offset(s, offset, weight, bias, eps, merged_norm, quantize)
    return _launch(s.contiguous(), None, None if offset is None else offset.contiguous(), weight, bias, eps,
                   merged_norm, group, quantize)
