"""`qwen3vl-encoder dataset` against the forward, on one GPU and on every GPU of the node, in bf16 and FP8.

Inputs: 448 px JPEGs on local disk, each file's bytes its own (scikit-image's photos, a JPEG comment apart), pooled
vectors out, shards of 100 (`SHARD`). Per precision:
- the forward's best over packs of those images (as a CUDA graph of the pack's signature, eagerly, on the served
  path, in 300-ms bursts), in this process, before the jobs: the reference; and the served path's full packs run back
  to back for 15 s, the rate the GPU holds at its power cap as a job's engines run it (`ratio_to_sustained_*`);
- the job on `--devices 0` and on every GPU. Its rate is counted from the output directory alone: the inputs of the
  shards committed from the end of the decoding processes' first two waves of shards (at least 10%) to 90% of them
  (engine start-up, the first shards, which all come in together, and the last shards' tail outside the window),
  the first GPU's SM clock over it, and the CPU of the job's whole process tree (psutil) over the same window: CPU
  cores per image/s, and per GPU;
  beside it the job's own figure, its inputs over the time from its processes' start-up to its last shard's commit
  (`job_images_per_s`, the last shards' tail included, the processes' exit after it apart: `stop_s`), against the
  forward's bursts and its sustained rate (`job_ratio_to_*`). A window
  above the sustained rate is an upper bound: the job's own rate is then the figure.
Then the resume test: the job on every GPU, SIGKILLed with its process group (what a scheduler's preemption sends)
half-way, run again to the end: every input in the output exactly once.

With `--cpu` (a machine without a GPU): the decoding processes' CPU per input alone, from the job on two CPU
engines (the processes' layout) with the tiny tower standing in for the GPUs' forward (`dataset_cpu.json`).

Usage: python -m benchmarks.bench_dataset [--images-per-gpu N] [--quant bf16,fp8] [--profile] [--out DIR]
       python -m benchmarks.bench_dataset --cpu [--images-per-gpu 1500]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.bench_service import photo_jpegs, unique
from benchmarks.common import ClockLog, environment, py_spy, top_frames, write_results
from service.settings import Settings

# the CLI's default is 1,000: a node's 24 decoding processes would then commit 48,000 inputs in two bursts, and the
# rate between 10% and 90% of the shards committed would measure the bursts, not the job
SHARD = 100


def tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of `root` and every live descendant (psutil, as `multigpu.server_cpu`)."""
    import psutil

    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def spy(proc: subprocess.Popen, out: Path, tag: str, seconds: int = 10) -> list[tuple[str, Path, subprocess.Popen]]:
    """py-spy (where installed, `common.py_spy`) for `seconds`, in the background, on the job's first engine process
    (its oldest child: the engines start before the decoding processes) and on a decoding process (its youngest):
    the threads holding each one's interpreter lock, and the decoding process's threads on a CPU whatever they hold.
    Returns (kind, raw profile path, py-spy process) for `top_frames` once the job is done."""
    import psutil

    def command(c) -> str:
        try:
            return " ".join(c.cmdline())
        except psutil.Error:  # gone, or a zombie (an engine's standby that exited)
            return ""

    kids = sorted((c for c in psutil.Process(proc.pid).children()
                   if "multiprocessing" in (cmd := command(c)) and "resource_tracker" not in cmd),
                  key=lambda c: c.create_time())
    if not kids:
        return []
    made = []
    for kind, pid, gil in (("engine_gil", kids[0].pid, True), ("worker_gil", kids[-1].pid, True),
                           ("worker_cpu", kids[-1].pid, False)):
        path = out / f"profile_dataset_{tag}_{kind}.txt"
        job = py_spy(pid, seconds, path, gil=gil)
        if job is not None:
            made.append((kind, path, job))
    return made


