"""CUDA graphs of the tower's forward by token-count bucket (`BucketedTower`): what the service runs.

A forward is ~300 kernel launches (GEMMs, Triton kernels, small plan ops); launched one by one from Python they leave
the GPU idle between kernels and cost the serving process CPU time under the GIL. Each bucket captures the pieces
between two attention calls once, over static buffers; the attention runs eagerly on the real segments in between,
so one capture serves every pack that fits the bucket. Small buckets also hold one graph of the whole forward of a
lone frame. Only for CUDA towers.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict, deque

import torch

from kernels.patchify import patchify_dims

from .tower import PackPlan, VisionTower

log = logging.getLogger(__name__)

Signature = tuple[tuple[int, int, int], ...]


# Buckets up to this many tokens also hold a graph of the whole forward of a one-frame pack (a lone image). Below it
# a forward's GPU time is short enough that issuing its pieces and attention calls one by one from Python is most of
# its latency (docs/PERFORMANCE.md); above it the launches hide behind
# the GPU's work.
WHOLE_MAX_TOKENS = 4096

# A pack above WHOLE_MAX_TOKENS runs in the smallest bucket that holds it unless a larger one's timed forward
# (`BucketedTower.time_buckets`) is at least this much faster: cuBLAS picks its GEMM kernel by the row count, and at
# some counts its pick is slower than at a few hundred rows more (docs/PERFORMANCE.md, "What a row costs in each
# bucket"). The margin keeps the timings' noise from moving packs to larger buckets for nothing.
ROUTE_GAIN = 0.02

# A pack above WHOLE_MAX_TOKENS runs eagerly, not through its bucket's graphs, when its forward takes the GPU at least
# this multiple of the host time eager forwards take to issue now (`EagerChoice`; `Settings.cuda_graph_eager_margin`'s
# default). Past that, an eager forward keeps the GPU as busy (the host issues its launches faster than the GPU runs
# them) without the bucket's padding rows and the graph launches between its pieces (docs/PERFORMANCE.md, "Large
# packs run eagerly"). Serving, the launching thread shares the GIL with the engine's loop and its copier threads,
# and the host's cores with the decoding processes; the margin leaves room for the host time to vary between the
# forwards it is measured on.
EAGER_MARGIN = 3.0


class _Statics:
    """The graphs' inputs and the buffers around the eager attention, sized for the largest bucket; each bucket
    reads and writes their first rows. Sharing them is safe because every replay, copy and attention call runs on
    one stream in order, and a pack's outputs are cloned before the next pack's inputs are copied in.

    Rows past a pack's tokens keep whatever they held (zeros at first, then an earlier pack's values): every op in
    the pieces is per token (or per merged group of 4), so padding rows never reach real ones."""

    def __init__(self, tower: VisionTower, tokens: int):
        cfg, device, dtype = tower.config, tower.device, tower.dtype
        half = cfg.head_dim // 2
        self.pixels = torch.zeros((tokens, cfg.patch_dim), dtype=dtype, device=device)
        self.cos = torch.zeros((tokens, half), dtype=torch.float32, device=device)
        self.sin = torch.zeros((tokens, half), dtype=torch.float32, device=device)
        # position-embedding taps: none in a windowed tower (it has no position embeddings)
        self.index = None if cfg.windowed else torch.zeros((tokens, 4), dtype=torch.long, device=device)
        self.weight = None if cfg.windowed else torch.zeros((tokens, 4), dtype=torch.float32, device=device)
        self.qkv = torch.zeros((tokens, 3, cfg.num_heads, cfg.head_dim), dtype=dtype, device=device)
        self.attended = torch.zeros((tokens, cfg.hidden_size), dtype=dtype, device=device)
        self.deepstack = tower.new_deepstack(tokens, device)
        self.cu_seqlens = torch.tensor([0, tokens], dtype=torch.int32, device=device)  # a one-frame pack's segment
        # a lone frame's way in (`BucketedTower.frame`): its uint8 frames, their (F, H, W) and the lookup table that
        # normalises them, read by the patchify launch of the frame graph
        self.frames = self.dims = self.table = None
        # the plan whose positions (and, for one frame, segment) the buffers hold: the same grids again (same-sized
        # images one after another) skip copying them
        self.plan: PackPlan | None = None


class _Bucket:
    """The graph pieces of one token-count bucket, over the first rows of the shared buffers. The pieces are what lies
    between two attention calls (`VisionTower.embed` + the first `project_qkv`; then per block `block_tail` + the next
    `project_qkv`, or the merger after the last): they depend on the token count only, so one capture per bucket
    serves every pack that fits. The attention between them runs eagerly on the real segments (its launch grid
    follows them), reading the static QKV buffer and writing the static attention buffer.

    With `whole`, the bucket also holds one graph of the whole forward of a pack of one frame (a lone image): its
    attention calls are captured too, over one segment whose end is a device input (`_Statics.cu_seqlens`), their
    grids sized for the bucket, the programs past the frame's rows exiting at once."""

    def __init__(self, tower: VisionTower, tokens: int, attention: str, offsets: torch.Tensor, statics: "_Statics",
                 whole: bool = False):
        self.tower, self.tokens, self.attention, self.offsets = tower, tokens, attention, offsets
        # the first `tokens` rows of buffers every bucket shares (`_Statics`)
        self.pixels, self.cos, self.sin, self.index, self.weight, self.qkv, self.attended = (
            None if t is None else t[:tokens] for t in (statics.pixels, statics.cos, statics.sin, statics.index,
                                                        statics.weight, statics.qkv, statics.attended))
        self.deepstack = statics.deepstack[:, :tokens // tower.config.merge_unit]
        self.cu_seqlens = statics.cu_seqlens
        self.statics = statics
        self.x = self.merged = None  # produced by the pieces
        self.graphs: list[torch.cuda.CUDAGraph] | None = None
        # one frame: its rows end at cu_seqlens[1] (set per pack), the rest of the bucket is padding
        self.one_frame = PackPlan((), None, self.cu_seqlens, tokens, self.cos, self.sin, self.index, self.weight,
                                  padded=True) if whole else None
        self.whole: torch.cuda.CUDAGraph | None = None
        self.whole_merged = None  # the whole graph's merged tokens

    def _piece(self, i: int) -> None:
        tower = self.tower
        if i == 0:
            self.x, h = tower.embed(self.pixels, self.index, self.weight)
        else:
            self.x, h = tower.block_tail(i - 1, self.x, self.attended, self.offsets, self.deepstack)
        if i < len(tower.blocks):
            tower.project_qkv(i, h, self.cos, self.sin, out=self.qkv)
        else:
            self.merged = tower.merge(h)

    def runs_whole(self, plan: PackPlan) -> bool:
        """Whether `plan` runs as the whole forward of one frame (else as the pieces)."""
        return self.one_frame is not None and len(plan.seqlens) == 1

    def _frame_forward(self) -> None:
        """The whole forward of a one-frame pack: the pieces, with each block's attention over the frame's rows."""
        for i in range(len(self.tower.blocks) + 1):
            if i:
                self.tower.attend(i - 1, self.qkv, self.one_frame, self.attention, out=self.attended)
            self._piece(i)

    def capture(self, pool) -> None:
        """Record every piece as a CUDA graph, in order, then the whole forward of one frame where the bucket has it,
        on one memory pool (replays run one at a time, the pieces in capture order, so intermediates may share
        memory)."""
        def pieces():
            for i in range(len(self.tower.blocks) + 1):
                self._piece(i)

        eager_pass(pieces, self.pixels.device)
        graphs = []
        for i in range(len(self.tower.blocks) + 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._piece(i)
            graphs.append(graph)
        self.graphs = graphs
        if self.one_frame is not None:
            merged = self.merged
            self.cu_seqlens[1] = self.tokens  # the eager pass's frame: the whole bucket
            self.statics.plan = None
            eager_pass(self._frame_forward, self.pixels.device)
            self.whole = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.whole, pool=pool):
                self._frame_forward()
            self.whole_merged, self.merged = self.merged, merged

    def run(self, pixel_values: torch.Tensor | None, plan: PackPlan,
            deepstack: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pack's merged tokens and DeepStack features; `pixel_values` None: its rows are in the static input
        already, in the tower's order (`BucketedTower.frame`)."""
        n = plan.num_tokens
        tower = self.tower
        if pixel_values is not None:
            tower.order_tokens(pixel_values, plan, out=self.pixels[:n])
        one_frame = self.runs_whole(plan)
        if self.statics.plan is not plan:  # else the buffers hold this plan's values already
            for static, value in ((self.cos, plan.cos), (self.sin, plan.sin), (self.index, plan.interp_index),
                                  (self.weight, plan.interp_weight)):
                if static is not None:
                    static[:n].copy_(value)
            if one_frame:
                self.cu_seqlens.copy_(plan.cu_seqlens)
            self.statics.plan = plan
        if one_frame:
            if self.whole is not None:
                self.whole.replay()
                merged = self.whole_merged
            else:  # not captured (no CUDA): the same forward, run eagerly
                self._frame_forward()
                merged = self.merged
        else:
            for i in range(len(tower.blocks) + 1):
                if i:
                    tower.attend(i - 1, self.qkv[:n], plan, self.attention, out=self.attended[:n])
                if self.graphs is not None:
                    self.graphs[i].replay()
                else:  # not captured (no CUDA): the same pieces, run eagerly
                    self._piece(i)
            merged = self.merged
        unit = tower.config.merge_unit
        merged = merged[:n // unit]
        restored = tower.restore_order(merged, plan)
        return (restored.clone() if restored is merged else restored,
                self.deepstack[:, :n // unit].clone() if deepstack else None)


def cheapest_buckets(bucket_ms: dict[int, float], above: int = WHOLE_MAX_TOKENS,
                     gain: float = ROUTE_GAIN) -> dict[int, int]:
    """Bucket -> the bucket its packs run in, from each bucket's timed forward (ms): the one at or above it whose
    forward is the fastest, where that is at least `gain` faster than its own; only buckets above `above` tokens,
    and only to buckets above it."""
    route, fastest = {}, None
    for tokens in sorted((t for t in bucket_ms if t > above), reverse=True):
        ms = bucket_ms[tokens]
        route[tokens] = fastest if fastest is not None and bucket_ms[fastest] < (1 - gain) * ms else tokens
        if fastest is None or ms <= bucket_ms[fastest]:
            fastest = tokens
    return {t: r for t, r in sorted(route.items()) if r != t}


# Buckets up to WHOLE_MAX_TOKENS may move up by this many rows at most, in steps of STEP_ROWS, to a row count where
# the blocks' GEMMs cost less (`off_steps`): cuBLAS's kernel for a row count can be slower than at a few dozen more,
# enough to cost a lone image a tenth of its forward (docs/PERFORMANCE.md, "A lone request"). The steps move with the
# GPU and the cuBLAS release, so they are found by timing, not listed. Only upwards: every pack a bucket held, the
# moved one holds.
STEP_SPAN_ROWS = 64
STEP_ROWS = 16


def off_steps(buckets: tuple[int, ...], cost, limit: int = WHOLE_MAX_TOKENS, span: int = STEP_SPAN_ROWS,
              step: int = STEP_ROWS, gain: float = ROUTE_GAIN) -> tuple[int, ...]:
    """`buckets` with each one up to `limit` moved to the row count from it to `span` rows above it (in `step`s,
    below the next bucket, up to `limit`: a bucket above it holds no whole forward) whose `cost(rows)` is least,
    where that is at least `gain` below its own cost."""
    placed = []
    for i, tokens in enumerate(buckets):
        if tokens > limit:
            placed.append(tokens)
            continue
        ceiling = min(tokens + span, limit, buckets[i + 1] - step if i + 1 < len(buckets) else limit)
        costs = {rows: cost(rows) for rows in range(tokens, ceiling + 1, step)}
        best = min(costs, key=costs.get)
        placed.append(best if costs[best] < (1 - gain) * costs[tokens] else tokens)
    return tuple(placed)


def typical_grids(tokens: int, merge: int) -> list[tuple[int, int, int]]:
    """Grids of `tokens` patches as 32 x 32-patch frames (a 512 px image's) and one smaller: a pack of photos, whose
    attention costs what a served pack's does (one frame of all the tokens would cost quadratically more)."""
    side = 32
    grids = [(1, side, side)] * (tokens // (side * side))
    rest = tokens % (side * side)
    if rest:
        grids.append((1, merge, rest // merge))
    return grids


def issue_ms(call, device, reps: int = 3) -> float:
    """Median milliseconds of `reps` calls of `call()`, the GPU idle before each and not waited for after: the host
    time it takes to issue its launches while the GPU runs behind it."""
    host = []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        call()
        host.append((time.perf_counter() - start) * 1000)
    torch.cuda.synchronize(device)
    return statistics.median(host)


def eager_costs(forward, device, reps: int = 3) -> tuple[float, float]:
    """(host ms, GPU ms) of `forward()` run eagerly, medians of `reps`: the time the host takes to issue its
    launches (`issue_ms`), and the time the GPU takes to run them (`queued_ms`)."""
    forward()
    host_ms = issue_ms(forward, device, reps)
    return host_ms, queued_ms(forward, host_ms, reps)


def sleep_cycles_per_ms() -> float:
    """The rate of `torch.cuda._sleep` on the current device, in cycles a millisecond (timed once: `queued_ms`)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 1 << 22
    begin.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / max(begin.elapsed_time(end), 1e-3)


def queued_ms(forward, host_ms: float, reps: int = 3, cycles_per_ms: float | None = None) -> float:
    """Median GPU milliseconds of `reps` calls of `forward()`, each queued behind a wait long enough for the host to
    issue its launches (about `host_ms`), so that no launch gap is counted; `cycles_per_ms`: the wait's rate where
    the caller timed it already (`sleep_cycles_per_ms`)."""
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    wait = int(2 * host_ms * (cycles_per_ms or sleep_cycles_per_ms())) + 1
    gpu = []
    for _ in range(reps):
        torch.cuda._sleep(wait)
        begin.record()
        forward()
        end.record()
        end.synchronize()
        gpu.append(begin.elapsed_time(end))
    return statistics.median(gpu)


class EagerChoice:
    """Which packs run eagerly: those whose forward takes the GPU at least `margin` times the host time an
    eager forward takes to issue, that host time being the median of the last `window` eager forwards' as served
    (`issued`), first start-up's (`measure`). The GPU time is linear in the tokens, from start-up's measurement.

    The host time is what varies: beside the engine's other threads and the decoding processes, and on a node of
    several engines, an eager forward took the host about twice its start-up time, each engine's start-up measurement
    giving a limit of its own (docs/PERFORMANCE.md, "A whole node"). Measured as served, host-bound eager
    forwards raise the limit until packs run through their graphs again. Every `probe_every`-th pack that start-up's
    measurement would run eagerly but the current one does not runs eagerly, so that the estimate follows the
    host when it frees up."""

    window = 16
    probe_every = 64

    def __init__(self, host_ms: float, gpu_ms: float, tokens: int, margin: float = EAGER_MARGIN):
        self.start_host_ms, self.gpu_ms_per_token, self.margin = host_ms, gpu_ms / tokens, margin
        self._issued: deque[float] = deque([host_ms], maxlen=self.window)
        self._declined = 0
        # the pack size from which eager forwards run now (`limit_for` the median host time, moved by `issued`), and
        # from start-up's timing (the probes')
        self.limit = self._start_limit = self.limit_for(host_ms)
        self._logged = self.limit  # the limit last logged: a move by a quarter or more is logged again

    @classmethod
    def measure(cls, tower: VisionTower, tokens: int, margin: float = EAGER_MARGIN) -> "EagerChoice":
        """Time one eager forward of a typical pack of `tokens` (`eager_costs`)."""
        cfg = tower.config
        plan = tower.plan(typical_grids(tokens, cfg.spatial_merge_size))
        pixels = torch.randn((tokens, cfg.patch_dim), dtype=tower.dtype, device=tower.device)
        host_ms, gpu_ms = eager_costs(lambda: tower(pixels, plan), tower.device)
        return cls(host_ms, gpu_ms, tokens, margin)

    @property
    def host_ms(self) -> float:
        return statistics.median(self._issued)

    def limit_for(self, host_ms: float) -> int:
        """The pack size in tokens from which an eager forward issued in `host_ms` pays."""
        return int(self.margin * host_ms / self.gpu_ms_per_token)

    def runs_eagerly(self, tokens: int, probe: bool = True) -> bool:
        """Whether a pack of `tokens` runs eagerly now: past the limit, or (with `probe`, a pack about to run) as the
        `probe_every`-th pack past start-up's limit. `probe=False` asks without counting a pack (`forward_ms`)."""
        if tokens >= self.limit:
            return True
        if probe and tokens >= self._start_limit:
            self._declined += 1
            if self._declined >= self.probe_every:
                self._declined = 0
                return True
        return False

    def issued(self, ms: float) -> None:
        """Record the host time of an eager forward as served."""
        self._issued.append(ms)
        limit = self.limit = self.limit_for(self.host_ms)
        if abs(limit - self._logged) >= self._logged / 4:
            self._logged = limit
            log.info("packs from %d tokens run eagerly: eager forwards take the host %.1f ms as served (median of the "
                     "last %d; %.1f ms at start-up)", limit, self.host_ms, len(self._issued), self.start_host_ms)


def _wall_ms(call) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def signature(grids) -> Signature:
    return tuple(tuple(int(x) for x in g) for g in grids)


def eager_pass(forward, device) -> None:
    """Run `forward` once on a side stream before capturing it: lazy library initialisation, kernel choices."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream(device).wait_stream(side)


class BucketedTower:
    """`(pixel_values, grids) -> (merged, deepstack)` for any mix of grids, through CUDA graphs captured once per
    token-count bucket (`capture`, at start-up): a pack is padded to the smallest bucket that holds it (or to a larger
    one that timed faster: `routes`), its plan is copied into the bucket's static inputs, and the graph pieces replay
    with the attention run eagerly between them (see `_Bucket`); a pack of one frame within `WHOLE_MAX_TOKENS`
    replays one graph of the whole forward instead. Nothing is captured once traffic flows; a pack larger than every
    bucket runs eagerly (such a pack keeps the GPU busier than its launches take to issue). With an `eager_margin`,
    `capture` also times an eager forward, and packs from where that is as fast run eagerly too (`EagerChoice`,
    which follows the host time eager forwards take as served). Plans of recent signatures are kept, so a repeated
    layout skips building its plan."""

    plan_cache_size = 256

    def __init__(self, tower: VisionTower, buckets: tuple[int, ...] = (), eager_margin: float | None = EAGER_MARGIN):
        """`eager_margin`: `EagerChoice`'s (None: every pack within a bucket runs its graphs)."""
        self.tower = tower
        self.buckets = self.asked = tuple(sorted(buckets))  # `capture` may move `buckets` (`_placed`), not `asked`
        self.eager_margin = eager_margin
        self.eager_choice: EagerChoice | None = None  # where `capture` timed an eager forward
        self.bucket_ms: dict[int, float] = {}  # each bucket's forward, GPU ms, where `capture` timed them
        self.routes: dict[int, int] = {}  # bucket -> the larger one its packs run in (`cheapest_buckets`)
        self._buckets: dict[int, _Bucket] = {}
        self._plans: OrderedDict[Signature, PackPlan] = OrderedDict()
        self.padded_tokens = 0  # tokens computed as padding, for the benchmarks
        self.bucketed = self.eager = 0
        self.whole_forwards = 0  # bucketed packs of one frame, run as one graph
        self._statics: _Statics | None = None
        # a lone frame's way in (`frame`): the graph of its patchify, the most rows it takes (the largest bucket
        # with a whole forward), and the shape and table its static inputs hold
        self._framer: torch.cuda.CUDAGraph | None = None
        self._frame_rows: int | None = None
        self._dims: tuple[int, int, int] | None = None
        self._table: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return bool(self._buckets) and all(b.graphs is not None for b in self._buckets.values())

    @torch.inference_mode()
    def capture(self, timings: dict[int, float] | None = None) -> None:
        """Capture every bucket's pieces (on CUDA; with an `eager_margin`, after timing an eager forward:
        `EagerChoice`), then time each bucket's forward (`time_buckets`; `timings`: an earlier start's, for these
        buckets of this tower on this GPU, taken instead); elsewhere set the buckets up to run their pieces
        eagerly."""
        tower = self.tower
        offsets = tower._bias_offsets() if tower.residual_in_gemm else None
        pool = torch.cuda.graph_pool_handle() if tower.device.type == "cuda" else None
        if pool is not None and self.eager_margin and self.buckets[-1] > WHOLE_MAX_TOKENS:
            try:
                choice = self.eager_choice = EagerChoice.measure(tower, self.buckets[-1], self.eager_margin)
            except torch.OutOfMemoryError as e:  # no room for a full eager pack beside the rest: graphs only
                log.warning("could not time an eager forward (%s); packs within a bucket run its graphs", e)
                torch.cuda.empty_cache()
            else:
                log.info("packs from %d tokens run eagerly while an eager forward's launches take the host %.1f ms (at "
                         "start-up; a forward of %d tokens takes the GPU %.1f ms)", max(choice.limit, WHOLE_MAX_TOKENS),
                         choice.host_ms, self.buckets[-1], choice.gpu_ms_per_token * self.buckets[-1])
        if pool is not None:
            self.buckets = self._placed(timings, offsets)
        statics = self._statics = _Statics(tower, self.buckets[-1])
        for tokens in self.buckets:
            # a whole forward needs the Triton kernel on a GPU (SDPA reads the segments back to the host)
            whole = not tower.config.windowed and tokens <= WHOLE_MAX_TOKENS and (pool is None
                                                                                  or tower.backend == "triton")
            bucket = _Bucket(tower, tokens, tower.backend, offsets, statics, whole)
            if pool is not None:
                bucket.capture(pool)
            self._buckets[tokens] = bucket
        wholes = [tokens for tokens, bucket in self._buckets.items() if bucket.one_frame is not None]
        if wholes:
            cfg, device = tower.config, tower.device
            self._frame_rows = max(wholes)
            side = cfg.patch_size * cfg.spatial_merge_size  # the capture's frame: the smallest image
            statics.frames = torch.zeros(self._frame_rows * cfg.patch_dim, dtype=torch.uint8, device=device)
            statics.dims = torch.tensor([1, side, side], dtype=torch.int32, device=device)
            statics.table = torch.zeros((256, cfg.in_channels), dtype=tower.dtype, device=device)
            if pool is not None:
                eager_pass(self._patchify_frame, device)
                self._framer = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self._framer, pool=pool):
                    self._patchify_frame()
        log.info("CUDA graphs captured for %d token buckets up to %d", len(self.buckets), self.buckets[-1])
        if pool is not None:
            self.time_buckets(known=timings)

    def _placed(self, known: dict[int, float] | None, offsets) -> tuple[int, ...]:
        """The buckets asked for (`asked`: so a second capture does not move them again) moved off the row counts
        where the blocks' GEMMs cost more than a little above (`off_steps`, costed by `_block_ms`); where an earlier
        start's timings are given, the buckets it placed and timed (their file is named by the buckets asked for and
        the placement's bounds: `timing_key`), so that every restart keeps one placement."""
        if known is not None and len(known) == len(self.asked):
            return tuple(sorted(known))
        rate = sleep_cycles_per_ms()
        placed = off_steps(self.asked, lambda rows: self._block_ms(rows, offsets, rate))
        if moved := {a: b for a, b in zip(self.asked, placed) if a != b}:
            log.info("buckets moved off row counts where the blocks' GEMMs cost more: %s", moved)
        return placed

    def _block_ms(self, rows: int, offsets, rate: float, calls: int = 8, reps: int = 5) -> float:
        """GPU ms of `calls` runs of a block's work after its attention (`VisionTower.block_tail`: the output
        projection, the MLP, the norms) on `rows` rows, queued behind a wait, median of `reps`: what of a forward
        grows with its rows, and the GEMMs whose kernel cuBLAS picks by the row count."""
        tower = self.tower
        layer = next((i for i in range(len(tower.blocks)) if i not in tower._taps), 0)
        source = torch.randn((rows, tower.config.hidden_size), dtype=tower.dtype, device=tower.device)
        attended, x = torch.randn_like(source), torch.empty_like(source)

        def run():
            for _ in range(calls):
                x.copy_(source)  # the residual stream is updated in place with `offsets`
                tower.block_tail(layer, x, attended, offsets, None)

        return queued_ms(run, _wall_ms(run), reps, rate)

    def timing_key(self) -> str:
        """What the buckets' timings depend on in this tower: its shapes, dtype, kernels' options, the buckets asked
        for and how start-up places them (`off_steps`' bounds: timings of buckets placed otherwise, or not at all,
        name another file); the same before and after `capture`. The GPU and the software versions are the caller's
        to add."""
        tower = self.tower
        placement = (WHOLE_MAX_TOKENS, STEP_SPAN_ROWS, STEP_ROWS, ROUTE_GAIN)
        return "|".join(map(str, (tower.config, tower.dtype, tower.backend, tower.options, self.asked, placement)))

    @torch.inference_mode()
    def time_buckets(self, reps: int = 3, known: dict[int, float] | None = None) -> None:
        """Time each bucket's forward of a full pack of photos (`typical_grids`): on CUDA the GPU's time with the
        launches queued ahead (`queued_ms`), elsewhere the wall time; after one run of each, `reps` rounds over every
        bucket, in ascending then descending order, the median of each bucket's: a drift of the GPU's clock as it warms
        under its power cap spreads over every bucket instead of falling on the ones timed last. What a row costs is
        not the same in every bucket (a GEMM's last wave of tiles may fill few of the GPU's SMs, and cuBLAS picks its
        kernel by the row count): on CUDA a bucket whose forward a larger one's beats hands its packs to that one
        (`cheapest_buckets`, `bucket_for`), and the batcher compares the measured forwards when it trims a pack
        (`forward_ms`). `known`: timings of every bucket from an earlier start (`timing_key` the same), taken as
        they are: a restart, which may come while the host's other GPUs run at their power cap, skips ten-odd seconds
        of timing and keeps the first start's routes."""
        cuda = self.tower.device.type == "cuda"
        if known is not None and set(known) == set(self.buckets):
            self.bucket_ms = {tokens: float(known[tokens]) for tokens in self.buckets}
            log.info("bucket forwards: the timings of an earlier start")
        else:
            self.bucket_ms = self._timed(reps, cuda)
            if not self.bucket_ms:
                return
        per_row = {tokens: ms / tokens * 1e6 for tokens, ms in self.bucket_ms.items() if tokens > WHOLE_MAX_TOKENS}
        if per_row:
            log.info("bucket forwards timed: %.0f to %.0f ns of GPU time a row above %d tokens (least at %d, most at "
                     "%d)", min(per_row.values()), max(per_row.values()), WHOLE_MAX_TOKENS,
                     min(per_row, key=per_row.get), max(per_row, key=per_row.get))
        log.info("bucket forwards, GPU ms: %s", {t: round(ms, 2) for t, ms in self.bucket_ms.items()})
        self.routes = cheapest_buckets(self.bucket_ms) if cuda else {}
        if self.routes:
            log.info("packs of %d buckets run in larger ones whose forwards timed faster: %s", len(self.routes),
                     ", ".join(f"{t} -> {r} ({self.bucket_ms[t]:.1f} -> {self.bucket_ms[r]:.1f} ms)"
                               for t, r in self.routes.items()))

    def _timed(self, reps: int, cuda: bool) -> dict[int, float]:
        """`time_buckets`' timings: each bucket's median ms ({} where a full pack's input finds no room)."""
        tower, cfg = self.tower, self.tower.config
        try:
            pixels = torch.randn((self.buckets[-1], cfg.patch_dim), dtype=tower.dtype, device=tower.device)
        except torch.OutOfMemoryError as e:  # no room for a full pack's input beside the rest: packs trim by rows
            log.warning("could not time the buckets' forwards (%s); packs are trimmed by their rows", e)
            torch.cuda.empty_cache()
            return {}
        forwards, host_ms = {}, {}
        for tokens, bucket in self._buckets.items():
            plan = tower.plan(typical_grids(tokens, cfg.spatial_merge_size))

            def forward(rows=pixels[:tokens], plan=plan, bucket=bucket):
                bucket.run(rows, plan, True)

            forwards[tokens] = forward
            host_ms[tokens] = _wall_ms(forward)  # the run before the timed ones; on CUDA its host time sizes their wait
        times: dict[int, list[float]] = {tokens: [] for tokens in forwards}
        rate = sleep_cycles_per_ms() if cuda else None  # the queued wait's, once for every timing
        for r in range(reps):  # ascending, then descending, ...: no bucket is always timed last in a round
            for tokens, forward in (forwards.items() if r % 2 == 0 else reversed(forwards.items())):
                times[tokens].append(queued_ms(forward, host_ms[tokens], 1, rate) if cuda else _wall_ms(forward))
        return {tokens: statistics.median(ms) for tokens, ms in times.items()}

    def forward_ms(self, tokens: int) -> float | None:
        """The GPU ms a forward of a pack of `tokens` patches takes, from the start-up timings (`time_buckets`): its
        bucket's, or where it runs eagerly (beyond every bucket, or past the eager choice's limit) its tokens at the
        eager forward's time a token (the largest bucket's without an eager choice). None before the buckets are
        timed."""
        if not self.bucket_ms:
            return None
        bucket, choice = self.bucket_for(tokens), self.eager_choice
        if not self._runs_eagerly(tokens, bucket, probe=False):
            return self.bucket_ms.get(bucket)
        largest = self.buckets[-1]
        per_token = choice.gpu_ms_per_token if choice is not None else self.bucket_ms[largest] / largest
        return per_token * tokens

    def _runs_eagerly(self, tokens: int, bucket: int | None, probe: bool) -> bool:
        """Whether a pack of `tokens` (in `bucket`, None past every bucket) runs eagerly: past every bucket, or above
        WHOLE_MAX_TOKENS where the eager choice runs it so (`EagerChoice.runs_eagerly`; `probe`: a pack about to
        run, which the choice's probes count)."""
        choice = self.eager_choice
        return bucket is None or (choice is not None and tokens > WHOLE_MAX_TOKENS
                                  and choice.runs_eagerly(tokens, probe))

    @property
    def takes_frames(self) -> bool:
        """Whether `frame` may take a lone frame (buckets with whole forwards are set up)."""
        return self._frame_rows is not None

    def _patchify_frame(self) -> None:
        """The static frames -> the first rows of the static patch rows, their shape read on the device."""
        cfg, statics = self.tower.config, self._statics
        patchify_dims(statics.frames, statics.dims, statics.table, statics.pixels[:self._frame_rows],
                      cfg.temporal_patch_size, cfg.patch_size, cfg.spatial_merge_size)

    def frame(self, frames: torch.Tensor, table: torch.Tensor, grid,
              deepstack: bool = True) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """`__call__` for a pack of one item of one frame (a lone image), from its uint8 frames `[F, H, W, C]` in host
        memory and its lookup table on the device (`preprocess.lut_table`): the frames are copied into a static
        buffer (by the copy engine, from where they lie if page-locked) and one graph patchifies them into the whole
        forward's input, reading their shape on the device. Before the forward's own graph the host then issues a
        copy and a replay, where `__call__` takes a patchify launch and the ops around it. None where the pack does
        not run as a whole forward (no bucket holds it with one, or it has more than one frame's segment)."""
        if self._frame_rows is None:
            return None
        plan = self.plan([grid])
        tokens = self.bucket_for(plan.num_tokens) if plan.num_tokens <= self._frame_rows else None
        if tokens is None or not self._buckets[tokens].runs_whole(plan):
            return None
        statics = self._statics
        statics.frames[:frames.numel()].copy_(frames.reshape(-1), non_blocking=True)
        dims = tuple(frames.shape[:3])
        if dims != self._dims:  # from pageable memory: staged at once, so the next call may build another
            statics.dims.copy_(torch.tensor(dims, dtype=torch.int32), non_blocking=True)
            self._dims = dims
        if table is not self._table:
            statics.table.copy_(table)
            self._table = table
        if self._framer is not None:
            self._framer.replay()
        else:  # not captured (no CUDA): the same patchify, eagerly
            self._patchify_frame()
        return self._run_bucket(tokens, None, plan, deepstack)

    def plan(self, grids) -> PackPlan:
        key = signature(grids)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self.tower.plan(key)
            if len(self._plans) > self.plan_cache_size:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan

    def bucket_for(self, tokens: int) -> int | None:
        """The bucket a pack of `tokens` patches runs in: the smallest that holds it, or the larger one start-up's
        timings route it to (`routes`); None past the largest (or before `capture`)."""
        if not self._buckets:
            return None
        smallest = next((b for b in self.buckets if b >= tokens), None)
        return self.routes.get(smallest, smallest)

    def __call__(self, pixel_values: torch.Tensor, grids,
                 deepstack: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The merged tokens and (unless `deepstack` is False: None) the DeepStack features."""
        plan = self.plan(grids)
        if pixel_values.shape[0] != plan.num_tokens:
            raise ValueError(f"{pixel_values.shape[0]} patch rows for grids totalling {plan.num_tokens}")
        tokens, choice = self.bucket_for(plan.num_tokens), self.eager_choice
        if self._runs_eagerly(plan.num_tokens, tokens, probe=True):
            self.eager += 1
            start = time.perf_counter()
            out = self.tower(pixel_values, plan)
            if choice is not None:
                choice.issued((time.perf_counter() - start) * 1000)
            return out
        return self._run_bucket(tokens, pixel_values, plan, deepstack)

    def _run_bucket(self, tokens: int, pixel_values: torch.Tensor | None, plan: PackPlan,
                    deepstack: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_Bucket.run` of the bucket of `tokens`, counted (`bucketed`, `whole_forwards`, `padded_tokens`)."""
        self.bucketed += 1
        self.padded_tokens += tokens - plan.num_tokens
        bucket = self._buckets[tokens]
        self.whole_forwards += bucket.runs_whole(plan)
        return bucket.run(pixel_values, plan, deepstack)
