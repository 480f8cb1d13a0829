"""Launch-configuration choice without `triton.autotune`, and the launch environment the kernels check.

One choice per key (kernel, size class, dims, dtype, device ...), timed once on the first call with
that key (the service's warm-up covers the classes it serves); every later call launches the chosen
configuration straight through the JIT function. The autotuner's per-call bookkeeping and pre-hook cost
more host time than a small pack's whole kernel (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
except ImportError:  # pragma: no cover - machines without Triton never reach the kernels
    triton = None

_choices: dict[tuple, object] = {}


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def is_hopper(device: torch.device) -> bool:
    """Whether the CUDA `device` is sm90 (TMA and wgmma)."""
    return _is_hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def tuned_choices() -> dict[tuple, object]:
    """The configurations chosen so far, by key (for logs and tests)."""
    return dict(_choices)


def choose(key: tuple, candidates, launch):
    """The configuration for `key`; `candidates()` lists them (only called the first time) and
    `launch(c)` runs one. Under CUDA-graph capture, where nothing can be timed, the first candidate."""
    choice = _choices.get(key)
    if choice is not None:
        return choice
    candidates = candidates()
    if len(candidates) == 1 or torch.cuda.is_current_stream_capturing():
        choice = candidates[0]
    else:
        times, error = [], None
        for c in candidates:
            try:
                times.append(triton.testing.do_bench(lambda c=c: launch(c), warmup=10, rep=40))
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile or launch here is skipped
                times.append(float("inf"))
                error = e
        if min(times) == float("inf"):
            raise error
        # Candidates within 5% of the best are re-timed, longer and back to back: 40 ms of runs does
        # not separate tiles 2-3% apart (the QKV GEMM's two persistent tiles, 0.261 vs 0.268 ms, were
        # picked either way).
        close = [c for c, t in zip(candidates, times) if t <= 1.05 * min(times)]
        if len(close) > 1:
            times = [triton.testing.do_bench(lambda c=c: launch(c), warmup=25, rep=200) for c in close]
            candidates = close
        choice = candidates[times.index(min(times))]
    _choices[key] = choice
    return choice
