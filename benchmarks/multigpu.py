"""The whole node through one endpoint: `qwen3vl-encoder serve` on 1, 2 and every GPU of the host, at its defaults.

Parts (each fits one device command; they share a kernel cache directory, `--cache`):
- `startup`: seconds from launch to /ready 200 (every engine up, every front-end connected) on one GPU and on every
  GPU, each with an empty kernel cache and then again with the warm one; and per-GPU memory from nvidia-smi.
- `scaling`: per configuration (`--devices 0`, `0,1`, every GPU), `--clients` closed-loop clients of the compiled
  generator (`tools/openloop`, `-unique`: each request's bytes its own, so no reply comes from the embedding cache)
  posting 448 px JPEGs, tokens only. Warm-up `--warmup-s`, then `--seconds` measured: images/s, p50/p99, the
  generator's achieved rate and CPU, each engine's forwards and GPU busy fraction (/info), the front-ends' and the
  engines' CPU-seconds per image, per-GPU memory. On every GPU also: a load of mixed sizes (224-1024 px; each GPU's
  busy fraction) and the fault test (SIGKILL of the engine on cuda:2, or the last, under the same load: statuses,
  dropped connections, seconds until it serves again).
- `QWEN3VL_QUANTIZATION=fp8` in the environment measures the FP8 tower (its own keys, `_fp8`).

Results merge into `multigpu.json` under `--out` (one key per part and precision), with a `summary`.

Usage on a multi-GPU machine (the web stack's wheels carried, the generator built here with
`CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go`):
    python -m benchmarks.multigpu --part startup --out $OUT
    python -m benchmarks.multigpu --part scaling --out $OUT
    QWEN3VL_QUANTIZATION=fp8 python -m benchmarks.multigpu --part scaling --out $OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple
from pathlib import Path

import httpx
import numpy as np
import psutil

from benchmarks.bench_service import photo_jpegs
from benchmarks.common import environment, forward_gaps, py_spy, read_forward_trace, top_frames
from tools.ready import wait_until_ready

PARAMS = "format=safetensors&deepstack=false"  # tokens only, as bench_service's uniform load


def gpu_count() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout
    return len(out.split())


def gpu_memory() -> dict:
    """Per GPU: memory in use (MiB), and each compute process on it with its memory (from nvidia-smi)."""
    gpus = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.used,clocks.sm,power.draw",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory",
                           "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    out, uuid_index = {}, {}
    for line in gpus.splitlines():
        index, uuid, used, clock, power = (p.strip() for p in line.split(","))
        uuid_index[uuid] = index
        out[index] = {"memory_used_mib": float(used), "sm_clock_mhz": clock, "power_w": power, "processes": {}}
    for line in apps.splitlines():
        if line.strip():
            pid, uuid, used = (p.strip() for p in line.split(","))
            out[uuid_index[uuid]]["processes"][pid] = float(used)
    return out


def write_bodies(directory: Path, sizes: list[tuple[int, int]]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for n, jpeg in enumerate(photo_jpegs(sizes, seed=len(sizes))):
        (directory / f"{n:05d}.jpg").write_bytes(jpeg)
    return directory


def start(devices: str | None, cache: Path, port: int, log: Path,
          http_workers: int | None = None) -> tuple[subprocess.Popen, str, float]:
    """`serve` at its defaults on `devices` (None: every GPU), or with `http_workers` front-ends; (process, url,
    seconds to /ready 200)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_CACHE")}
    if http_workers is not None:
        env["QWEN3VL_HTTP_WORKERS"] = str(http_workers)
    env.update({"QWEN3VL_MODEL": os.environ.get("QWEN3VL_MODEL", "random:qwen3-vl-2b"), "QWEN3VL_PORT": str(port),
                "QWEN3VL_HOST": "127.0.0.1", "QWEN3VL_CACHE_DIR": str(cache)})
    if devices is not None:
        env["QWEN3VL_DEVICES"] = devices
    trace = log.with_suffix(".forwards.csv")  # every engine's line per forward, for `forward_gaps`
    env["QWEN3VL_FORWARD_TRACE"] = str(trace)
    t0 = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=open(log, "w"),
                              stderr=subprocess.STDOUT, start_new_session=True)
    server.forward_trace = trace
    url = f"http://127.0.0.1:{port}"
    if not wait_until_ready(url, server, timeout_s=480, interval_s=0.1):
        server.kill()
        raise RuntimeError(f"server on {devices} did not become ready:\n{log.read_text()[-3000:]}")
    return server, url, time.perf_counter() - t0


