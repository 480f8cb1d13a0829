"""The batcher under closed-loop clients on a simulated GPU: how busy it keeps the GPU, by client count and by how
long a request spends outside the engine between two forwards (its reply, the client, its next request, decoding:
the round trip), with the real `Batcher` and a device whose forward of n 448 px images takes `a + b·n` (with the
server's graph buckets, `--eager-above`: its bucket's worth, padding included).

It answers whether the packing policy and its launch model starve a GPU fed by a given number of closed-loop
clients, and what a change does to that, apart from everything else a real run varies (clocks, GIL contention, the
front-ends' scheduling). The GPU time the batcher is told is by default the engine's (`--gpu-s events`: counted
from the launch's start, a wait for the launch's host work included).

The round trip: each answered request goes to one of `--frontends` front-ends (in turn, or with `--sticky` the one
its client's connection was placed on at random, as the kernel places keep-alive connections), which handle their
requests one at a time for `--frontend-ms` each (reply + decoding), plus `--network-ms` for the client; so a pack's
burst of requests comes back spread over (its requests on the busiest front-end) × frontend-ms. Times are in the
GPU's milliseconds scaled by `--scale` (2: a forward of 32 images takes ~70 ms of wall time), so asyncio's timer
jitter stays small.

Usage: python -m tools.sim_closed_loop [--clients 64,256] [--frontend-ms 2,4,6,8] [--frontends 8]
       [--engine-loop-ms 0,0.5] [--launch-ms 2] [--eager-above 0,30720] [--sticky] [--seeds 0,1] [--max-items 64]
       [--gpu-s events,compute] [--gpu-waits 0,0.5,1] [--ramp-ms 10] [--trim on,off] [--seconds 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import random
import statistics
import threading
import time
from dataclasses import dataclass

import torch

from service.engine.batching import Batcher
from service.model.results import EncodeResult
from service.settings import Settings, parse_buckets


PATCHES = 784  # a 448 px image's


@dataclass
class _Item:
    num_patches: int


@dataclass
class _Pending:
    n: int
    done: float
    gpu_s: float
    download_s: float = 0.0  # outputs on the host as the forward ends
    eager: bool = False

    def ready(self) -> bool:
        return time.perf_counter() >= self.done


class SimulatedGPU:
    """`launch` takes `launch_s` of host time and queues the pack behind the ones before it; `finish` waits until
    it has run. Records each forward's (start, end) on the device. The GPU time it reports (`gpu_s`): with
    `events`, as the engine reads it from CUDA events, from an event recorded as the launch begins to the forward's
    end, so a GPU that waits for the launch's host work counts that wait as busy; else the compute alone. `waits`:
    the share of the launch's host time the GPU's work waits for (1: the upload and patchify before anything runs;
    0: it computes from the launch's start, its work issued faster than it runs)."""

    def __init__(self, a_s: float, b_s: float, launch_s: float, buckets: tuple[int, ...] = (), events: bool = True,
                 waits: float = 1.0):
        self.a_s, self.b_s, self.launch_s, self.buckets, self.events = a_s, b_s, launch_s, buckets, events
        self.waits = waits
        self.device = torch.device("cpu")
        self.free_at = 0.0
        self.forwards: list[tuple[float, float, int]] = []
        self._lock = threading.Lock()
        self._result = EncodeResult(torch.zeros(0, 1), torch.zeros(0, 0, 1), (1, 1, 1), torch.zeros(1), 1)

    def launch(self, items, deepstack=True, tokens=True):
        begun = time.perf_counter()
        time.sleep(self.launch_s)
        with self._lock:
            start = max(begun + self.waits * (time.perf_counter() - begun), self.free_at)
            # a bucketed pack computes its whole bucket: the padding rows cost as much as an image's
            seconds = self.a_s + self.b_s * self.computed_tokens(sum(it.num_patches for it in items)) / PATCHES
            marked = max(begun, self.free_at)  # where the GPU passes the event recorded as the launch begins
            self.free_at = start + seconds
            self.forwards.append((start, self.free_at, len(items)))
        return _Pending(len(items), self.free_at, self.free_at - marked if self.events else seconds)

    def finish(self, pending: _Pending):
        time.sleep(max(0.0, pending.done - time.perf_counter()))
        return [self._result] * pending.n

    def computed_tokens(self, tokens: int) -> int:
        return next((b for b in self.buckets if b >= tokens), tokens)

    def forward_ms(self, tokens: int) -> float | None:
        """A forward's time as start-up's bucket timings give it (`Encoder.forward_ms`): none without buckets."""
        return (self.a_s + self.b_s * self.computed_tokens(tokens) / PATCHES) * 1000 if self.buckets else None


async def run(clients: int, frontends: int, frontend_s: float, network_s: float, gpu: SimulatedGPU,
              seconds: float, warmup_s: float, max_items: int, engine_loop_s: float = 0.0, sticky: bool = False,
              seed: int = 0, ramp_s: float = 0.0, trim: bool = True, **batcher_args) -> dict:
    batcher = Batcher(gpu, max_batch_patches=32768, max_batch_items=max_items, max_wait_ms=0,
                      max_queue_items=4 * clients, **batcher_args)
    if not trim:  # a busy GPU's pack goes whole (`Batcher._trim` off)
        batcher._trim = len
    await batcher.start()
    locks = [asyncio.Lock() for _ in range(frontends)]
    turn = itertools.count()
    # keep-alive connections: each client's requests all go to one front-end, which the kernel chose by a hash of
    # its addresses (uneven: 64 clients on 8 front-ends land 4 to 13 each); else each request to the next in turn
    rng = random.Random(seed)
    home = [rng.randrange(frontends) for _ in range(clients)]
    stop = time.perf_counter() + warmup_s + seconds

    async def round_trip(c: int):
        async with locks[home[c] if sticky else next(turn) % frontends]:
            await asyncio.sleep(frontend_s)
        await asyncio.sleep(network_s)

    async def client(c: int):
        await asyncio.sleep(c * ramp_s)  # clients that connect one after another: the first packs are small
        while time.perf_counter() < stop:
            time.sleep(engine_loop_s / 2)  # the engine's loop reading the submission (holds the loop)
            await batcher.submit([_Item(PATCHES)], timeout_s=60)
            time.sleep(engine_loop_s / 2)  # and answering it
            await round_trip(c)

    t0 = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    await batcher.stop()
    lo, hi = t0 + warmup_s, t0 + warmup_s + seconds
    window = [(max(s, lo), min(e, hi), n) for s, e, n in gpu.forwards if e > lo and s < hi]
    busy = sum(e - s for s, e, _ in window)
    # a forward's images counted in proportion to its time inside the window
    images = sum(n * (min(e, hi) - max(s, lo)) / (e - s) for s, e, n in gpu.forwards if e > lo and s < hi)
    sizes = [n for _, _, n in window]
    return {"per_frontend_max": max(home.count(f) for f in range(frontends)) if sticky else None,
            "gpu_busy": round(busy / seconds, 3), "images_per_s": round(images / seconds, 1),
            "images_per_forward": round(statistics.mean(sizes), 1) if sizes else 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="64,256")
    ap.add_argument("--frontends", type=int, default=8)
    ap.add_argument("--frontend-ms", default="2,4,6,8", help="one front-end's time per request (reply + decoding)")
    ap.add_argument("--network-ms", type=float, default=1.0)
    ap.add_argument("--a-ms", type=float, default=1.0, help="a forward's fixed GPU time")
    ap.add_argument("--b-ms", type=float, default=1.04, help="GPU time per 448 px image (bf16 on an H200)")
    ap.add_argument("--launch-ms", default="2", help="a launch's host time (an eager bf16 forward: ~13)")
    ap.add_argument("--max-items", default="64")
    ap.add_argument("--engine-loop-ms", default="0", help="the engine loop's own time per request (in and out)")
    ap.add_argument("--scale", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--warmup-s", type=float, default=2.0)
    ap.add_argument("--eager-above", default="0", help="graph buckets (the server's) up to this many tokens, packs "
                    "above eager (bf16 on an H200: ~30,700 at EAGER_MARGIN 3, 12,800 at 1.25); 0: no buckets")
    ap.add_argument("--sticky", action="store_true", help="each client keeps one front-end (keep-alive)")
    ap.add_argument("--gpu-s", default="events", help="the GPU time the batcher is told, comma-separated to "
                    "compare: events (as the engine reads it: from the launch's start, a wait for the host "
                    "counted) or compute (the forward's alone)")
    ap.add_argument("--gpu-waits", default="1", help="the share of a launch's host time the GPU waits for before "
                    "computing (1: all of it; 0: none, its work issued faster than it runs), comma-separated")
    ap.add_argument("--ramp-ms", type=float, default=0.0, help="client c starts c × this late")
    ap.add_argument("--seeds", default="0", help="the clients' front-ends, drawn per seed (with --sticky)")
    ap.add_argument("--trim", default="on", help="on, off or both (on,off): a busy GPU's pack trimmed to the "
                    "cheapest a patch (`Batcher._trim`), or whole")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    k = args.scale / 1000
    rows = []
    floats = lambda text: [float(x) for x in text.split(",")]  # noqa: E731
    served = parse_buckets(Settings().cuda_graph_buckets)
    for clients, fe_ms, max_items, loop_ms, launch_ms, eager_above, seed, gpu_s, waits, trim in itertools.product(
            [int(c) for c in args.clients.split(",")], floats(args.frontend_ms),
            [int(m) for m in args.max_items.split(",")], floats(args.engine_loop_ms), floats(args.launch_ms),
            [int(e) for e in args.eager_above.split(",")], [int(s) for s in args.seeds.split(",")],
            args.gpu_s.split(","), floats(args.gpu_waits), args.trim.split(",")):
        buckets = tuple(b for b in served if b <= eager_above)
        gpu = SimulatedGPU(args.a_ms * k, args.b_ms * k, launch_ms * k, buckets, events=gpu_s == "events",
                           waits=waits)
        r = asyncio.run(run(clients, args.frontends, fe_ms * k, args.network_ms * k, gpu, args.seconds * args.scale,
                            args.warmup_s * args.scale, max_items, loop_ms * k, args.sticky, seed,
                            args.ramp_ms * k, trim == "on"))
        r["images_per_s"] = round(r["images_per_s"] * args.scale, 1)  # in the GPU's time, not the scaled one
        row = {"clients": clients, "frontends": args.frontends, "frontend_ms": fe_ms, "engine_loop_ms": loop_ms,
               "launch_ms": launch_ms, "eager_above": eager_above, "max_items": max_items, "seed": seed,
               "gpu_s": gpu_s, "gpu_waits": waits, "trim": trim, **r}
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            host = f"{os.cpu_count()} CPUs, Python {platform.python_version()}"
            json.dump({"benchmark": "sim_closed_loop", "host": host, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
