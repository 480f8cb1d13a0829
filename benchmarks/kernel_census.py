"""Which attention implementation the tuner picks for every shape the served towers run, and by how much it wins.

For each tower (`--models`, random presets of the real sizes), the server's own engine set-up and warm-up run
(`service.engine.build.load_encoder` and `warmup`, at the server's defaults, with no tuning cache): the attention
tuning keys the warm-up meets are the ones serving meets (a key is a length class, a load class, the head dim, the
dtype). On Hopper each key's candidates are the TMA kernel's tiles and the Gluon kernel's; for every key the tuner's
own timings (`Tuner.timings`) give the winner, its implementation, and the best candidate of the other
implementation: the margin is that candidate's time over the winner's, less one. An implementation that wins no key
by at least `--threshold` (2%) in any tower is listed under `summary.removable`.

The timings are the tuner's: each candidate's median of three interleaved rounds of Triton's `do_bench`, those within
5% of the best timed again, longer; a margin above 5% comes from the short rounds.

Usage: python -m benchmarks.kernel_census [--models qwen3-vl-2b qwen3-vl-8b qwen2.5-vl-7b]
Prints a table, then one JSON line; writes kernel_census.json under $OUT or benchmarks/results.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common import environment, print_table, write_results
from kernels.attention.tiles import GluonTile
from kernels.runtime import TUNER
from service.engine.build import load_encoder, warmup
from service.settings import Settings

IMPLEMENTATIONS = ("tma", "gluon")


def implementation(config) -> str:
    return "gluon" if isinstance(config, GluonTile) else "tma"


def depth(config) -> int:
    """Stages in flight: the TMA kernel's software pipeline, the Gluon kernel's K/V ring."""
    return config.ring if isinstance(config, GluonTile) else config.num_stages


def key_row(key: tuple, first: list, final: list) -> dict:
    """One tuning key's census: the winner (from the final timings), and the other implementation's best, from the
    final timings where it was re-timed, else from the short ones (it was then more than 5% behind)."""
    winner, best = min(final, key=lambda ct: ct[1])
    won = implementation(winner)
    others = [t for c, t in final if implementation(c) != won] or [t for c, t in first if implementation(c) != won]
    other = min(others) if others else None
    _, seq_class, load_class, head_dim, *_ = key
    return {"seq_class": seq_class, "load_class": load_class, "head_dim": head_dim, "winner": won,
            "tile": f"{winner.block_m}x{winner.block_n}w{winner.num_warps}s{depth(winner)}",
            "winner_ms": best, "other_ms": other,
            "margin": None if other is None or other == float("inf") else other / best - 1.0,
            "candidates": len(first)}


def census(model: str) -> list[dict]:
    """The server's warm-up of `model` on a fresh tuner; each Hopper attention key's row."""
    TUNER.choices.clear()
    TUNER.timings.clear()
    settings = Settings(model=model, cache_dir="", warmup=True)
    start = time.perf_counter()
    enc = load_encoder(settings)
    warmup(enc, settings)
    print(f"{model}: warm-up {time.perf_counter() - start:.1f} s, {len(TUNER.timings)} keys timed", flush=True)
    rows = [{"model": model, **key_row(key, first, final)} for key, (first, final) in TUNER.timings.items()
            if key[0] == "tma"]
    del enc
    torch.cuda.empty_cache()
    return sorted(rows, key=lambda r: (r["head_dim"], r["seq_class"], r["load_class"]))


def summarize(rows: list[dict], threshold: float) -> dict:
    """Per implementation: keys won, and the largest margin of a win; which never win by `threshold`."""
    out: dict = {}
    for impl in IMPLEMENTATIONS:
        wins = [r for r in rows if r["winner"] == impl]
        margins = [r["margin"] for r in wins if r["margin"] is not None]
        out[impl] = {"keys_won": len(wins), "keys": len(rows), "largest_margin": max(margins, default=None),
                     "wins_over_threshold": sum(m >= threshold for m in margins)}
    # (None where nothing was measured: not a Hopper GPU)
    out["removable"] = [impl for impl in IMPLEMENTATIONS if not out[impl]["wins_over_threshold"]] if rows else None
    out["threshold"] = threshold
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["qwen3-vl-2b", "qwen3-vl-8b", "qwen2.5-vl-7b"])
    ap.add_argument("--threshold", type=float, default=0.02)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.models:
        rows += census(name if name.startswith("random:") else f"random:{name}")
    if not rows:
        print("no Hopper attention key was tuned (the TMA and Gluon kernels run on Hopper GPUs only)")
    else:
        print_table([{**r, "margin": None if r["margin"] is None else f"{100 * r['margin']:.1f}%"} for r in rows],
                    ["model", "head_dim", "seq_class", "load_class", "winner", "tile", "winner_ms", "other_ms",
                     "margin"])
    payload = {"benchmark": "kernel_census", "env": environment(), "models": args.models, "keys": rows,
               "summary": summarize(rows, args.threshold)}
    print(json.dumps(payload["summary"]))
    write_results("kernel_census", payload, args.out)


if __name__ == "__main__":
    main()
