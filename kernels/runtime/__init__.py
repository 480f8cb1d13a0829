"""How the kernels are launched, and the launch environment they check.

- `tuner.Tuner`: one launch configuration per key, timed on its first call (`choose`).
- `launcher.Launcher`: the lean launch path through the JIT's binder and a cache of compiled kernels (`launch`), and
  the recording of a launch for replay (`record`).
- `replay.Replay`: one recorded launch, relaunched with its tensors at new addresses.
- `triton_internals`: every read of Triton's private objects, checked against the releases it was written for.

`TUNER` and `LAUNCHER` are this process's; the functions below use them. Tests build their own.
"""

from __future__ import annotations

import functools

import torch

from .launcher import Launcher, interpreting
from .replay import Replay
from .tuner import Tuner

TUNER = Tuner()
LAUNCHER = Launcher()

__all__ = ["LAUNCHER", "TUNER", "Launcher", "Replay", "Tuner", "allow_lean_launch", "cdiv", "choose", "interpreting",
           "is_hopper", "launch", "launch_status", "next_power_of_2", "record", "restore_choices", "serving",
           "size_class", "sm_count", "tuned_choices"]


def choose(key: tuple, candidates, launch):
    return TUNER.choose(key, candidates, launch)


def size_class(rows: int) -> int:
    """The pack size class a tuned choice is made for (part of its key): up to 4096 rows, up to 16384, more. Packs
    of a new size fall in a class already tuned, so they launch at once."""
    return 0 if rows <= 4096 else 1 if rows <= 16384 else 2


def tuned_choices() -> dict[tuple, object]:
    """The configurations chosen so far, by key (for logs, tests, and the service's on-disk cache)."""
    return dict(TUNER.choices)


def restore_choices(choices: dict[tuple, object]) -> int:
    return TUNER.restore(choices)


def launch(fn, grid: tuple, *args, **kwargs):
    return LAUNCHER.launch(fn, grid, *args, **kwargs)


def record(run, roles: tuple):
    return LAUNCHER.record(run, roles)


def serving(on: bool = True) -> None:
    """Whether warm-up is over: from then on, a kernel compiled on its first launch is logged as a warning (every
    request waits for it)."""
    LAUNCHER.serving = on


def allow_lean_launch(enabled: bool) -> None:
    """Whether this process's launches may take the lean path (`Launcher.allow`)."""
    LAUNCHER.allow(enabled)


def launch_status() -> dict:
    """Whether this process's launches take the lean path (`Launcher.status`)."""
    return LAUNCHER.status()


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


def cdiv(a: int, b: int) -> int:
    """Ceiling division for launch grids (triton.cdiv is a constexpr function, slow to call from the host)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1), without triton.next_power_of_2's constexpr-function call."""
    return 1 << max(0, n - 1).bit_length()
