"""The reference and the PyTorch fallback of varlen attention, and the input checks both paths share.

`reference_varlen_attention` is per-segment softmax(QK^T)V in plain matmuls, the tests' ground truth.
`sdpa_varlen_attention` is the fallback the service runs where the Triton kernels cannot: the same
signature as `triton_varlen_attention`, one batched SDPA call per run of equal-length segments.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def check_inputs(q, k, v, cu_seqlens, max_seqlen):
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


def reference_varlen_attention(q, k, v, cu_seqlens, max_seqlen=None, *, softmax_scale=None, upcast=True):
    """Per-segment softmax(QKᵀ)V in plain matmuls: float32 when `upcast`, else in the inputs' dtype."""
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
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


# SDPA's backends in our order of preference on CUDA. PyTorch's default order puts flash first; cuDNN is faster
# at the towers' shapes (docs/PERFORMANCE.md), and each backend declines inputs it cannot take, so the next one runs.
_CUDA_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH]


def _sdpa(q, k, v, scale):
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    with sdpa_kernel(_CUDA_SDPA_ORDER, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)


def sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, softmax_scale=None, seqlens=None):
    """The fallback: one batched SDPA call per run of equal-length segments, not one per segment.

    A run of consecutive segments of one length is a `(B, H, L, D)` view of q, k and v as they are
    (e.g. strided slices of a fused QKV buffer): no copies in, and SDPA's output (token-major on
    CUDA) is returned as is when one run covers the pack. Image packs have few runs (a video's frames,
    same-sized images side by side); when equal lengths are scattered (`sdpa_gathers`), segments are
    gathered by length instead. SDPA runs its best backend: cuDNN first on CUDA, the fused CPU kernel
    otherwise. `seqlens` (host ints) avoids reading `cu_seqlens` back.
    """
    check_inputs(q, k, v, cu_seqlens, max_seqlen)
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
