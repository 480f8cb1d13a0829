"""`@triton.jit` helpers of the pointer kernel (`pointer.py`) and the remainder copy (`remainder.py`): the program
prologue, tile loads, the online-softmax step, the normalised store, and the alignment hints given the compiler."""

import triton
import triton.language as tl


@triton.jit
def segment_program(CU_SEQLENS):
    """The prologue of the varlen kernels, whose grid is (query tiles, heads, segments): this program's query tile,
    head and segment, the segment's first token and its length. The caller exits where the tile starts past the
    segment's end (a launch covers any mix of lengths: tiles past a short segment's end do nothing)."""
    start_m = tl.program_id(0)
    head = tl.program_id(1)
    seg = tl.program_id(2)
    tok0 = tl.load(CU_SEQLENS + seg)
    seqlen = tl.load(CU_SEQLENS + seg + 1) - tok0
    return start_m, head, seg, tok0, seqlen


@triton.jit
def load_tile(BASE, rows, cols, stride_t, row_mask, MASK_ROWS: tl.constexpr):
    """A [rows, cols] tile of one head. Only rows are ever masked, so column loads stay vectorised."""
    ptrs = BASE + rows[:, None] * stride_t + cols[None, :]
    if MASK_ROWS:
        return tl.load(ptrs, mask=row_mask[:, None], other=0.0)
    return tl.load(ptrs)

@triton.jit
def softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i):
    """Online-softmax step on raw scores: the running max is kept in scaled base-2 units, so each
    score costs one FMA before the exp2. Returns the rescaled accumulators and P (float32)."""
    m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc0 * alpha[:, None], acc1 * alpha[:, None], l_i, m_ij, p

@triton.jit
def store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr,
               REM_COL: tl.constexpr, W1: tl.constexpr):
    """Normalise and store: chunk 0 (columns [0, D0)), then the remainder accumulator's columns
    [REM_COL, REM_COL + W1) that are neither in chunk 0 nor past the head (the pointer kernel's
    remainder is the last W1 columns)."""
    inv_l = 1.0 / l_i
    tl.store(o_rows + tl.arange(0, D0)[None, :], (acc0 * inv_l[:, None]).to(o_rows.dtype.element_ty),
             mask=m_mask[:, None])
    if REM:
        cols1 = REM_COL + tl.arange(0, W1)
        tl.store(o_rows + cols1[None, :], (acc1 * inv_l[:, None]).to(o_rows.dtype.element_ty),
                 mask=m_mask[:, None] & ((cols1 >= D0) & (cols1 < HEAD_DIM))[None, :])

@triton.jit
def multiple_of_8(x):
    """x, for an x the caller knows to be a multiple of 8 elements (16 bytes at 16 bits), written so that the
    compiler sees it too: the JIT marks integer arguments divisible by 16 only, and an unmarked stride makes
    every access through it a 2-byte one."""
    return x // 8 * 8

@triton.jit
def r_start(tok0, seg):
    """R's column of a segment's first token (`remainder.kv_remainder_t`): 16-byte aligned (a TMA box's start in the
    contiguous dim must be; an unaligned one is an illegal instruction), and past the previous segment's
    columns: round_up(tok0, 8) + 8 * seg, written so that the compiler sees a multiple of 8."""
    return 8 * ((tok0 + 7) // 8 + seg)
