"""Preprocessed items -> per-item embeddings, through packed forwards of the tower.

No HTTP and no queueing here. `encode` runs one packed forward and splits its outputs back per item;
the batching engine uses its two halves, `launch` (dispatch, asynchronous on the GPU) and `finish`
(wait, split), to keep two forwards in flight. An item's result does not depend on what it was
packed with (attention is block-diagonal per frame, every other op is per token).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import DeviceUnavailable
from .graphs import EAGER_MARGIN, BucketedTower
from .loader import load_tower
from .preprocess import Preprocessor, Preprocessed, lut_table, patchify
from .results import EncodeResult
from .tower import TowerOptions, VisionTower


def bind_thread(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device (no-op elsewhere). CUDA's current device is per thread,
    and Triton launches on it: a kernel given tensors on cuda:N from a thread still on cuda:0 fails ("cannot be
    accessed from Triton"), and a thread that never chose one creates a context on cuda:0. Every thread that touches
    the model's device calls this first."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"{device}: CUDA is not available to this process (torch {torch.__version__}, "
                                    f"CUDA build {torch.version.cuda}, CUDA_VISIBLE_DEVICES="
                                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
        torch.cuda.set_device(device.index if device.index is not None else 0)


class Encoder:
    def __init__(self, tower: VisionTower, preprocessor: Preprocessor, graph_buckets: tuple[int, ...] = (),
                 eager_margin: float | None = EAGER_MARGIN):
        """`graph_buckets`: the token counts whose CUDA graphs `capture_graphs` records (empty: every forward runs
        eagerly); `eager_margin`: `BucketedTower`'s."""
        self.tower = tower
        self.forward = BucketedTower(tower, graph_buckets, eager_margin)
        self.preprocessor = preprocessor
        p = next(tower.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.config = tower.config
        self._luts: dict[bytes, torch.Tensor] = {}  # preprocessing LUTs, on the device
        self._last_lut: tuple = (None, None)  # the last LUT array asked for, and its table
        # CUDA events of finished forwards, recorded again by later ones (creating one costs host time)
        self._events: list[torch.cuda.Event] = []
        # The copies run beside the forwards, each way on a stream of its own (the GPU has a copy engine each way):
        # a pack's frames go over while the forward before it computes, its outputs come back while the next one
        # does. On the compute stream nothing would compute while they run (docs/PERFORMANCE.md, "Service").
        cuda = self.device.type == "cuda"
        self._upload = torch.cuda.Stream(self.device) if cuda else None
        self._download = torch.cuda.Stream(self.device) if cuda else None

    @classmethod
    def load(cls, model: str, device="cpu", dtype="float32", options: TowerOptions = TowerOptions(),
             graph_buckets: tuple[int, ...] = (), eager_margin: float | None = EAGER_MARGIN) -> "Encoder":
        tower, pre_cfg = load_tower(model, device, dtype, options)
        return cls(tower, Preprocessor(pre_cfg), graph_buckets, eager_margin)

    def capture_graphs(self, timings: dict[int, float] | None = None) -> None:
        """Record the CUDA graphs of every token bucket (start-up, after the kernels are compiled and tuned), and
        time their forwards (`timings`: an earlier start's, taken instead: `BucketedTower.time_buckets`)."""
        if self.forward.buckets and self.device.type == "cuda":
            self.forward.capture(timings)

    def computed_tokens(self, tokens: int) -> int:
        """The rows a forward of a pack of `tokens` patches computes: its graph bucket's (the rest is padding), or
        its own where it runs eagerly."""
        if not self.forward.captured:
            return tokens
        return self.forward.bucket_for(tokens) or tokens

    def forward_ms(self, tokens: int) -> float | None:
        """The GPU ms of a forward of a pack of `tokens` patches as timed at start-up (`BucketedTower.forward_ms`);
        None where its buckets were not timed (no CUDA graphs)."""
        return self.forward.forward_ms(tokens) if self.forward.captured else None

    @property
    def backend(self) -> str:
        return self.tower.backend

    def preprocess(self, data, min_pixels: int | None = None, max_pixels: int | None = None, fps: float | None = None,
                   num_frames: int | None = None) -> Preprocessed:
        return self.preprocessor(data, min_pixels, max_pixels, fps, num_frames)

    def pixels(self, items: list[Preprocessed]) -> torch.Tensor:
        """Patch rows of the pack, in the tower's dtype on its device: uint8 frames go over, then are normalised and
        patchified there, each run of consecutive items of one shape in one pass (a pack of same-sized images is
        one kernel, not one per image).

        Frames in page-locked host memory (the engine process's mapping of a front-end's shared arena, registered
        with CUDA) are read by the copy engine where they lie; the others are gathered into one pinned buffer first,
        each run of them copied over at once."""
        sizes = [it.frames.size for it in items]
        frames = self._frames(items, sizes)
        out = torch.empty((sum(it.num_patches for it in items), self.config.patch_dim), dtype=self.dtype,
                          device=self.device)
        offset, row, i = 0, 0, 0
        while i < len(items):
            first = items[i]
            j = i + 1
            while (j < len(items) and items[j].frames.shape == first.frames.shape and items[j].config == first.config
                   and (items[j].lut is first.lut or np.array_equal(items[j].lut, first.lut))):
                j += 1
            n, rows = sizes[i] * (j - i), first.num_patches * (j - i)
            patchify(frames[offset:offset + n].view(j - i, *first.frames.shape), self._lut(first), first.config,
                     out[row:row + rows])
            offset, row, i = offset + n, row + rows, j
        return out

    def _frames(self, items: list[Preprocessed], sizes: list[int]) -> torch.Tensor:
        """The items' uint8 frames in one device buffer. On CUDA they are copied on the upload stream; the current
        (compute) stream waits for them, and the buffer is not reused before that stream is done with it.

        A handful of torch calls whatever the pack's size: each call lets go of the interpreter lock and must win it
        back from the engine's other threads (its event loop, the result copiers), at up to a switch interval each,
        so calls per item would make a launch's host time grow with the load until the GPU waits for it
        (docs/PERFORMANCE.md, "The GPU waiting for launches")."""
        cuda = self._upload is not None
        compute = torch.cuda.current_stream(self.device) if cuda else None
        sources = [torch.from_numpy(it.frames.reshape(-1)) for it in items]
        with torch.cuda.stream(self._upload) if cuda else contextlib.nullcontext():
            frames = torch.empty(sum(sizes), dtype=torch.uint8, device=self.device)
            if not cuda:
                torch.cat(sources, out=frames)
            else:
                parts = frames.split(sizes)
                direct = [i for i, it in enumerate(items) if it.pinned]
                if direct:  # one call queues every copy
                    torch._foreach_copy_([parts[i] for i in direct], [sources[i] for i in direct], non_blocking=True)
                if len(direct) < len(items):
                    offsets = [0, *itertools.accumulate(sizes)]
                    self._stage(frames, [(offsets[i], sources[i]) for i, it in enumerate(items) if not it.pinned])
        if cuda:
            compute.wait_stream(self._upload)
            frames.record_stream(compute)
        return frames

    @staticmethod
    def _stage(frames: torch.Tensor, staged: list[tuple[int, torch.Tensor]]) -> None:
        """Copy pageable `staged` (offset in `frames`, bytes) to the device through one pinned buffer, gathered there
        in one call: one transfer per run of adjacent offsets."""
        staging = torch.empty(sum(source.numel() for _, source in staged), dtype=torch.uint8, pin_memory=True)
        torch.cat([source for _, source in staged], out=staging)
        runs: list[list[int]] = []  # [offset in frames, offset in staging, length]
        at = 0
        for offset, source in staged:
            n = source.numel()
            if runs and runs[-1][0] + runs[-1][2] == offset:
                runs[-1][2] += n
            else:
                runs.append([offset, at, n])
            at += n
        for offset, at, n in runs:
            frames[offset:offset + n].copy_(staging[at:at + n], non_blocking=True)

    def _lut(self, item: Preprocessed) -> torch.Tensor:
        if item.lut is self._last_lut[0]:  # the preprocessor's own array, shared by its images
            return self._last_lut[1]
        key = item.lut.tobytes()
        table = self._luts.get(key)
        if table is None:
            table = self._luts[key] = lut_table(item.lut, self.dtype, self.device)
        self._last_lut = (item.lut, table)
        return table

    @torch.inference_mode()
    def launch(self, items: list[Preprocessed], deepstack: bool = True, tokens: bool = True) -> "Pending":
        """Dispatch one packed forward, the per-item mean of its merged tokens, and the copies of the outputs asked
        for (`tokens`: the merged tokens, `deepstack`: the DeepStack features; the pooled vectors always) to pinned
        host memory, without waiting for the GPU. `finish` waits and splits the outputs per item. The pending forward
        keeps the host time of each part of the launch (`Pending.host_s`)."""
        began = time.perf_counter()
        started = self._event() if self.device.type == "cuda" else None
        if started is not None:
            started.record()
        eager_before = self.forward.eager
        lone = self.forward.frame(torch.from_numpy(items[0].frames), self._lut(items[0]), items[0].grid_thw,
                                  deepstack) if len(items) == 1 and self.forward.takes_frames else None
        uploaded, pixels = began, None  # a lone frame is uploaded within its forward
        if lone is None:
            pixels = self.pixels(items)
            uploaded = time.perf_counter()
        merged, ds = lone or self.forward(pixels, [it.grid_thw for it in items], deepstack)
        counts = [it.num_patches // self.config.merge_unit for it in items]
        pooled = _segment_mean(merged, counts)
        outputs = [merged if tokens else None, ds if deepstack else None, pooled]
        eager = self.forward.eager > eager_before
        forwarded = time.perf_counter()
        done = computed = None
        if started is not None:
            outputs, computed, done = self._to_host(outputs, beside=lone is None)
        return Pending(items, counts, *outputs, done, started, computed, eager=eager,
                       host_s=(uploaded - began, forwarded - uploaded, time.perf_counter() - forwarded))

    def _to_host(self, outputs: list, beside: bool) -> tuple[list, "torch.cuda.Event", "torch.cuda.Event"]:
        """Copies of `outputs` (None stays None) into pinned host memory, queued after the forward; the events
        recorded after the forward and after the copies. `beside`: on the download stream, beside the next forward;
        else on the compute stream (a lone frame's: nothing computes beside them, so a hand-over to another stream
        would only add to its latency)."""
        computed = self._event()
        computed.record()
        download = self._download if beside else torch.cuda.current_stream(self.device)
        if beside:
            download.wait_event(computed)
        host = []
        with torch.cuda.stream(download):
            for t in outputs:
                if t is not None:
                    if beside:
                        t.record_stream(download)  # its memory waits for the copy, not only for the forward
                    t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                host.append(t)
            done = self._event()
            done.record()
        return host, computed, done

    def _event(self) -> "torch.cuda.Event":
        try:
            return self._events.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def finish(self, pending: "Pending") -> list[EncodeResult]:
        if pending.done is not None:
            pending.done.synchronize()  # releases the GIL while the GPU finishes
            pending.gpu_s = pending.started.elapsed_time(pending.computed) / 1000
            pending.download_s = pending.computed.elapsed_time(pending.done) / 1000
            self._events += (pending.started, pending.computed, pending.done)
            pending.started = pending.computed = pending.done = None
        merged, ds, pooled = pending.merged, pending.deepstack, pending.pooled
        width = pooled.shape[1]
        out, start = [], 0
        for i, (it, n) in enumerate(zip(pending.items, pending.counts)):
            out.append(EncodeResult(
                embeds=merged[start:start + n] if merged is not None else pooled.new_empty((0, width)),
                deepstack=ds[:, start:start + n] if ds is not None else pooled.new_empty((0, n, width)),
                grid_thw=it.grid_thw, pooled=pooled[i], num_tokens=n,
            ))
            start += n
        return out

    def encode(self, items: list[Preprocessed], deepstack: bool = True, tokens: bool = True) -> list[EncodeResult]:
        """One packed forward over `items`; results in the same order, on the CPU."""
        if not items:
            return []
        return self.finish(self.launch(items, deepstack, tokens))


@dataclass
class Pending:
    """A dispatched forward: its items, host buffers that will hold its outputs, and the event after
    which they do (None on the CPU, where everything is done already)."""

    items: list[Preprocessed]
    counts: list[int]  # merged tokens per item
    merged: torch.Tensor | None
    deepstack: torch.Tensor | None
    pooled: torch.Tensor
    done: "torch.cuda.Event | None"  # recorded after the copies to the host
    started: "torch.cuda.Event | None" = None  # recorded before the forward on the compute stream
    computed: "torch.cuda.Event | None" = None  # and after it: computed - started is its GPU time
    gpu_s: float | None = None  # that time in seconds, set by `Encoder.finish` (None on the CPU)
    download_s: float | None = None  # and from its end to the outputs on the host (done - computed)
    eager: bool = False  # the pack ran its forward eagerly, not through graphs (`BucketedTower`)
    # the launch's host seconds: the inputs' upload and patchify issued (0 for a lone frame, uploaded within its
    # forward), the forward and the pooling issued, the outputs' copies to the host issued
    host_s: tuple[float, float, float] | None = None

    def ready(self) -> bool:
        """Whether the outputs are on the host already (`Encoder.finish` would not wait)."""
        return self.done is None or self.done.query()


def _segment_mean(merged: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """float32 [items, out_hidden]: the mean of each item's rows of `merged` [sum(counts), out_hidden]."""
    if len(set(counts)) == 1:  # one size: a view, one reduction
        return merged.view(len(counts), counts[0], -1).float().mean(1)
    lengths = torch.tensor(counts, pin_memory=merged.is_cuda).to(merged.device, non_blocking=True)
    return torch.segment_reduce(merged.float(), "mean", lengths=lengths, axis=0)
