"""`tools.request_trace.compare`: the stage table of a lone request's trace (docs/PERFORMANCE.md's tables)."""

from __future__ import annotations

import pytest

from tools.request_trace.compare import STAGES, stages


def _steps(marks: list[tuple[str, float]]) -> list[list]:
    return [[a, b, us] for (a, _), (b, us) in zip([("http<", 0)] + marks, marks)]


@pytest.mark.parametrize("expect", [False, True])
def test_stages_split_a_trace_at_its_marks(expect):
    """Each stage is the sum of the steps between its marks; with `expect` the engine reads twice and the frames'
    way to the engine ends at the second read (the submit), not at the heads-up."""
    before = [("parse<", 200), ("parse>", 100), ("decode<", 50)]
    decode = [("e-read", 100), ("decode>", 1400)] if expect else [("decode>", 1500)]
    after = [("f-write", 150), ("e-read#2" if expect else "e-read", 150), ("esubmit<", 80), ("pixels<", 120),
             ("pixels>", 300), ("launch>", 250), ("efinish<", 40), ("complete<", 1800), ("finish<", 10),
             ("finish>", 60), ("f-read", 200), ("respond<", 150), ("http>", 400)]
    steps = _steps(before + decode + after)
    got = stages(steps)
    assert [name for name, *_ in STAGES] == list(got)
    want = [0.35, 1.5, 0.3, 0.5, 0.25, 1.87, 0.75]
    assert list(got.values()) == pytest.approx(want)
    # every step but one is in a stage: the launch's tail, from `launch>` to `efinish<`
    assert sum(got.values()) == pytest.approx((sum(us for *_, us in steps) - 40) / 1e3)


def test_a_lone_frame_without_pixel_rows_launches_from_the_start_of_the_launch():
    """A lone frame goes in through `BucketedTower.frame` (no `Encoder.pixels` marks): the engine's queue ends where
    `Encoder.launch` starts, and launching runs from there to its end."""
    marks = [("decode<", 100), ("decode>", 1500), ("e-read", 300), ("esubmit<", 80), ("launch<", 120),
             ("frame<", 20), ("frame>", 200), ("launch>", 50), ("efinish<", 40), ("complete<", 1800),
             ("finish>", 70), ("http>", 800)]
    got = stages(_steps(marks))
    assert got["engine: queue to launch, pixels to the GPU"] == pytest.approx(0.2)
    assert got["launching the forward"] == pytest.approx(0.27)
    assert got["frames to the engine process"] == pytest.approx(0.3)


def test_the_tracer_wraps_every_step_of_this_revision(tmp_path):
    """The tracer (`sitecustomize.py`) wraps the service's steps by name as their modules are imported: each name it
    looks for exists in this revision's code and is wrapped (a renamed class once kept the traced server from
    starting)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = """
import importlib, sitecustomize
checks = {
    "service.http.middleware": ["ObserveMiddleware.__call__"],
    "service.http.app": ["Service.encode", "embed_response", "openai_response", "parse_embed", "parse_openai"],
    "service.engine.remote": ["EnginePool.preprocess", "RemoteEngine.submit"],
    "service.model.preprocess": ["Preprocessor.__call__"],
    "service.engine.batching": ["Batcher.submit", "Batcher._launch", "Batcher._finish", "Batcher._complete"],
    "service.model.encoder": ["Encoder.launch", "Encoder.finish", "Encoder.pixels"],
    "service.model.graphs": ["BucketedTower.frame"],
}
missing = []
for module, names in checks.items():
    m = importlib.import_module(module)
    for name in names:
        obj = m
        for part in name.split("."):
            obj = getattr(obj, part)
        if not hasattr(obj, "__wrapped__"):
            missing.append(f"{module}.{name}")
print(missing)
"""
    env = {**os.environ, "TRACE_FILE": str(tmp_path / "trace"),
           "PYTHONPATH": os.pathsep.join([os.path.join(root, "tools", "request_trace"), root])}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
