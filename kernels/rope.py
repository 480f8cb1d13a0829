"""Qwen's 2D vision rotary embedding: the pure-PyTorch reference that the Triton kernels must equal.

The tower rotates each head's `head_dim` channels "rotate-half" style. Channel pairs (i, i + D/2)
share one angle; the first D/4 angles come from the token's row, the next D/4 from its column. So the
whole table is `(total_tokens, D/2)`, stored in float32: `cos_half`, `sin_half`. transformers builds
the full-width `cat(half, half)` and upcasts Q and K to float32 to apply it; the result is cast back
to the input dtype. Our kernels compute the same float32 expression and round once.
"""

from __future__ import annotations

import torch


def vision_rope_inv_freq(head_dim: int, theta: float = 10000.0, device=None) -> torch.Tensor:
    """Inverse frequencies, `head_dim // 4` of them (the half-dim shared by the row and column axes)."""
    spatial_dim = head_dim // 2
    return 1.0 / (theta ** (torch.arange(0, spatial_dim, 2, dtype=torch.float32, device=device) / spatial_dim))


def vision_rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions `(T, 2)` (row, col) -> cos, sin `(T, D/2)` float32: `[row * f, col * f]`."""
    freqs = positions[..., None].float() * inv_freq  # [T, 2, D/4]
    freqs = freqs.flatten(1)  # [T, D/2]: row angles then column angles
    return freqs.cos(), freqs.sin()


def apply_vision_rope(x: torch.Tensor, cos_half: torch.Tensor, sin_half: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(T, H, D)` with float32 `(T, D/2)` tables; float32 arithmetic, result in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos_half[:, None, :], sin_half[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
