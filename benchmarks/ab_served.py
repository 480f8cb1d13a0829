"""The served throughput of other revisions beside this tree's on one machine: each revision's server at its
defaults under this tree's compiled closed-loop generator (`bench_service.compiled`: 448 px JPEGs, each request's
bytes its own, tokens only), one after another, with what tells a run's mode apart (`measured`). A lease's host
differs from the last, so only such a run says what a revision changed.

    mkdir -p .ab && git archive REV > .ab/REV.tar     (here; carry .ab to the GPU machine)
    python -m benchmarks.ab_served [--clients 64] [--rounds 1] [--out DIR]      (ab_served.json)

Each `.ab/*.tar` is unpacked once under /tmp/ab; "head" is this tree; `--variant` adds this tree's server with
other settings.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.bench_service import EPD_PARAMS, PARAMS, compiled, photo_jpegs, start_server, stop_server, write_bodies
from benchmarks.common import environment, py_spy, top_frames, write_results
from benchmarks.multigpu import server_cpu


def trees(folder: Path) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for archive in sorted(folder.glob("*.tar")):
        root = Path("/tmp/ab") / archive.stem
        if not root.exists():
            root.mkdir(parents=True)
            with tarfile.open(archive) as t:
                t.extractall(root, filter="data")
        out[archive.stem] = str(root)
    out["head"] = None
    return out


def measured(url: str, server, bodies: Path, clients: int, warmup_s: float, seconds: float, work: Path,
             trace: Path, profile: Path | None = None, params: dict = PARAMS) -> dict:
    """`compiled`'s row, with what tells a run's mode: each front-end's client connections and cores over the window
    (the kernel's hash spreads the connections), and the engine's forwards in it (`FORWARD_TRACE`, summarised by
    `common.forward_gaps`: images per forward, the GPU's idle time between forwards, the launches). With `profile`
    (a file), py-spy records which of the engine's threads hold its interpreter lock over the window, and the row
    gets the frames where most of those samples end (`engine_gil_top`); beside it (`PROFILE-frontend.txt`), every
    thread of the front-end with the most connections, on a CPU or not (`frontend_top`)."""
    import httpx

    engine_pids = {e["pid"] for e in httpx.get(f"{url}/info", timeout=10).json()["engine"].get("engines", [])
                   if e.get("pid")}
    result: dict = {}

    def sample():  # the front-ends over the measured window, sampled beside the generator
        time.sleep(warmup_s)
        a = server_cpu(server, engine_pids)
        spy = py_spy(min(engine_pids), seconds, profile, rate=200) if profile and engine_pids else None
        busiest = max(a.frontends, key=lambda pid: a.frontends[pid][1], default=None)
        front = profile.with_name(profile.stem + "-frontend.txt") if profile else None
        front_spy = py_spy(busiest, seconds, front, rate=200, gil=False) if front and busiest else None
        time.sleep(seconds)
        b = server_cpu(server, engine_pids)
        result["engine_cores"] = round((b.engines - a.engines) / seconds, 2)
        if spy is not None:
            spy.wait(timeout=30)
            if profile.exists():
                result["engine_gil_top"] = top_frames(profile, 30)
        if front_spy is not None:
            front_spy.wait(timeout=30)
            if front.exists():
                result["frontend_top"] = top_frames(front, 30)
        result["frontends"] = sorted(
            ({"connections": conns, "cores": round((b.frontends[pid][0] - cpu) / seconds, 2)}
             for pid, (cpu, conns) in a.frontends.items() if pid in b.frontends),
            key=lambda f: -f["connections"])

    sampler = threading.Thread(target=sample)
    sampler.start()
    row = compiled(url, bodies, clients, warmup_s, seconds, work, trace=trace, params=params)
    sampler.join()
    row.update(result)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--ab", default=".ab")
    ap.add_argument("--clients", default="64")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--warmup-s", type=float, default=6.0)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE]",
                    help="this tree's server again with these settings in its environment, as NAME "
                         "(e.g. items22:QWEN3VL_MAX_BATCH_ITEMS=22)")
    ap.add_argument("--format", choices=("tokens", "vllm"), default="tokens",
                    help="each request's reply: the merged tokens (bench_service's), or vLLM's layout (bench_epd's)")
    ap.add_argument("--profile", action="store_true", help="py-spy on the engine over each measured window "
                    "(raw stacks of the threads holding its interpreter lock, beside ab_served.json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # KEY=VALUE pairs apart at the commas before a KEY= (a value may hold commas: a bucket list)
    variants = {name: dict(kv.split("=", 1) for kv in re.split(r",(?=[A-Z0-9_]+=)", spec))
                for name, spec in (v.split(":", 1) for v in args.variant)}
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-ab-"))
    bodies = write_bodies(photo_jpegs([(448, 448)] * 256), work)
    # one cache directory (the tuner's, the buckets' timings) for every tree and round: its files are keyed by the
    # kernels' source and the tower's options, so trees whose kernels differ do not share entries
    cache = tempfile.mkdtemp(prefix="qwen3vl-ab-cache-")
    runs: dict[str, list] = {}
    profiles = Path(args.out or "benchmarks/results")
    profiles.mkdir(parents=True, exist_ok=True)  # py-spy writes there before the results do
    try:
        for round_ in range(args.rounds):
            for name, tree in {**trees(Path(args.ab)), **dict.fromkeys(variants)}.items():
                trace = work / f"forwards-{name}-{round_}.csv"
                saved = dict(os.environ)
                os.environ.update(variants.get(name, {}))
                try:
                    server, url, ready = start_server(args.model, 18790, cache, tree, trace=trace)
                except RuntimeError as e:
                    runs.setdefault(name, []).append({"error": str(e)})
                    continue
                finally:
                    os.environ.clear()
                    os.environ.update(saved)
                try:
                    row = {"round": round_, "ready_s": round(ready, 1)}
                    for n in (int(c) for c in args.clients.split(",")):
                        spy = (profiles / f"engine_gil_{name}_{round_}_c{n}.txt") if args.profile else None
                        row[f"c{n}"] = measured(url, server, bodies, n, args.warmup_s, args.seconds, work, trace, spy,
                                                params=EPD_PARAMS if args.format == "vllm" else PARAMS)
                    print(name, row, flush=True)
                    runs.setdefault(name, []).append(row)
                finally:
                    stop_server(server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(cache, ignore_errors=True)
    write_results("ab_served", {"benchmark": "ab_served", "env": environment(), "model": args.model,
                                "clients": args.clients, "format": args.format, "variants": variants, "runs": runs},
                  args.out)


if __name__ == "__main__":
    main()
