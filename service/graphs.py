"""CUDA graphs of whole tower forwards, one per pack signature.

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
  (measured: the service fell from 520 to 238 images/s); a failed capture (e.g. out of memory)
  falls back to the eager forward for that signature.
Only for CUDA towers. On the SDPA backend a pack is captured only when its segments form few runs of
equal lengths (`kernels.varlen_attention.sdpa_gathers`): otherwise the fallback gathers segments with
indices built on the host at every call, which a graph cannot hold.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass

import torch

from kernels.varlen_attention import sdpa_gathers

from .tower import PackPlan, VisionTower, segment_lengths

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int], ...]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    plan: PackPlan
    pixels: torch.Tensor
    merged: torch.Tensor
    deepstack: torch.Tensor


class GraphedTower:
    """`(pixel_values, grids) -> (merged, deepstack)`, replaying captured graphs where it can."""

    def __init__(self, tower: VisionTower, max_graphs: int = 8, capture_after: int = 3):
        self.tower = tower
        self.max_graphs = max_graphs
        self.capture_after = max(1, capture_after)
        self.enabled = max_graphs > 0 and tower.pos_embed.weight.is_cuda
        self._graphs: dict[Signature, _Captured] = {}
        self._seen: Counter[Signature] = Counter()
        self._failed: set[Signature] = set()
        self._pool = None
        self.replays = 0
        self.captures = 0

    def __call__(self, pixel_values: torch.Tensor, grids) -> tuple[torch.Tensor, torch.Tensor]:
        key: Signature = tuple(tuple(int(x) for x in g) for g in grids)
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
        return self.tower.backend == "triton" or not sdpa_gathers(segment_lengths(key))

    def _count(self, key: Signature) -> int:
        if len(self._seen) > 100_000:  # bound the bookkeeping of one-off signatures
            self._seen.clear()
        self._seen[key] += 1
        return self._seen[key]

    def _capture(self, key: Signature, pixel_values: torch.Tensor) -> _Captured | None:
        tower = self.tower
        try:
            plan = tower.plan(key)
            pixels = pixel_values.clone()
            # one eager run on a side stream first: kernel autotuning, lazy library initialisation
            side = torch.cuda.Stream(pixels.device)
            side.wait_stream(torch.cuda.current_stream(pixels.device))
            with torch.cuda.stream(side):
                tower(pixels, plan)
            torch.cuda.current_stream(pixels.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                merged, deepstack = tower(pixels, plan)
        except (torch.OutOfMemoryError, RuntimeError) as e:
            log.warning("CUDA graph capture failed for a pack of %d grids (%s); running it eagerly", len(key), e)
            self._failed.add(key)
            torch.cuda.synchronize(pixel_values.device)
            return None
        captured = self._graphs[key] = _Captured(graph, plan, pixels, merged, deepstack)
        self.captures += 1
        return captured
