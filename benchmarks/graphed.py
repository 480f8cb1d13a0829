"""The benchmarks' graphed tower: CUDA graphs of whole tower forwards, one per pack signature (the tower's best case,
which `bench_tower` reports as `ours`; the service runs `service.model.graphs.BucketedTower`).

A forward is ~300 kernel launches (GEMMs, Triton kernels, small plan ops); launched one by one from
Python they leave the GPU idle between kernels and cost the serving process CPU time under the GIL.
A signature (the tuple of grids in the pack) that repeats -- a benchmark, or a service that sees
batches of same-sized images -- is captured once and replayed:

- the plan is built before capture, so its tensors are the graph's static inputs; the pixels are
  copied into a static buffer on each replay and the outputs are cloned out, so nothing a caller
  holds aliases graph memory;
- every graph shares one memory pool: replays run one at a time on one stream and each replay's
  outputs are cloned before the next is queued, so intermediates may overlap between graphs;
- a signature is captured the `capture_after`-th time it is seen (a one-off pack runs eagerly);
  once `max_graphs` are held no more are captured and none is evicted: a capture costs an eager
  forward plus the recording, and under varied traffic an LRU cache recaptures without end
  (the service's throughput halved when measured); a failed capture (e.g. out of memory)
  falls back to the eager forward for that signature.
Only for CUDA towers. On the SDPA backend a pack is captured only when its segments form few runs of
equal lengths (`kernels.attention.sdpa_gathers`): otherwise the fallback gathers segments with
indices built on the host at every call, which a graph cannot hold.

Where the tower can run its attention on either backend (`attention_choices`: a CUDA GPU
with the Triton kernels, no backend forced), a signature is captured once per backend, the graphs are
replayed in turn and timed by CUDA events, and the faster one is kept (Triton on near ties: see
`triton_margin`). Neither backend wins every pack: at head_dim 64 cuDNN wins a single 1024px image,
our kernel 448px images. Eager forwards keep the tower's default backend.
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter
from dataclasses import dataclass, field

import torch

from kernels.attention import sdpa_gathers, triton_supported
from service.model.graphs import Signature, eager_pass, signature
from service.model.tower import PackPlan, VisionTower, layer_segments

log = logging.getLogger(__name__)


def attention_choices(tower: VisionTower) -> tuple[str, ...]:
    """The attention backends `tower` can run, its default (`backend`) first: both on a CUDA GPU where the Triton
    kernels run, unless `options.attention_backend` forces one."""
    device = tower.device
    if tower.options.attention_backend != "auto" or device.type != "cuda" or not triton_supported(device)[0]:
        return (tower.backend,)
    return (tower.backend, "sdpa" if tower.backend == "triton" else "triton")


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    plan: PackPlan
    pixels: torch.Tensor
    merged: torch.Tensor
    deepstack: torch.Tensor
    attention: str  # the attention backend the graph runs
    replay_ms: dict[str, float] = field(default_factory=dict)  # per backend timed at capture (if more than one)


def pick_attention(ms: dict[str, float], triton_margin: float) -> str:
    """The backend to keep from each one's replay time: the fastest, but Triton unless beaten by more than
    `triton_margin` (a fraction of its time)."""
    fastest = min(ms, key=ms.get)
    if "triton" in ms and fastest != "triton" and ms["triton"] <= ms[fastest] * (1 + triton_margin):
        return "triton"
    return fastest


class GraphedTower:
    """`(pixel_values, grids) -> (merged, deepstack)`, replaying captured graphs where it can."""

    # Replays per backend when choosing: interleaved rounds, the median of each backend's times. Rounds are
    # added up to `choice_budget_ms` of replays in all (one round at least): the choice runs in front of traffic.
    choice_rounds = 5
    choice_budget_ms = 100.0
    # A burst of replays runs before the GPU settles at its power cap, where a tower spends most of its time
    # under load; our attention draws less power than cuDNN's and keeps a higher clock there (measured on H100:
    # a tie in the burst became a 2-3% Triton lead in sustained runs). So Triton is kept unless SDPA's burst
    # is faster by more than this fraction.
    triton_margin = 0.01

    def __init__(self, tower: VisionTower, max_graphs: int = 8, capture_after: int = 3):
        self.tower = tower
        self.max_graphs = max_graphs
        self.capture_after = max(1, capture_after)
        self.enabled = max_graphs > 0 and tower.device.type == "cuda"
        self._graphs: dict[Signature, _Captured] = {}
        self._seen: Counter[Signature] = Counter()
        self._failed: set[Signature] = set()
        self._pool = None
        self.replays = 0
        self.captures = 0

    def __call__(self, pixel_values: torch.Tensor, grids) -> tuple[torch.Tensor, torch.Tensor]:
        key = signature(grids)
        captured = self._graphs.get(key)
        if captured is None:
            if (not self.enabled or key in self._failed or len(self._graphs) >= self.max_graphs
                    or self._count(key) < self.capture_after or not self._capturable(key)):
                return self.tower(pixel_values, self.tower.plan(key))
            captured = self._capture(key, pixel_values)
            if captured is None:
                return self.tower(pixel_values, self.tower.plan(key))
        if pixel_values.shape != captured.pixels.shape or pixel_values.dtype != captured.pixels.dtype:
            raise ValueError(f"pixel_values {tuple(pixel_values.shape)} {pixel_values.dtype} do not match the "
                             f"grids' {tuple(captured.pixels.shape)} {captured.pixels.dtype}")
        captured.pixels.copy_(pixel_values)
        captured.graph.replay()
        self.replays += 1
        return captured.merged.clone(), captured.deepstack.clone()

    def _capturable(self, key: Signature) -> bool:
        return bool(self._choices(key))

    def _choices(self, key: Signature) -> list[str]:
        """The attention backends a graph of `key` may run: SDPA only where it needs no host-built gather."""
        distinct = {id(s): s for s in layer_segments(self.tower.config, key)}.values()
        gathers = any(sdpa_gathers(s) for s in distinct)
        return [b for b in attention_choices(self.tower) if b == "triton" or not gathers]

    def attention(self, grids) -> str | None:
        """The attention backend of the graph held for `grids`, or None if there is none."""
        captured = self._graphs.get(signature(grids))
        return captured.attention if captured is not None else None

    def replay_ms(self, grids) -> dict[str, float]:
        """Each backend's replay time measured when the graph for `grids` was chosen (empty: no choice)."""
        captured = self._graphs.get(signature(grids))
        return dict(captured.replay_ms) if captured is not None else {}

    def _count(self, key: Signature) -> int:
        if len(self._seen) > 100_000:  # bound the bookkeeping of one-off signatures
            self._seen.clear()
        self._seen[key] += 1
        return self._seen[key]

    def _capture(self, key: Signature, pixel_values: torch.Tensor) -> _Captured | None:
        tower = self.tower
        device = pixel_values.device
        graphs: dict[str, _Captured] = {}
        choices = self._choices(key)
        try:
            plan = tower.plan(key)
            for attention in choices:
                pixels = pixel_values.clone()
                eager_pass(lambda: tower(pixels, plan, attention), device)  # kernel tuning, lazy initialisation
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    merged, deepstack = tower(pixels, plan, attention)
                graphs[attention] = _Captured(graph, plan, pixels, merged, deepstack, attention)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            if not graphs:
                log.warning("CUDA graph capture failed for a pack of %d grids (%s); running it eagerly", len(key), e)
                self._failed.add(key)
                torch.cuda.synchronize(device)
                return None
            log.warning("CUDA graph capture with %s attention failed for a pack of %d grids (%s)",
                        next(b for b in choices if b not in graphs), len(key), e)
            torch.cuda.synchronize(device)
        captured = next(iter(graphs.values())) if len(graphs) == 1 else self._fastest(graphs, key)
        self._graphs[key] = captured
        self.captures += 1
        return captured

    def _fastest(self, graphs: dict[str, _Captured], key: Signature) -> _Captured:
        """Replay the graphs in turn, each timed by CUDA events, and keep the fastest by median."""
        for c in graphs.values():  # first replays: lazy initialisation, caches
            c.graph.replay()
        times: dict[str, list[float]] = {b: [] for b in graphs}
        spent, rounds = 0.0, 0
        while rounds < self.choice_rounds and (rounds == 0 or spent < self.choice_budget_ms):
            for attention, c in graphs.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                c.graph.replay()
                end.record()
                end.synchronize()
                times[attention].append(start.elapsed_time(end))
                spent += times[attention][-1]
            rounds += 1
        ms = {b: statistics.median(t) for b, t in times.items()}
        best = graphs[pick_attention(ms, self.triton_margin)]
        best.replay_ms = ms
        log.info("CUDA graph for a pack of %d grids (%d tokens): %s attention (%s)", len(key), best.plan.num_tokens,
                 best.attention, ", ".join(f"{b} {t:.3f} ms" for b, t in ms.items()))
        return best


# -- bucketed graphs: any mix of grids -----------------------------------------------------------------------------
