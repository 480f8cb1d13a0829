"""The Hopper varlen attention kernel in `tl.dot`: K and V tiles by TMA tensor descriptors.

The descriptors run over the packed token rows with K and V in the fused QKV layout (each token's heads side by
side), so tiles land in shared memory already swizzled for wgmma. Q is loaded once per program by pointers. Head
dims past the power-of-two chunk D0 (72, 80) read the remainder
columns of K and V from R, their transposed copy (`kv_remainder_t`, one small launch before the kernel), in boxes
of 16 rows, so 72 costs 64 + 16 lanes in both dots. A segment's last keys, when they fill at most half a tile, go
in narrow pointer-loaded steps (`TAIL_N`), and its last query rows in a half-height tile (`Q_TAIL`).
"""

import torch
import triton
import triton.language as tl

from ..runtime import cdiv, interpreting, launch, next_power_of_2
from .common import load_tile, multiple_of_8, r_start, segment_program, softmax_update, store_out
from .tiles import head_dim_split, remainder_rows

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host tensor descriptors
    TensorDescriptor = None


@triton.jit
def _load_q_rem(q_base, rows_m, m_mask, stride_qt, HEAD_DIM: tl.constexpr, D0: tl.constexpr, W1: tl.constexpr):
    """Q's columns [D0, D0 + W1), zero past the head: the A operand against the transposed remainder."""
    cols = D0 + tl.arange(0, W1)
    mask = m_mask[:, None] & (cols < HEAD_DIM)[None, :]
    return tl.load(q_base + rows_m[:, None] * stride_qt + cols[None, :], mask=mask, other=0.0)

@triton.jit
def _tma_step(acc0, acc1, l_i, m_i, q0, q1, k_desc, v_desc, r_desc, row, col, r_row, r_col, start_n, seqlen,
              qk_scale, BLOCK_N: tl.constexpr, REM: tl.constexpr, R_V: tl.constexpr, MASK_N: tl.constexpr,
              SUM_MMA: tl.constexpr = False):
    qk = tl.dot(q0, tl.trans(k_desc.load([row, col])))
    if REM:  # + the remainder columns: K's arrive transposed, a [W1, BLOCK_N] tile (B operand as is)
        qk = tl.dot(q1, r_desc.load([r_row, r_col]), qk)
    if MASK_N:  # the rows past the segment's end are the next segment's keys (or TMA's zero fill)
        qk = tl.where((start_n + tl.arange(0, BLOCK_N) < seqlen)[None, :], qk, float("-inf"))
    acc0, acc1, l_i, m_ij, p = softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i, SUM_MMA)
    v0 = v_desc.load([row, col])
    p = p.to(v0.dtype)
    acc0 = tl.dot(p, v0, acc0)
    if REM:  # V's remainder, transposed [W1, BLOCK_N]: its transpose is a K-major B operand (its row of
        # ones past the head, where there is one, sums P: SUM_MMA)
        acc1 = tl.dot(p, tl.trans(r_desc.load([r_row + R_V, r_col])), acc1)
    return acc0, acc1, l_i, m_ij

@triton.jit
def _narrow_step(acc0, acc1, l_i, m_i, q0, q1, k_rows, v_rows, r_cols, stride_kt, stride_vt, stride_r, start_n,
                 seqlen, qk_scale, D0: tl.constexpr, W1: tl.constexpr, TAIL_N: tl.constexpr, REM: tl.constexpr,
                 R_V: tl.constexpr, SUM_MMA: tl.constexpr = False):
    """A masked step over TAIL_N keys, loaded by pointers (the tensor descriptors' boxes are BLOCK_N
    rows): the last keys of a segment cost TAIL_N / BLOCK_N of a full step. `k_rows`/`v_rows` point at
    the segment's first key of this head, `r_cols` at its first column in R's K rows."""
    n = start_n + tl.arange(0, TAIL_N)
    n_mask = n < seqlen
    d = tl.arange(0, D0)
    k = load_tile(k_rows, n, d, stride_kt, n_mask, True)
    qk = tl.dot(q0, tl.trans(k))
    if REM:  # K's remainder rows of R only (a TMA box also holds this head's V rows, cancelled by Q's zeros)
        j = tl.arange(0, W1)
        rk = tl.load(r_cols + j[:, None] * stride_r + n[None, :], mask=(j < R_V)[:, None] & n_mask[None, :],
                     other=0.0)
        qk = tl.dot(q1, rk, qk)
    qk = tl.where(n_mask[None, :], qk, float("-inf"))
    acc0, acc1, l_i, m_ij, p = softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i, SUM_MMA)
    v = load_tile(v_rows, n, d, stride_vt, n_mask, True)
    p = p.to(v.dtype)
    acc0 = tl.dot(p, v, acc0)
    if REM:
        # V's remainder and its row of ones, where there is one
        rv = tl.load(r_cols + (R_V + j)[:, None] * stride_r + n[None, :],
                     mask=(j <= R_V)[:, None] & n_mask[None, :], other=0.0)
        acc1 = tl.dot(p, tl.trans(rv), acc1)
    return acc0, acc1, l_i, m_ij

