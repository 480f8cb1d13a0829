"""Packed variable-length ("block-diagonal") attention forward, with optional fused 2D vision RoPE.

Contract (flash-attention's varlen one): q, k, v are `(total_tokens, heads, head_dim)` views with any
token and head strides and a contiguous last dim — e.g. the three slices of a fused QKV projection,
no copies. `cu_seqlens` int32 `(segments + 1,)` on the device, `max_seqlen` a Python int: the longest
segment's length (a larger one only launches programs that exit at once; a smaller one leaves rows past it
unwritten, and where total tokens = segments * max_seqlen the Gluon kernel takes every segment to be max_seqlen
long without reading cu_seqlens). Every token attends to every token of its own segment (non-causal), never across
segments.

Kernel design:
- one program per (query tile, head, segment); tiles past a segment's end exit at once, so a launch
  covers any mix of lengths without host syncs or per-segment launches;
- online softmax in base 2 with fp32 state; each K/V tile is loaded once per query tile and shared by
  all its rows; full tiles run unmasked, only a segment's last tile is masked;
- the head dim is split into a power-of-two chunk D0 and a remainder. The pointer kernel reads the
  remainder as the *last* columns (for 72: QK^T over [0, 64) + [56, 72), PV over [0, 64) + [8, 72));
  the overlap is zeroed in Q's registers and not stored from the output, so no load needs a column
  mask (see head_dim_split for why its PV remainder is 64 wide);
- with `cos`/`sin`, Q (once per program) and, unless the caller rotated K already (`rotate_k=False`),
  each K tile are rotated as they are loaded: the rotate-half partner columns are a second (cached)
  load, the float32 cos/sin table is indexed by global token;
- on Hopper a second kernel reads K and V through TMA tensor descriptors over the packed token rows
  (K/V in the fused QKV layout, K not rotated in the kernel), so tiles land in shared memory already
  swizzled for wgmma; the remainder of K and V (72: columns [64, 72)) is first copied out transposed
  (`kv_remainder_t`, one small launch) and read in boxes of 16 rows, so 72 costs 64 + 16 lanes in both
  dots. With `cos`/`sin` at power-of-two head dims it rotates Q into the program's own output rows first
  and reads it back from there, so that Q is staged in shared memory like an unrotated one (see
  `_tma_tile`). The pointer kernel serves every other case;
- at head dims 64, 72 and 80 without RoPE in the kernel, the Hopper path also offers the Gluon kernel
  (kernels/gluon_attention.py: Q by TMA too, fewer registers, 128-row tiles on two warpgroups; past 64 the
  remainder read in place or from the transposed copy), and the tuner picks between both kernels' tiles per
  size class.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .gluon_attention import GLUON_TILES, gluon_available, launch_gluon, qkv_columns
from .gluon_attention import REM_WIDTH as GLUON_REM_WIDTH
from .rope import apply_vision_rope
from .tuning import (  # noqa: F401 - tuned_choices is re-exported
    cdiv, choose, interpreting, is_hopper, launch, next_power_of_2, record, tuned_choices)

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised on machines without Triton
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host tensor descriptors
    TensorDescriptor = None


def _check_inputs(q, k, v, cu_seqlens, max_seqlen, cos, sin):
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q, k, v must share one (total_tokens, heads, head_dim) shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype != torch.int32 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be int32 of shape (segments + 1,); got {cu_seqlens.dtype} "
                         f"{tuple(cu_seqlens.shape)}")
    if not isinstance(max_seqlen, int) or max_seqlen < 1:
        raise ValueError(f"max_seqlen must be a positive Python int; got {max_seqlen!r}")
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither")
    if cos is not None:
        half = q.shape[-1] // 2
        for name, t in (("cos", cos), ("sin", sin)):
            if t.shape != (q.shape[0], half) or t.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 ({q.shape[0]}, {half}); got {t.dtype} {tuple(t.shape)}")


# ----------------------------------------------------------------------------------------------------
# Reference and PyTorch fallback
# ----------------------------------------------------------------------------------------------------


def reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, cos=None, sin=None,
                               softmax_scale=None, upcast=True):
    """Per-segment softmax(QKᵀ)V in plain matmuls: float32 when `upcast`, else in the inputs' dtype."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    if cos is not None:
        q, k = apply_vision_rope(q, cos, sin), apply_vision_rope(k, cos, sin)
    dtype = torch.float32 if upcast else q.dtype
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    bounds = cu_seqlens.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[s:e].transpose(0, 1).to(dtype) for t in (q, k, v))  # [H, L, D]
        scores = torch.matmul(qs, ks.transpose(1, 2)) * scale
        probs = torch.softmax(scores.float(), dim=-1).to(dtype)
        out[s:e] = torch.matmul(probs, vs).transpose(0, 1)
    return out


