"""Decoding in a sandbox process: a crash, a runaway loop or a huge allocation costs that input a typed 4xx error
and nothing else; results are those of decoding in this process."""

from __future__ import annotations

import asyncio
import ctypes
import os
import time

import numpy as np
import pytest

from conftest import make_video
from service.engine.sandbox import DecodeSandbox
from service.errors import ImageTooLarge, Unavailable, UnsupportedVideo
from service.model.preprocess import PreprocessConfig, Preprocessor, decode_in_worker_config


def _segfault():
    ctypes.string_at(0)


def _spin():
    while True:
        pass


def _allocate(n_bytes):
    return bytearray(n_bytes)


def _sleep(s):
    time.sleep(s)
    return os.getpid()


@pytest.fixture(scope="module")
def sandbox():
    box = DecodeSandbox(concurrency=2, cpu_s=1, memory_bytes=1 << 30, wall_s=20)
    yield box
    box.close()


def _run(box, fn, *args):
    return asyncio.run(box.run(fn, *args))


def test_crash_loop_and_bomb_fail_alone(sandbox):
    with pytest.raises(UnsupportedVideo, match="crashed on this input \\(SIGSEGV\\)"):
        _run(sandbox, _segfault)
    with pytest.raises(UnsupportedVideo, match="more than 1 s of CPU time"):
        _run(sandbox, _spin)
    with pytest.raises(ImageTooLarge, match="more than 1024 MiB"):
        _run(sandbox, _allocate, 2 << 30)
    # the sandbox still works, in a fresh process each time
    assert _run(sandbox, _sleep, 0) != os.getpid()


def test_wall_clock_limit():
    box = DecodeSandbox(concurrency=1, cpu_s=5, wall_s=0.5)
    try:
        start = time.monotonic()
        with pytest.raises(UnsupportedVideo, match="took more than 0.5 s"):
            _run(box, _sleep, 30)
        assert time.monotonic() - start < 5
    finally:
        box.close()


def test_video_decoded_in_the_sandbox_equals_decoding_here(sandbox):
    cfg = PreprocessConfig()
    video = make_video(12, 64, 48, seed=4)
    frames, grid, meta = asyncio.run(DecodeSandbox(cpu_s=30).run(decode_in_worker_config, cfg, video, None, None))
    ref = Preprocessor(cfg)(video)
    assert np.array_equal(frames, ref.frames) and tuple(grid) == ref.grid_thw and meta == ref.meta


def test_corrupt_video_is_a_typed_error(sandbox):
    video = make_video(12, 64, 48, seed=4)
    with pytest.raises(UnsupportedVideo):
        asyncio.run(DecodeSandbox(cpu_s=30).run(decode_in_worker_config, PreprocessConfig(), video[: len(video) // 3],
                                                None, None))


def test_a_child_that_cannot_start_is_unavailable_not_the_inputs_fault(tmp_path, monkeypatch):
    """A child that dies before the decoder runs is the server's fault (503), not the input's (422), and never an
    unhandled exception (500): here its target's module is gone from disk after this process imported it, so the
    child cannot import it, as when the installed code is replaced under a running server. With a small payload the
    child exits with code 1; with one larger than a pipe's buffer the parent's write of it breaks first
    (BrokenPipeError)."""
    import shutil

    box = DecodeSandbox(concurrency=1, cpu_s=5, wall_s=20)
    (tmp_path / "sandbox_vanishing_target.py").write_text("def size(data):\n    return len(data)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import sandbox_vanishing_target

    (tmp_path / "sandbox_vanishing_target.py").unlink()
    shutil.rmtree(tmp_path / "__pycache__", ignore_errors=True)

    try:
        for payload in (b"x" * 10, b"x" * (4 << 20)):
            with pytest.raises(Unavailable, match="video decoder"):
                _run(box, sandbox_vanishing_target.size, payload)
        assert _run(box, _sleep, 0) != os.getpid()  # and the sandbox still decodes
    finally:
        box.close()


def test_the_forkserver_is_started_by_prepare_and_replaced_if_it_dies():
    """The forkserver starts at `prepare()` (once the server is ready: not at the first video, under load, nor
    beside the engines' start), not when the sandbox is made; killed, it is started again by the next call."""
    import multiprocessing.forkserver
    import signal
    import subprocess
    import sys

    # in a fresh interpreter: this one's forkserver may be running already (the module's other tests)
    made = subprocess.run([sys.executable, "-c", (
        "import time, multiprocessing.forkserver as f\n"
        "from service.engine.sandbox import DecodeSandbox\n"
        "box = DecodeSandbox(concurrency=1)\n"
        "time.sleep(2)\n"
        "print(f._forkserver._forkserver_pid)\n"
        "box.close()")], capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert made.stdout.strip() == "None", (made.stdout, made.stderr[-2000:])

    box = DecodeSandbox(concurrency=1, cpu_s=5, wall_s=20)
    box.prepare()
    try:
        deadline = time.monotonic() + 30
        while multiprocessing.forkserver._forkserver._forkserver_pid is None and time.monotonic() < deadline:
            time.sleep(0.05)
        pid = multiprocessing.forkserver._forkserver._forkserver_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        assert _run(box, _sleep, 0) != os.getpid()
        assert multiprocessing.forkserver._forkserver._forkserver_pid not in (None, pid)
    finally:
        box.close()
