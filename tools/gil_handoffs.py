"""What a torch call that lets go of the interpreter lock costs a thread that shares it: a launch's per-item copies
(32 copies of a 448 px image's 602 KB of frames, as `Encoder.pixels` issues them) timed alone and beside Python
threads that want the lock, at the engine's switch interval (`runtime.BATCHER_SWITCH_INTERVAL_S`).

    python -m tools.gil_handoffs [--items 32] [--threads 0,1,2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import numpy as np
import torch

from service.runtime import BATCHER_SWITCH_INTERVAL_S


def copies_ms(sources: list[torch.Tensor], out: torch.Tensor, runs: int = 50) -> float:
    """Median ms of copying every source into its place in `out`, one `copy_` each."""
    def once() -> float:
        start, offset = time.perf_counter(), 0
        for source in sources:
            out[offset:offset + source.numel()].copy_(source)
            offset += source.numel()
        return (time.perf_counter() - start) * 1000

    return statistics.median(once() for _ in range(runs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--items", type=int, default=32)
    ap.add_argument("--threads", default="0,1,2", help="Python threads spinning beside the copies")
    args = ap.parse_args()
    sys.setswitchinterval(BATCHER_SWITCH_INTERVAL_S)
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sources = [torch.from_numpy(rng.integers(0, 256, 448 * 448 * 3, dtype=np.uint8)) for _ in range(args.items)]
    out = torch.empty(sum(s.numel() for s in sources), dtype=torch.uint8)
    for n in (int(t) for t in args.threads.split(",")):
        stop = threading.Event()

        def spin():
            while not stop.is_set():
                pass

        spinners = [threading.Thread(target=spin) for _ in range(n)]
        for t in spinners:
            t.start()
        try:
            ms = copies_ms(sources, out)
        finally:
            stop.set()
            for t in spinners:
                t.join()
        print(f"{args.items} copies of {sources[0].numel() // 1000} KB beside {n} spinning threads: {ms:.2f} ms "
              f"(switch interval {BATCHER_SWITCH_INTERVAL_S * 1000:.1f} ms)", flush=True)


if __name__ == "__main__":
    main()
