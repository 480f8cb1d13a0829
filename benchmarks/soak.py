"""A soak: the server at its defaults under an open-loop load at a fraction of its capacity, for many minutes.

1. Bodies: distinct 448 px JPEGs (the same photos as `bench_service`, each in bytes of its own, so that the
   embedding cache answers none of them, as with a stream of distinct photos) and a few short MP4 videos.
2. `qwen3vl-encoder serve` with nothing but the model, host and port set.
3. Capacity: 64 clients in a closed loop, images only (`--capacity-s`, after as long again of warm-up).
4. The soak: `--fraction` of that capacity, open loop (each request sent when it is due, its latency counted from
   then), one request in `--video-every` a video, for `--minutes`. Every `--sample-s`: the resident memory of
   every server process and the GPU's memory in use.
5. `soak.json`: per minute, p50 / p99 latency, status counts, memory; overall, the offered and achieved rates
   (achieved: requests sent over the time it took to send them; the run is void below 0.98 of offered), the
   errors, the generator's own CPU, and the 20 slowest forwards for their size from the engine's forward trace
   (`slowest_forwards`: when a stall was, and whether inside a forward or between two). And `soak.png`.

The load comes from `tools/openloop` (Go, standard library only): a Python generator cannot sustain these rates
with megabyte replies. Build it with `CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go`.

Usage: python -m benchmarks.soak [--model random:qwen3-vl-2b] [--minutes 20] [--out DIR]
On the GPU machine, where a command's processes end with it, start it in a session of its own
(`setsid nohup python -m benchmarks.soak ... &`) and collect `soak.json` in a later command.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_service import photo_jpegs, start_server, stop_server, unique
from benchmarks.common import environment, metric_sums, read_forward_trace, write_results

PARAMS = "format=safetensors&deepstack=false"  # as bench_service's uniform load


def write_bodies(directory: Path, images: int, videos: int) -> None:
    """`images` distinct 448 px JPEGs and `videos` distinct 2 s MP4s (448 x 448, 24 fps) in `directory`."""
    from tools.synthetic import encode_video

    photos = photo_jpegs([(448, 448)] * 8)
    for n in range(images):
        (directory / f"{n:06d}.jpg").write_bytes(unique(photos[n % len(photos)], n))
    rng = np.random.default_rng(0)
    for n in range(videos):
        background = rng.integers(0, 200, (448, 448, 3), dtype=np.uint8)
        frames = []
        for i in range(48):
            frame = background.copy()
            frame[40:80, (i * 8) % 400:(i * 8) % 400 + 40] = 255
            frames.append(frame)
        (directory / f"video{n:03d}.mp4").write_bytes(encode_video(frames, 24, "mp4", "mpeg4", False))


def openloop(binary: str, url: str, bodies: Path, out: Path, seconds: float, rate: float = 0,
             concurrency: int = 0, video_every: int = 0) -> dict:
    args = [binary, "-url", url, "-bodies", str(bodies), "-out", str(out), "-duration", f"{seconds}s",
            "-video-every", str(video_every)]
    args += ["-rate", str(rate)] if rate else ["-concurrency", str(concurrency)]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{"due_s": int(r["due_ns"]) / 1e9, "delay_ms": int(r["delay_ns"]) / 1e6,
                 "latency_ms": int(r["latency_ns"]) / 1e6, "status": int(r["status"]), "bytes": int(r["bytes"]),
                 "kind": r["kind"], "cache": r["cache"], "error": r["error"]} for r in csv.DictReader(f)]


def server_processes(pid: int) -> dict[int, str]:
    """The server's process and its descendants: pid -> a short name from its command line."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out[p] = "main" if "service.cli" in cmd else "spawned" if "multiprocessing" in cmd else cmd[:40]
        todo += children.get(p, [])
    return out


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def gpu_memory_mib() -> float | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.split()
        return float(out[0])
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return None


class Sampler(threading.Thread):
    """Every `every_s`: seconds since `t0`, RSS (MiB) of each server process, and the GPU's memory in use."""

    def __init__(self, pid: int, t0: float, every_s: float):
        super().__init__(daemon=True)
        self.pid, self.t0, self.every_s = pid, t0, every_s
        self.samples: list[dict] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            procs = server_processes(self.pid)
            rss = {f"{name}:{p}": rss_mib(p) for p, name in procs.items()}
            self.samples.append({"t_s": time.perf_counter() - self.t0,
                                 "rss_mib": {k: round(v, 1) for k, v in rss.items() if v is not None},
                                 "gpu_memory_mib": gpu_memory_mib()})
            self.stop.wait(self.every_s)


