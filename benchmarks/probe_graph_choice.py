"""The CUDA-graph attention choice against sustained load: both backends' graphs of one pack, timed in
alternating one-second blocks (median ms per forward, with the SM clock and board power logged).

`service.graphs.GraphedTower` times the two graphs in a short burst at capture. The tower runs at the
H100's power cap under sustained load, where the backend that draws less power keeps a higher clock; this
probe shows whether the burst's choice holds there.

Usage: python -m benchmarks.probe_graph_choice [--preset qwen3-vl-8b] [--workload 32x448px] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.bench_tower import WORKLOADS
from benchmarks.common import RESULTS, ClockLog, bench, environment
from service.config import preset
from service.graphs import GraphedTower
from service.loader import random_tower


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-vl-8b")
    ap.add_argument("--workload", default="32x448px")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    cfg = preset(args.preset)
    tower = random_tower(cfg, "cuda", torch.bfloat16)
    grids = WORKLOADS[args.workload]
    tokens = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
    graphs = {}
    with torch.inference_mode():
        for attention in tower.attention_choices():
            g = GraphedTower(tower, capture_after=1)
            g._choices = lambda key, attention=attention: [attention]  # one backend per cache
            g(pixels, grids)
            graphs[attention] = g
        chooser = GraphedTower(tower, capture_after=1)
        chooser(pixels, grids)
        burst = {"chosen": chooser.attention(grids), "ms": chooser.replay_ms(grids)}
        print("burst at capture:", burst, flush=True)
        blocks = []
        for r in range(args.rounds):
            for attention, g in (graphs.items() if r % 2 == 0 else reversed(graphs.items())):
                with ClockLog() as clocks:
                    ms = bench(lambda g=g: g(pixels, grids), warmup_ms=100, rep_ms=1000)
                blocks.append({"round": r, "attention": attention, "ms": ms, "gpu": clocks.summary()})
                print(json.dumps(blocks[-1]), flush=True)
    summary = {a: sorted(b["ms"] for b in blocks if b["attention"] == a) for a in graphs}
    result = {"benchmark": "probe_graph_choice", "env": environment(), "preset": args.preset,
              "workload": args.workload, "burst": burst, "blocks": blocks,
              "median_ms": {a: t[len(t) // 2] for a, t in summary.items()}}
    print("sustained median ms:", result["median_ms"])
    path = Path(args.out) / f"graph_choice_{args.preset}_{args.workload}.json"
    path.write_text(json.dumps(result, indent=1))
    print("wrote", path)


if __name__ == "__main__":
    main()
