"""Hopper varlen attention in Gluon (Triton's explicit-layout dialect).

The contract of `kernels.varlen_attention`, narrowed to the tower's layout: q, k, v `(total_tokens,
heads, head_dim)` views that are the three parts of one buffer's rows, each token's heads side by side (the fused
QKV buffer; `qkv_columns`), read through descriptors over q's rows; int32 `cu_seqlens`, one program per (query
tile, head, segment); tiles past a segment's end exit at once. Q, K and V arrive by TMA (K and V in NBUF-deep
rings, one mbarrier per slot, each slot refilled as soon as the wgmma that read it is done); each key tile is one
QK^T wgmma, an online softmax in base 2, and one PV wgmma with P from registers. Only a segment's last key tile
is masked, and only where the segment ends inside it.

Head dims past a power of two (72, 80): each dot is a 64-wide wgmma plus a 16-wide one over the columns past
D0 = 64. Q's remainder is a [BLOCK_M, 16] box whose columns past the head are zeroed once in shared memory; K's and
V's come two ways, picked per size class by the tuner:
- in place: [BLOCK_N, 16] boxes from column D0 of the head. At 72 they run into the next head's first columns (or
  TMA's zero fill), which Q's zeros cancel in QK^T and which land in accumulator columns never stored in PV;
- copied (REM_T): R, K's and V's remainder transposed (`remainder.kv_remainder_t`), [16, BLOCK_N] boxes of
  one column per token. At 72 R has a row of ones after V's rows, so PV's remainder wgmma also sums P's rows and the
  softmax sums none. That pays from 1x4096 up; on packs of short segments the copy does not.

Each wgmma is waited for at once: where several programs share an SM, the warp schedulers overlap one program's
softmax with another's tensor-core work, and a program that keeps a second score tile in flight needs ~205
registers instead of ~130, so fewer programs fit. FlashAttention-3's intra-warpgroup overlap, two key streams per
program and split-K over two programs were each measured slower here (docs/PERFORMANCE.md, "What did not work").

Against the `tl.dot` kernel, the gain is in registers and staging: ~130 registers per thread instead of 154, Q by
TMA, and 128-row tiles on two warpgroups capped at 128 registers, two CTAs per SM.
"""


import functools

import torch

try:
    from triton.language.core import _aggregate as aggregate
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # noqa: BLE001 - Triton without Gluon's Hopper API (older, or a changed experimental API)
    gluon = None

from ..runtime import cdiv, launch, sm_count
from ..runtime.triton_internals import unvalidated

