"""Repeated shutdowns under a keep-alive load: does any request that reached the server go unanswered?

Per run: `qwen3vl-encoder serve` in a process group of its own (as a service manager starts it), the compiled
generator (`tools/openloop`, closed loop, keep-alive connections, each request's bytes its own) at full rate, then
SIGTERM to the whole group (systemd's KillMode=control-group) while the load runs; the clients keep sending until
the server is gone. Every request ends one of three ways:
- answered (any status);
- not connected: the connection could not be made (`dial tcp ...`: refused, the server no longer listening; or the
  client's own ports exhausted by its reconnects): it never reached the server;
- lost: anything else without a reply (a reset or an EOF on a connection it was sent on): it may have reached it.

Usage: python -m benchmarks.shutdowns [--runs 20] [--clients 32] [--model random:tiny] [--http-workers 2]
(the generator built: CGO_ENABLED=0 go build -o .bin/openloop tools/openloop/main.go) -> shutdowns.json
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment, write_results
from tools.ready import wait_until_ready


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bodies(directory: Path) -> Path:
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    for i in range(8):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
        (directory / f"{i}.jpg").write_bytes(buf.getvalue())
    return directory


def one_run(args, bodies: Path, work: Path, run: int) -> dict:
    port = _free_port()
    env = {**os.environ, "QWEN3VL_MODEL": args.model, "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_HTTP_WORKERS": str(args.http_workers), "QWEN3VL_DRAIN_S": str(args.drain_s)}
    log = open(work / f"server_{run}.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    if not wait_until_ready(url, server, timeout_s=180, interval_s=0.1):
        server.kill()
        raise RuntimeError((work / f"server_{run}.log").read_text()[-3000:])
    out = work / f"run_{run}.csv"
    gen = subprocess.Popen([args.openloop, "-url", f"{url}/embed?embeddings=false&pooling=mean", "-bodies",
                            str(bodies), "-concurrency", str(args.clients), "-duration",
                            f"{args.load_s + args.drain_s + 3}s", "-unique", "-timeout", "60s", "-out", str(out)],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(args.load_s)
    os.killpg(server.pid, signal.SIGTERM)
    code = server.wait(120)
    gen.communicate(timeout=120)  # it ends on its own, every row written
    answered = refused = 0
    lost: list[str] = []
    with open(out, newline="") as f:
        for r in csv.DictReader(f):
            if r["status"] != "0":
                answered += 1
            elif "dial tcp" in r["error"]:
                refused += 1
            else:
                lost.append(r["error"])
    return {"run": run, "exit_code": code, "answered": answered, "not_connected": refused, "lost": len(lost),
            "lost_errors": sorted(set(e.split(": ")[-1] for e in lost))[:5]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--http-workers", type=int, default=2)
    ap.add_argument("--drain-s", type=float, default=1.0)
    ap.add_argument("--load-s", type=float, default=3.0, help="seconds of load before the SIGTERM")
    ap.add_argument("--openloop", default=".bin/openloop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qwen3vl-shutdowns-"))
    bodies = _bodies(Path(tempfile.mkdtemp(prefix="qwen3vl-bodies-")))
    runs = []
    for run in range(args.runs):
        runs.append(one_run(args, bodies, work, run))
        print(json.dumps(runs[-1]), flush=True)
    summary = {"runs": len(runs), "lost_total": sum(r["lost"] for r in runs),
               "runs_with_loss": sum(r["lost"] > 0 for r in runs),
               "answered_total": sum(r["answered"] for r in runs), "not_connected_total": sum(r["not_connected"] for r in runs),
               "exit_codes": sorted({r["exit_code"] for r in runs})}
    write_results("shutdowns", {"benchmark": "shutdowns", "env": environment(), "model": args.model,
                                "clients": args.clients, "http_workers": args.http_workers, "drain_s": args.drain_s,
                                "signal": "SIGTERM to the process group", "runs": runs, "summary": summary}, args.out)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