def stop(server: subprocess.Popen) -> int:
    server.send_signal(signal.SIGTERM)
    try:
        return server.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        return -9


def engines(url: str) -> list[dict]:
    return httpx.get(f"{url}/info", timeout=10).json()["engine"]["engines"]


class ServerCpu(NamedTuple):
    """CPU seconds so far of a server's processes: each HTTP front-end's (a process listening on its port), with its
    client connections open now; its engines'; and the rest's: the main process, standby engines, the front-ends'
    video sandboxes (whose start-up imports follow readiness)."""

    frontends: dict[int, tuple[float, int]]
    engines: float
    other: float

    @property
    def front(self) -> float:
        return sum(cpu for cpu, _ in self.frontends.values())

    @property
    def total(self) -> float:
        return self.front + self.engines + self.other


def server_cpu(server: subprocess.Popen, engine_pids: set[int]) -> ServerCpu:
    """`ServerCpu` now. The kernel spreads connections over the front-ends by a hash of their addresses, so a closed
    loop's clients are not spread evenly, and the busiest front-end saturates first: hence each one's own."""
    front: dict[int, tuple[float, int]] = {}
    eng = other = 0.0
    procs = [psutil.Process(server.pid)]
    try:
        procs += psutil.Process(server.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        pass
    for p in procs:
        try:
            t = p.cpu_times()
            conns = p.net_connections("tcp") if p.pid not in engine_pids and p.pid != server.pid else []
        except psutil.NoSuchProcess:
            continue
        s = t.user + t.system
        ports = {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}
        if p.pid in engine_pids:
            eng += s
        elif ports:
            front[p.pid] = (s, sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port in ports for c in conns))
        else:
            other += s
    return ServerCpu(front, eng, other)


def settle(server: subprocess.Popen, engine_pids: set[int], idle_cores: float = 1.0, timeout_s: float = 60.0) -> float:
    """Wait until what a start leaves running after readiness (standby engines' and video sandboxes' imports) uses
    less than `idle_cores`, over one second: the load then measures the server as it serves, not its last seconds
    of start-up. Seconds waited."""
    t0 = time.perf_counter()
    last = server_cpu(server, engine_pids).total
    while time.perf_counter() - t0 < timeout_s:
        time.sleep(1.0)
        now = server_cpu(server, engine_pids).total
        if now - last < idle_cores:
            break
        last = now
    return round(time.perf_counter() - t0, 1)


def openloop(binary: str, url: str, bodies: Path, out: Path, seconds: float, clients: int) -> dict:
    args = [binary, "-url", f"{url}/embed?{PARAMS}", "-bodies", str(bodies), "-out", str(out), "-duration",
            f"{seconds}s", "-concurrency", str(clients), "-unique"]
    return json.loads(subprocess.run(args, capture_output=True, text=True, check=True).stdout)


def rows(path: Path) -> list[tuple[float, float, int, str]]:
    """(done_s, latency_ms, status, error) of each request."""
    with open(path, newline="") as f:
        return [((int(r["due_ns"]) + int(r["latency_ns"])) / 1e9, int(r["latency_ns"]) / 1e6, int(r["status"]),
                 r["error"]) for r in csv.DictReader(f)]


def profile(server: subprocess.Popen, engine_pids: set[int], seconds: float, out: Path, tag: str) -> list:
    """py-spy (where installed, `common.py_spy`) on one front-end process and one engine process for `seconds`, in
    the background: raw stacks of the threads holding the interpreter lock (what bounds each process) under `out`."""
    front = [p.pid for p in psutil.Process(server.pid).children(recursive=True)
             if p.pid not in engine_pids and "spawn_main" in " ".join(p.cmdline())]
    jobs = []
    for role, pid in (("frontend", front[0] if front else None), ("engine", min(engine_pids, default=None))):
        job = py_spy(pid, seconds, out / f"profile_{tag}_{role}.txt", rate=200) if pid is not None else None
        if job is not None:
            jobs.append(job)
    return jobs


