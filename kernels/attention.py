"""The public attention entry point and its backend choice.

`varlen_attention` runs the Triton kernel on CUDA GPUs of compute capability 8.0 or newer, and
PyTorch SDPA everywhere else (CPU, older GPUs, no Triton). Both take exactly the same arguments
and compute the same function. `QWEN3VL_ATTN_BACKEND=triton|sdpa` forces one; the choice is made
once per device and dtype and can be read back with `resolve_backend`.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .gluon_attention import gluon_available
from .tuning import interpreting, is_hopper
from .varlen_attention import GLUON_HEAD_DIMS, sdpa_varlen_attention, triton, triton_varlen_attention

log = logging.getLogger(__name__)

BACKENDS = ("triton", "sdpa")
ENV_VAR = "QWEN3VL_ATTN_BACKEND"


def forced_backend() -> str | None:
    """The backend QWEN3VL_ATTN_BACKEND forces ('triton' or 'sdpa'), or None ('auto' or unset)."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {BACKENDS} or 'auto'")
    return value


def triton_supported(device: torch.device) -> tuple[bool, str]:
    if triton is None:
        return False, "triton is not installed"
    if device.type != "cuda":
        if interpreting():
            return True, "Triton interpreter (TRITON_INTERPRET=1), tests only"
        return False, f"device {device.type} is not CUDA"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        return False, f"compute capability {major}.{minor} < 8.0"
    return True, f"CUDA sm{major}{minor}"


@functools.lru_cache(maxsize=None)
def _resolve(device_type: str, device_index: int | None, forced: str | None) -> str:
    device = torch.device(device_type, device_index) if device_index is not None else torch.device(device_type)
    ok, why = triton_supported(device)
    if forced == "triton":
        if not ok:
            raise RuntimeError(f"{ENV_VAR}=triton but the Triton kernels cannot run here: {why}")
        choice = "triton"
    elif forced == "sdpa":
        choice, why = "sdpa", f"forced by {ENV_VAR}"
    else:
        choice = "triton" if ok and device.type == "cuda" else "sdpa"
    log.info("attention backend on %s: %s (%s)", device, choice, why)
    return choice


def resolve_backend(device: torch.device | str, head_dim: int | None = None) -> str:
    """'triton' or 'sdpa' for this device (and head dim), honouring QWEN3VL_ATTN_BACKEND.

    Unforced, head dims that are not powers of two go to SDPA unless the Gluon kernel takes them on Hopper (72
    and 80): at 72 it runs 1.03-1.29x the best PyTorch baseline on the attention benchmark's cases from 1x4096
    up, and the 8B tower ran 1.05-1.32x faster eagerly on it than on SDPA (benchmarks/results/attention.json,
    tower_v16_99a774f.json). Elsewhere the pointer kernel runs their PV remainder 64 wide (head_dim_split) and
    loses everywhere (docs/PERFORMANCE.md).
    """
    device = torch.device(device)
    index = device.index if device.type != "cuda" else (device.index if device.index is not None else
                                                         torch.cuda.current_device())
    forced = forced_backend()
    choice = _resolve(device.type, index, forced)
    if choice == "triton" and forced is None and head_dim is not None and head_dim & (head_dim - 1) and not (
            device.type == "cuda" and head_dim in GLUON_HEAD_DIMS and gluon_available() and is_hopper(device)):
        log.info("attention backend for head_dim %d: sdpa (cuDNN is as fast or faster than the Triton kernels "
                 "at non-power-of-two head dims off Hopper)", head_dim)
        return "sdpa"
    return choice


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, cos=None, sin=None, softmax_scale=None, seqlens=None,
                     rotate_k: bool = True, backend: str | None = None):
    """Block-diagonal attention over packed segments, with optional fused 2D vision RoPE on q and k.

    q, k, v: `(total_tokens, heads, head_dim)`, last dim contiguous, any token/head strides.
    cu_seqlens: int32 `(segments + 1,)` on q's device. max_seqlen: Python int, the longest segment.
    cos, sin: optional float32 `(total_tokens, head_dim // 2)` rotary tables (see kernels.rope); they
    rotate q, and k too unless `rotate_k=False` (k already rotated by the caller).
    seqlens: optional host list of segment lengths; the SDPA path uses it to avoid a device read.
    Returns `(total_tokens, heads, head_dim)` in q's dtype.
    """
    backend = backend or resolve_backend(q.device)
    fn = triton_varlen_attention if backend == "triton" else sdpa_varlen_attention
    return fn(q, k, v, cu_seqlens, max_seqlen, cos=cos, sin=sin, softmax_scale=softmax_scale, seqlens=seqlens,
              rotate_k=rotate_k)
