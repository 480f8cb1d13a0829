"""Launch-configuration choice without `triton.autotune`, a lean launch path, and the launch
environment the kernels check.

One choice per key (kernel, size class, dims, dtype, device ...), timed once on the first call with
that key (the service's warm-up covers the classes it serves); every later call launches the chosen
configuration directly. The autotuner's per-call bookkeeping and pre-hook cost more host time than a
small pack's whole kernel (docs/PERFORMANCE.md), and so does much of the JIT's own launch path: see
`launch`.
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
_kernels: dict[tuple, object] = {}


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
        times = _timings(candidates, launch, 10, 15)
        if min(times) == float("inf"):
            launch(candidates[0])  # raises the first candidate's error
            raise RuntimeError(f"no candidate for {key} could be timed")
        # Candidates within 5% of the best are re-timed, longer: 45 ms of runs does not separate tiles 2-3% apart
        # (the QKV GEMM's two persistent tiles, 0.261 vs 0.268 ms, were picked either way).
        close = [c for c, t in zip(candidates, times) if t <= 1.05 * min(times)]
        if len(close) > 1:
            times, candidates = _timings(close, launch, 25, 70), close
        choice = candidates[times.index(min(times))]
    _choices[key] = choice
    return choice


TIMING_ROUNDS = 3


def _timings(candidates, launch, warmup: int, rep: int) -> list[float]:
    """Each candidate's median of TIMING_ROUNDS timings (`do_bench`, ms; inf where it fails), the rounds
    interleaved: where a call's host time counts (small calls launched eagerly), the host's own slow spells last
    tens of milliseconds and would otherwise land on one candidate (H100 machines here, host time per call
    varying 2x within a run: benchmarks/results/launch/launch_profile_d72_h100_rev20f7171.json)."""
    runs = [[] for _ in candidates]
    for _ in range(TIMING_ROUNDS):
        for c, run in zip(candidates, runs):
            try:
                run.append(triton.testing.do_bench(lambda c=c: launch(c), warmup=warmup, rep=rep))
            except Exception:  # noqa: BLE001 - a candidate that does not compile or launch here is skipped
                run.append(float("inf"))
    return [sorted(run)[len(run) // 2] for run in runs]


def launch(fn, grid: tuple, *args, **kwargs):
    """`fn[grid](*args, **kwargs)` for a `triton.jit` function, through a cache of its compiled kernels.

    The JIT's launch path reads knobs, builds its cache key from the options' string form, checks the
    globals the kernel used and builds launch metadata for hooks on every call. This keeps the one part
    that decides which compiled kernel is valid, the JIT's own binder (Triton's specialisation of every
    argument: dtypes, 16-byte alignment, ints divisible by 16 or equal to 1), and keys compiled kernels
    by its result; a miss, the interpreter, an installed launch hook or a Triton whose internals differ
    goes through `fn[grid]`, which compiles and launches as usual.
    """
    if _lean is False or interpreting() or triton.knobs.runtime.launch_enter_hook.calls:
        return fn[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    try:
        binder = fn.device_caches[device][4]
    except (AttributeError, KeyError, IndexError, TypeError):
        return _first_launch(fn, grid, args, kwargs, None)
    bound, specialization, options = binder(*args, **kwargs)
    key = (id(fn), device, tuple(specialization), tuple(options.items()))  # JIT functions hash their source
    try:
        kernel = _kernels.get(key)
    except TypeError:  # an argument whose specialisation is not hashable
        return fn[grid](*args, **kwargs)
    if kernel is None:
        return _first_launch(fn, grid, args, kwargs, key)
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], grid_1, grid_2, _current_stream(device), kernel.function, kernel.packed_metadata, None,
               None, None, *bound.values())
    return kernel


_lean = None  # None: not yet known whether this Triton's internals are the ones `launch` expects


def _first_launch(fn, grid, args, kwargs, key):
    global _lean
    kernel = fn[grid](*args, **kwargs)
    if hasattr(kernel, "result"):  # compiled asynchronously
        kernel = kernel.result()
    if _lean is None:
        _lean = key is not None and all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))
    if _lean and key is not None:
        _kernels[key] = kernel
    return kernel


@functools.lru_cache(maxsize=None)
def _stream_getter():
    return triton.runtime.driver.active.get_current_stream


def _current_stream(device: int):
    return _stream_getter()(device)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids (triton.cdiv is a constexpr function: ~4 us per host call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1), without triton.next_power_of_2's constexpr-function call."""
    return 1 << max(0, n - 1).bit_length()
