"""Launch-configuration choice without `triton.autotune`: one choice per key (kernel, size class, dims, dtype,
device ...), timed once on the first call with that key (the service's warm-up covers the classes it serves); every
later call launches the chosen configuration directly. The autotuner's per-call bookkeeping and pre-hook cost more
host time than a small pack's whole kernel (docs/PERFORMANCE.md)."""

from __future__ import annotations

from typing import Callable

import torch

try:
    import triton
except ImportError:  # pragma: no cover - machines without Triton never reach the kernels
    triton = None


def _do_bench(fn, warmup: int, rep: int) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep)


class Tuner:
    """The choices of one process. `timer(fn, warmup_ms, rep_ms)` times a launch (ms; Triton's `do_bench`);
    `capturing()` says whether the current stream is being captured into a CUDA graph, where nothing can be timed."""

    ROUNDS = 3  # timings per candidate, interleaved; the median is kept

    def __init__(self, timer: Callable[..., float] = _do_bench,
                 capturing: Callable[[], bool] = lambda: torch.cuda.is_current_stream_capturing()):
        self.choices: dict[tuple, object] = {}
        # what each key's choice rested on: (candidate, median ms) of every candidate, first with the short timings,
        # then of those re-timed longer (the same list where none was); for benchmarks that ask what a choice rested on
        self.timings: dict[tuple, tuple[list, list]] = {}
        self.timer = timer
        self.capturing = capturing

    def choose(self, key: tuple, candidates: Callable[[], list], launch: Callable[[object], object]):
        """The configuration for `key`; `candidates()` lists them (only called the first time) and `launch(c)` runs
        one. Under CUDA-graph capture, the first candidate."""
        choice = self.choices.get(key)
        if choice is not None:
            return choice
        listed = candidates()
        if len(listed) == 1 or self.capturing():
            choice = listed[0]
        else:
            times = self._timings(listed, launch, 10, 15)
            if min(times) == float("inf"):
                launch(listed[0])  # raises the first candidate's error
                raise RuntimeError(f"no candidate for {key} could be timed")
            first = list(zip(listed, times))
            # Candidates within 5% of the best are timed again, longer: short runs do not separate tiles a few
            # percent apart.
            close = [c for c, t in zip(listed, times) if t <= 1.05 * min(times)]
            if len(close) > 1:
                times, listed = self._timings(close, launch, 25, 70), close
            choice = listed[times.index(min(times))]
            self.timings[key] = (first, list(zip(listed, times)))
        self.choices[key] = choice
        return choice

    def _timings(self, candidates: list, launch, warmup: int, rep: int) -> list[float]:
        """Each candidate's median of ROUNDS timings (ms; inf where it fails), the rounds interleaved: where a call's
        host time counts (small calls launched eagerly), the host's slow spells last tens of milliseconds and would
        otherwise land on one candidate."""
        runs = [[] for _ in candidates]
        for _ in range(self.ROUNDS):
            for c, run in zip(candidates, runs):
                try:
                    run.append(self.timer(lambda c=c: launch(c), warmup, rep))
                except Exception:  # noqa: BLE001 - a candidate that does not compile or launch here is skipped
                    run.append(float("inf"))
        return [sorted(run)[len(run) // 2] for run in runs]

    def restore(self, choices: dict[tuple, object]) -> int:
        """Adopt earlier choices (of a process with the same kernels, GPU and versions), so that their keys launch at
        once instead of being timed again; keys already chosen here stay. Returns how many were new."""
        new = {k: v for k, v in choices.items() if k not in self.choices}
        self.choices.update(new)
        return len(new)
