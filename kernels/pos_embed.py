"""Learned position embeddings, bilinearly interpolated to each image's grid and added in place.

transformers gathers the four taps of every token into a `[T, 4, hidden]` tensor, scales, sums and
adds: four passes over data four times the activations' size. Here one pass reads each token's
four table rows (the table is small and stays in L2), blends them in float32, rounds once to the
activations' dtype (as the reference does) and adds.
"""

from __future__ import annotations

import torch

from .runtime import cdiv, launch, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def reference_pos_embed(table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`[T, hidden]` float32: sum over the 4 taps of `weight[t, j] * table[index[t, j]]`."""
    return (table[index].float() * weight[:, :, None]).sum(1)


if triton is not None:

    @triton.jit
    def _pos_embed_add_kernel(X, TABLE, INDEX, WEIGHT, n_tokens, hidden,
                              TAPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_H)
        row_mask = rows < n_tokens
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        pos = tl.zeros([BLOCK_T, BLOCK_H], tl.float32)
        for j in tl.static_range(TAPS):
            idx = tl.load(INDEX + rows * TAPS + j, mask=row_mask, other=0)
            w = tl.load(WEIGHT + rows * TAPS + j, mask=row_mask, other=0.0)
            e = tl.load(TABLE + idx[:, None] * hidden + cols[None, :], mask=mask, other=0.0)
            pos += w[:, None] * e.to(tl.float32)
        offs = rows.to(tl.int64)[:, None] * hidden + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0)
        tl.store(X + offs, (x.to(tl.float32) + pos.to(x.dtype).to(tl.float32)).to(x.dtype), mask=mask)


def pos_embed_add_(x: torch.Tensor, table: torch.Tensor, index: torch.Tensor, weight: torch.Tensor,
                   use_triton: bool | None = None) -> torch.Tensor:
    """x `[T, hidden]` += interpolated embeddings, in place; index long `[T, taps]`, weight float32 alike."""
    if x.dim() != 2 or not x.is_contiguous() or table.shape[1] != x.shape[1] or index.shape != weight.shape \
            or index.shape[0] != x.shape[0]:
        raise ValueError(f"pos_embed_add_: x {tuple(x.shape)}, table {tuple(table.shape)}, index "
                         f"{tuple(index.shape)}, weight {tuple(weight.shape)} do not fit")
    if use_triton is None:
        use_triton = triton is not None and x.is_cuda
    if not use_triton:
        x += reference_pos_embed(table, index, weight).to(x.dtype)
        return x
    tokens, hidden = x.shape
    block_h = next_power_of_2(hidden)
    block_t = max(1, 8192 // block_h)
    launch(
        _pos_embed_add_kernel, (cdiv(tokens, block_t),), x, table.contiguous(), index.contiguous(),
        weight.contiguous(), tokens, hidden, TAPS=index.shape[1], BLOCK_T=block_t, BLOCK_H=block_h, num_warps=8)
    return x
