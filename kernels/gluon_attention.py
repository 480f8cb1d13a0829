"""Hopper varlen attention written in Gluon (Triton's explicit-layout dialect), head dims 64 and 128.

Same contract as `kernels.varlen_attention` (q, k, v `(total_tokens, heads, head_dim)` views with
heads side by side in each token row, e.g. the fused QKV buffer; int32 `cu_seqlens`; one program per
(query tile, head, segment)). What Gluon allows and `tl.dot` does not: the schedule of the tensor
cores is written out. Each step issues QK^T of the *next* K tile (asynchronous wgmma) before the
softmax of the current one, so the exponentials run while the tensor cores work; PV of a tile is
waited for only when the next step must rescale the accumulator. K and V tiles arrive by TMA into
NBUF-deep rings with one mbarrier each, so QK^T can start before the matching V tile lands.
Experimental: benchmarks/probe_gluon_attention.py measures it against the Triton kernel and cuDNN.
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
        if MASK:
            cols = gl.arange(0, s.shape[1], layout=gl.SliceLayout(0, s_layout))
            s = gl.where((cols < n_valid)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i


    @gluon.jit
    def _gl_varlen_attn_fwd(q_desc, k_desc, v_desc, O, CU_SEQLENS, stride_ot, stride_oh, qk_scale,
                            HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NBUF: gl.constexpr, num_warps: gl.constexpr):
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

            kv_bytes: gl.constexpr = BLOCK_N * HEAD_DIM * dtype.primitive_bitwidth // 8
            mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(q_desc, [tok0 + row0, col], q_bar, q_smem)
            for i in gl.static_range(NBUF):
                mbarrier.expect(k_ready.index(i), kv_bytes, pred=i < n)
                tma.async_copy_global_to_shared(k_desc, [tok0 + i * BLOCK_N, col], k_ready.index(i), k_bufs.index(i),
                                                pred=i < n)
                mbarrier.expect(v_ready.index(i), kv_bytes, pred=i < n)
                tma.async_copy_global_to_shared(v_desc, [tok0 + i * BLOCK_N, col], v_ready.index(i), v_bufs.index(i),
                                                pred=i < n)

            m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
            acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))
            s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

            mbarrier.wait(q_bar, 0)
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            # K tile NBUF goes where K tile 0 was
            mbarrier.expect(k_ready.index(0), kv_bytes, pred=NBUF < n)
            tma.async_copy_global_to_shared(k_desc, [tok0 + NBUF * BLOCK_N, col], k_ready.index(0), k_bufs.index(0),
                                            pred=NBUF < n)

            for j in range(0, n - 1):
                nxt = j + 1
                ks = nxt % NBUF
                mbarrier.wait(k_ready.index(ks), (nxt // NBUF) & 1)
                s_next = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, False, s_layout)
                # PV of tile j - 1 (issued before s_next) is done once at most one group is outstanding
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                prev = j - 1 + NBUF  # V tile for the stage tile j - 1 used
                vs_free = (j + NBUF - 1) % NBUF
                mbarrier.expect(v_ready.index(vs_free), kv_bytes, pred=(j >= 1) & (prev < n))
                tma.async_copy_global_to_shared(v_desc, [tok0 + prev * BLOCK_N, col], v_ready.index(vs_free),
                                                v_bufs.index(vs_free), pred=(j >= 1) & (prev < n))
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
                p_op = gl.convert_layout(p.to(dtype), p_layout)
                vs = j % NBUF
                mbarrier.wait(v_ready.index(vs), (j // NBUF) & 1)
                acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
                # S of tile j + 1 (issued before this PV) is done once at most one group is outstanding
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
                kn = nxt + NBUF
                mbarrier.expect(k_ready.index(ks), kv_bytes, pred=kn < n)
                tma.async_copy_global_to_shared(k_desc, [tok0 + kn * BLOCK_N, col], k_ready.index(ks), k_bufs.index(ks),
                                                pred=kn < n)

            last = n - 1
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, seqlen - last * BLOCK_N, True, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            vs = last % NBUF
            mbarrier.wait(v_ready.index(vs), (last // NBUF) & 1)
            acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

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


    @gluon.jit
    def _ws_producer(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok0, col, n,
                     BLOCK_N: gl.constexpr, NBUF: gl.constexpr):
        """One warp: K and V tiles into their rings, each as soon as the consumer released its slot."""
        kv_bytes: gl.constexpr = BLOCK_N * k_desc.block_type.shape[1] * k_desc.dtype.primitive_bitwidth // 8
        for t in range(n):
            st = t % NBUF
            ph = ((t // NBUF) & 1) ^ 1  # a fresh barrier's "previous phase" counts as complete
            mbarrier.wait(k_empty.index(st), ph)
            mbarrier.expect(k_ready.index(st), kv_bytes)
            tma.async_copy_global_to_shared(k_desc, [tok0 + t * BLOCK_N, col], k_ready.index(st), k_bufs.index(st))
            mbarrier.wait(v_empty.index(st), ph)
            mbarrier.expect(v_ready.index(st), kv_bytes)
            tma.async_copy_global_to_shared(v_desc, [tok0 + t * BLOCK_N, col], v_ready.index(st), v_bufs.index(st))

    @gluon.jit
    def _ws_consumer(q_desc, O, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, tok0, row0, col,
                     head, seqlen, n, stride_ot, stride_oh, qk_scale, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, NBUF: gl.constexpr, num_warps: gl.constexpr):
        """The softmax warpgroup(s): the same schedule as `_gl_varlen_attn_fwd`, releasing ring slots to the
        producer (K after its QK^T, V after its PV) instead of loading."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        dtype: gl.constexpr = q_desc.dtype
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=gl.SliceLayout(1, s_layout))
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=o_layout))
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        mbarrier.wait(q_bar, 0)
        mbarrier.wait(k_ready.index(0), 0)
        s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        mbarrier.arrive(k_empty.index(0), count=1)
        for j in range(0, n - 1):
            nxt = j + 1
            ks = nxt % NBUF
            mbarrier.wait(k_ready.index(ks), (nxt // NBUF) & 1)
            s_next = warpgroup_mma(q_smem, k_bufs.index(ks).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, 0, False, s_layout)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            mbarrier.arrive(v_empty.index((j + NBUF - 1) % NBUF), count=1, pred=j >= 1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            vs = j % NBUF
            mbarrier.wait(v_ready.index(vs), (j // NBUF) & 1)
            acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_next,))
            mbarrier.arrive(k_empty.index(ks), count=1)
        last = n - 1
        p, alpha, m_i, l_i = _softmax(s, m_i, l_i, qk_scale, seqlen - last * BLOCK_N, True, s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        vs = last % NBUF
        mbarrier.wait(v_ready.index(vs), (last // NBUF) & 1)
        acc = warpgroup_mma(p_op, v_bufs.index(vs), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        o = gl.convert_layout(acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))[:, None], out_layout)
        rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, out_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, out_layout))
        ptrs = O + (tok0 + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(ptrs, o.to(O.dtype.element_ty), mask=(rows < seqlen)[:, None])

    @gluon.jit
    def _gl_varlen_attn_fwd_ws(q_desc, k_desc, v_desc, O, CU_SEQLENS, stride_ot, stride_oh, qk_scale,
                               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                               NBUF: gl.constexpr, num_warps: gl.constexpr):
        """`_gl_varlen_attn_fwd` with a producer warp: loads run on their own warp (warp specialisation)."""
        start_m = gl.program_id(0)
        head = gl.program_id(1)
        seg = gl.program_id(2)
        tok0 = gl.load(CU_SEQLENS + seg)
        seqlen = gl.load(CU_SEQLENS + seg + 1) - tok0
        row0 = start_m * BLOCK_M
        if row0 < seqlen:
            col = head * HEAD_DIM
            n = (seqlen + BLOCK_N - 1) // BLOCK_N
            dtype: gl.constexpr = q_desc.dtype
            q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
            k_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], k_desc.layout)
            v_bufs = gl.allocate_shared_memory(dtype, [NBUF, BLOCK_N, HEAD_DIM], v_desc.layout)
            q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            k_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            v_ready = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            k_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            v_empty = gl.allocate_shared_memory(gl.int64, [NBUF, 1], mbarrier.MBarrierLayout())
            mbarrier.init(q_bar, count=1)
            for i in gl.static_range(NBUF):
                mbarrier.init(k_ready.index(i), count=1)
                mbarrier.init(v_ready.index(i), count=1)
                mbarrier.init(k_empty.index(i), count=1)
                mbarrier.init(v_empty.index(i), count=1)
            fence_async_shared()
            mbarrier.expect(q_bar, BLOCK_M * HEAD_DIM * dtype.primitive_bitwidth // 8)
            tma.async_copy_global_to_shared(q_desc, [tok0 + row0, col], q_bar, q_smem)
            gl.warp_specialize([
                (_ws_consumer, (q_desc, O, q_smem, k_bufs, v_bufs, q_bar, k_ready, v_ready, k_empty, v_empty, tok0,
                                row0, col, head, seqlen, n, stride_ot, stride_oh, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N,
                                NBUF, num_warps)),
                (_ws_producer, (k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, k_empty, v_empty, tok0, col, n,
                                BLOCK_N, NBUF)),
            ], [1], [24])


# (block_m, block_n, warps, stages of the K/V rings, producer warp)
GLUON_TILES = [(128, 64, 8, 3, False), (64, 128, 4, 2, False), (64, 64, 4, 3, False), (128, 128, 8, 2, True),
               (128, 64, 8, 3, True), (64, 128, 4, 2, True), (64, 128, 4, 3, True), (64, 64, 4, 4, True)]


def gluon_supported(q) -> bool:
    return (gluon is not None and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] in (64, 128) and torch.cuda.get_device_capability(q.device)[0] == 9)


def gluon_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, softmax_scale=None, out=None,
                           tile=(64, 128, 4, 2, False)):
    """Varlen attention through the Gluon kernel; `tile` = (block_m, block_n, warps, ring depth, producer
    warp)."""
    total, heads, head_dim = q.shape
    bm, bn, warps, nbuf, ws = tile
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
    kernel = _gl_varlen_attn_fwd_ws if ws else _gl_varlen_attn_fwd
    kernel[grid](q_desc, k_desc, v_desc, out, cu_seqlens, out.stride(0), out.stride(1), scale,
                 HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, NBUF=nbuf, num_warps=warps)
    return out
