"""Triton kernels for the Qwen3-VL vision tower, each beside its pure-PyTorch reference.

`attention/` (varlen block-diagonal attention: three kernels, the SDPA fallback, the dispatcher), `qkv_rope.py`
(QKV projection with RoPE in its epilogue, and the in-place RoPE pass), `fp8.py` / `fp8_gemm.py` / `act_quant.py`
(e4m3 quantisation, the FP8 GEMM with the tower's epilogues, the MLP activation's e4m3 pass), `add_layernorm.py`,
`pos_embed.py`, `rope.py` (the rotary tables), `runtime/` (launch-configuration choice, the lean launch path and its
replays).
"""

from .attention import BACKENDS, resolve_backend, triton_supported, varlen_attention
from .rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq

__all__ = [
    "BACKENDS",
    "apply_vision_rope",
    "resolve_backend",
    "triton_supported",
    "varlen_attention",
    "vision_rope_cos_sin",
    "vision_rope_inv_freq",
]