def segment_runs(seqlens) -> list[tuple[int, int, int]]:
    """(first token, segments, length) of each maximal run of consecutive equal-length segments."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for n in seqlens:
        if runs and runs[-1][2] == n:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, n)
        else:
            runs.append((offset, 1, n))
        offset += n
    return runs


def sdpa_gathers(seqlens) -> bool:
    """Whether the fallback gathers segments by length (index copies, host-built indices: not capturable
    in a CUDA graph) rather than viewing runs of equal lengths in place: only when runs far outnumber
    the distinct lengths, i.e. equal lengths are scattered through the pack."""
    return _scattered(segment_runs(seqlens), seqlens)


def _scattered(runs, seqlens) -> bool:
    return len(runs) > max(8, 2 * len(set(seqlens)))


# SDPA's backends in our order of preference on CUDA. PyTorch's default order puts flash first; cuDNN is
# 1.3-1.5x faster on H100 at the tower's shapes (benchmarks/results/attention.json, batched-cudnn vs
# batched-flash), and each backend declines inputs it cannot take, so the next one runs instead.
_CUDA_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


def _sdpa(q, k, v, scale):
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    with sdpa_kernel(_CUDA_SDPA_ORDER, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)


def sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, cos=None, sin=None, softmax_scale=None,
                          seqlens=None, rotate_k=True):
    """The fallback: one batched SDPA call per run of equal-length segments, not one per segment.

    A run of consecutive segments of one length is a `(B, H, L, D)` view of q, k and v as they are
    (e.g. strided slices of a fused QKV buffer): no copies in, and SDPA's output (token-major on
    CUDA) is returned as is when one run covers the pack. Image packs have few runs (a video's frames,
    same-sized images side by side); when equal lengths are scattered (`sdpa_gathers`), segments are
    gathered by length instead. SDPA runs its best backend: cuDNN first on CUDA, the fused CPU kernel
    otherwise. `seqlens` (host ints) avoids reading `cu_seqlens` back.
    """
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, cos, sin)
    if cos is not None:
        q = apply_vision_rope(q, cos, sin)
        k = apply_vision_rope(k, cos, sin) if rotate_k else k
    if seqlens is None:
        bounds = cu_seqlens.tolist()
        seqlens = [e - s for s, e in zip(bounds[:-1], bounds[1:])]
    total, heads, dim = q.shape
    runs = segment_runs(seqlens)
    if _scattered(runs, seqlens):
        return _sdpa_gathered(q, k, v, seqlens, softmax_scale)
    out = None if len(runs) == 1 else torch.empty((total, heads, dim), dtype=q.dtype, device=q.device)
    for start, count, length in runs:
        end = start + count * length
        qb, kb, vb = (t[start:end].unflatten(0, (count, length)).transpose(1, 2) for t in (q, k, v))
        ob = _sdpa(qb, kb, vb, softmax_scale).transpose(1, 2).reshape(end - start, heads, dim)
        if out is None:
            return ob
        out[start:end] = ob
    return out


def _sdpa_gathered(q, k, v, seqlens, softmax_scale):
    total, heads, dim = q.shape
    out = torch.empty((total, heads, dim), dtype=q.dtype, device=q.device)
    starts: dict[int, list[int]] = {}
    offset = 0
    for n in seqlens:
        starts.setdefault(n, []).append(offset)
        offset += n
    for length, group in starts.items():
        idx = (torch.tensor(group, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
        qb, kb, vb = (t.index_select(0, idx).view(len(group), length, heads, dim).transpose(1, 2)
                      for t in (q, k, v))
        ob = _sdpa(qb, kb, vb, softmax_scale)  # [B, H, L, D]
        out.index_copy_(0, idx, ob.transpose(1, 2).reshape(-1, heads, dim))
    return out


# ----------------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _load_tile(BASE, rows, cols, stride_t, row_mask, COS, SIN, stride_c, tok0,
                   HEAD_DIM: tl.constexpr, MASK_ROWS: tl.constexpr, ROPE: tl.constexpr):
        """A [rows, cols] tile of one head (all cols < HEAD_DIM); with ROPE, rotated in float32 and
        rounded to the input dtype. Only rows are ever masked, so column loads stay vectorised."""
        ptrs = BASE + rows[:, None] * stride_t + cols[None, :]
        if MASK_ROWS:
            x = tl.load(ptrs, mask=row_mask[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
        if ROPE:
            HALF: tl.constexpr = HEAD_DIM // 2
            lower = cols < HALF
            partner = tl.where(lower, cols + HALF, cols - HALF)
            cs = (tok0 + rows)[:, None] * stride_c + tl.where(lower, cols, cols - HALF)[None, :]
            p_ptrs = BASE + rows[:, None] * stride_t + partner[None, :]
            if MASK_ROWS:
                xp = tl.load(p_ptrs, mask=row_mask[:, None], other=0.0)
                c = tl.load(COS + cs, mask=row_mask[:, None], other=0.0)
                s = tl.load(SIN + cs, mask=row_mask[:, None], other=0.0)
            else:
                xp = tl.load(p_ptrs)
                c = tl.load(COS + cs)
                s = tl.load(SIN + cs)
            xp = tl.where(lower[None, :], -xp.to(tl.float32), xp.to(tl.float32))
            x = (x.to(tl.float32) * c + xp * s).to(x.dtype)
        return x

    @triton.jit
    def _attn_step(acc0, acc1, l_i, m_i, q0, q1, K_BASE, V_BASE, COS, SIN, start_n, seqlen, tok0,
                   stride_kt, stride_vt, stride_c, qk_scale,
                   HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr, D1: tl.constexpr,
                   DV1: tl.constexpr, BLOCK_N: tl.constexpr,
                   MASK_N: tl.constexpr, ROPE_K: tl.constexpr):
        rows = start_n + tl.arange(0, BLOCK_N)
        n_mask = rows < seqlen
        cols0 = tl.arange(0, D0)
        k0 = _load_tile(K_BASE, rows, cols0, stride_kt, n_mask, COS, SIN, stride_c, tok0, HEAD_DIM, MASK_N, ROPE_K)
        qk = tl.dot(q0, tl.trans(k0))
        if REM:
            cols1 = (HEAD_DIM - D1) + tl.arange(0, D1)
            k1 = _load_tile(K_BASE, rows, cols1, stride_kt, n_mask, COS, SIN, stride_c, tok0, HEAD_DIM, MASK_N, ROPE_K)
            qk = tl.dot(q1, tl.trans(k1), qk)  # q1 is zero where cols1 overlaps chunk 0
        if MASK_N:
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
        acc0, acc1, l_i, m_ij, p = _softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i)
        v0 = _load_tile(V_BASE, rows, cols0, stride_vt, n_mask, COS, SIN, stride_c, tok0, HEAD_DIM, MASK_N, False)
        acc0 = tl.dot(p.to(v0.dtype), v0, acc0)
        if REM:
            v1 = _load_tile(V_BASE, rows, (HEAD_DIM - DV1) + tl.arange(0, DV1), stride_vt, n_mask, COS, SIN,
                            stride_c, tok0, HEAD_DIM, MASK_N, False)
            acc1 = tl.dot(p.to(v1.dtype), v1, acc1)
        return acc0, acc1, l_i, m_ij

    @triton.jit
    def _softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i, SUM_MMA: tl.constexpr = False):
        """Online-softmax step on raw scores: the running max is kept in scaled base-2 units, so each
        score costs one FMA before the exp2. Returns the rescaled accumulators and P (float32).
        SUM_MMA: the caller sums P's rows on the tensor cores (a row of ones in V's transposed remainder,
        into acc1), so l_i is left alone: no add per score, no cross-thread reduction."""
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
        alpha = tl.math.exp2(m_i - m_ij)
        if not SUM_MMA:
            l_i = l_i * alpha + tl.sum(p, 1)
        return acc0 * alpha[:, None], acc1 * alpha[:, None], l_i, m_ij, p

    @triton.jit
    def _load_q(q_base, rows_m, m_mask, COS, SIN, stride_qt, stride_c, tok0, HEAD_DIM: tl.constexpr,
                D0: tl.constexpr, D1: tl.constexpr, REM: tl.constexpr, ROPE_Q: tl.constexpr):
        """The program's query tile as chunk 0 (columns [0, D0)) and, for other head dims, the last D1
        columns with the overlap with chunk 0 zeroed, so QK^T counts each column once."""
        q0 = _load_tile(q_base, rows_m, tl.arange(0, D0), stride_qt, m_mask, COS, SIN, stride_c, tok0, HEAD_DIM,
                        True, ROPE_Q)
        q1 = q0
        if REM:
            cols1 = (HEAD_DIM - D1) + tl.arange(0, D1)
            q1 = _load_tile(q_base, rows_m, cols1, stride_qt, m_mask, COS, SIN, stride_c, tok0, HEAD_DIM, True, ROPE_Q)
            q1 = tl.where((cols1 >= D0)[None, :], q1, 0.0).to(q0.dtype)
        return q0, q1

    @triton.jit
    def _store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr,
                   REM_COL: tl.constexpr, W1: tl.constexpr):
        """Normalise and store: chunk 0 (columns [0, D0)), then the remainder accumulator's columns
        [REM_COL, REM_COL + W1) that are neither in chunk 0 nor past the head (the pointer kernel's
        remainder is the last W1 columns, the TMA kernel's starts at D0)."""
        inv_l = 1.0 / l_i
        tl.store(o_rows + tl.arange(0, D0)[None, :], (acc0 * inv_l[:, None]).to(o_rows.dtype.element_ty),
                 mask=m_mask[:, None])
        if REM:
            cols1 = REM_COL + tl.arange(0, W1)
            tl.store(o_rows + cols1[None, :], (acc1 * inv_l[:, None]).to(o_rows.dtype.element_ty),
                     mask=m_mask[:, None] & ((cols1 >= D0) & (cols1 < HEAD_DIM))[None, :])

    @triton.jit
    def _varlen_attn_fwd(
        Q, K, V, O, CU_SEQLENS, COS, SIN,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_c,
        qk_scale,
        HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM: tl.constexpr, D1: tl.constexpr, DV1: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE_Q: tl.constexpr, ROPE_K: tl.constexpr,
    ):
        start_m = tl.program_id(0)
        head = tl.program_id(1)
        seg = tl.program_id(2)
        tok0 = tl.load(CU_SEQLENS + seg)
        seqlen = tl.load(CU_SEQLENS + seg + 1) - tok0
        if start_m * BLOCK_M >= seqlen:
            return
        rows_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rows_m < seqlen
        q_base = Q + tok0.to(tl.int64) * stride_qt + head * stride_qh
        k_base = K + tok0.to(tl.int64) * stride_kt + head * stride_kh
        v_base = V + tok0.to(tl.int64) * stride_vt + head * stride_vh
        # The remainder chunks are the last D1 (for QK^T) and DV1 (for PV) columns; where they overlap chunk 0
        # they are zeroed in Q and not stored from the output accumulator.
        q0, q1 = _load_q(q_base, rows_m, m_mask, COS, SIN, stride_qt, stride_c, tok0, HEAD_DIM, D0, D1, REM, ROPE_Q)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc0 = tl.zeros([BLOCK_M, D0], tl.float32)
        acc1 = tl.zeros([BLOCK_M, DV1], tl.float32)
        n_full = (seqlen // BLOCK_N) * BLOCK_N
        for start_n in range(0, n_full, BLOCK_N):
            acc0, acc1, l_i, m_i = _attn_step(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, COS, SIN,
                                              start_n, seqlen, tok0, stride_kt, stride_vt, stride_c,
                                              qk_scale, HEAD_DIM, D0, REM, D1, DV1, BLOCK_N, False, ROPE_K)
        if n_full < seqlen:
            acc0, acc1, l_i, m_i = _attn_step(acc0, acc1, l_i, m_i, q0, q1, k_base, v_base, COS, SIN,
                                              n_full, seqlen, tok0, stride_kt, stride_vt, stride_c,
                                              qk_scale, HEAD_DIM, D0, REM, D1, DV1, BLOCK_N, True, ROPE_K)

        o_rows = O + tok0.to(tl.int64) * stride_ot + head * stride_oh + rows_m[:, None] * stride_ot
        _store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM, D0, REM, HEAD_DIM - DV1, DV1)


    @triton.jit
    def _load_q_rem(q_base, rows_m, m_mask, COS, SIN, stride_qt, stride_c, tok0, HEAD_DIM: tl.constexpr,
                    D0: tl.constexpr, W1: tl.constexpr, ROPE_Q: tl.constexpr):
        """Q's columns [D0, D0 + W1), zero past the head: the A operand against the transposed remainder.
        D0 >= HEAD_DIM / 2, so every column here is in the second rotate-half, its partner `col - HALF`."""
        cols = D0 + tl.arange(0, W1)
        mask = m_mask[:, None] & (cols < HEAD_DIM)[None, :]
        ptrs = q_base + rows_m[:, None] * stride_qt + cols[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
        if ROPE_Q:
            HALF: tl.constexpr = HEAD_DIM // 2
            xp = tl.load(ptrs - HALF, mask=mask, other=0.0).to(tl.float32)
            cs = (tok0 + rows_m)[:, None] * stride_c + (cols - HALF)[None, :]
            c = tl.load(COS + cs, mask=mask, other=0.0)
            s = tl.load(SIN + cs, mask=mask, other=0.0)
            x = (x.to(tl.float32) * c + xp * s).to(x.dtype)
        return x

    @triton.jit
    def _rotate_rows(SRC, stride_s, DST, stride_d, COS, SIN, stride_c, tok0, row0, seqlen,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr):
        """DST[r] = SRC[r] rotated (2D vision RoPE, rotate-half, float32, rounded to DST's dtype) for the
        segment rows row0 .. row0 + BLOCK_M below seqlen, ROWS rows at a time (few live registers; the
        loop is not software-pipelined)."""
        HALF: tl.constexpr = HEAD_DIM // 2
        j = tl.arange(0, triton.next_power_of_2(HALF))
        for r in tl.range(0, BLOCK_M, ROWS, num_stages=1):
            rows = row0 + r + tl.arange(0, ROWS)
            mask = (rows < seqlen)[:, None] & (j < HALF)[None, :]
            src = SRC + rows[:, None] * stride_s + j[None, :]
            dst = DST + rows[:, None] * stride_d + j[None, :]
            cs = (tok0 + rows)[:, None] * stride_c + j[None, :]
            lo = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            hi = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            c = tl.load(COS + cs, mask=mask, other=0.0)
            s = tl.load(SIN + cs, mask=mask, other=0.0)
            tl.store(dst, (lo * c - hi * s).to(DST.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, (hi * c + lo * s).to(DST.dtype.element_ty), mask=mask)

    @triton.jit
    def _tma_step(acc0, acc1, l_i, m_i, q0, q1, k_desc, v_desc, r_desc, row, col, r_row, r_col, start_n, seqlen,
                  qk_scale, BLOCK_N: tl.constexpr, REM: tl.constexpr, R_V: tl.constexpr, MASK_N: tl.constexpr,
                  SUM_MMA: tl.constexpr = False):
        qk = tl.dot(q0, tl.trans(k_desc.load([row, col])))
        if REM:  # + the remainder columns: K's arrive transposed, a [W1, BLOCK_N] tile (B operand as is)
            qk = tl.dot(q1, r_desc.load([r_row, r_col]), qk)
        if MASK_N:  # the rows past the segment's end are the next segment's keys (or TMA's zero fill)
            qk = tl.where((start_n + tl.arange(0, BLOCK_N) < seqlen)[None, :], qk, float("-inf"))
        acc0, acc1, l_i, m_ij, p = _softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i, SUM_MMA)
        v0 = v_desc.load([row, col])
        p = p.to(v0.dtype)
        acc0 = tl.dot(p, v0, acc0)
        if REM:  # V's remainder, transposed [W1, BLOCK_N]: its transpose is a K-major B operand (its row of
            # ones past the head, where there is one, sums P: SUM_MMA)
            acc1 = tl.dot(p, tl.trans(r_desc.load([r_row + R_V, r_col])), acc1)
        return acc0, acc1, l_i, m_ij

    @triton.jit
    def _narrow_step(acc0, acc1, l_i, m_i, q0, q1, k_rows, v_rows, r_cols, COS, SIN, stride_kt, stride_vt,
                     stride_r, stride_c, tok0, start_n, seqlen, qk_scale, HEAD_DIM: tl.constexpr, D0: tl.constexpr,
                     W1: tl.constexpr, TAIL_N: tl.constexpr, REM: tl.constexpr, R_V: tl.constexpr,
                     SUM_MMA: tl.constexpr = False):
        """A masked step over TAIL_N keys, loaded by pointers (the tensor descriptors' boxes are BLOCK_N
        rows): the last keys of a segment cost TAIL_N / BLOCK_N of a full step. `k_rows`/`v_rows` point at
        the segment's first key of this head, `r_cols` at its first column in R's K rows."""
        n = start_n + tl.arange(0, TAIL_N)
        n_mask = n < seqlen
        d = tl.arange(0, D0)
        k = _load_tile(k_rows, n, d, stride_kt, n_mask, COS, SIN, stride_c, tok0, HEAD_DIM, True, False)
        qk = tl.dot(q0, tl.trans(k))
        if REM:  # K's remainder rows of R only (a TMA box also holds this head's V rows, cancelled by Q's zeros)
            j = tl.arange(0, W1)
            rk = tl.load(r_cols + j[:, None] * stride_r + n[None, :], mask=(j < R_V)[:, None] & n_mask[None, :],
                         other=0.0)
            qk = tl.dot(q1, rk, qk)
        qk = tl.where(n_mask[None, :], qk, float("-inf"))
        acc0, acc1, l_i, m_ij, p = _softmax_update(qk, qk_scale, acc0, acc1, l_i, m_i, SUM_MMA)
        v = _load_tile(v_rows, n, d, stride_vt, n_mask, COS, SIN, stride_c, tok0, HEAD_DIM, True, False)
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
        Q, k_desc, v_desc, r_desc, O, CU_SEQLENS, COS, SIN,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_c, qk_scale,
        K, V, R, stride_kt, stride_vt, stride_r, total_tokens,
        HEAD_DIM: tl.constexpr, D0: tl.constexpr, W1: tl.constexpr, HEADS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE_Q: tl.constexpr, WS: tl.constexpr,
        TAIL_IN_LOOP: tl.constexpr = False, DEVICE_DESC: tl.constexpr = False, TAIL_N: tl.constexpr = 0,
        Q_TAIL: tl.constexpr = False, SUM_MMA: tl.constexpr = False, R_ROWS: tl.constexpr = 0,
    ):
        """Hopper variant: K and V tiles arrive by TMA (tensor descriptors over the packed (T, H*D) rows,
        K's and V's head picked by the column offset), so the tiles land swizzled for wgmma without
        going through registers. Q is loaded once per program by pointers, optionally rotated (ROPE_Q).
        Head dims past the power-of-two chunk D0 (72, 80, ...): the remainder columns of K and V come from
        R, their transposed copy (`kv_remainder_t`: per head K's remainder rows, V's, and for 72 a row of
        ones; one column per token, each segment from an aligned column `_r_start`), so no operand is
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
        start_m = tl.program_id(0)
        head = tl.program_id(1)
        seg = tl.program_id(2)
        tok0 = tl.load(CU_SEQLENS + seg)
        seqlen = tl.load(CU_SEQLENS + seg + 1) - tok0
        if start_m * BLOCK_M >= seqlen:
            return
        # Q's and O's strides are multiples of 8 (the launcher checks). At 72 the head strides would otherwise look
        # unaligned, and Q's loads and O's stores would be 2 bytes each (190-255 registers instead of 114-217).
        stride_qt = _multiple_of_8(stride_qt)
        stride_qh = _multiple_of_8(stride_qh)
        stride_ot = _multiple_of_8(stride_ot)
        stride_oh = _multiple_of_8(stride_oh)
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
            _tma_tile(Q, kd, vd, rd, O, COS, SIN, stride_qt, stride_qh, stride_ot, stride_oh, stride_c, qk_scale,
                      K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, start_m * BLOCK_M,
                      HEAD_DIM, D0, W1, HEADS, BLOCK_M // 2, BLOCK_N, ROPE_Q, WS, TAIL_IN_LOOP, TAIL_N, SUM_MMA, R_ROWS)
        else:
            _tma_tile(Q, kd, vd, rd, O, COS, SIN, stride_qt, stride_qh, stride_ot, stride_oh, stride_c, qk_scale,
                      K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, start_m * BLOCK_M,
                      HEAD_DIM, D0, W1, HEADS, BLOCK_M, BLOCK_N, ROPE_Q, WS, TAIL_IN_LOOP, TAIL_N, SUM_MMA, R_ROWS)

    @triton.jit
    def _tma_tile(Q, kd, vd, rd, O, COS, SIN, stride_qt, stride_qh, stride_ot, stride_oh, stride_c, qk_scale,
                  K, V, R, stride_kt, stride_vt, stride_r, tok0, seqlen, seg, head, row0,
                  HEAD_DIM: tl.constexpr, D0: tl.constexpr, W1: tl.constexpr, HEADS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROPE_Q: tl.constexpr, WS: tl.constexpr,
                  TAIL_IN_LOOP: tl.constexpr, TAIL_N: tl.constexpr, SUM_MMA_ASKED: tl.constexpr,
                  R_ROWS: tl.constexpr):
        """The query rows row0 .. row0 + BLOCK_M of one segment and head, against all its keys.
        SUM_MMA_ASKED: P's row sums on the tensor cores where the remainder has a spare column (72: R's V rows
        hold ones there, so PV's remainder dot sums P at no cost): 1.5-3% faster on every benchmark case
        (benchmarks/results/sum_mma_probe_rev11686c6.json). Power-of-two head dims sum in registers: a separate
        dot with ones made ptxas serialise the wgmmas (0.8x). So does 80, whose remainder has no spare column."""
        REM: tl.constexpr = D0 < HEAD_DIM
        SUM_MMA: tl.constexpr = SUM_MMA_ASKED and REM and HEAD_DIM - D0 < W1
        SUM_COL: tl.constexpr = HEAD_DIM - D0  # acc1's column holding the row sums
        rows_m = row0 + tl.arange(0, BLOCK_M)
        m_mask = rows_m < seqlen
        q_base = Q + tok0.to(tl.int64) * stride_qt + head * stride_qh
        q_stride = stride_qt
        # Power-of-two head dims: Q is rotated into this program's own output rows, then loaded from there like an
        # unrotated Q. A tile rotated in registers becomes a register-sourced wgmma operand, live through the whole
        # loop; at 128-row tiles ptxas then runs out of registers and serialises every wgmma (each one waited on at
        # once). A loaded tile is staged in shared memory instead. Other head dims rotate in registers: there the
        # staging measured slower on packs of short segments (benchmarks/results/rope_q_probe_vs_d530591.json).
        STAGE_Q: tl.constexpr = ROPE_Q and not REM
        if STAGE_Q:
            o_base = O + tok0.to(tl.int64) * stride_ot + head * stride_oh
            _rotate_rows(q_base, stride_qt, o_base, stride_ot, COS, SIN, stride_c, tok0, row0, seqlen, HEAD_DIM,
                         BLOCK_M, BLOCK_M // 4)
            tl.debug_barrier()  # the other threads' stores are visible to this CTA's loads
            q_base = o_base
            q_stride = stride_ot
        q0 = _load_tile(q_base, rows_m, tl.arange(0, D0), q_stride, m_mask, COS, SIN, stride_c, tok0, HEAD_DIM, True,
                        ROPE_Q and not STAGE_Q)
        q1 = q0
        if REM:
            q1 = _load_q_rem(q_base, rows_m, m_mask, COS, SIN, q_stride, stride_c, tok0, HEAD_DIM, D0, W1, ROPE_Q)
        col = head * HEAD_DIM
        r_row = head * R_ROWS
        r_col0 = _r_start(tok0, seg)
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
                    acc0, acc1, l_i, m_i = _narrow_step(acc0, acc1, l_i, m_i, q0, q1, k_rows, v_rows, r_cols, COS,
                                                        SIN, stride_kt, stride_vt, stride_r, stride_c, tok0, start_n,
                                                        seqlen, qk_scale, HEAD_DIM, D0, W1, TAIL_N, REM, HEAD_DIM - D0,
                                                        SUM_MMA)
            else:
                acc0, acc1, l_i, m_i = _tma_step(acc0, acc1, l_i, m_i, q0, q1, kd, vd, rd, tok0 + n_full, col,
                                                 r_row, r_col0 + n_full, n_full, seqlen, qk_scale, BLOCK_N, REM,
                                                 HEAD_DIM - D0, True, SUM_MMA)
        if SUM_MMA:
            l_i = tl.sum(tl.where((tl.arange(0, W1) == SUM_COL)[None, :], acc1, 0.0), 1)
        o_rows = O + tok0.to(tl.int64) * stride_ot + head * stride_oh + rows_m[:, None] * stride_ot
        _store_out(o_rows, acc0, acc1, l_i, m_mask, HEAD_DIM, D0, REM, D0, W1)

    @triton.jit
    def _multiple_of_8(x):
        """x, for an x the caller knows to be a multiple of 8 elements (16 bytes at 16 bits), written so that the
        compiler sees it too: the JIT marks integer arguments divisible by 16 only, and an unmarked stride makes
        every access through it a 2-byte one."""
        return x // 8 * 8

    @triton.jit
    def _r_start(tok0, seg):
        """R's column of a segment's first token: 16-byte aligned (a TMA box's start in the contiguous dim
        must be; an unaligned one is an illegal instruction on H100), and past the previous segment's
        columns: round_up(tok0, 8) + 8 * seg, written so that the compiler sees a multiple of 8."""
        return 8 * ((tok0 + 7) // 8 + seg)

    @triton.jit
    def _remainder_t_kernel(K, V, R, CU_SEQLENS, stride_kt, stride_vt, stride_r,
                            HEAD_DIM: tl.constexpr, D0: tl.constexpr, REM_P: tl.constexpr, R_ROWS: tl.constexpr,
                            BLOCK_T: tl.constexpr):
        """Head h's rows of R (`kv_remainder_t`), at column c = _r_start(segment) + (t - its first token):
        R[h * R_ROWS + j, c] = K[t, h, D0 + j] and R[h * R_ROWS + REM + j, c] = V[t, h, D0 + j] for j < REM
        (= HEAD_DIM - D0), and where R_ROWS has room (72), R[h * R_ROWS + 2 * REM, c] = 1: PV's dot then sums
        P's rows (the kernel's SUM_MMA; masked scores are zero in P). Zero in the gap up to the next segment's
        start: the attention kernel's last tile of a segment reads into it, where P's zeros cancel only finite
        values. K and V are in the fused QKV layout (head h's columns start at h * HEAD_DIM), which lets the
        compiler vectorise the loads; R's row stride and segment starts are multiples of 8, written so
        (`_multiple_of_8`, `_r_start`) that it vectorises the stores."""
        REM: tl.constexpr = HEAD_DIM - D0
        blk = tl.program_id(0)
        h = tl.program_id(1)
        seg = tl.program_id(2)
        tok0 = tl.load(CU_SEQLENS + seg)
        seqlen = tl.load(CU_SEQLENS + seg + 1) - tok0
        c0 = _r_start(tok0, seg)
        span = _r_start(tok0 + seqlen, seg + 1) - c0  # this segment's columns and the gap after them
        i = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        if blk * BLOCK_T >= span:
            return
        stride_r = _multiple_of_8(stride_r)
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


@functools.lru_cache(maxsize=None)
def remainder_rows(head_dim: int) -> int:
    """R's rows per head (`kv_remainder_t`): K's remainder columns, V's, and a row of ones where the
    remainder leaves a spare accumulator column (72: 8 + 8 + 1; 80: 16 + 16; 0 for powers of two)."""
    d0, w1, _ = head_dim_split(head_dim)
    rem = head_dim - d0
    return 0 if rem == 0 else 2 * rem + int(rem < w1)


def kv_remainder_t(k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int) -> torch.Tensor:
    """The columns of k and v `(T, H, D)` past the power-of-two chunk, transposed for the Hopper kernel:
    `(H * remainder_rows, round_up(T, 8) + 8 * segments)`, one column per token, each segment from an
    aligned column (`_r_start`). Head h's rows: K's remainder columns, then V's, then (72) a row of ones.
    Nothing is padded: the kernel's boxes are W1 rows (16 at 72), so K's box runs into V's rows of the
    same head, which Q's zero columns past the head cancel, and V's into the next head's, which only fill
    accumulator columns past the head. One launch; at 72 it writes 544 bytes per token (the zero-padded
    layout of rev 454b1ab wrote 1024; that one took ~37 us per 8B block, T = 25088, on H100:
    benchmarks/results/profile_qwen3-vl-8b_32x448px_h100_rev725e17e_triton.json)."""
    total, heads, head_dim = k.shape
    for name, t in (("k", k), ("v", v)):
        if not _heads_side_by_side(t):
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


@functools.lru_cache(maxsize=None)  # called several times per launch, on the host path of small calls
def head_dim_split(head_dim: int) -> tuple[int, int, int]:
    """(D0, D1, DV1): a power-of-two chunk D0 plus, for other head dims, a remainder D1 columns wide
    (the smallest power of two >= 16 covering it) and the pointer kernel's PV remainder DV1 (0, 0, 0
    when head_dim is a power of two).

    The pointer kernel reads the last D1 / DV1 columns of each row; DV1 is at least 64 because Triton 3.6
    on sm90 miscompiles a PV dot whose V operand has rows narrower than 64 columns (out-of-range
    shared-memory accesses, seen on H100 for N = 16 and 32). The Hopper kernel avoids narrow rows
    altogether: it reads the remainder of K and V transposed (`kv_remainder_t`), 16 rows of one column
    per token, so 72 costs 64 + 16 lanes in both QK^T and PV.
    """
    if head_dim < 16 or head_dim > 256 or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in [16, 256]; got {head_dim}")
    d0 = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - d0
    if rest == 0:
        return d0, 0, 0
    if d0 < 64:
        raise ValueError(f"head_dim {head_dim}: non-power-of-two head dims must be > 64")
    d1 = max(16, 1 << (rest - 1).bit_length())
    return d0, d1, max(d1, 64)


def seq_bucket(max_seqlen: int) -> int:
    """Coarse length class for the tuning key: a new image size never re-tunes, a new class may."""
    return 0 if max_seqlen <= 256 else 1 if max_seqlen <= 1024 else 2 if max_seqlen <= 4096 else 3


def load_class(total_tokens: int, heads: int) -> int:
    """Whether a call fills the GPU (1) or not (0), for the tuning key: the best tiles for one 1024-token
    image (128 programs of 128 rows: a fraction of a wave) are ~7% slower on 32 images of 784 tokens than
    the best there (benchmarks/results/sweeps/sweep_h100_rev86c9ecc.jsonl), and full packs are what the
    service encodes most. 4096 tokens of 16 heads is 512 programs of 128 rows."""
    return int(total_tokens * heads > 4096 * 16)


@dataclass(frozen=True)
class TileConfig:
    """One launch configuration. `tma` picks the Hopper kernel (K/V by tensor descriptors)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False
    # pointer/TMA kernel: Triton's warp specialisation of the loop (0 or 1); Gluon kernel: persistent programs per
    # SM, each with a one-warp loader partition (0: the plain kernel)
    ws: int = 0
    tail_in_loop: bool = False
    device_desc: bool = False  # TMA kernel: descriptors built on the device (no host encoding per launch)
    tail_n: int = 0  # TMA kernel: width of the narrow steps over a segment's last keys (0: one masked full tile)
    q_tail: bool = False  # TMA kernel: a segment's last query rows, if at most block_m / 2, as a half-height tile
    sum_mma: bool = True  # TMA kernel: P's row sums by the tensor cores where the remainder has a spare column (72)
    gluon: bool = False  # the Gluon kernel (kernels/gluon_attention.py) instead; num_stages is its K/V ring depth
    maxnreg: int = 0  # Gluon kernel: registers per thread, capped (0: ptxas's choice)
    rem_copy: bool = True  # Gluon kernel, past a power of two: K's and V's remainder from kv_remainder_t, or in place