def measure(binary: str, url: str, server, bodies: Path, work: Path, tag: str, warmup_s: float, seconds: float,
            clients: int, profile_out: Path | None = None) -> dict:
    """One closed-loop run: `warmup_s` unmeasured, then `seconds` measured (requests completed within them);
    `profile_out`: py-spy on a front-end and an engine meanwhile (`profile`)."""
    pids = {e["pid"] for e in engines(url)}
    settled_s = settle(server, pids)
    box: dict = {}
    total = warmup_s + seconds
    gen = threading.Thread(target=lambda: box.update(openloop(binary, url, bodies, work / f"{tag}.csv", total,
                                                              clients)))
    gen.start()
    time.sleep(warmup_s)
    t0, e0, c0, unix0 = time.perf_counter(), engines(url), server_cpu(server, pids), time.time()
    spies = profile(server, pids, seconds - 1, profile_out, tag) if profile_out is not None else []
    time.sleep(seconds)
    t1, e1, c1 = time.perf_counter(), engines(url), server_cpu(server, pids)
    memory = gpu_memory()
    trace = getattr(server, "forward_trace", None)
    forwards = read_forward_trace(trace, unix0, unix0 + (t1 - t0)) if trace is not None else []
    gen.join()
    for spy in spies:
        spy.wait(30)
    done = [r for r in rows(work / f"{tag}.csv") if warmup_s <= r[0] < total]
    ok = [r for r in done if r[2] == 200]
    lat = np.array([r[1] for r in ok])
    wall = t1 - t0
    images = len(ok) / seconds * wall  # completions over the sampled wall window
    per_engine = [{"device": a["device"], "forwards": b["forwards"] - a["forwards"],
                   "gpu_busy_fraction": round((b["gpu_busy_s"] - a["gpu_busy_s"]) / wall, 4)}
                  for a, b in zip(e0, e1)]
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
    result = {
        "images_per_s": round(len(ok) / seconds, 1), "p50_ms": round(float(np.percentile(lat, 50)), 1),
        "p99_ms": round(float(np.percentile(lat, 99)), 1), "statuses": statuses, "engines": per_engine,
        "images_per_forward": round(len(ok) / max(1, sum(e["forwards"] for e in per_engine)), 1),
        # the engines' own account of the GPUs between forwards (CUDA events; `Settings.forward_trace`)
        "forwards": forward_gaps(forwards, wall, len(per_engine)) if forwards else None,
        "frontend_cpu_s_per_image": round((c1.front - c0.front) / max(1, images), 5),
        "engine_cpu_s_per_image": round((c1.engines - c0.engines) / max(1, images), 5),
        "other_cpu_s_per_image": round((c1.other - c0.other) / max(1, images), 5),
        "frontend_cores": round((c1.front - c0.front) / wall, 2),
        "settled_after_s": settled_s,
        # each front-end's cores over the window and its client connections at its start (the load is running
        # then; at its end the generator may be closing them), busiest first
        "per_frontend": sorted(([round((c1.frontends[pid][0] - cpu) / wall, 2), conns]
                                for pid, (cpu, conns) in c0.frontends.items() if pid in c1.frontends), reverse=True),
        "generator": {"achieved_requests_per_s": round(box["achieved_per_s"], 1),
                      "cpu_cores": round(box["generator_cpu_s"] / box["wall_s"], 2),
                      "clients": clients, "host_cores": os.cpu_count(), "statuses_all": box["statuses"]},
        "gpu_memory": memory,
    }
    if spies:
        result["profile_gil_top"] = {role: top_frames(f) for role in ("frontend", "engine")
                                     if (f := profile_out / f"profile_{tag}_{role}.txt").exists()}
    print(tag, json.dumps({k: v for k, v in result.items() if k != "gpu_memory"}), flush=True)
    return result


