"""The per-stage table of lone-request traces (`tools.request_trace.run`'s NAME.json files), side by side: what
docs/PERFORMANCE.md's "Single image" tables show.

A stage is the time between two marks of the first request's order (medians of each step between them, summed):
HTTP in to the decoder, the decode, the frames' way to the engine process (to the engine's read of the submit;
with `expect`, its second read), the engine's queue to the frames on the GPU, launching the forward (from the start
of `Encoder.launch` where a lone frame goes in through `BucketedTower.frame`, not `Encoder.pixels`), waiting for
it (to the end of `Encoder.finish`, which waits in a thread or finds it done when the loop polled), and everything
after, to the response's last byte.

Usage: python -m tools.request_trace.compare RUN.json [RUN.json ...] [--route embed|v1]
"""

from __future__ import annotations

import argparse
import json
import os

STAGES = (("HTTP in, parse, to the decoder", "http<", "decode<"),
          ("decode", "decode<", "decode>"),
          ("frames to the engine process", "decode>", "submit-read"),
          ("engine: queue to launch, pixels to the GPU", "submit-read", "pixels>"),
          ("launching the forward", "pixels>", "launch>"),
          ("waiting for it", "efinish<", "finish>"),
          ("result back, response out", "finish>", "http>"))


def stages(steps: list[list]) -> dict[str, float]:
    """Milliseconds per stage from a route's `steps_us` ([from, to, median us] in the first request's order)."""
    at, t = {"http<": 0.0}, 0.0
    reads = 0
    for _, to, us in steps:
        t += us
        label = to.split("#")[0]
        if label == "e-read":
            reads += 1
            at["submit-read"] = t  # the last read before the launch: the submit (an `expect` comes first)
        at.setdefault(label, t)
        if label in ("decode>", "pixels>", "launch>", "finish>", "http>"):
            at[label] = t
    at.setdefault("pixels>", at.get("launch<"))  # a lone frame that skips Encoder.pixels: launching from the start
    return {name: (at[b] - at[a]) / 1e3 for name, a, b in STAGES}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--route", choices=("embed", "v1"), default=None, help="one route (default: both)")
    args = ap.parse_args()
    runs = {os.path.splitext(os.path.basename(p))[0]: json.load(open(p)) for p in args.runs}
    for route in (args.route,) if args.route else ("embed", "v1"):
        print(f"-- {route}: {next(iter(runs.values()))[route]['path']} (ms)")
        print(f"{'':44}" + "".join(f"{name:>10}" for name in runs))
        rows = {name: stages(run[route]["steps_us"]) for name, run in runs.items()}
        for stage, *_ in STAGES:
            print(f"{stage:44}" + "".join(f"{rows[name][stage]:10.2f}" for name in runs))
        print(f"{'curl p50':44}" + "".join(f"{run[route]['curl']['p50_ms']:10.2f}" for run in runs.values()))
        print(f"{'server total':44}" + "".join(f"{run[route]['server_total_us'] / 1e3:10.2f}"
                                              for run in runs.values()))


if __name__ == "__main__":
    main()
