"""The locust load test users run (loadtest/locustfile.py), headless for a few seconds against a real
server: every request kind is sent and none fails (429s would count as shed load, not failures)."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from servers import serve

# Not imported here: importing locust monkey-patches threading and sockets (gevent) in this process.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed")


def test_locustfile_runs_clean(tmp_path):
    with serve(max_wait_ms=5) as (url, _):
        env = {**os.environ, "IMAGE_SIDE": "96", "VIDEO_WEIGHT": "3"}
        run = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "loadtest/locustfile.py", "--headless", "-u", "4", "-r", "4",
             "-t", "8s", "--host", url, "--csv", str(tmp_path / "run"), "--exit-code-on-error", "1",
             "--only-summary"],
            env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
            cwd=Path(__file__).parent.parent)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
        metrics = httpx.get(f"{url}/metrics").text
    rows = {r["Name"]: r for r in csv.DictReader(open(tmp_path / "run_stats.csv"))}
    for name in ("/embed [safetensors]", "/embed [json pooled]", "/embed [video]", "/v1/embeddings"):
        assert int(rows[name]["Request Count"]) > 0, (name, rows.keys())
        assert int(rows[name]["Failure Count"]) == 0, rows[name]
    frames = [line for line in metrics.splitlines() if line.startswith("qwen3vl_video_frames_total")]
    assert frames and float(frames[0].split()[-1]) >= 8, frames  # 8 sampled frames per clip


def test_the_locust_users_send_bytes_of_their_own_unless_asked_for_cache_hits():
    """A rotation of 16 images would make a run mostly cache hits: each request's bytes are its own, its pixels
    those of its photo; CACHE_HITS=1 sends the same bytes again."""
    import subprocess
    import sys

    probe = ("import io, sys, numpy as np; from PIL import Image; sys.path.insert(0, 'loadtest'); import locustfile as l; "
             "a, b = l._image(), l._image(); px = lambda d: np.asarray(Image.open(io.BytesIO(d))); "
             "print(len({a, b} | set(l.IMAGES)) - len(l.IMAGES), "
             "any(np.array_equal(px(a), px(i)) for i in l.IMAGES))")
    for env, fresh in (({}, "2"), ({"CACHE_HITS": "1"}, "0")):
        out = subprocess.run([sys.executable, "-c", probe], env={**__import__("os").environ, "VIDEO_WEIGHT": "0", **env},
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split()[-2:] == [fresh, "True"], out.stdout
