"""In-place 2D vision RoPE on the fused QKV projection's output.

The tower's QKV GEMM writes `(T, 3, H, D)`; this kernel rotates the Q and K slices in place (float32
arithmetic, one rounding, as transformers does) so the attention kernel reads plain Q/K with no
per-tile rotation work. Measured against rotating inside the attention kernel (kernels/varlen_attention
with cos/sin): rotating every K tile once per query tile costs far more than one pass here
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import torch

from .rope import apply_vision_rope

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(QKV, COS, SIN, n_tokens, stride_t, stride_s, stride_h, stride_c,
                         HALF: tl.constexpr, HALF_P2: tl.constexpr, BLOCK_T: tl.constexpr, FIRST: tl.constexpr):
        pid_t = tl.program_id(0)
        head = tl.program_id(1)
        which = tl.program_id(2) + FIRST  # 0: Q, 1: K
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, HALF_P2)
        mask = (rows < n_tokens)[:, None] & (cols < HALF)[None, :]
        base = QKV + rows[:, None].to(tl.int64) * stride_t + which * stride_s + head * stride_h + cols[None, :]
        x1 = tl.load(base, mask=mask, other=0.0)
        x2 = tl.load(base + HALF, mask=mask, other=0.0)
        cs = rows[:, None] * stride_c + cols[None, :]
        c = tl.load(COS + cs, mask=mask, other=0.0)
        s = tl.load(SIN + cs, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(base, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(base + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


def qkv_rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_triton: bool | None = None,
              k_only: bool = False) -> torch.Tensor:
    """Rotate Q and K (only K with `k_only`: the attention kernel rotates Q as it loads it) of `qkv`
    `(T, 3, H, D)` in place with float32 `(T, D/2)` tables; returns qkv."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be (T, 3, H, D) with a contiguous last dim; got {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    tokens, _, heads, head_dim = qkv.shape
    half = head_dim // 2
    if cos.shape != (tokens, half) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 ({tokens}, {half}); got {cos.dtype} {tuple(cos.shape)}")
    if use_triton is None:
        use_triton = triton is not None and qkv.is_cuda
    if not use_triton:
        for i in (1,) if k_only else (0, 1):
            qkv[:, i] = apply_vision_rope(qkv[:, i], cos, sin)
        return qkv
    block_t = 64
    grid = (triton.cdiv(tokens, block_t), heads, 1 if k_only else 2)
    _qkv_rope_kernel[grid](qkv, cos, sin, tokens, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0),
                           HALF=half, HALF_P2=triton.next_power_of_2(half), BLOCK_T=block_t, FIRST=int(k_only),
                           num_warps=4)
    return qkv