def fault(binary: str, url: str, bodies: Path, work: Path, seconds: float, clients: int, victim_index: int) -> dict:
    """SIGKILL the engine at `victim_index` a third of the way into a closed-loop run; every request's status, the
    dropped connections (status 0), and when it served again."""
    before = engines(url)
    victim = before[victim_index]
    box: dict = {}
    gen = threading.Thread(target=lambda: box.update(openloop(binary, url, bodies, work / "fault.csv", seconds,
                                                              clients)))
    gen.start()
    time.sleep(seconds / 3)
    killed_at = time.perf_counter()
    os.kill(victim["pid"], signal.SIGKILL)
    rejoin_s, ready_codes = None, set()
    while rejoin_s is None and time.perf_counter() - killed_at < 120:
        ready_codes.add(httpx.get(f"{url}/ready", timeout=10).status_code)
        now = engines(url)[victim_index]
        if now["state"] == "up" and now.get("pid") not in (None, victim["pid"]):
            rejoin_s = round(time.perf_counter() - killed_at, 2)
        time.sleep(0.05)
    gen.join()
    done = rows(work / "fault.csv")
    statuses: dict[str, int] = {}
    for r in done:
        statuses[str(r[2])] = statuses.get(str(r[2]), 0) + 1
    errors = sorted({r[3] for r in done if r[3]})[:5]
    result = {"victim": victim["device"], "killed_after_s": round(seconds / 3, 1), "statuses": statuses,
              "dropped_connections": statuses.get("0", 0), "fault_500s": statuses.get("500", 0),
              "rejoined_after_s": rejoin_s, "ready_statuses_meanwhile": sorted(ready_codes),
              "errors": errors, "generator": box}
    print("fault", json.dumps(result), flush=True)
    return result


def start_phases(log: Path) -> dict:
    """Where a start's time went, from the server's log: the main process's own start until it launches the engines
    (and the device count within it); from the engines' launch to every engine ready, to the last front-end's
    modules imported and to the last front-end's connection to an engine after that (wall); per engine
    its modules' import, its device binding, the model's load and the warm-up, and per front-end its modules' import
    (seconds, as each process logs them, in the order they were logged)."""
    stamps: dict[str, float] = {}
    per: dict = {"imported_s": [], "device_s": [], "loaded_s": [], "warmed_s": [], "frontend_imported_s": []}
    for line in log.read_text(errors="replace").splitlines():
        parts = line.split(" ", 2)
        try:
            t = time.mktime(time.strptime(f"{parts[0]} {parts[1][:8]}", "%Y-%m-%d %H:%M:%S"))
            t += int(parts[1][9:12]) / 1e3
        except (IndexError, ValueError):
            continue
        if "service.server: engine processes on" in line:
            stamps.setdefault("launched", t)
            if "after the server's launch" in line:  # the main process's own start, before it launches engines
                words = line.replace("(", " ").replace(";", " ").split()
                per["main_process_s"] = float(words[words.index("after") - 2])
                per["devices_counted_s"] = float(words[words.index("counted") + 2].rstrip(")"))
        elif "engines ready" in line and "service.server" in line:
            stamps.setdefault("all_ready", t)
        elif "front-end process: modules imported in" in line:
            per["frontend_imported_s"].append(float(line.split()[-2]))
            stamps["frontends_imported"] = t
        elif "engine on" in line and " connected (process" in line:
            stamps["connected"] = t  # the last front-end's connection to an engine, by the end of the start
        elif "SIGTERM: draining" in line:
            break
        elif "modules imported in" in line:
            words = line.replace(",", "").split()
            per["imported_s"].append(float(words[words.index("imported") + 2]))
            per["device_s"].append(float(words[words.index("bound") + 2]))
        elif "model loaded in" in line:
            words = line.replace(",", "").split()
            per["loaded_s"].append(float(words[words.index("loaded") + 2]))
            per["warmed_s"].append(float(words[words.index("warmed") + 3]))
    def after(stamp: str) -> float | None:
        return round(stamps[stamp] - stamps["launched"], 2) if stamp in stamps and "launched" in stamps else None

    return {"engines_ready_after_s": after("all_ready"), "frontends_imported_after_s": after("frontends_imported"),
            "frontends_connected_after_s": after("connected"), **per}