# The pointer kernel's candidates (block_m, block_n, warps, stages): they compile correctly on sm90 with
# Triton 3.6 for every head dim we serve (see head_dim_split).
PTR_TILES = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3)]


def ptr_candidates(head_dim: int) -> list[TileConfig]:
    """The pointer kernel's candidates for `head_dim`; above 128 only 64-wide K tiles (registers: the fp32
    P tile plus a 256-wide accumulator)."""
    return [TileConfig(bm, bn, w, s) for bm, bn, w, s in PTR_TILES if head_dim <= 128 or bn <= 64]


# The TMA kernel's candidates (block_m, block_n, warps, stages), chosen by
# benchmarks/sweep_attention.py on H100/H200. (An earlier version read the remainder of 72/80 by TMA as
# [BLOCK_N, 16] row tiles: compute-sanitizer found out-of-bounds shared-memory reads in that QK^T dot and
# the PV dot gave wrong results with 8 warps, hence the transposed remainder.)
# A segment's last keys, where they fill at most half a K tile, go in narrow steps of TAIL_N keys.
TAIL_N = 16
TMA_TILES = [(64, 128, 4, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 2)]


# Where the TMA kernel's K/V descriptors are encoded. Host: TensorDescriptor arguments, which Triton's
# launcher encodes at every call (~25 us of host time). Device: every program builds its own (~1-15 us more
# GPU time, growing with the number of programs). Measured on H100 (benchmarks/profile_launch.py,
# launch_profile.json): at 1x1024 d64 the kernel needs ~14 us of GPU time but ~75 us of host time with host
# descriptors, ~45 us with device ones; from 64x256 up the GPU time dominates and host descriptors win.
# "auto" (the default) therefore picks device descriptors for small calls launched eagerly, host ones
# otherwise (and always under CUDA-graph capture, where host time is paid once). Device descriptors need
# Triton's allocator, which is per thread (see _set_scratch_allocator); the service ran with auto under
# load without an error (benchmarks/results/service_h100_*autodesc*). QWEN3VL_TMA_DESCRIPTORS=auto|host|device.
DEVICE_DESC_MAX_WORK = 2 * 2**30  # total_tokens * max_seqlen * heads * head_dim: 1x1024 d64 is 2**30


