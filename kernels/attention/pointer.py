"""The portable varlen attention kernel: Q, K and V by pointers, `tl.dot`.

One program per (query tile, head, segment); online softmax in base 2 with fp32 state; each K/V tile is loaded
once per query tile; full tiles run unmasked, only a segment's last tile is masked. Head dims past a power of two
split into a power-of-two chunk D0 and a remainder read as the *last* columns of each row (for 72: QK^T over
[0, 64) + [56, 72), PV over [0, 64) + [8, 72)); the overlap is zeroed in Q's registers and not stored from the
output, so no load needs a column mask (`tiles.head_dim_split` says why PV's remainder is 64 wide).
It runs on every sm80+ GPU and under Triton's interpreter; on Hopper, for the fused QKV layout at head dims 64, 72
and 80, `gluon.py` is faster.
"""

import triton
import triton.language as tl

from .common import load_tile, segment_program, softmax_update, store_out


@triton.jit
def _attn_step(acc0, acc1, l_i, m_i, q0, q1, K_BASE, V_BASE, start_n, seqlen, stride_kt, stride_vt, qk_scale,
               HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr, D1: tl.constexpr,
               DV1: tl.constexpr, BLOCK_N: tl.constexpr, MASK_N: tl.constexpr):
    rows = start_n + tl.arange(0, BLOCK_N)
    n_mask = rows < seqlen
    cols0 = tl.arange(0, D0)
    k0 = load_tile(K_BASE, rows, cols0, stride_kt, n_mask, MASK_N)
    qk = tl.dot(q0, tl.trans(k0))
    if REM:
        cols1 = (HEAD_DIM - D1) + tl.arange(0, D1)
        k1 = load_tile(K_BASE, rows, cols1, stride_kt, n_mask, MASK_N)
        qk = tl.dot(q1, tl.trans(k1), qk)  # q1 is zero where cols1 overlaps chunk 0
    if MASK_N:
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
    acc0, acc1, l_i, m_ij, p = softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i)
    v0 = load_tile(V_BASE, rows, cols0, stride_vt, n_mask, MASK_N)
    acc0 = tl.dot(p.to(v0.dtype), v0, acc0)
    if REM:
        v1 = load_tile(V_BASE, rows, (HEAD_DIM - DV1) + tl.arange(0, DV1), stride_vt, n_mask, MASK_N)
        acc1 = tl.dot(p.to(v1.dtype), v1, acc1)
    return acc0, acc1, l_i, m_ij

@triton.jit
def _load_q(q_base, rows_m, m_mask, stride_qt, HEAD_DIM: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
            REM: tl.constexpr):
    """The program's query tile as chunk 0 (columns [0, D0)) and, for other head dims, the last D1
    columns with the overlap with chunk 0 zeroed, so QK^T counts each column once."""
    q0 = load_tile(q_base, rows_m, tl.arange(0, D0), stride_qt, m_mask, True)
    q1 = q0
    if REM:
        cols1 = (HEAD_DIM - D1) + tl.arange(0, D1)
        q1 = load_tile(q_base, rows_m, cols1, stride_qt, m_mask, True)
        q1 = tl.where((cols1 >= D0)[None, :], q1, 0.0).to(q0.dtype)
    return q0, q1

@triton.jit
def _varlen_attn_fwd(
    Q, K, V, O, CU_SEQLENS,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    qk_scale,
    HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr, D1: tl.constexpr, DV1: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    start_m, head, seg, tok0, seqlen = segment_program(CU_SEQLENS)
    if start_m * BLOCK_M >= seqlen:
        return
    rows_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows_m < seqlen
    q_base = Q + tok0.to(tl.int64) * stride_qt + head * stride_qh
    k_base = K + tok0.to(tl.int64) * stride_kt + head * stride_kh
    v_base = V + tok0.to(tl.int64) * stride_vt + head * stride_vh
    # The remainder chunks are the last D1 (for QK^T) and DV1 (for PV) columns; where they overlap chunk 0
    # they are zeroed in Q and not stored from the output accumulator.
    q0, q1 = _load_q(q_base, rows_m, m_mask, stride_qt, HEAD_DIM, D0, D1, REM)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
    acc1 = tl.zeros([BLOCK_M, DV1], tl.float32)
    n_full = (seqlen // BLOCK_N) * BLOCK_N
    for start_n in range(0, n_full, BLOCK_N):
        acc0, acc1, l_i, m_i = _attn_step(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, start_n, seqlen,
                                          stride_kt, stride_vt, qk_scale, HEAD_DIM, D0, REM, D1, DV1, BLOCK_N, False)
    if n_full < seqlen:
        acc0, acc1, l_i, m_i = _attn_step(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, n_full, seqlen,
                                          stride_kt, stride_vt, qk_scale, HEAD_DIM, D0, REM, D1, DV1, BLOCK_N, True)

    o_rows = O + tok0.to(tl.int64) * stride_ot + head * stride_oh + rows_m[:, None] * stride_ot
    store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM, D0, REM, HEAD_DIM - DV1, DV1)
