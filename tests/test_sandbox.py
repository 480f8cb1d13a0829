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
from service.errors import ImageTooLarge, UnsupportedVideo
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
