"""What the embedding cache costs a front-end per input, on the CPU: a miss's write of its result (`EncoderCache._put`:
the entry encoded, written to a file in /dev/shm, renamed into place, and the least recently used entries evicted at
the server's default budget, steady state) and a hit's read (`EncoderCache.get`), for the results of one 448 px image
of the 2B as each output asks for them: the pooled vector, the merged tokens, the tokens and DeepStack (the vLLM and
SGLang layouts). CPU time (user and system) per operation, median of `--rounds` rounds of `--n` operations.

Usage: python -m benchmarks.bench_cache [--n 1000] [--rounds 5] [--out DIR]   (cache_cpu.json)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time

import torch

from benchmarks.common import environment, write_results
from service.engine.cache import CachedItem, EncoderCache, _nbytes, cache_parent
from service.model.results import EncodeResult
from service.settings import Settings

TOKENS, WIDTH, LEVELS = 196, 2048, 3  # the 2B's merged tokens of a 448 px image, their width, its DeepStack levels


def result(tokens: bool, deepstack: bool) -> EncodeResult:
    return EncodeResult(grid_thw=(1, 28, 28), num_tokens=TOKENS, pooled=torch.randn(WIDTH),
                        embeds=torch.randn(TOKENS if tokens else 0, WIDTH).bfloat16(),
                        deepstack=torch.randn(LEVELS if deepstack else 0, TOKENS, WIDTH).bfloat16())


def cpu_ms(fn, n: int) -> float:
    began = time.process_time()
    for i in range(n):
        fn(i)
    return 1e3 * (time.process_time() - began) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    budget = Settings().embedding_cache_mib << 20
    item = CachedItem({"kind": "image", "width": 448, "height": 448})
    rows = {}
    for name, tokens, deepstack in (("pooled", False, False), ("tokens", True, False), ("vllm", True, True)):
        value = (item, result(tokens, deepstack))
        directory = tempfile.mkdtemp(prefix="qwen3vl-cache-bench-", dir=cache_parent())
        try:
            cache = EncoderCache(directory, budget)
            nbytes = _nbytes(value[1])
            fill = budget // nbytes
            for i in range(min(fill + 16, 20 * args.n)):  # past the budget: every write then evicts in turn
                cache._put(f"fill-{i:08x}", value)
            writes, reads = [], []
            for r in range(args.rounds):
                writes.append(cpu_ms(lambda i: cache._put(f"r{r}-{i:08x}", value), args.n))
                reads.append(cpu_ms(lambda i: cache.get(f"r{r}-{i:08x}"), args.n))
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        rows[name] = {"result_bytes": nbytes, "miss_write_cpu_ms": round(statistics.median(writes), 3),
                      "hit_read_cpu_ms": round(statistics.median(reads), 3),
                      "write_rounds_ms": [round(x, 3) for x in writes], "read_rounds_ms": [round(x, 3) for x in reads]}
        print(name, rows[name], flush=True)
    write_results("cache_cpu", {"benchmark": "cache_cpu", "env": environment(), "budget_mib": budget >> 20,
                                "directory": cache_parent(), "n": args.n, "rounds": args.rounds, "results": rows},
                  args.out)


if __name__ == "__main__":
    main()