def profile_start(out: Path, seconds: int = 25) -> None:
    """py-spy on every process (`--subprocesses`) of the server this process starts next, sampled from its launch
    for `seconds`."""
    me = psutil.Process()
    deadline = time.time() + 10
    while time.time() < deadline:
        found = [c for c in me.children() if "service.cli" in " ".join(c.cmdline())]
        if found:
            subprocess.run(["py-spy", "record", "--pid", str(found[0].pid), "--subprocesses", "--duration",
                            str(seconds), "--rate", "100", "--nonblocking", "--format", "raw", "--output", str(out)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            return
        time.sleep(0.02)


def part_startup(args, gpus: int, work: Path) -> dict:
    out: dict = {}
    for label, devices in (("1gpu", "0"), (f"{gpus}gpu", None)):
        cache = Path(tempfile.mkdtemp(prefix="qwen3vl-ready-"))
        # a profiled start comes after the measured ones: py-spy's sampling does not touch their times
        for run in ("empty_cache", "warm_cache") + (("warm_cache_profiled",) if args.profile else ()):
            spy = None
            if run == "warm_cache_profiled" and shutil.which("py-spy"):
                spy = threading.Thread(target=profile_start, args=(Path(args.out) / f"profile_startup_{label}.txt",))
                spy.start()
            server, url, ready_s = start(devices, cache, args.port, work / f"startup_{label}_{run}.log")
            if spy is not None:
                spy.join()
            info = engines(url)
            memory = gpu_memory()
            code = stop(server)
            out[f"{label}_{run}"] = {"ready_s": round(ready_s, 1), "engines_up": sum(e["state"] == "up" for e in info),
                                     "exit_code": code, "gpu_memory": memory,
                                     "phases": start_phases(work / f"startup_{label}_{run}.log"),
                                     "engine_pids": {e["device"]: e["pid"] for e in info}}
            if spy is not None and (Path(args.out) / f"profile_startup_{label}.txt").exists():
                # the engine processes' samples, summed over the engines
                out[f"{label}_{run}"]["engine_profile_top"] = top_frames(
                    Path(args.out) / f"profile_startup_{label}.txt", 30, within="engine_process_main")
            print(label, run, ready_s, flush=True)
        shutil.rmtree(cache, ignore_errors=True)
    return out


def part_scaling(args, gpus: int, work: Path) -> dict:
    uniform = write_bodies(work / "uniform", [(448, 448)] * 64)
    rng = np.random.default_rng(1)
    mixed = write_bodies(work / "mixed", [(int(s), int(s * r)) for s, r in
                                          zip(rng.integers(224, 1025, 96), rng.choice([0.75, 1.0, 1.33], 96))])
    configs = [("1gpu", "0")] + ([("2gpu", "0,1")] if gpus > 2 and args.two else []) + [(f"{gpus}gpu", None)]
    out: dict = {}
    for label, devices in configs:
        server, url, ready_s = start(devices, Path(args.cache), args.port, work / f"scaling_{label}.log")
        try:
            out[label] = {"ready_s": round(ready_s, 1), "devices": devices or "default (every GPU)",
                          "http_workers": httpx.get(f"{url}/info").json()["http_workers"]}
            out[label]["uniform"] = measure(args.openloop, url, server, uniform, work, f"{label}_uniform",
                                            args.warmup_s, args.seconds, args.clients,
                                            Path(args.out) if devices is None and args.profile else None)
            if devices is None and args.mixed:
                out[label]["mixed"] = measure(args.openloop, url, server, mixed, work, f"{label}_mixed",
                                              args.warmup_s, args.seconds, args.clients)
                if args.fault:
                    out[label]["fault"] = fault(args.openloop, url, uniform, work, 3 * args.seconds, args.clients,
                                                min(2, gpus - 1))
        finally:
            out[label]["exit_code"] = stop(server)
    # every GPU with other front-end counts than the default's: what the front-ends bound
    for workers in args.frontends:
        label = f"{gpus}gpu_{workers}_frontends"
        server, url, ready_s = start(None, Path(args.cache), args.port, work / f"scaling_{label}.log", workers)
        try:
            out[label] = {"ready_s": round(ready_s, 1), "http_workers": workers,
                          "uniform": measure(args.openloop, url, server, uniform, work, f"{label}_uniform",
                                             args.warmup_s, args.seconds, args.clients)}
        finally:
            out[label]["exit_code"] = stop(server)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["startup", "scaling"], required=True)
    ap.add_argument("--openloop", default=".bin/openloop")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "qwen3vl-bench-cache"),
                    help="the kernel cache the scaling runs share (warm after the first start)")
    ap.add_argument("--clients", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--no-fault", dest="fault", action="store_false")
    ap.add_argument("--no-mixed", dest="mixed", action="store_false", help="without the load of mixed sizes")
    ap.add_argument("--no-two", dest="two", action="store_false", help="without the 2-GPU configuration")
    ap.add_argument("--frontends", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="also every GPU with these front-end counts, e.g. 24,32 (uniform load only)")
    ap.add_argument("--profile", action="store_true",
                    help="py-spy on a front-end and an engine during every GPU's uniform load (--gil, raw, in --out); "
                         "with --part startup, on every process of one more warm start")
    args = ap.parse_args()
    gpus = gpu_count()
    quant = os.environ.get("QWEN3VL_QUANTIZATION", "none")
    suffix = ("_fp8" if quant == "fp8" else "") + (f"_{args.clients}_clients" if args.clients != 256 else "")
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-multigpu-"))
    path = Path(args.out) / "multigpu.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results.setdefault("benchmark", "multigpu")
    results.setdefault("environment", environment())
    results["gpus"] = gpus
    if args.part == "startup":
        results["startup"] = part_startup(args, gpus, work)
    else:
        results[f"scaling{suffix}"] = {"clients": args.clients, "seconds": args.seconds, "warmup_s": args.warmup_s,
                                       "load": "448 px JPEGs, each request's bytes its own, tokens only (" + PARAMS
                                       + "); mixed: 224-1024 px", **part_scaling(args, gpus, work)}
    results["summary"] = summarize(results, gpus)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1))
    for log in work.glob("*.log"):
        shutil.copy(log, Path(args.out) / f"multigpu_{log.name}")
    print(json.dumps(results["summary"], indent=1))