def minute_rows(rows: list[dict], samples: list[dict], minutes: int) -> list[dict]:
    """Per minute of due time: requests, p50 / p99 of the answered ones' latency (ms), status counts (0: no reply),
    send delays, and the last memory sample within the minute."""
    out = []
    for m in range(minutes):
        these = [r for r in rows if m * 60 <= r["due_s"] < (m + 1) * 60]
        ok = np.array([r["latency_ms"] for r in these if r["status"] == 200])
        statuses: dict[str, int] = {}
        for r in these:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        sample = [s for s in samples if s["t_s"] < (m + 1) * 60]
        last = sample[-1] if sample else {"rss_mib": {}, "gpu_memory_mib": None}
        out.append({
            "minute": m + 1, "requests": len(these), "status": statuses,
            "p50_ms": float(np.percentile(ok, 50)) if ok.size else None,
            "p99_ms": float(np.percentile(ok, 99)) if ok.size else None,
            "video_p50_ms": float(np.median([r["latency_ms"] for r in these if r["kind"] == "video"
                                             and r["status"] == 200] or [np.nan])),
            "send_delay_p99_ms": float(np.percentile([r["delay_ms"] for r in these], 99)) if these else None,
            "rss_mib": last["rss_mib"], "rss_total_mib": round(sum(last["rss_mib"].values()), 1),
            "gpu_memory_mib": last["gpu_memory_mib"],
        })
    return out


COMPILES = "qwen3vl_kernel_compiles_while_serving"


def slowest_forwards(trace: Path, start: float, n: int = 20) -> list[dict]:
    """The `n` forwards of the soak (from unix time `start`) whose launch-to-outputs time was longest against their
    patches' median cost: when each ran (seconds into the soak), its items, patches and times. A stall inside a
    forward (a compilation, a new block of pinned or device memory) shows here; a stall between forwards shows as
    the gap before the next one (`gap_before_s`)."""
    rows = read_forward_trace(trace, start)
    if not rows:
        return []
    per_patch = float(np.median([r[4] / max(r[2], 1) for r in rows]))
    gaps = [0.0] + [b[0] - a[0] for a, b in zip(rows, rows[1:])]
    order = sorted(range(len(rows)), key=lambda i: rows[i][4] - per_patch * rows[i][2], reverse=True)[:n]
    return [{"t_s": round(rows[i][0] - start, 3), "items": rows[i][1], "patches": rows[i][2], "gpu_ms": rows[i][3],
             "launch_to_outputs_ms": rows[i][4], "expected_ms": round(per_patch * rows[i][2], 3),
             "gap_before_s": round(gaps[i], 3)} for i in sorted(order)]


