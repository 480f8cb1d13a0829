"""A newcomer's first mistakes at `serve`, with the CPU's defaults and with front-end processes: a bad --model is one
line and exit code 2 before anything loads; a port in use is found before the model loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from servers import free_port


def _serve(*flags, **env):
    return subprocess.run([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", *flags],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("workers", ["0", "1"])
@pytest.mark.parametrize("model,says", [("random:nope", "unknown preset"), ("{tmp}/missing", "not a directory"),
                                        ("{tmp}", "config.json")])
def test_a_bad_model_is_one_line_and_exit_2(tmp_path, workers, model, says):
    out = _serve("--model", model.format(tmp=tmp_path), "--port", str(free_port()), "--http-workers", workers,
                 "--device", "cpu")
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [line for line in out.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and says in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_a_port_in_use_is_found_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _serve("--model", "random:tiny", "--port", str(port), "--device", "cpu")
    assert out.returncode == 1 and "cannot listen on" in out.stderr, out.stderr[-2000:]
    assert "RANDOM WEIGHTS" not in out.stderr  # nothing was loaded
