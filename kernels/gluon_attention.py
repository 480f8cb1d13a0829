"""Hopper varlen attention in Gluon (Triton's explicit-layout dialect), power-of-two head dims.

Same contract as `kernels.varlen_attention`'s TMA kernel: q, k, v `(total_tokens, heads, head_dim)` views with
heads side by side in each token row (the fused QKV buffer), int32 `cu_seqlens`, one program per (query tile,
head, segment). What Gluon gives that `tl.dot` does not is the tensor cores' schedule:

- SCHED 2 (FlashAttention-3's intra-warpgroup overlap): each step issues QK^T of key tile j and PV of tile j - 1
  together, waits for QK^T only, runs tile j's softmax while PV still runs on the tensor cores, then waits for PV
  and rescales the accumulator. No wgmma stays in flight across the loop's back-edge;
- SCHED 1: QK^T of tile j + 1 is issued before tile j's softmax, PV is waited for at once;
- SCHED 0: every wgmma waited for at once (the control).

A wgmma still in flight across the back-edge whose accumulator the next iteration reads (the schedule of the
session 12 prototype, rev 66bd4ed) makes ptxas serialise every wgmma of the kernel ("wgmma.mma_async instructions
are serialized due to non wgmma instructions reading accumulator registers"): that prototype measured a serial
kernel. `benchmarks/inspect_sass.py --gluon` checks the ptxas report of each schedule.
K and V tiles arrive by TMA into NBUF-deep rings, one mbarrier per slot, refilled by the softmax warps as soon as
the wgmma that read a slot is waited for.
"""

from __future__ import annotations

import math

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # noqa: BLE001 - Triton without Gluon's Hopper API (older, or a changed experimental API)
    gluon = None

from .tuning import cdiv

