"""A front-end's CPU per vLLM-layout reply, two revisions side by side on this machine: what a front-end does once
an image's encoding is in, for distinct 448 px images (`format=vllm`: the 2B's bfloat16 tokens and three DeepStack
levels, 3.2 MB), at a front-end's share of a served load (`--rate`, replies a second; 94 is 753 img/s over 8
front-ends, `ab_served_vllm.json`).

Each revision runs in a fresh process set up as a front-end (`runtime.configure_process("frontend")`) with its
default settings: the embedding cache in /dev/shm at its size (and, where the revision has it, its write rate), each
result handed to it as the server does (`EncoderCache.finish`), then the reply built in a thread
(`output.llm_response`) and its chunks walked as the server sends them. Reported: the process's CPU (every thread)
per reply, over `--seconds` after a second's warm-up. Runs alternate between the revisions.

Usage: python -m benchmarks.bench_vllm_reply REV_A REV_B [--rate 94] [--seconds 8] [--runs 3] [--out DIR]
(a revision: a git revision, checked out in a worktree, or `.`: this tree)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import environment, revision_trees, write_results

CHILD = r"""
import asyncio, inspect, json, os, shutil, sys, tempfile, time
import torch
from service.runtime import configure_process
configure_process("frontend")
from service.engine.cache import CachedItem, EncoderCache, cache_key
from service.engine.api import EncodeResult
from service.http.output import llm_response
from service.http.schemas import EmbedOptions
from service.settings import Settings

rate, seconds = float(sys.argv[1]), float(sys.argv[2])
settings = Settings()
path = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
kwargs = {}
if "write_bytes_per_s" in inspect.signature(EncoderCache).parameters:
    kwargs["write_bytes_per_s"] = settings.embedding_cache_write_mib_s << 20
cache = EncoderCache(path, settings.embedding_cache_mib << 20, **kwargs)
g = torch.Generator().manual_seed(0)
results = [EncodeResult(embeds=torch.randn(196, 2048, generator=g).bfloat16(), grid_thw=(1, 28, 28), num_tokens=196,
                        deepstack=torch.randn(3, 196, 2048, generator=g).bfloat16(), pooled=torch.randn(2048))
           for _ in range(8)]
opts = EmbedOptions(format="vllm")


class Item:
    kind, meta = "image", {"kind": "image"}


async def reply(i):
    key = cache_key(i.to_bytes(8, "little"), ("m",))  # distinct images
    cache.lead(key)
    result = results[i % len(results)]
    cache.finish(key, (CachedItem(Item.meta), result))
    response = await asyncio.to_thread(llm_response, [result], [Item()], opts, "m", 2048, {})
    return sum(len(c) for c in response.chunks)


async def main():
    n, start = 0, time.perf_counter()
    cpu = None
    while True:
        due = start + n / rate
        now = time.perf_counter()
        if now - start > 1.0 and cpu is None:
            cpu, counted, t0 = time.process_time(), n, now
        if now - start > 1.0 + seconds:
            break
        await asyncio.sleep(max(0.0, due - now))
        await reply(n)
        n += 1
    await asyncio.sleep(0.2)  # the last writes
    elapsed = time.perf_counter() - t0
    print(json.dumps({"replies": n - counted, "replies_per_s": (n - counted) / elapsed,
                      "cpu_ms_per_reply": 1e3 * (time.process_time() - cpu) / (n - counted),
                      "cache_bytes": cache.bytes}))


asyncio.run(main())
shutil.rmtree(path, ignore_errors=True)
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs=2)
    ap.add_argument("--rate", type=float, default=94.0)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="vllm_reply_cpu")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-reply-"))
    runs: dict[str, list] = {rev: [] for rev in args.revisions}
    with revision_trees(args.revisions, work) as trees:
        for _ in range(args.runs):
            for rev, path in trees.items():
                out = subprocess.run([sys.executable, "-c", CHILD, str(args.rate), str(args.seconds)], cwd=path,
                                     env={"PYTHONPATH": str(path), "PATH": "/usr/bin:/bin"}, capture_output=True,
                                     text=True, check=True)
                runs[rev].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(rev, runs[rev][-1], flush=True)
    summary = {rev: statistics.median(r["cpu_ms_per_reply"] for r in rs) for rev, rs in runs.items()}
    write_results(args.name, {"benchmark": "vllm_reply_cpu", "env": environment(), "rate": args.rate,
                              "seconds": args.seconds, "runs": runs, "summary_cpu_ms_per_reply": summary}, args.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