def plot(d: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = d["minutes"]
    x = [r["minute"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    axes[0].plot(x, [r["p50_ms"] for r in rows], "o-", label="p50")
    axes[0].plot(x, [r["p99_ms"] for r in rows], "s-", label="p99")
    axes[0].set_ylabel("latency (ms)")
    axes[0].legend()
    axes[0].set_title(f"soak: {d['offered_per_s']:.0f} req/s offered ({d['fraction']:.0%} of "
                      f"{d['capacity_per_s']:.0f}), achieved {d['achieved_per_s']:.0f}, {d['errors']} errors")
    axes[1].plot(x, [r["rss_total_mib"] / 1024 for r in rows], "o-")
    axes[1].set_ylabel("server RSS, all processes (GiB)")
    axes[2].plot(x, [r["gpu_memory_mib"] or 0 for r in rows], "o-")
    axes[2].set_ylabel("GPU memory in use (MiB)")
    axes[2].set_xlabel("minute")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--openloop", default=".bin/openloop", help="the generator's binary (tools/openloop)")
    ap.add_argument("--minutes", type=int, default=20)
    ap.add_argument("--fraction", type=float, default=0.7, help="of the measured capacity")
    ap.add_argument("--capacity-s", type=float, default=20)
    ap.add_argument("--clients", type=int, default=64, help="closed-loop clients measuring capacity")
    ap.add_argument("--images", type=int, default=4000, help="distinct JPEGs, sent round robin: more than the "
                    "embedding cache holds (512 MiB by default), so none is answered from it")
    ap.add_argument("--videos", type=int, default=8)
    ap.add_argument("--video-every", type=int, default=100)
    ap.add_argument("--sample-s", type=float, default=10)
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--out", default=None)
    ap.add_argument("--name", default="soak", help="the result's name: NAME.json and NAME.png")
    ap.add_argument("--plot", metavar="JSON", help="only draw the plot (PNG beside it) of a result file")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), os.path.splitext(args.plot)[0] + ".png")
        return

    work = Path(tempfile.mkdtemp(prefix="soak-"))
    bodies = work / "bodies"
    bodies.mkdir()
    write_bodies(bodies, args.images, args.videos)
    trace = work / "forwards.csv"  # the engine's line per forward (`Settings.forward_trace`): what a stall was
    os.environ["QWEN3VL_FORWARD_TRACE"] = str(trace)
    server, url, ready_s = start_server(args.model, args.port, str(work / "cache"))
    endpoint = f"{url}/embed?{PARAMS}"
    try:
        openloop(args.openloop, endpoint, bodies, work / "warmup.csv", args.capacity_s, concurrency=args.clients)
        cap = openloop(args.openloop, endpoint, bodies, work / "capacity.csv", args.capacity_s,
                       concurrency=args.clients)
        cap_rows = read_rows(work / "capacity.csv")
        capacity = sum(r["status"] == 200 for r in cap_rows) / args.capacity_s
        hits = sum(r["cache"] == "hit" for r in cap_rows)
        if hits > 0.01 * len(cap_rows):  # a capacity of cache hits would offer the GPU far more than it can do
            raise SystemExit(f"the capacity was measured on cache hits ({hits} of {len(cap_rows)} requests): give "
                             "--images more distinct images than the embedding cache holds")
        rate = args.fraction * capacity
        print(f"capacity {capacity:.1f} req/s ({args.clients} clients, closed loop); soak at {rate:.1f} req/s "
              f"for {args.minutes} min", flush=True)
        soak_start = time.time()
        sampler = Sampler(server.pid, time.perf_counter(), args.sample_s)
        sampler.start()
        gen = openloop(args.openloop, endpoint, bodies, work / "soak.csv", args.minutes * 60, rate=rate,
                       video_every=args.video_every)
        sampler.stop.set()
        sampler.join()
        # kernels the engines compiled after warm-up, each a stall of every request
        compiles = metric_sums(url, [COMPILES])[COMPILES]
    finally:
        stop_server(server)
    rows = read_rows(work / "soak.csv")
    ok = np.array([r["latency_ms"] for r in rows if r["status"] == 200])
    errors = [r for r in rows if r["status"] != 200]
    payload = {
        "benchmark": "soak", "env": environment(), "model": args.model, "params": PARAMS,
        "duration_s": args.minutes * 60, "capacity_per_s": capacity, "fraction": args.fraction,
        "offered_per_s": rate, "achieved_per_s": gen["achieved_per_s"],
        "achieved_ratio": gen["achieved_per_s"] / rate, "void": gen["achieved_per_s"] < 0.98 * rate,
        "requests": len(rows), "errors": len(errors), "cache_hits": sum(r["cache"] == "hit" for r in rows),
        "error_kinds": sorted({f"{r['status']} {r['error']}"[:120] for r in errors})[:20],
        "p50_ms": float(np.percentile(ok, 50)), "p99_ms": float(np.percentile(ok, 99)),
        "p99_over_p50": float(np.percentile(ok, 99) / np.percentile(ok, 50)),
        "video_every": args.video_every, "ready_s": ready_s,
        "generator": {"cpu_s": gen["generator_cpu_s"], "wall_s": gen["wall_s"],
                      "cpu_cores": gen["generator_cpu_s"] / gen["wall_s"],
                      "send_delay_p99_ms": float(np.percentile([r["delay_ms"] for r in rows], 99)),
                      "send_delay_max_ms": max(r["delay_ms"] for r in rows)},
        "capacity": {"clients": args.clients, "seconds": args.capacity_s, "generator": cap},
        "minutes": minute_rows(rows, sampler.samples, args.minutes),
        "slowest_forwards": slowest_forwards(trace, soak_start),
        "kernel_compiles_while_serving": compiles,
        "samples": sampler.samples,
    }
    path = write_results(args.name, payload, args.out)
    try:
        plot(payload, path.with_suffix(".png"))
    except ImportError:  # matplotlib is optional: --plot draws it later from the JSON
        pass
    print(json.dumps({k: payload[k] for k in ("offered_per_s", "achieved_per_s", "errors", "p50_ms", "p99_ms")}))


if __name__ == "__main__":
    main()