@functools.lru_cache(maxsize=None)
def tma_descriptors() -> str:
    mode = os.environ.get("QWEN3VL_TMA_DESCRIPTORS", "auto")
    if mode not in ("auto", "host", "device"):
        raise ValueError(f"QWEN3VL_TMA_DESCRIPTORS={mode!r}: use auto, host or device")
    return mode


def tma_candidates(head_dim: int) -> list[TileConfig]:
    """Every configuration the automatic TMA path may pick for `head_dim` (the GPU tests run each). The
    128-row tiles run a segment's last query rows as a 64-row tile where they fit one (`q_tail`): -1% to
    +16% at 32x784 and mixed8 (benchmarks/results/sweeps/sweep_qtail_h100_rev2068eb3.jsonl); 64-row
    tiles do not (a 32-row tile is slower per row). Head dims past a power of two leave out the 128x128
    tile on 4 warps: with the remainder's accumulator it needs more than 255 registers, ptxas serialises its
    wgmmas, and it ran at half the best tile's speed on every case at 72
    (benchmarks/results/rope_q_probe_vs_d530591.json); the tuner, timing small calls by their host time,
    could still pick it."""
    device = tma_descriptors() == "device"
    rem = head_dim_split(head_dim)[1] > 0
    return [TileConfig(bm, bn, w, s, tma=True, device_desc=device, tail_n=TAIL_N, q_tail=bm >= 128)
            for bm, bn, w, s in TMA_TILES if not (rem and bm == bn == 128 and w == 4)]