if gluon is not None:
    # renamed in later Triton releases
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @aggregate
    class Config:
        """A kernel's compile-time shape: key tile rows, ring depth, the remainder's width W1 and its columns past the
        head's power of two R_V, whether K's and V's remainder come from R (REM_T), whether PV sums P's rows
        (SUM_MMA); and the compute warps' register layouts: the score tile S, the accumulator O (D0 columns) and its
        remainder (16 columns), and P as PV's A operand."""

        BLOCK_N: gl.constexpr
        NBUF: gl.constexpr
        W1: gl.constexpr
        R_V: gl.constexpr
        REM_T: gl.constexpr
        SUM_MMA: gl.constexpr
        s: gl.constexpr
        o: gl.constexpr
        o1: gl.constexpr
        p: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, BLOCK_N, D0, NBUF, W1, R_V, REM_T, SUM_MMA, num_warps):
            self.BLOCK_N = gl.constexpr(BLOCK_N)
            self.NBUF = gl.constexpr(NBUF)
            self.W1 = gl.constexpr(W1)
            self.R_V = gl.constexpr(R_V)
            self.REM_T = gl.constexpr(REM_T)
            self.SUM_MMA = gl.constexpr(SUM_MMA)
            self.s = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, BLOCK_N, 16]))
            self.o = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                            instr_shape=[16, D0, 16]))
            self.o1 = gl.constexpr(gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, 16, 16]))
            self.p = gl.constexpr(gl.DotOperandLayout(operand_index=0, parent=self.o.value, k_width=2))

    @aggregate
    class Operands:
        """A program's operands in shared memory: Q and its remainder, the K and V rings and their remainders' (R's
        boxes, or the columns past D0), and each ring's barriers that a slot's load has landed."""

        q: gl.shared_memory_descriptor
        q1: gl.shared_memory_descriptor
        k: gl.shared_memory_descriptor
        v: gl.shared_memory_descriptor
        rk: gl.shared_memory_descriptor
        rv: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q, q1, k, v, rk, rv, k_ready, v_ready):
            self.q = q
            self.q1 = q1
            self.k = k
            self.v = v
            self.rk = rk
            self.rv = rv
            self.k_ready = k_ready
            self.v_ready = v_ready

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, n_valid, MASK: gl.constexpr, cfg):
        """Online softmax of one score tile in base 2: P (fp32), the rescale factor of the running sums, the new
        row maxima (already scaled) and row sums (unchanged with SUM_MMA: PV sums P's rows). MASK: only the first
        n_valid columns are keys."""
        if MASK:
            cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, cfg.s))
            s = gl.where((cols < n_valid)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        if not cfg.SUM_MMA:
            l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _load_tile(desc, bufs, r_desc, r_bufs, bar, slot, tok, col, r_row, r_col, pred, BLOCK_N: gl.constexpr,
                   W1: gl.constexpr, REM_T: gl.constexpr):
        """BLOCK_N rows of K (or V) from token `tok` into ring slot `slot`, counted on `bar`, and with a remainder
        (W1 > 0) their W1 columns past D0 on the same barrier: W1 rows of R from (r_row, r_col) (REM_T), or the next
        W1 columns of the same rows. Nothing where `pred` is false."""
        nbytes: gl.constexpr = BLOCK_N * (desc.block_type.shape[1] + W1) * desc.dtype.primitive_bitwidth // 8
        mbarrier.expect(bar, nbytes, pred=pred)
        _tma_load(desc, [tok, col], bar, bufs.index(slot), pred=pred)
        if W1 > 0:
            if REM_T:
                _tma_load(r_desc, [r_row, r_col], bar, r_bufs.index(slot), pred=pred)
            else:
                _tma_load(r_desc, [tok, col + desc.block_type.shape[1]], bar, r_bufs.index(slot), pred=pred)

    @gluon.jit
    def _load_kv(desc, bufs, r_desc, r_bufs, ready, tile, tok0, col, r_row, r_col, n, cfg):
        """Key tile `tile` of the segment into its ring slot, if the segment has it (`_load_tile`). The caller has
        waited for the slot's last reader, a wgmma; with two warpgroups, both have (`_both_done`: one thread issues
        the copy)."""
        slot = tile % cfg.NBUF
        _load_tile(desc, bufs, r_desc, r_bufs, ready.index(slot), slot, tok0 + tile * cfg.BLOCK_N, col, r_row,
                   r_col + tile * cfg.BLOCK_N, tile < n, cfg.BLOCK_N, cfg.W1, cfg.REM_T)

    @gluon.jit
    def _both_done():
        """With two warpgroups, a CTA barrier: both have waited for the wgmmas that read the slots about to be
        refilled. One per key tile, after the next QK^T (one before each refill is slower): each barrier holds the two
        warpgroups in step, where one's softmax could otherwise overlap the other's tensor-core work."""
        if gl.num_warps() > 4:
            _cta_barrier()

    @gluon.jit
    def _qk(ops, tile, s_zero, cfg):
        """S = Q K^T for key tile `tile`, once its K tile has landed; with a remainder, + Q's remainder columns
        times K's (R's K box [W1, BLOCK_N] is the B operand as it is)."""
        slot = tile % cfg.NBUF
        mbarrier.wait(ops.k_ready.index(slot), (tile // cfg.NBUF) & 1)
        s = warpgroup_mma(ops.q, ops.k.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if cfg.W1 > 0:
            if cfg.REM_T:
                s = warpgroup_mma(ops.q1, ops.rk.index(slot), s, is_async=True)
            else:
                s = warpgroup_mma(ops.q1, ops.rk.index(slot).permute((1, 0)), s, is_async=True)
        return warpgroup_mma_wait(num_outstanding=0, deps=(s,))

    @gluon.jit
    def _softmax_pv(s, acc, acc1, m_i, l_i, ops, tile, n_valid, qk_scale, MASK: gl.constexpr, cfg):
        """The softmax of score tile S (`_softmax`), the accumulators rescaled, and O += P V for key tile `tile`
        once its V tile has landed (V's remainder too: R's box transposed is a K-major B operand), waited for."""
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, n_valid, MASK, cfg)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o))[:, None]
        slot = tile % cfg.NBUF
        p_op = gl.convert_layout(p.to(ops.v.dtype), cfg.p)
        mbarrier.wait(ops.v_ready.index(slot), (tile // cfg.NBUF) & 1)
        acc = warpgroup_mma(p_op, ops.v.index(slot), acc, is_async=True)
        if cfg.W1 > 0:
            acc1 = acc1 * gl.convert_layout(alpha, gl.SliceLayout(1, cfg.o1))[:, None]
            if cfg.REM_T:
                acc1 = warpgroup_mma(p_op, ops.rv.index(slot).permute((1, 0)), acc1, is_async=True)
            else:
                acc1 = warpgroup_mma(p_op, ops.rv.index(slot), acc1, is_async=True)
            acc, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc1))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        return acc, acc1, m_i, l_i

    @gluon.jit
    def _step(j, s, acc, acc1, m_i, l_i, ops, kv_desc, kv1_desc, s_zero, tok0, k_col, v_col, r_row, r_col, n, seqlen,
              qk_scale, MASK: gl.constexpr, NEXT: gl.constexpr, cfg):
        """Key tile j: the softmax of S_j, the accumulators rescaled, O += P_j V_j, then (NEXT) S_{j+1}; only then
        are the slots read by both wgmmas refilled with the tiles NBUF ahead (refilling V's slot before issuing QK^T
        puts the copy's issue in front of the tensor cores, which is slower)."""
        acc, acc1, m_i, l_i = _softmax_pv(s, acc, acc1, m_i, l_i, ops, j, seqlen - j * cfg.BLOCK_N, qk_scale, MASK,
                                          cfg)
        if NEXT:
            s = _qk(ops, j + 1, s_zero, cfg)
        _both_done()
        _load_kv(kv_desc, ops.v, kv1_desc, ops.rv, ops.v_ready, j + cfg.NBUF, tok0, v_col, r_row + cfg.R_V, r_col, n,
                 cfg)
        if NEXT:
            _load_kv(kv_desc, ops.k, kv1_desc, ops.rk, ops.k_ready, j + 1 + cfg.NBUF, tok0, k_col, r_row, r_col, n,
                     cfg)
        return s, acc, acc1, m_i, l_i

    @gluon.jit
    def _store_rows(O, vals, row0, tok0, seqlen, stride_ot, col, WIDTH: gl.constexpr, num_warps: gl.constexpr):
        """The first WIDTH columns of `vals` into O's rows row0.. of the segment, from column `col` of the head's
        row (8 columns, 16 bytes, per thread and store)."""
        cols_w: gl.constexpr = vals.shape[1] // 8
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // cols_w, cols_w], [num_warps, 1], [1, 0])
        o = gl.convert_layout(vals, layout)
        rows = row0 + gl.arange(0, vals.shape[0], layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, vals.shape[1], layout=gl.SliceLayout(0, layout))
        ptrs = O + (tok0 + rows).to(gl.int64)[:, None] * stride_ot + col + cols[None, :]
        mask = (rows < seqlen)[:, None]
        if WIDTH < vals.shape[1]:
            mask = mask & (cols < WIDTH)[None, :]
        gl.store(ptrs, o.to(O.dtype.element_ty), mask=mask)

    @gluon.jit
    def _zero_past(q1_smem, R_V: gl.constexpr, num_warps: gl.constexpr):
        """Q's remainder box in shared memory with its columns from R_V on zeroed (they run past the head: into the
        next head, or TMA's zero fill), fenced for the wgmmas and seen by every warp."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [16, 2], [num_warps, 1], [1, 0])
        q1 = q1_smem.load(layout)
        cols = gl.arange(0, q1_smem.type.shape[1], layout=gl.SliceLayout(0, layout))
        q1_smem.store(gl.where((cols < R_V)[None, :], q1, gl.zeros_like(q1)))
        fence_async_shared()
        _cta_barrier()

    @gluon.jit
    def _store_o(o_row, acc, acc1, l_i, row0, tok0, seqlen, stride_ot, R_V: gl.constexpr, W1: gl.constexpr,
                 SUM_MMA: gl.constexpr, num_warps: gl.constexpr):
        """O = acc / l into the rows row0.. of the segment (`o_row`: O at the head's first column), the remainder's
        R_V columns from acc1. One reciprocal per row and a multiply per element, not a division per element (32 of
        them per thread at 64/64 on 4 warps, a tenth of all the instructions of a 256-token segment's program). With
        SUM_MMA the row sums are acc1's column R_V (PV summed P's rows against R's row of ones)."""
        o_slice: gl.constexpr = gl.SliceLayout(1, acc.type.layout)
        o1_slice: gl.constexpr = gl.SliceLayout(1, acc1.type.layout)
        if SUM_MMA:
            sum_col = gl.arange(0, acc1.shape[1], layout=gl.SliceLayout(0, acc1.type.layout))
            inv_o1 = 1.0 / gl.sum(gl.where((sum_col == R_V)[None, :], acc1, 0.0), axis=1)
            inv_o = gl.convert_layout(inv_o1, o_slice)
        else:
            inv_l = 1.0 / l_i
            inv_o = gl.convert_layout(inv_l, o_slice)
            inv_o1 = gl.convert_layout(inv_l, o1_slice)
        _store_rows(o_row, acc * inv_o[:, None], row0, tok0, seqlen, stride_ot, 0, acc.shape[1], num_warps)
        if W1 > 0:
            _store_rows(o_row, acc1 * inv_o1[:, None], row0, tok0, seqlen, stride_ot, acc.shape[1], R_V, num_warps)

    @gluon.jit
    def _gl_varlen_attn_fwd(q_desc, kv_desc, q1_desc, kv1_desc, O, CU_SEQLENS, stride_ot, stride_oh, k_col, v_col,
                            qk_scale, max_seqlen, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, NBUF: gl.constexpr, W1: gl.constexpr, REM_T: gl.constexpr,
                            R_ROWS: gl.constexpr, SUM_ASKED: gl.constexpr, UNIFORM: gl.constexpr,
                            num_warps: gl.constexpr):
        """The query rows start_m * BLOCK_M .. + BLOCK_M of one segment and head, against all its keys. The
        descriptors read q's rows (q, k and v parts of one buffer's rows: `qkv_columns`), K's and V's heads from
        columns k_col and v_col: `q_desc` and `kv_desc` [BLOCK_M | BLOCK_N, D0] boxes; past D0 (W1 > 0) `q1_desc`
        Q's remainder ([BLOCK_M, W1] boxes) and `kv1_desc` K's and V's, either R (REM_T; R_ROWS rows per head,
        [W1, BLOCK_N] boxes) or the same rows ([BLOCK_N, W1] boxes from column D0 of the head). Where a K/V box
        has Q's shape (BLOCK_M == BLOCK_N, and not R's) the launcher passes None and Q's descriptor serves: one
        descriptor fewer to encode per launch. SUM_ASKED: P's row sums from R's row of ones, where it has one.
        UNIFORM: every segment is max_seqlen tokens long (the launcher found total tokens = segments * max_seqlen),
        so a program finds its rows without reading cu_seqlens: the TMA loads are issued at once, not after a
        dependent global load (slow on a cold L2, as after another kernel's traffic, at the start of each
        program)."""
        if BLOCK_M == BLOCK_N:
            kv_desc = q_desc
            if W1 > 0 and not REM_T:
                kv1_desc = q1_desc
        start_m = gl.program_id(0)
        head = gl.program_id(1)
        seg = gl.program_id(2)
        if UNIFORM:
            tok0 = seg * max_seqlen
            seqlen = max_seqlen
        else:
            tok0 = gl.load(CU_SEQLENS + seg)
            seqlen = gl.load(CU_SEQLENS + seg + 1) - tok0
        row0 = start_m * BLOCK_M
        if row0 < seqlen:
            D0: gl.constexpr = q_desc.block_type.shape[1]
            R_V: gl.constexpr = HEAD_DIM - D0  # R's rows per head: K's R_V remainder columns, then V's
            SUM_MMA: gl.constexpr = SUM_ASKED and REM_T and 0 < R_V and R_V < W1  # R's row of ones: acc1's column R_V
            col = head * HEAD_DIM
            k_col = k_col + col
            v_col = v_col + col
            # O's head stride is a multiple of 8 (the launcher checks); written so, the compiler sees it at 72 too
            stride_oh = stride_oh // 8 * 8
            r_row = head * R_ROWS
            r_col = 8 * ((tok0 + 7) // 8 + seg)  # common.r_start: the segment's first column in R
            n = (seqlen + BLOCK_N - 1) // BLOCK_N
            cfg = Config(BLOCK_N, D0, NBUF, W1, R_V, REM_T, SUM_MMA, num_warps)
            dtype: gl.constexpr = q_desc.dtype

            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D0], q_desc.layout)
            k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, D0], kv_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, D0], kv_desc.layout)
            if W1 > 0:
                q1_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, W1], q1_desc.layout)
                rk_bufs = gl.allocate_shared_memory(dtype, [NBUF] + kv1_desc.block_type.shape, kv1_desc.layout)
                rv_bufs = gl.allocate_shared_memory(dtype, [NBUF] + kv1_desc.block_type.shape, kv1_desc.layout)
            else:  # placeholders, never read
                q1_smem = q_smem
                rk_bufs = k_bufs
                rv_bufs = v_bufs
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(NBUF):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
            fence_async_shared()
            ops = Operands(q_smem, q1_smem, k_bufs, v_bufs, rk_bufs, rv_bufs, k_ready, v_ready)

            mbarrier.expect(q_bar, BLOCK_M * (D0 + W1) * dtype.primitive_bitwidth // 8)
            _tma_load(q_desc, [tok0 + row0, col], q_bar, q_smem)
            if W1 > 0:
                _tma_load(q1_desc, [tok0 + row0, col + D0], q_bar, q1_smem)
            for i in gl.static_range(NBUF):
                _load_kv(kv_desc, k_bufs, kv1_desc, rk_bufs, k_ready, i, tok0, k_col, r_row, r_col, n, cfg)
                _load_kv(kv_desc, v_bufs, kv1_desc, rv_bufs, v_ready, i, tok0, v_col, r_row + R_V, r_col, n, cfg)

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, cfg.s))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, cfg.s))
            acc = gl.zeros([BLOCK_M, D0], gl.float32, layout=cfg.o)
            acc1 = gl.zeros([BLOCK_M, 16], gl.float32, layout=cfg.o1)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=cfg.s)

            mbarrier.wait(q_bar, 0)
            if R_V < W1:  # Q's remainder box runs past the head (into the next head, or TMA's zero fill): zeroed
                _zero_past(q1_smem, R_V, num_warps)
            s = _qk(ops, 0, s_zero, cfg)
            _both_done()
            _load_kv(kv_desc, k_bufs, kv1_desc, rk_bufs, k_ready, NBUF, tok0, k_col, r_row, r_col, n, cfg)
            for j in range(0, n - 1):
                s, acc, acc1, m_i, l_i = _step(j, s, acc, acc1, m_i, l_i, ops, kv_desc, kv1_desc, s_zero, tok0, k_col,
                                               v_col, r_row, r_col, n, seqlen, qk_scale, False, True, cfg)
            # the last key tile: masked only where the segment ends inside it
            if seqlen % BLOCK_N == 0:
                s, acc, acc1, m_i, l_i = _step(n - 1, s, acc, acc1, m_i, l_i, ops, kv_desc, kv1_desc, s_zero, tok0,
                                               k_col, v_col, r_row, r_col, n, seqlen, qk_scale, False, False, cfg)
            else:
                s, acc, acc1, m_i, l_i = _step(n - 1, s, acc, acc1, m_i, l_i, ops, kv_desc, kv1_desc, s_zero, tok0,
                                               k_col, v_col, r_row, r_col, n, seqlen, qk_scale, True, False, cfg)

            mbarrier.invalidate(q_bar)
            for i in gl.static_range(NBUF):
                mbarrier.invalidate(k_ready.index(i))
                mbarrier.invalidate(v_ready.index(i))

            _store_o(O + head * stride_oh, acc, acc1, l_i, row0, tok0, seqlen, stride_ot, R_V, W1, SUM_MMA,
                     num_warps)

    # ---- persistent, warp-specialised variant: a one-warp loader partition feeds the compute warps ----

    @aggregate
    class Barriers:
        """The persistent kernel's mbarriers: per Q buffer (two per compute partition) and per K and V ring slot, one
        that a TMA load has landed (`*_ready`) and one that its readers are done with it (`*_empty`)."""

        q_ready: gl.shared_memory_descriptor
        q_empty: gl.shared_memory_descriptor
        k_ready: gl.shared_memory_descriptor
        k_empty: gl.shared_memory_descriptor
        v_ready: gl.shared_memory_descriptor
        v_empty: gl.shared_memory_descriptor

        @gluon.constexpr_function
        def __init__(self, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty):
            self.q_ready = q_ready
            self.q_empty = q_empty
            self.k_ready = k_ready
            self.k_empty = k_empty
            self.v_ready = v_ready
            self.v_empty = v_empty

    @gluon.jit
    def _ws_item(i, n_qt, heads, CU_SEQLENS, max_seqlen, BLOCK_M: gl.constexpr, UNIFORM: gl.constexpr):
        """Work item i (query tile fastest, then head, then segment: the plain kernel's grid order): its first
        query row, head, segment, first token and length."""
        rest = i // n_qt
        head = rest % heads
        seg = rest // heads
        if UNIFORM:
            tok0 = seg * max_seqlen
            seqlen = max_seqlen
        else:
            tok0 = gl.load(CU_SEQLENS + seg)
            seqlen = gl.load(CU_SEQLENS + seg + 1) - tok0
        return (i % n_qt) * BLOCK_M, head, seg, tok0, seqlen

    @gluon.jit
    def _ws_loader(q_desc, kv_desc, q1_desc, kv1_desc, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs, bars,
                   CU_SEQLENS, k_col0, v_col0, max_seqlen, heads, n_items, HEAD_DIM: gl.constexpr,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr, W1: gl.constexpr,
                   REM_T: gl.constexpr, R_ROWS: gl.constexpr, UNIFORM: gl.constexpr, HALVES: gl.constexpr):
        """The loader partition: for each of the program's work items, Q into the free one of two Q buffers, then
        K and V tile by tile into their rings, each slot as soon as the compute warps have released it. It runs
        ahead of them across items: the next item's Q and first key tiles are in flight while the current item's
        last tiles are computed."""
        D0: gl.constexpr = q_desc.block_type.shape[1]
        R_V: gl.constexpr = HEAD_DIM - D0
        BLOCK_MH: gl.constexpr = BLOCK_M // HALVES  # each compute partition's rows
        q_bytes: gl.constexpr = BLOCK_MH * (D0 + W1) * q_desc.dtype.primitive_bitwidth // 8
        n_qt = (max_seqlen + BLOCK_M - 1) // BLOCK_M
        it = 0
        kt = 0
        for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
            row0, head, seg, tok0, seqlen = _ws_item(i, n_qt, heads, CU_SEQLENS, max_seqlen, BLOCK_M, UNIFORM)
            if row0 < seqlen:
                col = head * HEAD_DIM
                for h in gl.static_range(HALVES):
                    qs = it % 2 * HALVES + h
                    mbarrier.wait(bars.q_empty.index(qs), ((it // 2) & 1) ^ 1)
                    mbarrier.expect(bars.q_ready.index(qs), q_bytes)
                    _tma_load(q_desc, [tok0 + row0 + h * BLOCK_MH, col], bars.q_ready.index(qs), q_bufs.index(qs))
                    if W1 > 0:
                        _tma_load(q1_desc, [tok0 + row0 + h * BLOCK_MH, col + D0], bars.q_ready.index(qs),
                                  q1_bufs.index(qs))
                r_row = head * R_ROWS
                r_col = 8 * ((tok0 + 7) // 8 + seg)  # common.r_start
                n = (seqlen + BLOCK_N - 1) // BLOCK_N
                for j in range(n):
                    slot = kt % NBUF
                    phase = ((kt // NBUF) & 1) ^ 1
                    tok = tok0 + j * BLOCK_N
                    mbarrier.wait(bars.k_empty.index(slot), phase)
                    _load_tile(kv_desc, k_bufs, kv1_desc, rk_bufs, bars.k_ready.index(slot), slot, tok, k_col0 + col,
                               r_row, r_col + j * BLOCK_N, True, BLOCK_N, W1, REM_T)
                    mbarrier.wait(bars.v_empty.index(slot), phase)
                    _load_tile(kv_desc, v_bufs, kv1_desc, rv_bufs, bars.v_ready.index(slot), slot, tok, v_col0 + col,
                               r_row + R_V, r_col + j * BLOCK_N, True, BLOCK_N, W1, REM_T)
                    kt += 1
                it += 1

    @gluon.jit
    def _ws_step(kt, s_zero, acc, acc1, m_i, l_i, ops, bars, n_valid, qk_scale, MASK: gl.constexpr, cfg):
        """Ring tile kt: S = Q K^T, K's slot released, the softmax, O += P V, V's slot released."""
        slot = kt % cfg.NBUF
        s = _qk(ops, kt, s_zero, cfg)
        mbarrier.arrive(bars.k_empty.index(slot), count=1)
        acc, acc1, m_i, l_i = _softmax_pv(s, acc, acc1, m_i, l_i, ops, kt, n_valid, qk_scale, MASK, cfg)
        mbarrier.arrive(bars.v_empty.index(slot), count=1)
        return acc, acc1, m_i, l_i

    @gluon.jit
    def _ws_compute(O, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs, bars, CU_SEQLENS, stride_ot, stride_oh,
                    qk_scale, max_seqlen, heads, n_items, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NBUF: gl.constexpr, W1: gl.constexpr, REM_T: gl.constexpr,
                    SUM_ASKED: gl.constexpr, UNIFORM: gl.constexpr, HALF: gl.constexpr, HALVES: gl.constexpr,
                    num_warps: gl.constexpr):
        """A compute partition: the plain kernel's key-tile loop and epilogue for each of the program's items, its
        operands from the loader's buffers. With HALVES = 2, two such partitions of one warpgroup each take the
        item's first and second half of its rows (HALF), on their own Q buffers, and each releases the shared K/V
        slots for itself (their barriers count both): neither waits for the other, as an 8-warp partition's
        warpgroups would at every release."""
        D0: gl.constexpr = q_bufs.type.shape[2]
        R_V: gl.constexpr = HEAD_DIM - D0
        SUM_MMA: gl.constexpr = SUM_ASKED and REM_T and 0 < R_V and R_V < W1
        cfg = Config(BLOCK_N, D0, NBUF, W1, R_V, REM_T, SUM_MMA, num_warps)
        stride_oh = stride_oh // 8 * 8
        BLOCK_MH: gl.constexpr = q_bufs.type.shape[1]
        n_qt = (max_seqlen + BLOCK_M - 1) // BLOCK_M
        it = 0
        kt = 0
        for i in range(gl.program_id(0), n_items, gl.num_programs(0)):
            row0, head, seg, tok0, seqlen = _ws_item(i, n_qt, heads, CU_SEQLENS, max_seqlen, BLOCK_M, UNIFORM)
            if row0 < seqlen:  # both halves run every key tile (the ring's slots count both), stores past it masked
                row0 = row0 + HALF * BLOCK_MH
                qs = it % 2 * HALVES + HALF
                q_smem = q_bufs.index(qs)
                q1_smem = q1_bufs.index(qs)
                ops = Operands(q_smem, q1_smem, k_bufs, v_bufs, rk_bufs, rv_bufs, bars.k_ready, bars.v_ready)
                m_i = gl.full([BLOCK_MH], float("-inf"), gl.float32, layout=gl.SliceLayout(1, cfg.s))
                l_i = gl.zeros([BLOCK_MH], gl.float32, layout=gl.SliceLayout(1, cfg.s))
                acc = gl.zeros([BLOCK_MH, D0], gl.float32, layout=cfg.o)
                acc1 = gl.zeros([BLOCK_MH, 16], gl.float32, layout=cfg.o1)
                s_zero = gl.zeros([BLOCK_MH, BLOCK_N], gl.float32, layout=cfg.s)
                mbarrier.wait(bars.q_ready.index(qs), (it // 2) & 1)
                if R_V < W1:  # Q's remainder box runs past the head: zeroed, as in the plain kernel
                    _zero_past(q1_smem, R_V, num_warps)
                n = (seqlen + BLOCK_N - 1) // BLOCK_N
                for j in range(0, n - 1):
                    acc, acc1, m_i, l_i = _ws_step(kt, s_zero, acc, acc1, m_i, l_i, ops, bars, BLOCK_N, qk_scale, False,
                                                   cfg)
                    kt += 1
                # the last key tile, masked (a no-op where the segment fills it). One masked copy only: with an
                # unmasked copy beside it, selected at run time, Triton 3.6 built the masked copy's wgmma operand
                # addresses wrong (compute-sanitizer: shared reads out of bounds, segments not a multiple of BLOCK_N)
                acc, acc1, m_i, l_i = _ws_step(kt, s_zero, acc, acc1, m_i, l_i, ops, bars, seqlen - (n - 1) * BLOCK_N,
                                               qk_scale, True, cfg)
                kt += 1
                mbarrier.arrive(bars.q_empty.index(qs), count=1)
                _store_o(O + head * stride_oh, acc, acc1, l_i, row0, tok0, seqlen, stride_ot, R_V, W1, SUM_MMA,
                         num_warps)
                it += 1

    @gluon.jit
    def _gl_varlen_attn_ws(q_desc, kv_desc, q1_desc, kv1_desc, O, CU_SEQLENS, stride_ot, stride_oh, k_col, v_col,
                           qk_scale, max_seqlen, heads, n_items, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                           BLOCK_N: gl.constexpr, NBUF: gl.constexpr, W1: gl.constexpr, REM_T: gl.constexpr,
                           R_ROWS: gl.constexpr, SUM_ASKED: gl.constexpr, UNIFORM: gl.constexpr,
                           HALVES: gl.constexpr, LOADER_REGS: gl.constexpr, HALF_REGS: gl.constexpr,
                           num_warps: gl.constexpr):
        """`_gl_varlen_attn_fwd`'s work as persistent programs: program p takes work items p, p + grid, ... (one
        item per (query tile, head, segment), in the plain kernel's grid order), a one-warp loader partition
        (`_ws_loader`) streams each item's Q, K and V through shared memory, and the `num_warps` compute warps
        (`_ws_compute`) run the plain kernel's step on them; with HALVES = 2, in two partitions of `num_warps` (4)
        each, one per half of the item's BLOCK_M rows (q's descriptor boxes are BLOCK_M / HALVES rows). Q is
        double-buffered, so the next item's Q and first key tiles arrive during the current item's last steps and
        epilogue."""
        if BLOCK_M // HALVES == BLOCK_N:
            kv_desc = q_desc
            if W1 > 0 and not REM_T:
                kv1_desc = q1_desc
        D0: gl.constexpr = q_desc.block_type.shape[1]
        dtype: gl.constexpr = q_desc.dtype
        BLOCK_MH: gl.constexpr = BLOCK_M // HALVES
        q_bufs = gl.allocate_shared_memory(dtype, [2 * HALVES, BLOCK_MH, D0], q_desc.layout)
        k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, D0], kv_desc.layout)
        v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, D0], kv_desc.layout)
        if W1 > 0:
            q1_bufs = gl.allocate_shared_memory(dtype, [2 * HALVES, BLOCK_MH, W1], q1_desc.layout)
            rk_bufs = gl.allocate_shared_memory(dtype, [NBUF] + kv1_desc.block_type.shape, kv1_desc.layout)
            rv_bufs = gl.allocate_shared_memory(dtype, [NBUF] + kv1_desc.block_type.shape, kv1_desc.layout)
        else:  # placeholders, never read
            q1_bufs = q_bufs
            rk_bufs = k_bufs
            rv_bufs = v_bufs
        q_ready = gl.allocate_shared_memory(gl.int64, [2 * HALVES, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2 * HALVES, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * HALVES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=1)
        for i in gl.static_range(NBUF):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=HALVES)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(v_empty.index(i), count=HALVES)
        fence_async_shared()
        bars = Barriers(q_ready, q_empty, k_ready, k_empty, v_ready, v_empty)
        # (the argument tuples written out in each call: a tuple built first would not keep the constexprs)
        if HALVES == 2:
            gl.warp_specialize([
                (_ws_compute, (O, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs, bars, CU_SEQLENS, stride_ot,
                               stride_oh, qk_scale, max_seqlen, heads, n_items, HEAD_DIM, BLOCK_M, BLOCK_N, NBUF, W1,
                               REM_T, SUM_ASKED, UNIFORM, 0, 2, num_warps)),
                (_ws_compute, (O, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs, bars, CU_SEQLENS, stride_ot,
                               stride_oh, qk_scale, max_seqlen, heads, n_items, HEAD_DIM, BLOCK_M, BLOCK_N, NBUF, W1,
                               REM_T, SUM_ASKED, UNIFORM, 1, 2, num_warps)),
                (_ws_loader, (q_desc, kv_desc, q1_desc, kv1_desc, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs,
                              bars, CU_SEQLENS, k_col, v_col, max_seqlen, heads, n_items, HEAD_DIM, BLOCK_M, BLOCK_N,
                              NBUF, W1, REM_T, R_ROWS, UNIFORM, 2)),
            ], [num_warps, 1], [HALF_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_ws_compute, (O, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs, bars, CU_SEQLENS, stride_ot,
                               stride_oh, qk_scale, max_seqlen, heads, n_items, HEAD_DIM, BLOCK_M, BLOCK_N, NBUF, W1,
                               REM_T, SUM_ASKED, UNIFORM, 0, 1, num_warps)),
                (_ws_loader, (q_desc, kv_desc, q1_desc, kv1_desc, q_bufs, q1_bufs, k_bufs, v_bufs, rk_bufs, rv_bufs,
                              bars, CU_SEQLENS, k_col, v_col, max_seqlen, heads, n_items, HEAD_DIM, BLOCK_M, BLOCK_N,
                              NBUF, W1, REM_T, R_ROWS, UNIFORM, 1)),
            ], [1], [LOADER_REGS])

# The remainder's width past D0 (72: 8 columns; 80: 16) in the remainder's boxes: a wgmma's K step at 16 bits.
REM_WIDTH = 16


def gluon_available() -> bool:
    """Whether this Triton has the Gluon Hopper API the kernel is written in."""
    return gluon is not None


@functools.lru_cache(maxsize=None)
def _smem_layout(rows: int, cols: int, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


@functools.lru_cache(maxsize=None)
def _template(rows: int, cols: int, dtype: torch.dtype) -> dict:
    """The fields of a descriptor with this box, built once through the validating constructor."""
    probe = torch.empty((rows, cols), dtype=dtype)
    return dict(vars(TensorDescriptor(probe, [rows, cols], [cols, 1], [rows, cols], _smem_layout(rows, cols, dtype))))


def _descriptor(t: torch.Tensor, shape: list[int], stride: int, rows: int, cols: int):
    """A host descriptor over `t`'s rows (`shape`, row stride `stride`), [rows, cols] boxes. Its constructor's checks
    (alignment, shape, dtype) cost host time per descriptor, up to four per launch at 72; the launcher has
    checked the same (16-byte aligned base and rows: `remainder.hopper_layout_ok`), so the fields of a
    validated descriptor with the same box are reused and only the tensor, shape and strides set."""
    return unvalidated(TensorDescriptor, {**_template(rows, cols, t.dtype), "base": t, "shape": shape,
                                          "strides": [stride, 1]})


def qkv_columns(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int] | None:
    """Where q, k and v `(T, H, D)` are the three parts of one buffer's rows, as the tower's fused QKV projection
    emits them (one row stride, each token's heads side by side, k's and v's heads after q's in the row): the
    columns of q's rows where k's and v's heads start. None otherwise; the Gluon kernel takes only this layout."""
    row, head_stride, col_stride = q.stride()
    width = q.shape[1] * q.shape[2]
    if k.stride() != q.stride() or v.stride() != q.stride() or head_stride != q.shape[2] or col_stride != 1:
        return None
    q_ptr, size = q.data_ptr(), q.element_size()
    k_col, v_col = (k.data_ptr() - q_ptr) // size, (v.data_ptr() - q_ptr) // size
    if min(k_col, v_col) < width or max(k_col, v_col) + width > row or abs(k_col - v_col) < width:
        return None
    return k_col, v_col


def launch_gluon(q, out, cu_seqlens, max_seqlen: int, qk_scale: float, columns: tuple[int, int], block_m: int,
                 block_n: int, num_warps: int, nbuf: int, maxnreg: int = 0, rem: torch.Tensor | None = None,
                 rem_rows: int = 0, sum_mma: bool = True, ws: int = 0, padded: bool = False):
    """One launch over the packed segments. q `(T, H, D)` and, at `columns` of its rows, k's and v's heads
    (`qkv_columns`: the caller has found q, k and v parts of one buffer's rows) with 16-byte aligned rows, at most
    REM_WIDTH head-dim columns past a power of two (`launch.triton_varlen_attention` checks both);
    `qk_scale` includes log2(e). Past a power-of-two head dim, the remainder columns of K and V come from `rem` =
    `kv_remainder_t(k, v, ...)` (`rem_rows` rows per head; `sum_mma`: P's row sums from its row of ones, where it
    has one) or, without it, from K and V in place. `padded`: q has rows past the last segment, so the segments are
    never taken to fill it.

    One descriptor per box shape serves q, k and v, read from their column offsets: at 72 two to four descriptors
    instead of six, at 64 one or two instead of three. Each costs host time at every launch (built, specialised and
    encoded), which sets the time of a small call."""
    total, heads, head_dim = q.shape
    d0 = 1 << (head_dim.bit_length() - 1)
    k_col, v_col = columns
    w1 = REM_WIDTH if d0 < head_dim else 0
    row = q.stride(0)
    shape = [total, max(k_col, v_col) + heads * head_dim]  # q's rows, from q's first element to the last head
    q_rows = block_m // ws_halves(num_warps, ws)
    same = q_rows == block_n  # one box shape for Q and K/V: Q's descriptor serves (the kernel aliases it)
    q_desc = _descriptor(q, shape, row, q_rows, d0)
    kv_desc = None if same else _descriptor(q, shape, row, block_n, d0)
    q1_desc = kv1_desc = None
    if w1:
        q1_desc = _descriptor(q, shape, row, q_rows, w1)
        if rem is not None:
            kv1_desc = _descriptor(rem, list(rem.shape), rem.stride(0), w1, block_n)
        elif not same:
            kv1_desc = _descriptor(q, shape, row, block_n, w1)
    o_stride = out.stride()
    options = {"maxnreg": maxnreg} if maxnreg else {}
    segments = cu_seqlens.numel() - 1
    # every segment max_seqlen long (segments of at most max_seqlen tokens, summing to segments * max_seqlen): the
    # image packs of one resolution, a video's frames
    uniform = not padded and total == segments * max_seqlen
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, NBUF=nbuf, W1=w1, REM_T=rem is not None,
                     R_ROWS=rem_rows, SUM_ASKED=sum_mma, UNIFORM=uniform, num_warps=num_warps)
    if ws:  # persistent programs, `ws` per SM, each with a one-warp loader partition
        items = cdiv(max_seqlen, block_m) * heads * segments
        launch(_gl_varlen_attn_ws, (min(items, sm_count(q.device) * ws),), q_desc, kv_desc, q1_desc, kv1_desc, out,
               cu_seqlens, o_stride[0], o_stride[1], k_col, v_col, qk_scale, max_seqlen, heads, items,
               **{**constants, **ws_options(num_warps, ws, maxnreg)})
        return
    launch(_gl_varlen_attn_fwd, (cdiv(max_seqlen, block_m), heads, segments), q_desc, kv_desc, q1_desc, kv1_desc, out,
           cu_seqlens, o_stride[0], o_stride[1], k_col, v_col, qk_scale, max_seqlen, **constants, **options)


# Registers per thread of the persistent kernel's loader warp (scalar work: item decoding, ring counters, TMA issue).
WS_LOADER_REGS = 40


def ws_halves(num_warps: int, ws: int) -> int:
    """Compute partitions per program: the persistent kernel's 8-warp tiles run as two 4-warp partitions, each on
    half the rows (q's boxes half as tall); everything else as one."""
    return 2 if ws and num_warps == 8 else 1


def ws_options(num_warps: int, ws: int, maxnreg: int = 0) -> dict:
    """The persistent kernel's launch options and register constants for a tile of `num_warps` compute warps, `ws`
    programs per SM. Registers are allocated per warpgroup (the loader's warp takes a whole one), so the cap is
    what `ws` programs of num_warps + 4 warps leave each thread; with two compute partitions, the three warpgroups
    share it, the loader's at WS_LOADER_REGS."""
    maxnreg = maxnreg or min(256, 65536 // (32 * (num_warps + 4) * ws) // 8 * 8)
    halves = ws_halves(num_warps, ws)
    return dict(num_warps=num_warps // halves, maxnreg=maxnreg, HALVES=halves, LOADER_REGS=WS_LOADER_REGS,
                HALF_REGS=(maxnreg * 3 - WS_LOADER_REGS) // 2 // 8 * 8 if halves == 2 else 0)


