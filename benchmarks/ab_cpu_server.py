"""Two revisions of the server on the CPU machine, side by side: images per second of the same load, each revision
started twice, alternated (a 2-core machine's throughput drifts; alternating spreads the drift over both).

Each start: `random:tiny`, two front-ends and one engine, the embedding cache off; 16 closed-loop clients of
`tools/openloop` post 96 px JPEGs (400 distinct), 6 s of warm-up, then two rounds of 10 s. A revision is a git
revision (checked out in a worktree under the work directory) or `.` (this working tree).

`--layout vllm`: what the front-ends do for vLLM's layout instead: a checkpoint whose tower is tiny but whose results
are the 2B's (2048 wide, three DeepStack levels; `save_pretrained` into the work directory), bfloat16, 448 px JPEGs,
`format=vllm`, the embedding cache at its default: the engine's forward costs little, the replies (3.2 MB of
tensors, 4.3 MB of JSON) what they cost on a GPU host.

Usage: python -m benchmarks.ab_cpu_server REV_A REV_B [--layout vllm] [--name NAME] [--out DIR]
(build .bin/openloop first)
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from benchmarks.common import environment, revision_trees, write_results
from benchmarks.soak import openloop
from tools.ready import wait_until_ready

ROOT = Path(__file__).resolve().parents[1]


def bodies(directory: Path, n: int = 400, side: int = 96) -> None:
    rng = np.random.default_rng(0)
    for i in range(n):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        (directory / f"{i:05d}.jpg").write_bytes(buf.getvalue())


def wide_checkpoint(path: Path) -> str:
    """A Qwen3-VL checkpoint whose tower is tiny (3 blocks of 64) and whose results are the 2B's shapes: merged
    tokens 2048 wide and three DeepStack levels."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    vision = dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4, out_hidden_size=2048,
                  num_position_embeddings=64, deepstack_visual_indexes=[0, 1, 2])
    text = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    # no preprocessor_config.json: the loader takes Qwen3-VL's processor defaults (`PreprocessConfig.from_dir`)
    Qwen3VLForConditionalGeneration(Qwen3VLConfig(vision_config=vision, text_config=text)).save_pretrained(path)
    return str(path)


# per load: the server's environment beside the common one, and the query
LAYOUTS = {"tokens": ({"QWEN3VL_MODEL": "random:tiny", "QWEN3VL_EMBEDDING_CACHE_MIB": "0"},
                      "format=safetensors&deepstack=false"),
           "vllm": ({"QWEN3VL_DTYPE": "bfloat16"}, "format=vllm")}


def rounds(tree: Path, port: int, work: Path, layout: str = "tokens") -> list[float]:
    extra, query = LAYOUTS[layout]
    env = {**os.environ, "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1", "QWEN3VL_CACHE_DIR": "",
           "QWEN3VL_HTTP_WORKERS": "2", "PYTHONPATH": str(tree), **extra}
    if layout == "vllm":
        env["QWEN3VL_MODEL"] = str(work / "checkpoint")
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, cwd=tree,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_ready(url, server, timeout_s=300, interval_s=0.2):
            raise RuntimeError(f"the server at {tree} did not become ready")
        endpoint = f"{url}/embed?{query}"
        return [openloop(str(ROOT / ".bin" / "openloop"), endpoint, work / "bodies", work / "rows.csv", seconds,
                         concurrency=16)["achieved_per_s"] for seconds in (6, 10, 10)][1:]
    finally:
        server.terminate()
        server.wait(60)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("revisions", nargs=2)
    ap.add_argument("--layout", choices=tuple(LAYOUTS), default="tokens")
    ap.add_argument("--name", default="ab_cpu_server")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ab-"))
    (work / "bodies").mkdir()
    bodies(work / "bodies", side=448 if args.layout == "vllm" else 96)
    if args.layout == "vllm":
        wide_checkpoint(work / "checkpoint")
    results = {rev: [] for rev in args.revisions}
    named = {rev: "working tree" if rev == "." else subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True).stdout.strip()
        for rev in args.revisions}
    with revision_trees(args.revisions, work) as trees:
        for start in range(2):
            for i, rev in enumerate(args.revisions):
                results[rev] += rounds(trees[rev], 18800 + 2 * start + i, work, args.layout)
                print(rev, [round(x) for x in results[rev]], flush=True)
    medians = {rev: statistics.median(v) for rev, v in results.items()}
    a, b = args.revisions
    payload = {"benchmark": args.name, "env": environment(), "layout": args.layout, "revisions": named,
               "req_per_s": results, "median": medians, "ratio_b_over_a": medians[b] / medians[a]}
    print(json.dumps({"median": medians, "ratio_b_over_a": payload["ratio_b_over_a"]}))
    write_results(args.name, payload, args.out)


if __name__ == "__main__":
    main()
