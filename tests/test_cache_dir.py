"""The embedding cache's directory in shared memory: removed when a single-process server's start fails, and a
killed server's directory removed by the next server that starts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from servers import free_port
from service.engine.cache import cache_parent, make_cache_dir

ROOT = Path(__file__).parents[1]


def test_a_dead_process_s_directory_goes_a_live_one_stays():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    parent = Path(make_cache_dir()).parent
    stale = parent / f"qwen3vl-embeddings-{dead.pid}-x"
    stale.mkdir()
    (stale / "entry").write_bytes(b"x" * 100)
    mine = Path(make_cache_dir())
    assert not stale.exists() and mine.is_dir() and mine.name.startswith(f"qwen3vl-embeddings-{os.getpid()}-")
    make_cache_dir()  # this process is alive: its directories stay
    assert mine.is_dir()


def test_a_single_process_server_that_fails_to_start_leaves_no_directory():
    """A model that cannot load (cuda:0 on a CPU build of torch), and a port another socket holds."""
    import socket

    env = {**os.environ, "PYTHONPATH": str(ROOT), "QWEN3VL_HTTP_WORKERS": "0"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        for extra in (["--device", "cuda:0", "--port", str(free_port())], ["--port", str(busy)]):
            proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--model", "random:tiny",
                                     "--host", "127.0.0.1", *extra], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode != 0, out[-1500:]
            if "cuda:0" in extra:  # one line and exit code 2, as a bad --model is
                assert proc.returncode == 2 and "CUDA is not available" in out and "Traceback" not in out, out
            left = sorted(p.name for p in Path(cache_parent()).glob(f"qwen3vl-embeddings-{proc.pid}-*"))
            assert not left, (extra, left, out[-1500:])

