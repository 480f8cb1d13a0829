"""The lean launch path: `fn[grid](*args)` for a `triton.jit` function, through a cache of its compiled kernels.

The JIT's launch path reads knobs, builds its cache key from the options' string form, checks the globals the kernel
used and builds launch metadata for hooks on every call. `Launcher.launch` keeps the one part that decides which
compiled kernel is valid, the JIT's own binder (Triton's specialisation of every argument: dtypes, 16-byte
alignment, ints divisible by 16 or equal to 1), and keys compiled kernels by its result. A miss, the interpreter, an
installed launch hook or a Triton whose internals differ (`triton_internals`) goes through `fn[grid]`, which
compiles and launches as usual.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

import torch

import kernels.runtime.triton_internals as internals
from .replay import NotReplayable, Replay

log = logging.getLogger(__name__)


def interpreting() -> bool:
    """Whether Triton runs its CPU interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class Launcher:
    """The compiled kernels of one process, by (function, device, specialisation, options), and whether the lean path
    works with this Triton (`lean`: None until the first compiled launch tells; False: every launch through the
    JIT, `reason` says why). `stream(device)` gives the current stream's handle."""

    def __init__(self, stream: Callable[[int], object] = internals.current_stream,
                 supported: Callable[[], bool] = internals.supported):
        self.kernels: dict[tuple, object] = {}
        self.lean: bool | None = None
        self.reason = ""
        self.stream = stream
        self._supported = supported
        self._recording = threading.local()
        self.serving = False  # set once warm-up is done: a compile after it is logged (`_first_launch`)
        self.compiles_while_serving = 0

    def status(self) -> dict:
        """Whether launches take the lean path (None: no kernel compiled yet), why not, and Triton's version."""
        return {"lean": self.lean, "reason": self.reason, "triton": internals.version(),
                "compiles_while_serving": self.compiles_while_serving}

    def launch(self, fn, grid: tuple, *args, **kwargs):
        """`fn[grid](*args, **kwargs)`; returns the compiled kernel."""
        kernel, bound, device = self._launch(fn, grid, args, kwargs)
        launches = getattr(self._recording, "launches", None)
        if launches is not None:  # under `record`: bound is None for a launch through the JIT
            launches.append(None if bound is None else (tuple(grid) + (1,) * (3 - len(grid)), kernel, bound, device))
        return kernel

    def _launch(self, fn, grid, args, kwargs):
        """The launch, and (bound arguments, device) where it was lean."""
        if self.lean is False or interpreting() or internals.launch_hooks_installed():
            return fn[grid](*args, **kwargs), None, None
        device = torch.cuda.current_device()
        binder = internals.binder(fn, device)
        if binder is None:
            kernel = self._first_launch(fn, grid, args, kwargs, None)
            if self.lean is None and internals.binder(fn, device) is None:
                self._off("the JIT keeps no argument binder where the lean path reads it")
            return kernel, None, None
        bound, specialization, options = binder(*args, **kwargs)
        key = (id(fn), device, tuple(specialization), tuple(options.items()))  # JIT functions hash their source
        try:
            kernel = self.kernels.get(key)
        except TypeError:  # an argument whose specialisation is not hashable
            return fn[grid](*args, **kwargs), None, None
        if kernel is None:
            return self._first_launch(fn, grid, args, kwargs, key), None, None
        internals.launch_direct(kernel, grid, self.stream(device), bound.values())
        return kernel, bound, device

    def _first_launch(self, fn, grid, args, kwargs, key):
        start = time.perf_counter()
        kernel = fn[grid](*args, **kwargs)
        if hasattr(kernel, "result"):  # compiled asynchronously
            kernel = kernel.result()
        if self.serving and key is not None:
            # every request waits while the engine compiles: a shape (or specialisation) the warm-up missed
            self.compiles_while_serving += 1
            log.warning("kernel %s compiled while serving, in %.0f ms: a specialisation the warm-up did not cover (%s)",
                        getattr(fn, "__name__", fn), 1e3 * (time.perf_counter() - start), self._uncovered(fn, key))
        if self.lean is None and key is not None:
            if not self._supported():
                self._off(f"Triton {internals.version()} is outside the releases whose internals the lean path "
                          f"reads ({internals.SUPPORTED})")
            elif not internals.launchable(kernel):
                self._off("a compiled kernel lacks the launcher fields the lean path uses")
            else:
                self.lean = True
        if self.lean and key is not None:
            self.kernels[key] = kernel
        return kernel

    def _uncovered(self, fn, key: tuple) -> str:
        """What sets `key`'s specialisation apart: the arguments (by name where the JIT function lists them) whose
        specialisation differs from the nearest one compiled for the same function, device and options, with the
        compiled one's beside each: what a warm-up must add to cover it."""
        names = list(getattr(fn, "arg_names", ()))
        spec = key[2]
        known = [k[2] for k in self.kernels if k[0] == key[0] and k[1] == key[1] and k[3] == key[3]
                 and len(k[2]) == len(spec)]
        if not known:
            return f"none compiled with these options; specialisation {str(spec)[:600]}"
        nearest = min(known, key=lambda other: sum(a != b for a, b in zip(spec, other)))
        diff = [f"{names[i] if i < len(names) else f'argument {i}'}: {str(now)[:160]} (compiled: {str(was)[:160]})"
                for i, (now, was) in enumerate(zip(spec, nearest)) if now != was]
        return "; ".join(diff)

    def allow(self, enabled: bool) -> None:
        """The operator's choice (`lean_launch`): False sends every launch through Triton's own path from now on;
        True lets the next compiled launch decide again whether this Triton supports the lean path."""
        self.kernels.clear()
        if enabled:
            self.lean, self.reason = None, ""
        else:
            self.lean, self.reason = False, "turned off (lean_launch=false)"
            log.info("kernel launches take Triton's own path: turned off by the settings (lean_launch=false)")

    def _off(self, reason: str) -> None:
        self.lean, self.reason = False, reason
        log.warning("kernel launches take Triton's own path, with more host time per launch: %s", reason)

    def record(self, run: Callable[[], object], roles: tuple) -> Replay | bool | None:
        """Runs `run()` and returns a Replay of its one launch with `roles` (the tensors whose addresses change between
        calls). False where it made several launches, or one that cannot be replayed; None where its one launch went
        through the JIT (a first launch, which compiles; a hook): a later call may record."""
        self._recording.launches = launches = []
        try:
            run()
        finally:
            self._recording.launches = None
        if len(launches) > 1:
            return False
        if not launches or launches[0] is None:
            return None
        try:
            return Replay(*launches[0], roles, stream=self.stream)
        except (NotReplayable, AttributeError, ImportError, IndexError, TypeError):
            return False