if gluon is not None:

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale, n_valid, MASK: gl.constexpr, s_layout: gl.constexpr):
        """Online softmax of one score tile in base 2: P (fp32), the rescale factor of the running sums, the new
        row maxima (already scaled) and row sums. MASK: only the first n_valid columns are keys."""
        if MASK:
            cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
            s = gl.where((cols < n_valid)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _load_kv(desc, bufs, ready, tile, tok0, col, n, BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
        """Key tile `tile` of the segment into its ring slot, if the segment has it. The slot's last reader, a wgmma,
        has been waited for; with two warpgroups, by both (one thread of the CTA issues the copy)."""
        if gl.num_warps() > 4:
            gl.thread_barrier()
        slot = tile % NBUF
        nbytes: gl.constexpr = BLOCK_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8
        mbarrier.expect(ready.index(slot), nbytes, pred=tile < n)
        tma.async_copy_global_to_shared(desc, [tok0 + tile * BLOCK_N, col], ready.index(slot), bufs.index(slot),
                                        pred=tile < n)

    @gluon.jit
    def _qk(q_smem, k_bufs, k_ready, tile, s_zero, NBUF: gl.constexpr):
        slot = tile % NBUF
        mbarrier.wait(k_ready.index(slot), (tile // NBUF) & 1)
        return warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)

    @gluon.jit
    def _pv(p, acc, v_bufs, v_ready, tile, p_layout: gl.constexpr, NBUF: gl.constexpr):
        slot = tile % NBUF
        p_op = gl.convert_layout(p.to(v_bufs.dtype), p_layout)
        mbarrier.wait(v_ready.index(slot), (tile // NBUF) & 1)
        return warpgroup_mma(p_op, v_bufs.index(slot), acc, is_async=True)

    @gluon.jit
    def _step2(j, p, acc, m_i, l_i, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, s_zero, tok0, col, n,
               seqlen, qk_scale, MASK: gl.constexpr, BLOCK_N: gl.constexpr, NBUF: gl.constexpr,
               s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """SCHED 2, step j >= 1: QK^T of tile j and PV of tile j - 1 issued together; tile j's softmax while PV runs."""
        s_tok = _qk(q_smem, k_bufs, k_ready, j, s_zero, NBUF)
        acc_tok = _pv(p, acc, v_bufs, v_ready, j - 1, p_layout, NBUF)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
        _load_kv(k_desc, k_bufs, k_ready, j + NBUF, tok0, col, n, BLOCK_N, NBUF)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, seqlen - j * BLOCK_N, MASK, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
        _load_kv(v_desc, v_bufs, v_ready, j - 1 + NBUF, tok0, col, n, BLOCK_N, NBUF)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        return p, acc, m_i, l_i

    @gluon.jit
    def _step01(j, acc, m_i, l_i, s, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, s_zero, tok0, col,
                n, seqlen, qk_scale, MASK: gl.constexpr, SCHED: gl.constexpr, BLOCK_N: gl.constexpr,
                NBUF: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr, p_layout: gl.constexpr):
        """SCHED 0/1, step j: softmax of S_j (given), PV of tile j; SCHED 1 issues QK^T of tile j + 1 first and
        returns it waited for."""
        if SCHED == 1:
            s_tok = _qk(q_smem, k_bufs, k_ready, j + 1, s_zero, NBUF)
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, seqlen - j * BLOCK_N, MASK, s_layout)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        acc_tok = _pv(p, acc, v_bufs, v_ready, j, p_layout, NBUF)
        if SCHED == 1:
            acc, s = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, s_tok))
            _load_kv(k_desc, k_bufs, k_ready, j + 1 + NBUF, tok0, col, n, BLOCK_N, NBUF)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
            s = s_zero
            if j + 1 < n:
                s = warpgroup_mma_wait(num_outstanding=0,
                                       deps=(_qk(q_smem, k_bufs, k_ready, j + 1, s_zero, NBUF),))
                _load_kv(k_desc, k_bufs, k_ready, j + 1 + NBUF, tok0, col, n, BLOCK_N, NBUF)
        _load_kv(v_desc, v_bufs, v_ready, j + NBUF, tok0, col, n, BLOCK_N, NBUF)
        return acc, m_i, l_i, s

    @gluon.jit
    def _gl_varlen_attn_fwd(q_desc, k_desc, v_desc, O, CU_SEQLENS, stride_ot, stride_oh, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NBUF: gl.constexpr, SCHED: gl.constexpr, num_warps: gl.constexpr):
        start_m = gl.program_id(0)
        head = gl.program_id(1)
        seg = gl.program_id(2)
        tok0 = gl.load(CU_SEQLENS + seg)
        seqlen = gl.load(CU_SEQLENS + seg + 1) - tok0
        row0 = start_m * BLOCK_M
        if row0 < seqlen:
            col = head * HEAD_DIM
            n = (seqlen + BLOCK_N - 1) // BLOCK_N
            s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, BLOCK_N, 16])
            o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                               instr_shape=[16, HEAD_DIM, 16])
            p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
            dtype: gl.constexpr = q_desc.dtype

            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
            k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(NBUF):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
            fence_async_shared()

            mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(q_desc, [tok0 + row0, col], q_bar, q_smem)
            for i in gl.static_range(NBUF):
                _load_kv(k_desc, k_bufs, k_ready, i, tok0, col, n, BLOCK_N, NBUF)
                _load_kv(v_desc, v_bufs, v_ready, i, tok0, col, n, BLOCK_N, NBUF)

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout)
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

            mbarrier.wait(q_bar, 0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_qk(q_smem, k_bufs, k_ready, 0, s_zero, NBUF),))
            _load_kv(k_desc, k_bufs, k_ready, NBUF, tok0, col, n, BLOCK_N, NBUF)
            if SCHED == 2:
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, seqlen, n == 1, s_layout)
                for j in range(1, n - 1):
                    p, acc, m_i, l_i = _step2(j, p, acc, m_i, l_i, q_smem, k_desc, v_desc, k_bufs, v_bufs, k_ready,
                                              v_ready, s_zero, tok0, col, n, seqlen, qk_scale, False, BLOCK_N, NBUF,
                                              s_layout, o_layout, p_layout)
                if n > 1:
                    p, acc, m_i, l_i = _step2(n - 1, p, acc, m_i, l_i, q_smem, k_desc, v_desc, k_bufs, v_bufs,
                                              k_ready, v_ready, s_zero, tok0, col, n, seqlen, qk_scale, True, BLOCK_N,
                                              NBUF, s_layout, o_layout, p_layout)
                acc = warpgroup_mma_wait(num_outstanding=0,
                                         deps=(_pv(p, acc, v_bufs, v_ready, n - 1, p_layout, NBUF),))
            else:
                for j in range(0, n - 1):
                    acc, m_i, l_i, s = _step01(j, acc, m_i, l_i, s, q_smem, k_desc, v_desc, k_bufs, v_bufs,
                                               k_ready, v_ready, s_zero, tok0, col, n, seqlen, qk_scale, False, SCHED,
                                               BLOCK_N, NBUF, s_layout, o_layout, p_layout)
                acc, m_i, l_i, s = _step01(n - 1, acc, m_i, l_i, s, q_smem, k_desc, v_desc, k_bufs, v_bufs,
                                           k_ready, v_ready, s_zero, tok0, col, n, seqlen, qk_scale, True, 0, BLOCK_N,
                                           NBUF, s_layout, o_layout, p_layout)

            mbarrier.invalidate(q_bar)
            for i in gl.static_range(NBUF):
                mbarrier.invalidate(k_ready.index(i))
                mbarrier.invalidate(v_ready.index(i))

            out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
            o = gl.convert_layout(acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None], out_layout)
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
            ptrs = O + (tok0 + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
            gl.store(ptrs, o.to(O.dtype.element_ty), mask=(rows < seqlen)[:, None])


# (block_m, block_n, warps, ring depth, schedule)
GLUON_TILES = [(64, 128, 4, 2, 2), (128, 128, 8, 2, 2), (128, 64, 8, 3, 2), (64, 64, 4, 3, 2), (64, 128, 4, 2, 1),
               (64, 128, 4, 2, 0)]


def gluon_supported(q) -> bool:
    return (gluon is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in (64, 128) and torch.cuda.get_device_capability(q.device)[0] == 9)


def gluon_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, softmax_scale=None, out=None,
                           tile=(64, 128, 4, 2, 2)):
    """Varlen attention through the Gluon kernel; `tile` = (block_m, block_n, warps, ring depth, schedule[,
    register cap per thread])."""
    total, heads, head_dim = q.shape
    bm, bn, warps, nbuf, sched, *cap = tile
    options = {"maxnreg": cap[0]} if cap else {}
    dtype = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([bm, head_dim], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([bn, head_dim], dtype)
    width = heads * head_dim
    q_desc = TensorDescriptor(q, [total, width], [q.stride(0), 1], [bm, head_dim], q_layout)
    k_desc = TensorDescriptor(k, [total, width], [k.stride(0), 1], [bn, head_dim], kv_layout)
    v_desc = TensorDescriptor(v, [total, width], [v.stride(0), 1], [bn, head_dim], kv_layout)
    if out is None:
        out = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
    scale = (softmax_scale if softmax_scale is not None else head_dim**-0.5) * math.log2(math.e)
    grid = (cdiv(max_seqlen, bm), heads, cu_seqlens.numel() - 1)
    _gl_varlen_attn_fwd[grid](q_desc, k_desc, v_desc, out, cu_seqlens, out.stride(0), out.stride(1), scale,
                              HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, NBUF=nbuf, SCHED=sched, num_warps=warps,
                              **options)
    return out
