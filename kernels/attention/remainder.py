"""K's and V's columns past a power-of-two head dim, transposed, for the Hopper (Gluon) kernel; and the layout
check of that kernel's inputs.

At head dims 72 and 80 the Gluon kernel may read the remainder columns of K and V from R, their transposed copy
(`kv_remainder_t`, one small launch before the attention), in boxes of 16 rows, so 72 costs 64 + 16 lanes in both
dots: from 1x4096 tokens up that beats reading the remainder in place (`tiles.GLUON_TILES`).
"""

import torch
import triton
import triton.language as tl

from ..runtime import cdiv, interpreting, launch, next_power_of_2
from .common import multiple_of_8, r_start, segment_program
from .tiles import head_dim_split, remainder_rows


@triton.jit
def _remainder_t_kernel(K, V, R, CU_SEQLENS, stride_kt, stride_vt, stride_r,
                        HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM_P: tl.constexpr, R_ROWS: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    """Head h's rows of R (`kv_remainder_t`), at column c = r_start(segment) + (t - its first token):
    R[h * R_ROWS + j, c] = K[t, h, D0 + j] and R[h * R_ROWS + REM + j, c] = V[t, h, D0 + j] for j < REM
    (= HEAD_DIM - D0), and where R_ROWS has room (72), R[h * R_ROWS + 2 * REM, c] = 1: PV's dot then sums
    P's rows (the kernel's SUM_MMA; masked scores are zero in P). Zero in the gap up to the next segment's
    start: the attention kernel's last tile of a segment reads into it, where P's zeros cancel only finite
    values. K and V are in the fused QKV layout (head h's columns start at h * HEAD_DIM), which lets the
    compiler vectorise the loads; R's row stride and segment starts are multiples of 8, written so
    (`multiple_of_8`, `r_start`) that it vectorises the stores."""
    REM: tl.constexpr = HEAD_DIM - D0
    blk, h, seg, tok0, seqlen = segment_program(CU_SEQLENS)
    c0 = r_start(tok0, seg)
    span = r_start(tok0 + seqlen, seg + 1) - c0  # this segment's columns and the gap after them
    i = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    if blk * BLOCK_T >= span:
        return
    stride_r = multiple_of_8(stride_r)
    j = tl.arange(0, REM_P)
    mask = (i < seqlen)[:, None] & (j < REM)[None, :]
    src = (tok0 + i)[:, None].to(tl.int64)
    k = tl.load(K + src * stride_kt + h * HEAD_DIM + D0 + j[None, :], mask=mask, other=0.0)
    v = tl.load(V + src * stride_vt + h * HEAD_DIM + D0 + j[None, :], mask=mask, other=0.0)
    dst = R + (h * R_ROWS + j)[None, :].to(tl.int64) * stride_r + (c0 + i)[:, None]
    keep = (i < span)[:, None] & (j < REM)[None, :]
    tl.store(dst, k, mask=keep)
    tl.store(dst + REM * stride_r, v, mask=keep)
    if 2 * REM < R_ROWS:
        tl.store(R + (h * R_ROWS + 2 * REM).to(tl.int64) * stride_r + c0 + i, tl.full([BLOCK_T], 1.0, v.dtype),
                 mask=i < span)


def kv_remainder_t(k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The columns of k and v `(T, H, D)` past the power-of-two chunk, transposed for the Gluon kernel (`gluon.py`, `GluonTile.rem_copy`):
    `(H * remainder_rows, round_up(T, 8) + 8 * segments)`, one column per token, each segment from an
    aligned column (`r_start`). Head h's rows: K's remainder columns, then V's, then (72) a row of ones.
    Nothing is padded: the kernel's boxes are W1 rows (16 at 72), so K's box runs into V's rows of the
    same head, which Q's zero columns past the head cancel, and V's into the next head's, which only fill
    accumulator columns past the head. One launch; at 72 it writes 544 bytes per token (the zero-padded
    layout wrote 1024)."""
    total, heads, head_dim = k.shape
    for name, t in (("k", k), ("v", v)):
        if not heads_side_by_side(t):
            raise ValueError(f"{name} must have its heads side by side in each token row; strides {t.stride()}")
    d0, _, _ = head_dim_split(head_dim)
    rows = remainder_rows(head_dim)
    segments = cu_seqlens.numel() - 1
    r = torch.empty((heads * rows, cdiv(total, 8) * 8 + 8 * segments), dtype=k.dtype, device=k.device)
    block_t = 32 if interpreting() else 128
    launch(
        _remainder_t_kernel, (cdiv(max_seqlen + 16, block_t), heads, segments), k, v, r, cu_seqlens, k.stride(0),
        v.stride(0), r.stride(0), HEAD_DIM=head_dim, D0=d0,
        REM_P=next_power_of_2(head_dim - d0), R_ROWS=rows, BLOCK_T=block_t)
    return r


def hopper_layout_ok(q, k, v, out=None) -> bool:
    """Whether the Hopper kernel can take these tensors: k and v readable through tensor descriptors (heads
    side by side in each token row, as in the fused QKV layout), half-precision data, and every row and head
    of q, k, v and out starting on 16 bytes (its boxes and O stores assume it)."""
    if q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (heads_side_by_side(k) and heads_side_by_side(v)):
        return False
    for t in (q, k, v) if out is None else (q, k, v, out):
        stride, size = t.stride(), t.element_size()
        if (stride[0] * size) % 16 or (stride[1] * size) % 16 or t.data_ptr() % 16:
            return False
    return True


def heads_side_by_side(t) -> bool:
    """Whether `(T, H, D)` t holds each token's heads side by side in one row (the fused QKV layout)."""
    stride = t.stride()
    return stride[2] == 1 and stride[1] == t.shape[2]