# Head dims the Gluon kernel's candidates were measured at (the towers' 64 and 72, Qwen2.5-VL's 80); others keep the
# TMA kernel.
GLUON_HEAD_DIMS = tuple(GLUON_TILES)


def gluon_candidates(head_dim: int) -> list[TileConfig]:
    """The Gluon kernel's candidates for `head_dim` (none where Gluon's Hopper API is missing)."""
    if head_dim not in GLUON_HEAD_DIMS or not gluon_available():
        return []
    return [TileConfig(bm, bn, w, nbuf, tma=True, gluon=True, maxnreg=cap, rem_copy=copy, ws=ws)
            for bm, bn, w, nbuf, cap, copy, ws in GLUON_TILES[head_dim]]


def hopper_candidates(head_dim: int, gluon: bool, max_seqlen: int | None = None) -> list[TileConfig]:
    """Every configuration the automatic Hopper path may pick: the TMA kernel's, and with `gluon` (no RoPE in the
    kernel, q, k and v parts of one buffer's rows: `qkv_columns`) the Gluon kernel's. At 64 the Gluon kernel is
    4-16% faster from 1x4096 up and on packs of short segments
    (benchmarks/results/gluon_attention_probe_d64_rev19a3e6d.json), at 72 2-32%
    (gluon_attention_probe_d72_rev4fdee81.json).
    With `max_seqlen` up to 1024, no Gluon candidate copies the remainder: the copy pays only from 1x4096 up, and
    its second launch and descriptor cost host time, which small calls are bound by."""
    own = gluon_candidates(head_dim) if gluon else []
    if max_seqlen is not None and seq_bucket(max_seqlen) < 2:
        own = [c for c in own if not (c.rem_copy and head_dim_split(head_dim)[1])]
    return tma_candidates(head_dim) + own


