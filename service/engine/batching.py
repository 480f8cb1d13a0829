"""The batcher: packs the preprocessed items of concurrent requests into forwards of the model. Plain asyncio plus
one GPU worker thread; knows nothing of HTTP.

- `submit(items)` queues a request's items and awaits their results. Items of many requests are
  packed into one forward by a patch budget (`max_batch_patches`) and an item cap. The queue is bounded in
  items: past `max_queue_items`, only a client within its equal share of the queue gets in (up to twice the
  bound), the others get `Overloaded` (the API answers 429), so one client's flood does not lock the rest out.
- When a pack is formed: an idle GPU gets one at once (after `max_wait_ms`, 0 by default: waiting on an idle
  GPU only adds latency). While a forward runs, the next pack fills until just before the GPU is expected to
  free up (its launch time ahead), so it holds everything that arrived in the meantime; with two forwards in
  flight the batcher waits for one to finish before forming the next. A request then waits for at most the
  forward in progress and its own (one more where it is left out, below). A forward computes its whole CUDA-graph
  bucket, so a busy GPU's pack leaves out its last few items where that wastes less of the bucket (up to a quarter
  of its patches): they go first in the next pack.
- Items whose request is abandoned (client gone, deadline passed) are dropped before compute.
- Clients (`submit(client=...)`: the HTTP layer's peer address) share each pack: while items of several clients
  wait, a pack takes them in turns, one item per client per turn (each client's items in their order), so one
  client's request of many large images is spread over several forwards alongside the others' and cannot hold a
  lone image behind all of them. One client alone gets the queue in order.
- A forward that fails is split in halves and retried, so an out-of-memory batch still serves what
  fits and a failing item fails alone (`InferenceFailed`, a 503). A device fault (a CUDA error other than
  out-of-memory) leaves the CUDA context unusable: the pack fails with `EngineUnavailable` and `on_fault` is
  called (the engine process exits there, and its supervisor starts a new one).
- `stop()` refuses new work, finishes everything queued or running, then returns.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from ..errors import DeadlineExceeded, EncoderError, EngineUnavailable, InferenceFailed, Overloaded, ShuttingDown
from ..model.encoder import Encoder, bind_thread
from ..model.results import EncodeResult, pack_size
from ..model.kernel_runtime import launch_status
from ..model.preprocess import Preprocessed
from .api import BatchStats, DeviceStats, Encoded, ItemDone, Timing
from .latency import LatencyPolicy

log = logging.getLogger(__name__)

# `Batcher._trim`: a busy GPU's pack keeps at least TRIM_KEEP of its patches; a forward's fixed cost (launches, the
# small kernels whose time does not grow with the pack) counts as FORWARD_ROWS rows, about what a lone 448 px image's
# forward spends beyond its rows' share of a full pack's; packs under TRIM_MIN_PATCHES go whole
TRIM_KEEP = 0.75
FORWARD_ROWS = 512
TRIM_MIN_PATCHES = 4096


def is_device_fault(e: BaseException) -> bool:
    """A CUDA error that poisons the context (an illegal address, a launch failure), as opposed to an
    out-of-memory error or a Python exception, after which the process can go on."""
    if isinstance(e, torch.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", ())
    return isinstance(e, accelerator_error) or (isinstance(e, RuntimeError) and "CUDA error" in str(e))


@dataclass
class _Work:
    item: Preprocessed
    future: asyncio.Future
    abandoned: Callable[[], bool]
    deepstack: bool = True
    tokens: bool = True
    client: str = ""
    enqueued: float = field(default_factory=time.perf_counter)


def _asked(result: EncodeResult, deepstack: bool, tokens: bool) -> EncodeResult:
    """`result` without the DeepStack features or the merged tokens where its request did not ask for them (empty
    along the token axis, as a pack that computed none returns them)."""
    if (deepstack or not result.deepstack.shape[0]) and (tokens or not result.embeds.shape[0]):
        return result
    return replace(result, embeds=result.embeds if tokens else result.embeds[:0],
                   deepstack=result.deepstack if deepstack else result.deepstack[:0])


class Batcher:
    def __init__(self, encoder: Encoder, *, max_batch_patches: int, max_batch_items: int, max_wait_ms: float,
                 max_queue_items: int, on_batch: Callable[[BatchStats], None] | None = None,
                 on_fault: Callable[[BaseException], None] | None = None, trace: str | None = None):
        """`on_batch`: called with each forward's stats; `on_fault`: called once on a device fault; `trace`: a file
        that gets a CSV line per forward (`Settings.forward_trace`)."""
        self.encoder = encoder
        self.max_batch_patches = max_batch_patches
        self.max_batch_items = max_batch_items
        self.max_wait = max_wait_ms / 1000
        self.max_queue_items = max_queue_items
        self.on_batch = on_batch
        self.on_fault = on_fault
        self.faulted: BaseException | None = None
        self._queue: collections.deque[_Work] = collections.deque()
        self._queued_patch_count = 0  # patches of the items in _queue
        self._client_items: collections.Counter[str] = collections.Counter()  # items in _queue, by client
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._gpu = ThreadPoolExecutor(1, thread_name_prefix="forward", initializer=bind_thread,
                                       initargs=(encoder.device,))  # dispatches, in order
        # whether a lone pack may be launched from the loop (`latency.LatencyPolicy`, 3.): where a launch is
        # asynchronous (CUDA); on the CPU it is the whole forward
        self.inline_launch = encoder.device.type == "cuda"
        self._finisher = ThreadPoolExecutor(1, thread_name_prefix="finish", initializer=bind_thread,
                                           initargs=(encoder.device,))  # waits for outputs
        self._accepting = False
        self._in_flight = 0  # items handed to the GPU worker and not yet answered
        # when launched work will be done (`_learn`): moving averages of GPU seconds per patch, of a launch's host
        # time, and of how long an idle GPU waits for a launch's host work before computing (None: not seen yet)
        self._s_per_patch = 0.0
        self._launch_s = 0.0
        self._wait_s: float | None = None
        self._gpu_free_at = 0.0  # time.perf_counter() at which the forwards launched so far should be done
        self._flight: collections.deque[_Launched] = collections.deque()  # launched, not yet finished, in order
        self._last_done = 0.0
        self._last_computed_at: float | None = None  # when the GPU last finished a pack (host clock): `_learn`
        self.forwards = 0  # forward passes run, for tests and /info
        self.gpu_busy_s = 0.0  # the GPU's time in those forwards (CUDA events), for /info, /metrics, the benchmarks
        # of it, how long the GPU waited for launches dispatched while it was busy to return (`_finish`)
        self.launch_wait_s = 0.0
        # appended a line at a time (O_APPEND: the engines of a node may share one file)
        self._trace = open(trace, "a", buffering=1) if trace else None

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self):
        self._wakeup = asyncio.Event()
        self._accepting = True
        self._task = asyncio.create_task(self._batcher(), name="batcher")

    async def stop(self):
        """Refuse new work, answer everything already accepted, then stop the workers."""
        self._accepting = False
        if self._task is not None:
            while self._queue or self._in_flight:
                self._wakeup.set()
                await asyncio.sleep(0.01)
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._gpu.shutdown(wait=True)
        self._finisher.shutdown(wait=True)
        if self._trace is not None:
            self._trace.close()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def queued_patches(self) -> int:
        return self._queued_patch_count

    # -- API -----------------------------------------------------------------------------------------

    def stats(self) -> DeviceStats:
        """Queue depth, items in flight, forwards run, and the device's memory (read in the process that owns it)."""
        device = self.encoder.device
        stats = DeviceStats(str(device), pid=os.getpid(), queue_depth=self.queue_depth,
                            queued_patches=self.queued_patches, in_flight=self.in_flight, forwards=self.forwards,
                            gpu_busy_s=self.gpu_busy_s, launch_wait_s=self.launch_wait_s,
                            lean_launch=(launch := launch_status())["lean"],
                            compiles_while_serving=launch["compiles_while_serving"])
        if device.type == "cuda":
            stats.gpu_allocated_bytes = torch.cuda.memory_allocated(device)
            stats.gpu_reserved_bytes = torch.cuda.memory_reserved(device)
        return stats

    async def submit(self, items: list[Preprocessed], *, timeout_s: float,
                     abandoned: "Callable[[], bool] | asyncio.Event | None" = None,
                     deepstack: bool = True, tokens: bool = True, client: str = "") -> Encoded:
        """Encode `items` within `timeout_s` in whatever packs the batcher forms. `abandoned` (a predicate, or an
        event set when the client has gone) drops the request's items before compute; `deepstack=False` and
        `tokens=False` let a pack skip copying the DeepStack features and the merged tokens back when none of its
        requests wants them (the pooled vectors always come back); `client`: who sent it, for the packs' turns and
        the queue's shares between clients."""
        if isinstance(abandoned, asyncio.Event):
            abandoned = abandoned.is_set
        abandoned = abandoned or (lambda: False)
        if self.faulted is not None:
            raise EngineUnavailable(f"the engine hit a device fault and is restarting ({self.faulted})")
        if not self._accepting:
            raise ShuttingDown("the service is shutting down")
        self._admit(len(items), client)
        loop = asyncio.get_running_loop()
        gone = False

        def is_abandoned() -> bool:
            return gone or abandoned()

        works = [_Work(it, loop.create_future(), is_abandoned, deepstack, tokens, client) for it in items]
        self._queue.extend(works)
        self._queued_patch_count += sum(it.num_patches for it in items)
        self._client_items[client] += len(items)
        self._wakeup.set()
        try:
            results = await asyncio.wait_for(asyncio.gather(*(w.future for w in works)), timeout_s)
        except asyncio.TimeoutError:
            gone = True
            raise DeadlineExceeded(f"request not served within {timeout_s:.1f} s") from None
        except BaseException:
            gone = True  # cancelled (client gone) or failed: the rest of its items are not computed
            raise
        timing = Timing(queue_s=max(d.queue_s for d in results), inference_s=max(d.inference_s for d in results),
                        pack_items=max(d.pack_items for d in results))
        # a pack computes what any of its requests asked for: each gets only what it asked for
        return Encoded([_asked(d.result, deepstack, tokens) for d in results], timing)

    # -- batching --------------------------------------------------------------------------------------

    def _take_batch(self, busy: bool = False) -> list[_Work]:
        """The next pack from the head of the queue (`pack_size`, or in turns between clients), after dropping the
        items no one awaits; while the GPU is `busy`, trimmed to waste less of its graph bucket (`_trim`)."""
        if any(w.future.done() or w.abandoned() for w in self._queue):
            kept = collections.deque()
            for w in self._queue:
                if w.future.done() or w.abandoned():
                    self._queued_patch_count -= w.item.num_patches
                    self._client_items[w.client] -= 1
                    w.future.cancel()
                else:
                    kept.append(w)
            self._queue = kept
        if self._queue and any(w.client != self._queue[0].client for w in self._queue):
            batch = self._take_turns()
        else:
            count = pack_size((w.item.num_patches for w in self._queue), self.max_batch_patches, self.max_batch_items)
            batch = [self._queue.popleft() for _ in range(count)]
        if busy:
            keep = self._trim([w.item.num_patches for w in batch])
            self._queue.extendleft(reversed(batch[keep:]))
            batch = batch[:keep]
        self._queued_patch_count -= sum(w.item.num_patches for w in batch)
        self._client_items.subtract(w.client for w in batch)
        self._client_items = +self._client_items  # clients with nothing queued leave the count
        return batch

    def _trim(self, sizes: list[int]) -> int:
        """How many of a pack's items (patch counts `sizes`, in order) go now. A forward computes its whole graph bucket
        (`Encoder.computed_tokens`: a pack of 30 448 px images, 23,520 patches, in a bucket of 25,600 rows computes 8%
        padding), and a row does not cost the same in every bucket (a GEMM's last wave of tiles may leave SMs idle;
        docs/PERFORMANCE.md, "What a row costs in each bucket"). While the GPU is busy the items left out go first in
        the next pack, a forward later, so of the prefixes holding at least `TRIM_KEEP` of the pack's patches the one
        whose forward costs the least a patch goes, the longest on a tie: its GPU time as timed at start-up
        (`Encoder.forward_ms`), or without timings its rows plus a forward's fixed cost (`FORWARD_ROWS`). Packs under
        `TRIM_MIN_PATCHES` go whole."""
        totals = list(itertools.accumulate(sizes))
        if len(sizes) < 2 or totals[-1] < TRIM_MIN_PATCHES:
            return len(sizes)
        kept = [k for k in range(1, len(sizes) + 1) if totals[k - 1] >= TRIM_KEEP * totals[-1]]
        timed = [self.encoder.forward_ms(totals[k - 1]) for k in kept]
        if None in timed:
            timed = [FORWARD_ROWS + self.encoder.computed_tokens(totals[k - 1]) for k in kept]
        cost = {k: t / totals[k - 1] for k, t in zip(kept, timed)}
        least = min(cost.values())
        return max(k for k, c in cost.items() if c <= least * (1 + 1e-9))

    def _admit(self, n: int, client: str) -> None:
        """Whether `n` more items of `client` may queue (else `Overloaded`, a 429 with Retry-After). Up to
        `max_queue_items` queued, anyone may. Past it, only a client whose items, these included, stay within an equal
        share of `max_queue_items` among the clients queued (it among them), up to twice `max_queue_items` in all:
        one client's flood fills the queue, then is refused while another's request still gets in."""
        queued = len(self._queue)
        if queued + n <= self.max_queue_items:
            return
        mine = self._client_items.get(client, 0)
        share = self.max_queue_items // (len(self._client_items) + (mine == 0))
        if queued + n <= 2 * self.max_queue_items and mine + n <= share:
            return
        raise Overloaded(f"queue full: {queued} images queued ({mine} of them this client's), limit "
                         f"{self.max_queue_items}", retry_after=max(1.0, self.max_wait * 4))

    def _take_turns(self) -> list[_Work]:
        """The next pack when several clients wait: in turns, one item per client per turn, clients in the order of
        their oldest item, each client's items in order; a client whose next item does not fit is done for this
        pack. The first item always goes (one larger than the budget travels alone, as `pack_size` has it)."""
        by_client: dict[str, collections.deque[_Work]] = {}
        for w in self._queue:
            by_client.setdefault(w.client, collections.deque()).append(w)
        taken: list[_Work] = []
        used = 0
        open_clients = list(by_client.values())
        while open_clients and len(taken) < self.max_batch_items:
            still = []
            for q in open_clients:
                n = q[0].item.num_patches
                if taken and (used + n > self.max_batch_patches or len(taken) >= self.max_batch_items):
                    continue  # this client's next item waits for a later pack
                taken.append(q.popleft())
                used += n
                if q:
                    still.append(q)
            open_clients = still
        chosen = {id(w) for w in taken}
        self._queue = collections.deque(w for w in self._queue if id(w) not in chosen)
        return taken

    def _pack_full(self) -> bool:
        return len(self._queue) >= self.max_batch_items or self._queued_patch_count >= self.max_batch_patches

    async def _fill(self, busy: list[asyncio.Task]) -> None:
        """Let the next pack fill: for `max_wait` after its oldest item arrived and, while forwards are still running
        (`busy`), until shortly before the GPU is expected to free up, or at once if it already has."""
        base = self._queue[0].enqueued + self.max_wait
        target = base
        if busy:
            # dispatch one launch's host time (plus a margin) before the running forwards end, so the GPU never waits
            target = max(base, self._gpu_free_at - 1.5 * self._launch_s - 0.001)
        while self._accepting and self._queue and not self._pack_full():
            now = time.perf_counter()
            if now >= target or (now >= base and busy and all(t.done() for t in busy)):
                return
            await asyncio.sleep(min(0.001, target - now))

    async def _batcher(self):
        """Forms packs and keeps up to two forwards in flight: while pack k computes, pack k+1 is dispatched, so
        Python dispatch overlaps GPU work. A free slot comes first, then the pack fills (`_fill`), so a pack holds
        everything that arrived while the GPU was busy rather than what was queued when the previous one left."""
        loop = asyncio.get_running_loop()
        finishing: collections.deque[asyncio.Task] = collections.deque()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                if not self._queue:
                    continue
                while len(finishing) >= 2 or (finishing and finishing[0].done()):
                    await finishing.popleft()
                await self._fill(list(finishing))
                # trimmed only while the GPU computes: where the forwards wait on the host instead (replies of
                # vLLM's layout), smaller packs only cost more forwards' host time
                batch = self._take_batch(busy=bool(finishing) and self._gpu_free_at > time.perf_counter())
                if self._queue:
                    self._wakeup.set()
                if not batch:
                    continue
                self._in_flight += len(batch)
                alone = LatencyPolicy.launch_inline(self.inline_launch, bool(finishing or self._queue), len(batch))
                launched = await self._launch(loop, batch, inline=alone)
                if launched is None:
                    self._in_flight -= len(batch)
                    continue
                finishing.append(asyncio.create_task(self._finish(loop, batch, launched, poll=alone)))
        finally:
            for task in finishing:
                await task

    async def _launch(self, loop, batch: list[_Work], inline: bool = False):
        """Dispatch a forward, on the forward thread or (`inline`) on this one. On failure the pack is split and its
        halves run to completion, so an out-of-memory pack still serves what fits and a failing item fails alone;
        then None."""
        start = time.perf_counter()
        args = ([w.item for w in batch], any(w.deepstack for w in batch), any(w.tokens for w in batch))
        try:
            pending = (self.encoder.launch(*args) if inline else
                       await loop.run_in_executor(self._gpu, self.encoder.launch, *args))
        except Exception as e:  # noqa: BLE001 - one bad pack must not take the service down
            self._report(batch, start, False)
            if is_device_fault(e):
                self._fault(batch, e)
                return None
            if len(batch) > 1:
                if isinstance(e, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                log.warning("forward of %d items failed (%s); retrying in halves", len(batch), e)
                half = len(batch) // 2
                for part in (batch[:half], batch[half:]):
                    launched = await self._launch(loop, part)
                    if launched is not None:
                        await self._finish(loop, part, launched, count=False)
                return None
            if isinstance(e, EncoderError):
                err = e
            elif isinstance(e, torch.OutOfMemoryError):
                err = InferenceFailed(f"out of device memory for one item of {batch[0].item.num_patches} patches "
                                      "while other work held memory; retry", retry_after=1.0)
            else:
                err = InferenceFailed(f"inference failed: {type(e).__name__}: {e}")
            if not batch[0].future.done():
                batch[0].future.set_exception(err)
            return None
        now = time.perf_counter()
        self._launch_s = _ema(self._launch_s, now - start)
        patches = sum(w.item.num_patches for w in batch)
        launched = _Launched(start, now, 0.0, pending, patches)
        self._gpu_free_at = launched.predicted_end = self._predicted_end(launched, self._gpu_free_at)
        self._flight.append(launched)
        return launched

    def _predicted_end(self, launched: "_Launched", free_at: float) -> float:
        """When the GPU should finish `launched` if it finishes what came before at `free_at`: an idle GPU computes
        once it has waited for the launch's host work, the learned wait (the whole launch until that is measured)
        and never longer than this launch took. A wait is learned only where a forward found the GPU idle: one
        learned from a cold start's slow first launches stays while the GPU is kept busy, and unbounded it put every
        end a cold launch late."""
        host = launched.returned - launched.start
        wait = host if self._wait_s is None else min(self._wait_s, host)
        return max(launched.start + wait, free_at) + self._s_per_patch * launched.patches

    async def _finish(self, loop, batch: list[_Work], launched, count: bool = True, poll: bool = False):
        """Wait for a launched pack's outputs in the finisher thread and answer its items; with `poll` (a pack launched
        alone), first by polling from this loop while nothing else arrives."""
        start, pending = launched.start, launched.pending
        try:
            if poll and await self._polled(pending, len(batch)):
                results, done, gpu_s = self._complete(pending)
            else:
                results, done, gpu_s = await loop.run_in_executor(self._finisher, self._complete, pending)
        except Exception as e:  # noqa: BLE001
            self._reanchor(launched, time.perf_counter())
            if is_device_fault(e):
                self._fault(batch, e)
                return
            err = InferenceFailed(f"inference failed: {type(e).__name__}: {e}")
            for w in batch:
                if not w.future.done():
                    w.future.set_exception(err)
            return
        finally:
            if count:
                self._in_flight -= len(batch)
        # the GPU's own time for the pack where it can be read (CUDA events); else the wall time from when it was
        # launched or the previous one finished, whichever came later. Not the wall time on a GPU: that includes
        # the GPU's idle time before a late launch, and a longer estimate would make the next launch later still.
        busy = gpu_s if gpu_s is not None else done - max(start, self._last_done)
        self.gpu_busy_s += busy
        self._last_done = done
        computed_at = done - pending.download_s if gpu_s is not None and pending.download_s is not None else None
        previous, self._last_computed_at = self._last_computed_at, computed_at
        if previous is not None and computed_at is not None and launched.start < previous < launched.returned:
            # dispatched while the GPU was busy, the launch's host work outlasted the work before it: the GPU waited
            # for the host (the operators' sign of a CPU-starved engine; a launch onto an idle GPU is not counted)
            self.launch_wait_s += launched.returned - previous
        self._learn(busy, launched, computed_at, previous)
        self._reanchor(launched, done if computed_at is None else computed_at)
        end = time.perf_counter()
        if self._trace is not None:
            self._write_trace(batch, launched, done, gpu_s, computed_at, previous, pending.eager)
        self._report(batch, start, True)
        for w, r in zip(batch, results):
            if not w.future.done():
                w.future.set_result(ItemDone(r, start - w.enqueued, end - start, len(batch)))

    def _reanchor(self, launched: "_Launched", ended: float) -> None:
        """Predict the packs still in flight from where `launched` really ended, so that an error in the model
        stays one forward's and never adds up. Added up, an estimate per pack above the packs' real spacing put the
        predicted end seconds ahead of the GPU (FP8 at 64 clients, docs/PERFORMANCE.md): every pack then waited for
        the one before to be answered, and the GPU idled through each launch."""
        try:
            self._flight.remove(launched)
        except ValueError:
            return
        free_at = ended
        for later in self._flight:
            free_at = later.predicted_end = self._predicted_end(later, free_at)
        self._gpu_free_at = free_at

    def _learn(self, busy: float, launched: "_Launched", computed_at: float | None,
               previous: float | None) -> None:
        """Update the launch model from a finished forward: `busy`, its GPU time (CUDA events where they can be read,
        counted from an event recorded as its launch began); `computed_at`, when the GPU finished it and `previous`,
        the forward before (host clock; None where unknown).

        A GPU that is busy with the forward before until after this launch has returned had all of this one's work
        queued when it got to it: its event time is its compute, and teaches GPU time per patch. A GPU that was idle
        before the launch returned waited for part of the launch's host work (the frames' upload and patchify, the
        graphs' issue) before computing, and the events count that wait too: such a forward teaches the wait, its
        event time less the compute its patches take. Fed the events' time as compute, the model predicted every end
        a launch late whenever a launch found the GPU idle; the next pack's fill then waited past the GPU's real end,
        the GPU idled for the next launch, and that was counted again: a mode that keeps itself (simulated, 64
        closed-loop clients: 77-88% busy against 100%; `tools/sim_closed_loop.py`, docs/PERFORMANCE.md "64
        clients").

        A forward that found the GPU idle also bounds its compute: at least its event time less the launch's host
        time after the GPU's last end, and at least the time from the launch's return to its end (all its work was
        queued then, and nothing else ran); at most its event time. The GPU time per patch is drawn into those
        bounds, so an estimate that is wrong (the first, from a small pack) is mended even while no forward finds
        its work all queued: an estimate too high otherwise kept every launch after the GPU's end, where no forward
        ever does."""
        start, returned, patches = launched.start, launched.returned, launched.patches
        # no GPU times (the CPU: the wall time, every forward alike), or the forward's work all queued: compute
        if computed_at is None or (previous is not None and previous >= returned):
            if busy > 0:
                self._s_per_patch = _ema(self._s_per_patch, busy / patches)
            return
        began = start if previous is None else max(start, previous)  # where the launch's event passed
        least = max(busy - (returned - began), computed_at - returned, 0.0)
        compute = min(max(self._s_per_patch * patches, least), busy)
        if compute != self._s_per_patch * patches:
            self._s_per_patch = _ema(self._s_per_patch, compute / patches)
        wait = min(max(0.0, busy - self._s_per_patch * patches), max(0.0, returned - began))
        self._wait_s = wait if self._wait_s is None else _ema(self._wait_s, wait)

    def _write_trace(self, batch: list[_Work], launched: "_Launched", done: float, gpu_s, computed_at, previous,
                     eager: bool) -> None:
        """The forward's line in the trace (`Settings.forward_trace`): unix time, device, items, patches, GPU ms,
        launch-to-outputs ms, the launch's host ms, and where the GPU's times could be read (CUDA events): the GPU's
        idle ms between the previous forward's end and this one's start, and how many ms after the GPU finished it
        the batcher had predicted at its launch it would (what the next pack's filling waits for); then 1 where the
        forward ran eagerly rather than through graphs, else 0; the ms the model now takes an idle GPU to wait for
        a launch's host work (`_learn`; nan until a forward has found the GPU idle); and the launch's host ms in its
        parts, where the encoder gives them (`Pending.host_s`): the inputs' upload and patchify, the forward, the
        outputs' copies (a launch that stalls shows in which); and how many ms the launch returned after the GPU had
        finished the forward before (nan where it returned before that): the most the GPU can have waited for it
        within its GPU time."""
        idle = error = exposed = None
        if computed_at is not None:
            if previous is not None:
                idle = computed_at - gpu_s - previous
                if launched.returned > previous:
                    exposed = launched.returned - previous
            error = launched.predicted_end - computed_at

        def ms(s):
            return f"{s * 1e3:.3f}" if s is not None else "nan"

        parts = getattr(launched.pending, "host_s", None) or (None, None, None)
        self._trace.write(f"{time.time():.4f},{self.encoder.device},{len(batch)},"
                          f"{sum(w.item.num_patches for w in batch)},{ms(gpu_s)},{ms(done - launched.start)},"
                          f"{ms(launched.returned - launched.start)},{ms(idle)},{ms(error)},{int(eager)},"
                          f"{ms(self._wait_s)},{','.join(map(ms, parts))},{ms(exposed)}\n")

    async def _polled(self, pending, items: int) -> bool:
        """Whether a lone forward finished while this loop polled it, once per turn, until other work came (False).
        The loop has nothing else to do meanwhile, and the finisher thread would cost a lone request a thread hop
        each way; the thread waits by spinning on the GPU as well."""
        while not pending.ready():
            if self._queue or self._in_flight > items:
                return False
            await asyncio.sleep(0)
        return True

    def _complete(self, pending):
        """In the finisher thread: wait for a forward's outputs; them, the time they were ready, and the GPU time of
        the forward (None where it cannot be read)."""
        results = self.encoder.finish(pending)
        return results, time.perf_counter(), pending.gpu_s

    def _fault(self, batch: list[_Work], e: BaseException) -> None:
        first = self.faulted is None
        if first:
            self.faulted = e
            log.critical("device fault in a forward: %s: %s", type(e).__name__, e)
        err = EngineUnavailable(f"the engine hit a device fault and is restarting ({type(e).__name__})")
        for w in batch + list(self._queue):
            if not w.future.done():
                w.future.set_exception(err)
        self._queue.clear()
        self._queued_patch_count = 0
        self._client_items.clear()
        if first and self.on_fault is not None:
            self.on_fault(e)

    def _report(self, batch, start, ok):
        self.forwards += 1
        if self.on_batch is not None:
            self.on_batch(BatchStats(len(batch), sum(w.item.num_patches for w in batch),
                                     time.perf_counter() - start, ok))


@dataclass
class _Launched:
    """A dispatched pack: when its launch began and returned, when the GPU is predicted to finish it, the encoder's
    pending forward, and its patches."""

    start: float
    returned: float
    predicted_end: float
    pending: object
    patches: int


def _ema(average: float, sample: float, weight: float = 0.2) -> float:
    return sample if average == 0.0 else average + weight * (sample - average)