def job(images: Path, out: Path, devices: str, kill_at: float | None = None, profile: Path | None = None,
        tag: str = "") -> dict:
    """One run of the CLI; its rate and CPU over the shards committed from the end of its first two waves (at least
    10% of them) to 90%, and the first GPU's SM clock and power over them (`ClockLog`: what tells a window run at a
    cooler chip's clock from the sustained forward's); `kill_at`: SIGKILL to its process group once that fraction
    of the shards is committed; `profile`: py-spy on its first engine and a decoding process from the window's
    start (`spy`), the top frames in the row; and the job's own rate (`job_images_per_s`)."""
    shards = -(-len(list(images.iterdir())) // SHARD)
    # the window opens once the first two shards of every decoding process are in: each process starts its two at
    # once and all of them alike, so they come in together, and a window opening among them counts work done before
    # it (the likely cause of a 10%-90% window 6.7% above the sustained forward on one H200, 120 shards)
    first_waves = 2 * 2 * max(1, Settings(devices=devices).resolved_http_workers())
    cmd = [sys.executable, "-m", "service.cli", "dataset", str(images), "-o", str(out), "--model", MODEL,
           "--devices", devices, "--shard-size", str(SHARD), "--quiet"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    hi = round(0.9 * shards)
    lo = max(1, round(0.1 * shards), min(first_waves, hi // 2))
    marks: dict[str, tuple[float, int, float]] = {}
    spied: list[tuple[str, Path, subprocess.Popen]] = []
    clocks = ClockLog(interval_ms=200)
    with contextlib.ExitStack() as window:
        while proc.poll() is None:
            n = len(list(out.glob("part-*.parquet"))) if out.exists() else 0
            if kill_at is not None and n >= kill_at * shards:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return {"killed_after_shards": n, "of_shards": shards}
            for name, at in (("lo", lo), ("hi", hi)):
                if name not in marks and n >= at:
                    marks[name] = (time.perf_counter(), n, tree_cpu_s(proc.pid))
                    if name == "lo":
                        window.enter_context(clocks)
                        if profile is not None:
                            spied = spy(proc, profile, tag)
                    else:
                        window.close()
            time.sleep(0.02)
    err = proc.stderr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {proc.returncode}: {err[-2000:]}")
    (ta, na, ca), (tb, nb, cb) = marks["lo"], marks["hi"]
    rate = (nb - na) * SHARD / (tb - ta)
    row = {"devices": devices, "inputs": shards * SHARD, "wall_s": round(time.perf_counter() - t0, 1),
           "window_shards": nb - na, "images_per_s": round(rate, 1),
           "cpu_cores": round((cb - ca) / (tb - ta), 2),
           "cpu_ms_per_image": round((cb - ca) / ((nb - na) * SHARD) * 1e3, 3)}
    if gpu := clocks.summary():
        row["sm_clock_mhz"], row["power_w"] = gpu["sm_mhz_median"], gpu["power_w_median"]
    if (m := re.search(r"started in ([\d.]+) s, then encoded in ([\d.]+) s", err)) is not None:
        row["startup_s"], row["encode_s"] = float(m.group(1)), float(m.group(2))
        row["job_images_per_s"] = round(shards * SHARD / row["encode_s"], 1)  # the whole job once its processes are up
    if (m := re.search(r"stopped in ([\d.]+) s", err)) is not None:
        row["stop_s"] = float(m.group(1))  # the processes' exit, after the last shard's commit
    if (m := re.search(r"CPU per input: ([\d.]+) ms decoding, ([\d.]+) ms in the engines", err)) is not None:
        row["decode_cpu_ms_per_image"], row["engine_cpu_ms_per_image"] = float(m.group(1)), float(m.group(2))
    for kind, path, spying in spied:
        with contextlib.suppress(subprocess.TimeoutExpired):  # py-spy writes its file when its duration is over
            spying.wait(10)
        if path.exists():
            row[f"profile_{kind}_top"] = top_frames(path)
    print(json.dumps(row), flush=True)
    return row


def write_images(directory: Path, n: int, photos: list[bytes]) -> Path:
    """`directory`, made, holding `n` JPEGs named by their number, each the bytes of one of `photos` made its own."""
    directory.mkdir()
    for i in range(n):
        (directory / f"{i:07d}.jpg").write_bytes(unique(photos[i % len(photos)], i))
    return directory


def forward_best(jpeg: bytes) -> dict:
    from benchmarks.bench_clients import forward_table

    table = forward_table(MODEL, jpeg, packs=(16, 32, 41))
    best = min(min(v["graph_ms_per_image"], v["eager_ms_per_image"], v["served_ms_per_image"]) for v in table.values())
    return {"by_pack": table, "images_per_s": round(1e3 / best, 1)}


def forward_sustained(jpeg: bytes, images: int = 41) -> dict:
    """The served forward (`BucketedTower` with the server's buckets) of `images`-image packs back to back
    (`bench_service.sustained`): the bursts of `forward_best` run at a clock the GPU does not hold under a job."""
    import torch

    from benchmarks.bench_service import served_encoder, sustained
    from service.model.graphs import BucketedTower

    settings, enc = served_encoder(MODEL)
    served = BucketedTower(enc.tower, settings.graph_buckets(), settings.graph_eager_margin())
    with torch.inference_mode():
        served.capture()
        one = enc.preprocess(jpeg)
        pixels, grids = enc.pixels([one] * images), [one.grid_thw] * images
        return sustained([lambda: served(pixels, grids)], images)  # freed on return: the caller empties the cache


def main():
    global MODEL
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--images-per-gpu", type=int, default=20000)
    ap.add_argument("--quant", default="bf16,fp8")
    ap.add_argument("--no-resume", dest="resume", action="store_false", help="without the kill-and-rerun test")
    ap.add_argument("--profile", action="store_true", help="py-spy on an engine and a decoding process during each job "
                    "(raw profiles in --out, their top frames in the rows)")
    ap.add_argument("--cpu", action="store_true", help="the decoding's CPU per input on two CPU engines")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    MODEL = args.model
    if args.cpu:
        return decoding_on_cpu(args)
    import torch

    gpus = torch.cuda.device_count()
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-dataset-"))
    photos = photo_jpegs([(448, 448)] * 64)
    sets = {n: write_images(work / f"images-{n}", n, photos)
            for n in sorted({args.images_per_gpu, args.images_per_gpu * gpus})}
    path = Path(args.out or os.environ.get("OUT") or "benchmarks/results") / "dataset.json"
    result = json.loads(path.read_text()) if path.exists() else {}  # other precisions' runs kept
    result.update({"benchmark": "dataset", "env": environment(), "model": MODEL, "gpus": gpus, "shard_size": SHARD,
                   "inputs": "448 px JPEGs on local disk, each file's bytes its own; outputs: pooled"})
    summary = result.get("summary", {})
    for quant in args.quant.split(","):
        os.environ.pop("QWEN3VL_QUANTIZATION", None)
        if quant != "bf16":
            os.environ["QWEN3VL_QUANTIZATION"] = quant
        fwd = forward_best(photos[0])
        fwd["sustained"] = forward_sustained(photos[0])
        torch.cuda.empty_cache()
        spy_dir = Path(args.out or os.environ.get("OUT") or "benchmarks/results") if args.profile else None
        one = job(sets[args.images_per_gpu], work / f"out-{quant}-1", "0", profile=spy_dir, tag=f"{quant}_1gpu")
        every = one if gpus == 1 else job(sets[args.images_per_gpu * gpus], work / f"out-{quant}-{gpus}", "all",
                                          profile=spy_dir, tag=f"{quant}_{gpus}gpu")  # one GPU: the same job
        result[quant] = {"forward": fwd, "gpus_1": one, f"gpus_{gpus}": every}
        key = "" if quant == "bf16" else f"_{quant}"
        summary[f"ratio_to_forward_1gpu{key}"] = round(one["images_per_s"] / fwd["images_per_s"], 3)
        summary[f"ratio_to_forward_{gpus}gpu{key}"] = round(every["images_per_s"] / (gpus * fwd["images_per_s"]), 3)
        held = fwd["sustained"]["images_per_s"]
        summary[f"ratio_to_sustained_forward_1gpu{key}"] = round(one["images_per_s"] / held, 3)
        summary[f"ratio_to_sustained_forward_{gpus}gpu{key}"] = round(every["images_per_s"] / (gpus * held), 3)
        summary[f"scaling_{gpus}gpu{key}"] = round(every["images_per_s"] / one["images_per_s"], 3)
        summary[f"cpu_cores_per_gpu{key}"] = round(every["cpu_cores"] / gpus, 2)
        for n, row in ((1, one), (gpus, every)):  # the job's own rate: start-up left out, its ramp and tail in
            if "job_images_per_s" in row:
                rate = row["job_images_per_s"] / n
                summary[f"job_ratio_to_forward_{n}gpu{key}"] = round(rate / fwd["images_per_s"], 3)
                summary[f"job_ratio_to_sustained_forward_{n}gpu{key}"] = round(rate / held, 3)
        print(quant, json.dumps(summary), flush=True)
    os.environ.pop("QWEN3VL_QUANTIZATION", None)
    if args.resume:
        resume(args, sets, work, result, summary)
    result["summary"] = summary
    write_results("dataset", result, args.out)
    print(json.dumps(summary, indent=1))


def decoding_on_cpu(args) -> None:
    """The job's decoding processes' CPU per 448 px JPEG, measured where no GPU is: two CPU engines with the tiny
    tower (its forward, not the decoding, sets the rate here), the job's own accounting (`decode_cpu_ms_per_image`),
    and what it comes to a GPU at the forward rates of the 2B on an H200 (`dataset.json`)."""
    global MODEL
    MODEL = "random:tiny"
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-dataset-"))
    n = min(args.images_per_gpu, 1500)
    images = write_images(work / "images", n, photo_jpegs([(448, 448)] * 64))
    rows = [job(images, work / f"out-{k}", "cpu,cpu") for k in range(3)]
    decode = sorted(r["decode_cpu_ms_per_image"] for r in rows)[1]
    forward = {"bf16": 975.0, "fp8": 1219.0}  # one H200's forward of the 2B, img/s (`dataset.json`, one_gpu_0a94fd5)
    result = {"benchmark": "dataset_cpu", "env": environment(), "model": MODEL, "inputs": n, "shard_size": SHARD,
              "what": "the decoding processes' CPU per input (448 px JPEGs read from disk, decoded, sent to the "
                      "engines, their pooled vectors written to Parquet), from the job's own accounting on two CPU "
                      "engines; median of 3 runs", "runs": rows,
              "summary": {"decode_cpu_ms_per_image": decode}}
    for quant, rate in forward.items():
        result["summary"][f"decode_cores_per_gpu_{quant}"] = round(decode * rate / 1e3, 2)
    write_results("dataset_cpu", result, args.out)
    print(json.dumps(result["summary"], indent=1))


def resume(args, sets, work, result, summary):
    out = work / "out-resume"
    images = sets[args.images_per_gpu]
    killed = job(images, out, "all", kill_at=0.5)
    ids = [f"{i:07d}.jpg" for i in range(args.images_per_gpu)]
    import pyarrow.parquet as pq

    before = sum(pq.read_metadata(f).num_rows for f in out.glob("part-*.parquet"))
    job(images, out, "all")
    got = pq.read_table(sorted(out.glob("part-*.parquet")), columns=["id"]).column(0).to_pylist()
    result["resume"] = {**killed, "rows_before_rerun": before, "rows_after": len(got), "distinct_ids": len(set(got)),
                        "inputs": len(ids)}
    summary["resume_exactly_once"] = sorted(got) == ids


MODEL = "random:qwen3-vl-2b"

if __name__ == "__main__":
    main()
