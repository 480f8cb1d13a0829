"""The encoder tier's reply under load: vLLM's layout (`format=vllm`: bfloat16 merged tokens and DeepStack levels,
3.2 MB of tensors and 4.3 MB of JSON a 448 px image) beside the merged tokens alone, from the compiled closed-loop
generator (`tools/openloop`, bytes of their own per request), at each `--shared-memory-mib` (a server per value,
every other setting its default), then one image alone, the embedding cache, and one image alone kept alive on
eight connections with the front-end each reached (`single_image_by_frontend`), on the first server.

Each request holds room in its front-end's shared memory (`Settings.shared_memory_mib`) from its submission to its
reply; what does not fit goes over the engine's socket. This shows what that bound costs vLLM's layout.

`--forward TOWER_JSON`: the served forward timed in the same device call (`bench_tower --presets qwen3-vl-2b
--workloads 1x448px 32x448px --no-compile --no-fp8`, as `gpu_suite.sh epd` runs it): epd.json's `summary` then
holds each load's images/s over the forward's at 32 images, and the lone image's p50 less its forward alone (kept
alive: the range over the front-ends).

Usage: python -m benchmarks.bench_epd [--shared-memory-mib 256,64] [--forward TOWER_JSON] [--out DIR] -> epd.json
(the compiled generator built: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from benchmarks import bench_service as b
from benchmarks.common import environment, write_results

LOADS = (("epd_c64", 64, b.EPD_PARAMS), ("epd_c256", 256, b.EPD_PARAMS), ("tokens_c64", 64, b.PARAMS),
         ("tokens_c256", 256, b.PARAMS))


def served_forward(tower: dict, model: str) -> dict:
    """{workload: the served forward's row (`ours`)} of a tower.json, for the preset `model` names."""
    preset = model.removeprefix("random:")
    ours = {r["workload"]: r["results"]["ours"] for r in tower["rows"] if r["preset"] == preset}
    if not ours:
        raise SystemExit(f"the forward's file has no rows of {preset}")
    return ours


def summary(runs: dict, ours: dict) -> dict:
    """The loads over the served forward (`ours`, 32 x 448 px) and the lone image's p50 beyond its forward alone
    (`ours`, 1 x 448 px)."""
    out: dict = {}
    if (full := ours.get("32x448px")) is not None:
        out["forward_images_per_s"] = round(full["images_per_s"], 1)
        out.update({f"{k}_ratio": round(v["images_per_s"] / full["images_per_s"], 3)
                    for k, v in runs.items() if "images_per_s" in v})
    if (lone := ours.get("1x448px")) is not None and "single_image" in runs:
        out["lone_forward_ms"] = round(lone["ms"], 2)
        out.update({f"{k}_beyond_forward_ms": round(v["p50_ms"] - lone["ms"], 2)
                    for k, v in runs["single_image"].items()})
        if by_frontend := runs.get("single_image_by_frontend"):  # kept alive, each connection's front-end
            p50s = [r["p50_ms"] for r in by_frontend]
            out["keepalive_by_frontend_beyond_forward_ms"] = [round(min(p50s) - lone["ms"], 2),
                                                              round(max(p50s) - lone["ms"], 2)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--shared-memory-mib", default="256,64", help="a server per value, in order")
    ap.add_argument("--warmup-s", type=float, default=8)
    ap.add_argument("--measure-s", type=float, default=12)
    ap.add_argument("--forward", type=Path, default=None, metavar="TOWER_JSON",
                    help="bench_tower's result of the same call: the summary's ratios")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # read first: a wrong file fails before the servers' minutes, not after
    forward = served_forward(json.loads(args.forward.read_text()), args.model) if args.forward else None
    photos = b.photo_jpegs([(448, 448)] * 256)
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-epd-"))
    bodies = b.write_bodies(photos, work)
    runs: dict = {}
    try:
        for i, mib in enumerate(args.shared_memory_mib.split(",")):
            os.environ["QWEN3VL_SHARED_MEMORY_MIB"] = mib
            server, url, _ = b.start_server(args.model, 18555, str(work / f"cache{i}"))
            try:
                for name, clients, params in LOADS:
                    runs[f"shm{mib}_{name}"] = b.compiled(url, bodies, clients, args.warmup_s, args.measure_s, work,
                                                          params=params)
                if i == 0:
                    runs["single_image"] = b.single_image(url, photos[0])
                    runs["cache"] = b.cache_latency(url, photos[0])
                    runs["single_image_by_frontend"] = b.lone_by_frontend(url, photos[0])
            finally:
                b.stop_server(server)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    payload = {"benchmark": "epd", "env": environment(), "model": args.model, "runs": runs}
    if forward is not None:
        payload["forward"] = forward
        payload["summary"] = summary(runs, forward)
    write_results("epd", payload, args.out)
    if "summary" in payload:
        print(json.dumps(payload["summary"]))
    print(json.dumps({k: v["images_per_s"] if "images_per_s" in v
                      else [(r["http_process"], r["p50_ms"]) for r in v] if isinstance(v, list)
                      else {case: r["p50_ms"] for case, r in v.items()} for k, v in runs.items()}))


if __name__ == "__main__":
    main()
