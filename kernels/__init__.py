"""Triton kernels for the Qwen3-VL vision tower, each beside its pure-PyTorch reference."""

from .attention import BACKENDS, forced_backend, resolve_backend, triton_supported, varlen_attention
from .rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq

__all__ = [
    "BACKENDS",
    "forced_backend",
    "apply_vision_rope",
    "resolve_backend",
    "triton_supported",
    "varlen_attention",
    "vision_rope_cos_sin",
    "vision_rope_inv_freq",
]
