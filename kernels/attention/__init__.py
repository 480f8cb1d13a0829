"""Varlen block-diagonal attention: the public entry point and its backend choice.

`varlen_attention` runs our Triton kernels on CUDA GPUs of compute capability 8.0 or newer, and PyTorch SDPA
everywhere else (CPU, older GPUs, no Triton). Both take exactly the same arguments and compute the same function.
The choice is made once per device (`resolve_backend`); the caller may force one (the service's
`Settings.attention_backend`).

Modules: the kernels `pointer.py` (portable) and `gluon.py` (Hopper, the tower's fused QKV layout), the latter's
remainder copy and layout check in `remainder.py`; the pointer kernel's `@triton.jit` helpers in `common.py`; the
launch configurations in `tiles.py`; checks, kernel choice and launch plans in `launch.py`; the reference and the
SDPA fallback in `reference.py`. (A third, a Hopper kernel in `tl.dot` with TMA descriptors, won none of the
served shapes on H100 or H200 and was removed: docs/PERFORMANCE.md, "Attention kernels".)
"""

from __future__ import annotations

import functools
import logging

import torch

from ..runtime import interpreting, is_hopper
from .reference import reference_varlen_attention, sdpa_gathers, sdpa_varlen_attention
from .tiles import GLUON_HEAD_DIMS

try:
    from .gluon import gluon_available
    from .launch import configure, triton_varlen_attention
except ImportError:  # pragma: no cover - machines without Triton
    triton_varlen_attention = None

    def gluon_available() -> bool:
        return False

    def configure(**_) -> None:
        pass

log = logging.getLogger(__name__)

BACKENDS = ("triton", "sdpa")

__all__ = ["BACKENDS", "configure", "reference_varlen_attention", "resolve_backend", "sdpa_gathers",
           "sdpa_varlen_attention", "triton_supported", "triton_varlen_attention", "varlen_attention"]


def check_backend(value: str | None) -> str | None:
    """`value` as a forced backend ('triton' or 'sdpa'), or None for 'auto' or None."""
    if value is None or value == "auto":
        return None
    if value not in BACKENDS:
        raise ValueError(f"attention backend {value!r}: expected one of {BACKENDS} or 'auto'")
    return value


def triton_supported(device: torch.device) -> tuple[bool, str]:
    if triton_varlen_attention is None:
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
            raise RuntimeError(f"the triton attention backend was asked for, but its kernels cannot run here: {why}")
        choice = "triton"
    elif forced == "sdpa":
        choice, why = "sdpa", "forced"
    else:
        choice = "triton" if ok and device.type == "cuda" else "sdpa"
    log.info("attention backend on %s: %s (%s)", device, choice, why)
    return choice


def resolve_backend(device: torch.device | str, head_dim: int | None = None, forced: str | None = None) -> str:
    """'triton' or 'sdpa' for this device (and head dim); `forced` ('triton', 'sdpa', or None/'auto') wins.

    Unforced, head dims that are not powers of two go to SDPA unless the Gluon kernel takes them on Hopper (72 and
    80): off Hopper the pointer kernel runs their PV remainder 64 wide (`tiles.head_dim_split`) and loses to cuDNN.
    """
    forced = check_backend(forced)
    device = torch.device(device)
    index = device.index if device.type != "cuda" else (device.index if device.index is not None else
                                                         torch.cuda.current_device())
    choice = _resolve(device.type, index, forced)
    if choice == "triton" and forced is None and head_dim is not None and head_dim & (head_dim - 1) and not (
            device.type == "cuda" and head_dim in GLUON_HEAD_DIMS and gluon_available() and is_hopper(device)):
        log.info("attention backend for head_dim %d: sdpa (cuDNN is as fast or faster than the Triton kernels "
                 "at non-power-of-two head dims off Hopper)", head_dim)
        return "sdpa"
    return choice


def varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, softmax_scale=None, seqlens=None,
                     backend: str | None = None, out=None, padded: bool = False):
    """Block-diagonal attention over packed segments (q and k rotated already: `kernels.rope`, `kernels.qkv_rope`).

    q, k, v: `(total_tokens, heads, head_dim)`, last dim contiguous, any token/head strides.
    cu_seqlens: int32 `(segments + 1,)` on q's device. max_seqlen: Python int, the longest segment.
    seqlens: optional host list of segment lengths; the SDPA path uses it to avoid a device read.
    backend: 'triton' or 'sdpa' (default: `resolve_backend(q.device)`).
    out: optional `(total_tokens, heads, head_dim)` in q's dtype, last dim contiguous, to write the result into.
    padded: rows past `cu_seqlens[-1]` are padding (a CUDA graph's bucket, whose segments are device inputs): they
    are never read or written, and the segments are never taken to fill q (see `launch`'s contract).
    Returns `(total_tokens, heads, head_dim)` in q's dtype (`out` if given).
    """
    backend = backend or resolve_backend(q.device)
    if backend == "triton":
        return triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale=softmax_scale, seqlens=seqlens,
                                       out=out, padded=padded)
    rows = slice(None)
    if padded:  # the fallback runs on the segments' rows alone
        seqlens = seqlens if seqlens is not None else (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        rows = slice(0, sum(seqlens))
        out = out if out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
        q, k, v = q[rows], k[rows], v[rows]
    result = sdpa_varlen_attention(q, k, v, cu_seqlens, max_seqlen, softmax_scale=softmax_scale, seqlens=seqlens)
    if out is None:
        return result
    out[rows].copy_(result)
    return out