@triton.jit
def _varlen_attn_fwd_tma(
    Q, k_desc, v_desc, r_desc, O, CU_SEQLENS,
    stride_qt, stride_qh, stride_ot, stride_oh, qk_scale,
    K, V, R, stride_kt, stride_vt, stride_r, total_tokens,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, W1: tl.constexpr, HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
    TAIL_IN_LOOP: tl.constexpr = False, DEVICE_DESC: tl.constexpr = False, TAIL_N: tl.constexpr = 0,
    Q_TAIL: tl.constexpr = False, SUM_MMA: tl.constexpr = False, R_ROWS: tl.constexpr = 0,
):
    """Hopper variant: K and V tiles arrive by TMA (tensor descriptors over the packed (T, H*D) rows,
    K's and V's head picked by the column offset), so the tiles land swizzled for wgmma without
    going through registers. Q is loaded once per program by pointers.
    Head dims past the power-of-two chunk D0 (72, 80, ...): the remainder columns of K and V come from
    R, their transposed copy (`kv_remainder_t`: per head K's remainder rows, V's, and for 72 a row of
    ones; one column per token, each segment from an aligned column `r_start`), so no operand is
    narrower than 16 rows of 128 bytes. A box of W1 rows can run past K's rows into V's of the same head
    (Q's remainder is zero past the head, so they add nothing) and past V's rows into the next head's
    (they land in accumulator columns that are never stored).
    DEVICE_DESC: the program builds its descriptors itself from K, V, R and their row strides,
    instead of receiving host-encoded ones (`k_desc`, `v_desc`, `r_desc` unused).
    TAIL_N: a segment's last keys, when they fill at most half a tile, go in steps of TAIL_N keys
    (`_narrow_step`) instead of one masked full tile: a 448px image's 784 tokens are 6 tiles of 128
    and 16 keys.
    Q_TAIL: a segment's last query rows, when they fill at most half a Q tile, run as a tile of
    BLOCK_M / 2 rows (at 784 tokens the 7th 128-row tile holds 16 rows: half its MMA and softmax
    work is saved)."""
    start_m, head, seg, tok0, seqlen = segment_program(CU_SEQLENS)
    if start_m * BLOCK_M >= seqlen:
        return
    # Q's and O's strides are multiples of 8 (the launcher checks). At 72 the head strides would otherwise look
    # unaligned, and Q's loads and O's stores would be 2 bytes each (190-255 registers instead of 114-217).
    stride_qt = multiple_of_8(stride_qt)
    stride_qh = multiple_of_8(stride_qh)
    stride_ot = multiple_of_8(stride_ot)
    stride_oh = multiple_of_8(stride_oh)
    REM: tl.constexpr = D0 < HEAD_DIM
    if DEVICE_DESC:
        kd = tl.make_tensor_descriptor(K, shape=[total_tokens, HEADS * HEAD_DIM], strides=[stride_kt, 1],
                                       block_shape=[BLOCK_N, D0])
        vd = tl.make_tensor_descriptor(V, shape=[total_tokens, HEADS * HEAD_DIM], strides=[stride_vt, 1],
                                       block_shape=[BLOCK_N, D0])
        if REM:
            rd = tl.make_tensor_descriptor(R, shape=[HEADS * R_ROWS, stride_r], strides=[stride_r, 1],
                                           block_shape=[W1, BLOCK_N])
        else:
            rd = kd
    else:
        kd = k_desc
        vd = v_desc
        rd = r_desc
    if Q_TAIL and seqlen - start_m * BLOCK_M <= BLOCK_M // 2:
        _tma_tile(Q, kd, vd, rd, O, stride_qt, stride_qh, stride_ot, stride_oh, qk_scale,
                  K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, start_m * BLOCK_M,
                  HEAD_DIM, D0, W1, HEADS, BLOCK_M // 2, BLOCK_N, WS, TAIL_IN_LOOP, TAIL_N, SUM_MMA, R_ROWS)
    else:
        _tma_tile(Q, kd, vd, rd, O, stride_qt, stride_qh, stride_ot, stride_oh, qk_scale,
                  K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, start_m * BLOCK_M,
                  HEAD_DIM, D0, W1, HEADS, BLOCK_M, BLOCK_N, WS, TAIL_IN_LOOP, TAIL_N, SUM_MMA, R_ROWS)

@triton.jit
def _tma_tile(Q, kd, vd, rd, O, stride_qt, stride_qh, stride_ot, stride_oh, qk_scale,
              K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, row0,
              HEAD_DIM: tl.constexpr, D0: tl.constexpr, W1: tl.constexpr, HEADS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WS: tl.constexpr,
              TAIL_IN_LOOP: tl.constexpr, TAIL_N: tl.constexpr, SUM_MMA_ASKED: tl.constexpr,
              R_ROWS: tl.constexpr):
    """The query rows row0 .. row0 + BLOCK_M of one segment and head, against all its keys.
    SUM_MMA_ASKED: P's row sums on the tensor cores where the remainder has a spare column (72: R's V rows
    hold ones there, so PV's remainder dot sums P at no cost; faster on every benchmark case).
    Power-of-two head dims sum in registers: a separate dot with ones made ptxas serialise the wgmmas. So does 80,
    whose remainder has no spare column."""
    REM: tl.constexpr = D0 < HEAD_DIM
    SUM_MMA: tl.constexpr = SUM_MMA_ASKED and REM and HEAD_DIM - D0 < W1
    SUM_COL: tl.constexpr = HEAD_DIM - D0  # acc1's column holding the row sums
    rows_m = row0 + tl.arange(0, BLOCK_M)
    m_mask = rows_m < seqlen
    q_base = Q + tok0.to(tl.int64) * stride_qt + head * stride_qh
    q0 = load_tile(q_base, rows_m, tl.arange(0, D0), stride_qt, m_mask, True)
    q1 = q0
    if REM:
        q1 = _load_q_rem(q_base, rows_m, m_mask, stride_qt, HEAD_DIM, D0, W1)
    col = head * HEAD_DIM
    r_row = head * R_ROWS
    r_col0 = r_start(tok0, seg)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
    acc1 = tl.zeros([BLOCK_M, W1], tl.float32)
    # TAIL_IN_LOOP: every step masked, one code path (no separate peeled tail step)
    n_full = tl.cdiv(seqlen, BLOCK_N) * BLOCK_N if TAIL_IN_LOOP else (seqlen // BLOCK_N) * BLOCK_N
    for start_n in tl.range(0, n_full, BLOCK_N, warp_specialize=WS):
        acc0, acc1, l_i, m_i = _tma_step(acc0, acc1, l_i, m_i, q0, q1, kd, vd, rd, tok0 + start_n, col, r_row,
                                         r_col0 + start_n, start_n, seqlen, qk_scale, BLOCK_N, REM, HEAD_DIM - D0,
                                         TAIL_IN_LOOP, SUM_MMA)
    if n_full < seqlen:
        if TAIL_N > 0 and seqlen - n_full <= BLOCK_N // 2:
            k_rows = K + tok0.to(tl.int64) * stride_kt + col
            v_rows = V + tok0.to(tl.int64) * stride_vt + col
            r_cols = R + r_row * stride_r + r_col0
            for start_n in range(n_full, seqlen, TAIL_N):
                acc0, acc1, l_i, m_i = _narrow_step(acc0, acc1, l_i, m_i, q0, q1, k_rows, v_rows, r_cols,
                                                    stride_kt, stride_vt, stride_r, start_n, seqlen, qk_scale, D0,
                                                    W1, TAIL_N, REM, HEAD_DIM - D0, SUM_MMA)
        else:
            acc0, acc1, l_i, m_i = _tma_step(acc0, acc1, l_i, m_i, q0, q1, kd, vd, rd, tok0 + n_full, col,
                                             r_row, r_col0 + n_full, n_full, seqlen, qk_scale, BLOCK_N, REM,
                                             HEAD_DIM - D0, True, SUM_MMA)
    if SUM_MMA:
        l_i = tl.sum(tl.where((tl.arange(0, W1) == SUM_COL)[None, :], acc1, 0.0), 1)
    o_rows = O + tok0.to(tl.int64) * stride_ot + head * stride_oh + rows_m[:, None] * stride_ot
    store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM, D0, REM, D0, W1)

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
    """The columns of k and v `(T, H, D)` past the power-of-two chunk, transposed for the Hopper kernel:
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


def tma_layout_ok(q, k, v, out=None) -> bool:
    """Whether the Hopper kernels can take these tensors: k and v readable through tensor descriptors (heads
    side by side in each token row, as in the fused QKV layout), half-precision data, and every row and head
    of q, k, v and out starting on 16 bytes (the kernel's Q loads and O stores assume it)."""
    if TensorDescriptor is None or q.dtype not in (torch.float16, torch.bfloat16):
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
