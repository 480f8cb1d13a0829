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
import threading
import types

import torch

try:
    import triton
    _hooks = triton.knobs.runtime
except ImportError:  # pragma: no cover - machines without Triton never reach the kernels
    triton = None

_choices: dict[tuple, object] = {}
_kernels: dict[tuple, object] = {}


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def sm_count(device) -> int:
    """Streaming multiprocessors of `device`: the persistent kernels' grid."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def is_hopper(device: torch.device) -> bool:
    """Whether the CUDA `device` is sm90 (TMA and wgmma)."""
    return _is_hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def tuned_choices() -> dict[tuple, object]:
    """The configurations chosen so far, by key (for logs, tests, and the service's on-disk cache)."""
    return dict(_choices)


def restore_choices(choices: dict[tuple, object]) -> int:
    """Adopt earlier choices (a `tuned_choices()` of a process with the same kernels, GPU and versions), so that their
    keys launch at once instead of being timed again; keys already chosen here stay. Returns how many were new."""
    new = {k: v for k, v in choices.items() if k not in _choices}
    _choices.update(new)
    return len(new)


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
    tens of milliseconds and would otherwise land on one candidate (host time per call varied 2x within a run on the
    H100 machines here)."""
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
    kernel, bound, device = _launch(fn, grid, args, kwargs)
    launches = getattr(_recording, "launches", None)
    if launches is not None:  # under `record`: bound is None for a launch through the JIT
        launches.append(None if bound is None else (tuple(grid) + (1,) * (3 - len(grid)), kernel, bound, device))
    return kernel


def _launch(fn, grid, args, kwargs):
    """The launch, and (bound arguments, device) where it was lean."""
    if _lean is False or interpreting() or _hooks.launch_enter_hook.calls:
        return fn[grid](*args, **kwargs), None, None
    device = torch.cuda.current_device()
    try:
        binder = fn.device_caches[device][4]
    except (AttributeError, KeyError, IndexError, TypeError):
        return _first_launch(fn, grid, args, kwargs, None), None, None
    bound, specialization, options = binder(*args, **kwargs)
    key = (id(fn), device, tuple(specialization), tuple(options.items()))  # JIT functions hash their source
    try:
        kernel = _kernels.get(key)
    except TypeError:  # an argument whose specialisation is not hashable
        return fn[grid](*args, **kwargs), None, None
    if kernel is None:
        return _first_launch(fn, grid, args, kwargs, key), None, None
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], grid_1, grid_2, _current_stream(device), kernel.function, kernel.packed_metadata, None,
               None, None, *bound.values())
    return kernel, bound, device


_lean = None  # None: not yet known whether this Triton's internals are the ones `launch` expects


# ----------------------------------------------------------------------------------------------------
# Replays: one launch bound once, relaunched with its tensors at new addresses
# ----------------------------------------------------------------------------------------------------

_recording = threading.local()


class Replay:
    """One lean launch, with every argument bound, specialised and expanded once, relaunched straight through the
    kernel's C launcher with its tensors' current addresses.

    What `launch` still does per call, and a replay does not: the binder (each argument specialised, each tensor
    descriptor's layout printed into its key), the launcher's Python wrapper (each descriptor encoded into a
    CUtensorMap, each tensor's address checked with a driver call). A replay reads one address per role, re-encodes
    a descriptor only where its base moved, and passes addresses as integers. The caller keys replays by everything
    else the launch depends on (shapes, strides, dtypes, scalars, the 16-byte alignment of every address: Triton's
    specialisation) and passes the same roles in the same order; a launch whose arguments hold a tensor outside
    `roles`, or that needs global scratch, is not replayable (`record` returns False).
    """

    def __init__(self, grid, kernel, bound, device, roles):
        runner = kernel.run
        if getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1):
            raise _NotReplayable("needs scratch per launch")
        c_launch, meta = _c_launcher(runner)
        signature = list(kernel.src.signature.values())
        values = list(bound.values())
        if len(signature) != len(values):
            raise _NotReplayable("signature and arguments differ in length")
        self.ptr_slots: list[tuple[int, int]] = []  # (position in the launch's arguments, role)
        # [position, role, descriptor, its metadata, (base address, its encoding)]: the pair replaced whole, so a
        # thread never reads one base's address with another's encoding
        self.desc_slots: list[list] = []
        head = [*grid, None, kernel.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
                kernel.packed_metadata, None, None, None]
        expanded, descs = list(head), 0
        for value, ty in zip(values, signature):
            if isinstance(ty, str) and ty.startswith("tensordesc"):
                if meta is None or meta[descs] is None:
                    raise _NotReplayable("tensor descriptor without its metadata")
                role, address = _role(value.base, roles), value.base.data_ptr()
                encoded = _make_tensordesc_arg()(value, meta[descs])
                self.desc_slots.append([len(expanded), role, value, meta[descs], (address, encoded[0])])
                expanded.extend(encoded)
                descs += 1
            elif isinstance(ty, str) and ty.startswith("*"):
                if value is not None:
                    self.ptr_slots.append((len(expanded), _role(value, roles)))
                expanded.append(None if value is None else value.data_ptr())
            elif isinstance(value, torch.Tensor) or isinstance(ty, tuple):
                raise _NotReplayable(f"argument of type {ty}")
            else:
                expanded.append(value)
        self.template, self.c_launch, self.device = expanded, c_launch, device

    def __call__(self, addresses) -> bool:
        """Launches on the current stream with the roles' `addresses` (ints, in `roles` order); False, launching
        nothing, where a launch hook is installed (a profiler's: the JIT's path calls it)."""
        if _hooks.launch_enter_hook.calls or _hooks.launch_exit_hook.calls:
            return False
        args = self.template.copy()
        args[3] = _current_stream(self.device)
        for position, role in self.ptr_slots:
            args[position] = addresses[role]
        for slot in self.desc_slots:
            address, encoded = slot[4]
            if address != addresses[slot[1]]:
                address, desc = addresses[slot[1]], slot[2]
                moved = types.SimpleNamespace(base=_Address(address), shape=desc.shape, strides=desc.strides,
                                              padding=desc.padding)
                encoded = _make_tensordesc_arg()(moved, slot[3])[0]
                slot[4] = (address, encoded)
            args[slot[0]] = encoded
        self.c_launch(*args)
        return True


class _NotReplayable(Exception):
    pass


class _Address:
    """A tensor descriptor's base as Triton's encoder reads it: only its address."""

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def _role(tensor, roles) -> int:
    for i, role in enumerate(roles):
        if tensor is role:
            return i
    raise _NotReplayable("a tensor outside the caller's roles")


def _c_launcher(runner):
    """The compiled launcher behind Triton's CudaLauncher and the descriptors' encoding metadata: its `launch` is the
    C function itself, or the wrapper that encodes tensor descriptors around it (Triton 3.4+)."""
    launch = runner.launch
    if isinstance(launch, types.BuiltinFunctionType):
        return launch, None
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    cells = dict(zip(code.co_freevars, closure)) if code is not None and closure else {}
    if "launcher" not in cells or "tensordesc_meta" not in cells:
        raise _NotReplayable("unknown launcher wrapper")
    return cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents


@functools.lru_cache(maxsize=None)
def _make_tensordesc_arg():
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg


def record(run, roles: tuple) -> Replay | bool | None:
    """Runs `run()` and returns a Replay of its one launch through `launch` with `roles` (the tensors whose addresses
    change between calls). False where it made several launches, or one that cannot be replayed; None where its one
    launch went through the JIT (a first launch, which compiles; a hook): a later call may record."""
    _recording.launches = launches = []
    try:
        run()
    finally:
        _recording.launches = None
    if len(launches) > 1:
        return False
    if not launches or launches[0] is None:
        return None
    try:
        return Replay(*launches[0], roles)
    except (_NotReplayable, AttributeError, ImportError, IndexError, TypeError):
        return False


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