@functools.lru_cache(maxsize=None)
def _with_descriptors(config: TileConfig, device_desc: bool) -> TileConfig:
    """`config` encoding its descriptors where `device_desc` says; a Gluon configuration as it is (that kernel
    encodes them on the host either way, and a field it ignores would mislead the logged choice)."""
    if config.gluon or config.device_desc == device_desc:
        return config
    return dataclasses.replace(config, device_desc=device_desc)


def _device_descriptors(work: int, replayable: bool = False) -> bool:
    """Where `tma_descriptors()` is auto: device descriptors for a small eager call that no launch plan will replay
    (a replay encodes host descriptors once, not per call; and device ones need scratch, which replays refuse)."""
    mode = tma_descriptors()
    if mode != "auto":
        return mode == "device"
    return not replayable and work <= DEVICE_DESC_MAX_WORK and not torch.cuda.is_current_stream_capturing()


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors, from PyTorch's caching allocator (stream-ordered,
    and taken from the graph pool under CUDA-graph capture)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_scratch_allocator():
    """Triton keeps its allocator in a ContextVar, so each thread that launches (the service's engine
    thread, warm-up threads, ...) must set it itself; setting it is a ContextVar write, done per launch."""
    triton.set_allocator(_scratch)


def tma_layout_ok(q, k, v, out=None) -> bool:
    """Whether the Hopper kernel can take these tensors: k and v readable through tensor descriptors (heads
    side by side in each token row, as in the fused QKV layout), half-precision data, and every row and head
    of q, k, v and out starting on 16 bytes (the kernel's Q loads and O stores assume it)."""
    if TensorDescriptor is None or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not (_heads_side_by_side(k) and _heads_side_by_side(v)):
        return False
    for t in (q, k, v) if out is None else (q, k, v, out):
        stride, size = t.stride(), t.element_size()
        if (stride[0] * size) % 16 or (stride[1] * size) % 16 or t.data_ptr() % 16:
            return False
    return True


