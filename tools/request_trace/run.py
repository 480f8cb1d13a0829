"""Where a lone request's time goes, step by step across the server's processes.

Starts `qwen3vl-encoder serve` with its defaults (plus any QWEN3VL_* variables in the environment) and the tracer
of `sitecustomize.py` in every process, posts one 448 px JPEG at a time with curl (as `benchmarks.bench_service`'s
single-image figures do, 5 unmeasured then 40), first to the pooled-only `/embed`, then to `/v1/embeddings`, and
prints for each route the median time of each step: from one mark to the next, in the order the first request
took them.
`--root` runs another checkout's server (an A/B of two revisions on one machine, in turn).

Usage: python -m tools.request_trace.run NAME [--root DIR] [--out DIR]
(CUDA or CPU; writes NAME.json, and the marks in NAME.trace, NAME.embed.trace and NAME.v1.trace)
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REQUESTS = 40  # measured per route, after 5 unmeasured


def steps(path: str, skip: int = 5) -> tuple[list[tuple[str, str, float]], float]:
    """(from, to, median us) per step in the first request's order, and the median of the whole, from a trace."""
    rows = sorted((int(t), int(p), int(th), label) for t, p, th, label in (line.split() for line in open(path)))
    requests = []
    for row in rows:
        if row[3] == "http<":
            requests.append([row])
        elif requests:
            requests[-1].append(row)
    requests = requests[skip:]
    gaps = collections.defaultdict(list)
    order = []
    for n, req in enumerate(requests):
        seen = collections.Counter()
        for a, b in zip(req, req[1:]):
            seen[b[3]] += 1
            key = (a[3], b[3] if seen[b[3]] == 1 else f"{b[3]}#{seen[b[3]]}")
            gaps[key].append((b[0] - a[0]) / 1e3)
            if n == 0:
                order.append(key)
    total = statistics.median((r[-1][0] - r[0][0]) / 1e3 for r in requests)
    return [(a, b, statistics.median(gaps[(a, b)])) for a, b in order], total


def main():
    from benchmarks.bench_service import curl_p50, lone_bodies, photo_jpegs
    from tools.ready import wait_until_ready

    ap = argparse.ArgumentParser()
    ap.add_argument("name")
    ap.add_argument("--root", default=os.getcwd(), help="the checkout whose server runs")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    os.makedirs(args.out, exist_ok=True)
    jpeg = photo_jpegs([(448, 448)])[0]
    work = tempfile.mkdtemp()
    jpgs, jsons = lone_bodies(work, jpeg, REQUESTS + 5)  # as `bench_service`'s lone image: no cache hits
    bodies = {"embed": ("/embed?embeddings=false&pooling=mean", "image/jpeg", jpgs),
              "v1": ("/v1/embeddings", "application/json", jsons)}
    trace = os.path.join(args.out, args.name + ".trace")
    env = {**os.environ, "QWEN3VL_PORT": "18999", "QWEN3VL_HOST": "127.0.0.1", "TRACE_FILE": trace,
           "PYTHONPATH": os.pathsep.join([HERE, root, os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result = {"benchmark": "request_trace", "name": args.name, "root": root}
    try:
        if not wait_until_ready("http://127.0.0.1:18999", server, timeout_s=600, interval_s=0.2):
            raise RuntimeError("server did not become ready")
        result["ready_s"] = time.perf_counter() - start
        time.sleep(2)
        for route, (path, ctype, body_files) in bodies.items():
            open(trace, "w").close()  # start-up marks, and the previous route's, are not this route's requests (the
            # processes append to this file: it is truncated, never replaced)
            curl = curl_p50("http://127.0.0.1:18999", path, body_files, ctype, REQUESTS)
            shutil.copyfile(trace, os.path.join(args.out, f"{args.name}.{route}.trace"))
            table, total = steps(os.path.join(args.out, f"{args.name}.{route}.trace"))
            print(f"-- {path}")
            for a, b, us in table:
                print(f"{a:>10} -> {b:<12} {us:8.1f} us")
            print(f"server total {total:.0f} us; curl p50 {curl['p50_ms']:.2f} ms")
            result[route] = {"path": path, "curl": curl, "server_total_us": total, "steps_us": table}
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)
    from benchmarks.common import environment

    with open(os.path.join(args.out, args.name + ".json"), "w") as out:
        json.dump({**result, "env": environment()}, out, indent=1)


if __name__ == "__main__":
    main()
