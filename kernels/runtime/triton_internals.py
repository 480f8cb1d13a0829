"""Every read of Triton's private objects, in one place, for the Triton versions it was written for.

The lean launcher (`launcher.py`) and the launch replays (`replay.py`) skip the JIT's per-call Python work by reading
what Triton keeps inside: the binder the JIT builds per device, a compiled kernel's launcher and metadata, the
closure of the launcher's wrapper that encodes tensor descriptors, and a descriptor built without its validating
constructor (`gluon.py`). Those are not Triton's API and change between releases. On a Triton outside `SUPPORTED`,
or where what is read is not there, the launcher takes Triton's own path (same results, more host time per launch)
and says so once (`launcher.Launcher.status`, the start-up log and /info).
"""

from __future__ import annotations

import functools
import types

try:
    import triton
except ImportError:  # pragma: no cover - machines without Triton never reach the kernels
    triton = None

# the Triton releases (major, minor) whose internals this module reads, inclusive
SUPPORTED = ((3, 6), (3, 9))


def version() -> str:
    return triton.__version__ if triton is not None else "none"


def supported() -> bool:
    """Whether the installed Triton is one this module was written for."""
    if triton is None:
        return False
    try:
        major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED[0] <= (major, minor) <= SUPPORTED[1]


def launch_hooks_installed() -> bool:
    """Whether a launch hook (a profiler's) is installed: only the JIT's own path calls it."""
    hooks = triton.knobs.runtime
    return bool(hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls)


def binder(fn, device: int):
    """The argument binder the JIT built for `fn` on `device` (None: not built yet, or another layout): it returns
    (bound arguments, specialisation, options) for a call's arguments."""
    try:
        return fn.device_caches[device][4]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


def launchable(kernel) -> bool:
    """Whether a compiled kernel exposes what a direct launch uses (`run`, `function`, `packed_metadata`)."""
    return all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata"))


def launch_direct(kernel, grid: tuple, stream, values) -> None:
    """Launch a compiled kernel through its launcher, arguments as the binder bound them."""
    grid_1 = grid[1] if len(grid) > 1 else 1
    grid_2 = grid[2] if len(grid) > 2 else 1
    kernel.run(grid[0], grid_1, grid_2, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)


def needs_scratch(kernel) -> bool:
    runner = kernel.run
    return bool(getattr(runner, "global_scratch_size", 1) or getattr(runner, "profile_scratch_size", 1))


def launch_head(grid: tuple, kernel) -> list:
    """The arguments of the C launcher before the kernel's own, the stream (index 3) left to fill."""
    runner = kernel.run
    return [*grid, None, kernel.function, runner.launch_cooperative_grid, runner.launch_pdl, None, None,
            kernel.packed_metadata, None, None, None]


def signature(kernel) -> list:
    return list(kernel.src.signature.values())


class Unknown(Exception):
    """What this module reads is not there in this Triton."""


def c_launcher(kernel):
    """The compiled launcher behind Triton's CudaLauncher and the descriptors' encoding metadata: its `launch` is the
    C function itself, or the wrapper that encodes tensor descriptors around it (Triton 3.4+)."""
    launch = kernel.run.launch
    if isinstance(launch, types.BuiltinFunctionType):
        return launch, None
    code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
    cells = dict(zip(code.co_freevars, closure)) if code is not None and closure else {}
    if "launcher" not in cells or "tensordesc_meta" not in cells:
        raise Unknown("unknown launcher wrapper")
    return cells["launcher"].cell_contents, cells["tensordesc_meta"].cell_contents


@functools.lru_cache(maxsize=None)
def make_tensordesc_arg():
    """Triton's encoder of a host tensor descriptor into the launcher's arguments."""
    from triton.backends.nvidia.driver import make_tensordesc_arg as encode  # noqa: PLC0415

    return encode


@functools.lru_cache(maxsize=None)
def _stream_getter():
    return triton.runtime.driver.active.get_current_stream


def current_stream(device: int):
    return _stream_getter()(device)


def unvalidated(cls, fields: dict):
    """An instance of `cls` (a tensor descriptor class) with `fields`, without running its constructor's checks."""
    obj = cls.__new__(cls)
    vars(obj).update(fields)
    return obj