def _heads_side_by_side(t) -> bool:
    """Whether `(T, H, D)` t holds each token's heads side by side in one row (the fused QKV layout)."""
    stride = t.stride()
    return stride[2] == 1 and stride[1] == t.shape[2]


def _tma_default(q) -> bool:
    if interpreting() or not q.is_cuda:
        return False
    return is_hopper(q.device)


def triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, cos=None, sin=None, softmax_scale=None,
                            seqlens=None, out=None, rotate_k=True, block_m=None, block_n=None,
                            config: TileConfig | None = None):
    """Triton forward. Returns `out` `(total_tokens, heads, head_dim)` in q's dtype.

    With `cos`/`sin`, Q is rotated in the kernel, and K too unless `rotate_k=False` (the caller
    rotated K already). On Hopper, with K/V in the fused QKV layout and K not rotated here, the TMA
    kernel runs; otherwise the pointer kernel. `seqlens` is accepted for signature parity with the
    fallback and ignored. `block_m`/`block_n` pin the pointer kernel's tiles, `config` pins everything
    (tests, the interpreter and the tile sweep use these).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    plan = None
    if LAUNCH_PLANS and cos is None and config is None and block_m is None and block_n is None and \
            type(max_seqlen) is int:
        plan, addresses = _plan_key(q, k, v, cu_seqlens, max_seqlen, softmax_scale, out)
        replay = _plans.get(plan)
        if replay:
            if out is None:
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                addresses[3] = out.data_ptr()
            if replay(addresses):
                return out
    _check_inputs(q, k, v, cu_seqlens, max_seqlen, cos, sin)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}; expected float16, bfloat16 or float32")
    q_stride, k_stride, v_stride = q.stride(), k.stride(), v.stride()
    for name, stride in (("q", q_stride), ("k", k_stride), ("v", v_stride)):
        if stride[-1] != 1:
            raise ValueError(f"{name} must have a contiguous last dim; strides {stride}")
    total, heads, head_dim = q.shape
    d0, d1, dv1 = head_dim_split(head_dim)
    if out is None:
        out = torch.empty((total, heads, head_dim), dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous last dim; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}, strides {out.stride()}")
    o_stride = out.stride()
    scale = (softmax_scale if softmax_scale is not None else head_dim**-0.5) * math.log2(math.e)
    rope = cos is not None
    cos_t = cos if rope else q  # placeholders: never read when ROPE is off
    sin_t = sin if rope else q
    stride_c = cos.stride(0) if rope else 0
    segments = cu_seqlens.numel() - 1
    bucket = seq_bucket(max_seqlen)
    k_rope = rope and rotate_k
    # where k's and v's heads start in q's rows, for the Gluon kernel (None: not one buffer's rows, or RoPE in the
    # kernel, which it does not do); found once per call, only where a Gluon configuration may run
    columns = qkv_columns(q, k, v) if not rope and (config is None or config.gluon) else None
    if config is not None:
        use_tma = config.tma
        if use_tma and (k_rope or not tma_layout_ok(q, k, v, out)):
            raise ValueError("the TMA kernel needs K/V in the fused QKV layout, K rotated by the caller and "
                             "16-byte aligned rows and heads in q and out")
        if config.gluon and (head_dim - d0 > GLUON_REM_WIDTH or columns is None):
            raise ValueError(f"the Gluon kernel needs at most {GLUON_REM_WIDTH} head-dim columns past a power of two, "
                             "no RoPE in the kernel and q, k, v as parts of one buffer's rows (the fused QKV layout)")
    else:
        use_tma = block_m is None and not k_rope and _tma_default(q) and tma_layout_ok(q, k, v, out)

    roles = (q, k, v, out, cu_seqlens)  # the tensors a launch plan substitutes, in `_plan_key`'s address order
    if use_tma:
        r_rows = remainder_rows(head_dim)

        def run(c: TileConfig):
            # the remainder's copy where the kernel reads it, inside each run: the tuner then times a candidate
            # that reads the copy with the copy, against one that reads the remainder in place
            rem = kv_remainder_t(k, v, cu_seqlens, max_seqlen) if d1 and (c.rem_copy or not c.gluon) else None
            if c.gluon:
                launch_gluon(q, out, cu_seqlens, max_seqlen, scale, columns, c.block_m, c.block_n, c.num_warps,
                             c.num_stages, c.maxnreg, rem, r_rows, c.sum_mma, int(c.ws))
                return
            rem = q if rem is None else rem  # q: a placeholder without a remainder
            rem_stride0 = rem.stride(0)
            if c.device_desc:
                _set_scratch_allocator()
                descs = [None] * 3
            else:
                # R's descriptor only exists where the kernel reads it (None is a constexpr there): each
                # descriptor costs host time at every launch
                descs = [TensorDescriptor(t, [total, heads * head_dim], [t_stride[0], 1], [c.block_n, d0])
                         for t, t_stride in ((k, k_stride), (v, v_stride))]
                descs.append(TensorDescriptor(rem, [rem.shape[0], rem.shape[1]], [rem_stride0, 1], [d1, c.block_n])
                             if d1 else None)
            grid = (cdiv(max_seqlen, c.block_m), heads, segments)
            launch(
                _varlen_attn_fwd_tma, grid, q, *descs, out, cu_seqlens, cos_t, sin_t, q_stride[0], q_stride[1],
                o_stride[0], o_stride[1], stride_c, scale, k, v, rem, k_stride[0], v_stride[0], rem_stride0, total,
                HEAD_DIM=head_dim, D0=d0, W1=max(d1, 16), HEADS=heads, ROPE_Q=rope, BLOCK_M=c.block_m,
                BLOCK_N=c.block_n, WS=bool(c.ws), TAIL_IN_LOOP=c.tail_in_loop, DEVICE_DESC=c.device_desc,
                TAIL_N=c.tail_n, Q_TAIL=c.q_tail, SUM_MMA=c.sum_mma, R_ROWS=r_rows, num_warps=c.num_warps,
                num_stages=c.num_stages)

        if config is None:
            # Tuned with the descriptors this call uses: a small call with host descriptors spends more host
            # time than GPU time, and the timings would rank launch overhead, not tiles.
            device_desc = _device_descriptors(total * max_seqlen * heads * head_dim, plan is not None)
            gluon = columns is not None
            key = ("tma", bucket, load_class(total, heads), head_dim, rope, gluon, q.dtype, q.device)
            candidates = lambda: [_with_descriptors(c, device_desc)  # noqa: E731 - listed on the first call only
                                  for c in hopper_candidates(head_dim, gluon, max_seqlen)]
            config = _with_descriptors(choose(key, candidates, _replaying(run, plan, roles)), device_desc)
        _run_and_plan(run, config, plan, roles)
        return out

    def run(c: TileConfig):
        grid = (cdiv(max_seqlen, c.block_m), heads, segments)
        launch(
            _varlen_attn_fwd, grid, q, k, v, out, cu_seqlens, cos_t, sin_t, q_stride[0], q_stride[1], k_stride[0],
            k_stride[1], v_stride[0], v_stride[1], o_stride[0], o_stride[1], stride_c, scale, HEAD_DIM=head_dim,
            D0=d0, REM=d1 > 0, D1=max(d1, 16), DV1=max(dv1, 16), ROPE_Q=rope, ROPE_K=k_rope, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)

    if config is None and (block_m is not None or interpreting()):
        # pinned small tiles; stages: shared memory holds K and V tiles of both chunks, per stage
        config = TileConfig(block_m or 32, block_n or 16, 4, 2 if head_dim > 64 else 3)
    if config is None:
        config = choose(("ptr", bucket, load_class(total, heads), head_dim, rope, k_rope, q.dtype, q.device),
                        lambda: ptr_candidates(head_dim), _replaying(run, plan, roles))
    _run_and_plan(run, config, plan, roles)
    return out


# Launch plans: the automatic path's one launch per call, recorded (tuning.Replay) under a key of everything its checks
# and choices read, and replayed on later calls with the same key at the tensors' new addresses. A small call's time is
# its host time (1x1024: ~20 us on the GPU, 70-90 us of host time on the H100 machines' hosts before plans,
# benchmarks/results/attention.json), and the full path's checks, tuner lookup, descriptors and Triton's binder and
# launcher wrapper are most of it. Keys hold no tensors; at most PLANS_MAX, then the table starts over.
# QWEN3VL_LAUNCH_PLANS=0 turns them off (every call through the full path).
LAUNCH_PLANS = os.environ.get("QWEN3VL_LAUNCH_PLANS", "1") != "0"
_plans: dict[tuple, object] = {}
PLANS_MAX = 256


def _plan_key(q, k, v, cu_seqlens, max_seqlen: int, softmax_scale, out) -> tuple[tuple, list[int]]:
    """A call's plan key and its roles' addresses (q, k, v, out or 0, cu_seqlens): shapes, strides, dtypes, devices,
    k's and v's offsets from q, scalars and every address modulo 16 (Triton specialises pointers on 16-byte
    alignment, and the TMA kernels need it)."""
    q_ptr, k_ptr, v_ptr, cu_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_seqlens.data_ptr()
    out_ptr = 0 if out is None else out.data_ptr()
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k_ptr - q_ptr, v_ptr - q_ptr, q_ptr % 16, cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device,
           cu_ptr % 16, max_seqlen, softmax_scale,
           None if out is None else (out.shape, out.stride(), out.dtype, out.device, out_ptr % 16))
    return key, [q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr]


def _replaying(run, plan: tuple | None, roles: tuple):
    """`run` as the tuner times it: where this call will be planned, each candidate through its own replay, so that
    small calls are ranked by what later calls cost (their host time a replay's, not the full path's)."""
    if plan is None:
        return run
    replays: dict[TileConfig, object] = {}
    addresses = [t.data_ptr() for t in roles]

    def timed(c: TileConfig):
        replay = replays.get(c)
        if replay is None:  # not recorded yet, or its first launch compiled through the JIT
            replays[c] = record(lambda: run(c), roles)
        elif replay is False or not replay(addresses):
            run(c)
    return timed


def _run_and_plan(run, config: TileConfig, plan: tuple | None, roles: tuple):
    """`run(config)`, recorded for `plan` (a key from `_plan_key`) the first time the key launches lean: the
    recorded launch, or False where it cannot be replayed (e.g. two launches: the remainder's copy and its reader)."""
    if plan is None or plan in _plans:
        run(config)
        return
    replay = record(lambda: run(config), roles)
    if replay is not None:
        if len(_plans) >= PLANS_MAX:
            _plans.clear()
        _plans[plan] = replay