def summarize(results: dict, gpus: int) -> dict:
    s: dict = {"gpus": gpus}
    runs = [(key.removeprefix("scaling"), key.removeprefix("scaling").replace("_fp8", "fp8").strip("_") or "bf16")
            for key in results if key.startswith("scaling")]
    for suffix, name in runs:
        if "fp8" not in name and "clients" in name:
            name = "bf16_" + name
        sc = results.get(f"scaling{suffix}")
        if not sc:
            continue
        one = sc["1gpu"]["uniform"]["images_per_s"]
        for label in ("2gpu", f"{gpus}gpu"):
            if label in sc:
                s[f"scaling_{label}_{name}"] = round(sc[label]["uniform"]["images_per_s"] / one, 3)
                s[f"images_per_s_{label}_{name}"] = sc[label]["uniform"]["images_per_s"]
        s[f"images_per_s_1gpu_{name}"] = one
        top = sc[f"{gpus}gpu"]
        if "mixed" in top:
            s[f"mixed_min_gpu_busy_{name}"] = min(e["gpu_busy_fraction"] for e in top["mixed"]["engines"])
        if "fault" in top:
            s[f"fault_500s{'' if name == 'bf16' else '_fp8'}"] = top["fault"]["fault_500s"]
            s[f"fault_dropped{'' if name == 'bf16' else '_fp8'}"] = top["fault"]["dropped_connections"]
        s[f"frontend_cpu_s_per_image_{name}"] = top["uniform"]["frontend_cpu_s_per_image"]
        s[f"engine_cpu_s_per_image_{name}"] = top["uniform"]["engine_cpu_s_per_image"]
        s[f"gpu_busy_{gpus}gpu_{name}"] = [e["gpu_busy_fraction"] for e in top["uniform"]["engines"]]
        s[f"http_workers_{gpus}gpu"] = top.get("http_workers")
        for label, run in sc.items():
            if label.endswith("_frontends"):
                s[f"scaling_{label}_{name}"] = round(run["uniform"]["images_per_s"] / one, 3)
    st = results.get("startup")
    if st:
        for run in ("empty_cache", "warm_cache"):
            s[f"ready_s_1gpu_{run}"] = st[f"1gpu_{run}"]["ready_s"]
            s[f"ready_s_{gpus}gpu_{run}"] = st[f"{gpus}gpu_{run}"]["ready_s"]
            s[f"ready_ratio_{gpus}gpu_{run}"] = round(st[f"{gpus}gpu_{run}"]["ready_s"] / st[f"1gpu_{run}"]["ready_s"], 3)
        s[f"ready_ratio_{gpus}gpu"] = max(s[f"ready_ratio_{gpus}gpu_empty_cache"], s[f"ready_ratio_{gpus}gpu_warm_cache"])
    return s


if __name__ == "__main__":
    main()
