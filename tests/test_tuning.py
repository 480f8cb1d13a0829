"""The launch-configuration choice (kernels.tuning.choose) with a scripted timer: what it times, what
it keeps."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kernels.tuning as tuning


@pytest.fixture
def timer(monkeypatch):
    """do_bench replaced by a script: candidate -> its timings, one per call in order; records each call."""
    calls = []

    def install(script):
        def do_bench(fn, warmup, rep):
            c = fn()
            calls.append((c, rep))
            return script[c][sum(1 for x, _ in calls if x == c) - 1]
        monkeypatch.setattr(tuning.triton.testing, "do_bench", do_bench)
        monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: False)
        monkeypatch.setattr(tuning, "_choices", {})
        return calls
    return install


R = tuning.TIMING_ROUNDS


def test_close_candidates_are_retimed_longer(timer):
    # "b" looks best in the short timings by 2%, "a" wins the longer ones; "c" is 20% off and not re-timed
    calls = timer({"a": [1.02] * R + [0.98] * R, "b": [1.00] * R + [1.01] * R, "c": [1.20] * R})
    assert tuning.choose(("k", 1), lambda: ["a", "b", "c"], lambda c: c) == "a"
    assert [c for c, rep in calls if rep > 40] == ["a", "b"] * R
    # the rounds interleave the candidates
    assert [c for c, _ in calls[:3 * R]] == ["a", "b", "c"] * R
    # chosen once: later calls with the key neither list nor time candidates
    assert tuning.choose(("k", 1), lambda: pytest.fail("re-listed"), lambda c: pytest.fail("re-timed")) == "a"


def test_clear_winner_is_not_retimed(timer):
    calls = timer({"a": [1.0] * R, "b": [1.5] * R})
    assert tuning.choose(("k", 2), lambda: ["a", "b"], lambda c: c) == "a"
    assert len(calls) == 2 * R


def test_one_slow_round_does_not_decide(timer):
    # the host's slow spell lands on "a"'s first timing: its median still wins, and "b" is more than 5% off
    timer({"a": [3.0] + [1.0] * (R - 1), "b": [1.1] * R})
    assert tuning.choose(("k", 6), lambda: ["a", "b"], lambda c: c) == "a"


def test_failing_candidates_are_skipped_and_all_failing_raises(timer):
    timer({"a": [1.0] * R})

    def launch(c):
        if c == "bad":
            raise RuntimeError("out of resources")
        return c

    assert tuning.choose(("k", 3), lambda: ["bad", "a"], launch) == "a"
    with pytest.raises(RuntimeError, match="out of resources"):
        tuning.choose(("k", 4), lambda: ["bad", "bad"], launch)


def test_under_graph_capture_the_first_candidate_untimed(timer, monkeypatch):
    calls = timer({})
    monkeypatch.setattr(tuning.torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tuning.choose(("k", 5), lambda: ["x", "y"], lambda c: pytest.fail("timed under capture")) == "x"
    assert calls == []


class FakeKernel:
    """What `launch` uses of Triton's CompiledKernel; records its launches."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("lean", args))


class FakeJit:
    """A `triton.jit` function as `launch` sees it: a per-device binder (alignment-like specialisation of
    ints: divisible by 16 or not) and `fn[grid](...)`, which compiles one kernel per specialisation."""

    def __init__(self):
        self.log, self.compiled = [], {}
        self.device_caches = {0: (None, None, None, None, self.bind)}

    def bind(self, x, n, BLOCK=64, **options):
        return {"x": x, "n": n, "BLOCK": BLOCK}, [("*fp16", "D"), ("i32", "D" if n % 16 == 0 else ""),
                                                  ("constexpr", BLOCK)], options

    def __getitem__(self, grid):
        def jit_launch(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            _, spec, _ = self.bind(*args, **kwargs)
            return self.compiled.setdefault(str(spec), FakeKernel(self.log))
        return jit_launch


@pytest.fixture
def lean(monkeypatch):
    monkeypatch.setattr(tuning, "_lean", None)
    monkeypatch.setattr(tuning, "_kernels", {})
    monkeypatch.setattr(tuning, "interpreting", lambda: False)
    monkeypatch.setattr(tuning.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(tuning, "_current_stream", lambda device: "stream")


def test_launch_compiles_once_per_specialisation_then_launches_lean(lean):
    fn = FakeJit()
    tuning.launch(fn, (4, 2), "x", 32, BLOCK=128, num_warps=4)
    tuning.launch(fn, (5,), "y", 48, BLOCK=128, num_warps=4)  # same specialisation: lean
    tuning.launch(fn, (6, 1, 3), "z", 7, BLOCK=128, num_warps=4)  # n not divisible by 16: through the JIT
    tuning.launch(fn, (6, 1, 3), "z", 9, BLOCK=128, num_warps=4)
    tuning.launch(fn, (4, 2), "x", 32, BLOCK=128, num_warps=8)  # another option: another kernel
    assert [entry[0] for entry in fn.log] == ["jit", "lean", "jit", "lean", "jit"]
    # the lean launch passes the grid padded to three dims, the stream, the kernel's handles, no hooks,
    # then every parameter in signature order, constexprs included
    assert fn.log[1][1] == (5, 1, 1, "stream", "fn-handle", "meta", None, None, None, "y", 48, 128)
    assert fn.log[3][1][:3] == (6, 1, 3)


def test_launch_goes_through_the_jit_with_a_hook_or_unknown_internals(lean, monkeypatch):
    fn = FakeJit()
    tuning.launch(fn, (1,), "x", 32)
    monkeypatch.setattr(tuning.triton.knobs.runtime.launch_enter_hook, "calls", [print])
    tuning.launch(fn, (1,), "x", 32)
    monkeypatch.setattr(tuning.triton.knobs.runtime.launch_enter_hook, "calls", [])
    tuning.launch(fn, (1,), "x", 32)
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "lean"]

    monkeypatch.setattr(tuning, "_lean", None)
    monkeypatch.setattr(tuning, "_kernels", {})
    other = FakeJit()
    del other.device_caches  # a Triton whose JIT functions keep their binders elsewhere
    for _ in range(3):
        tuning.launch(other, (1,), "x", 32)
    assert [entry[0] for entry in other.log] == ["jit"] * 3 and tuning._lean is False


class FakeTensor:
    """What a replay reads of a tensor: its address."""

    def __init__(self, address):
        self.address = address

    def data_ptr(self):
        return self.address


class FakeDescriptor:
    def __init__(self, base, shape, strides, padding="zero"):
        self.base, self.shape, self.strides, self.padding = base, shape, strides, padding


def _wrap_handle_tensordesc(launcher, tensordesc_meta):
    """The shape of Triton's own wrapper around the C launcher: a closure over `launcher` and `tensordesc_meta`."""
    def inner(*args):
        assert tensordesc_meta
        return launcher(*args)
    return inner


class ReplayKernel:
    """A compiled kernel with a C launcher behind the descriptor-encoding wrapper; the launcher records its args."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, signature, scratch=0):
        self.c_calls = []
        self.src = type("Src", (), {"signature": signature})()
        c_launch = lambda *args: self.c_calls.append(args)  # noqa: E731
        self.run = type("Runner", (), dict(global_scratch_size=scratch, profile_scratch_size=0,
                                           launch_cooperative_grid=False, launch_pdl=False,
                                           launch=staticmethod(_wrap_handle_tensordesc(c_launch, [{"swizzle": 128}]))))()


@pytest.fixture
def encoder(monkeypatch):
    """Triton's descriptor encoder replaced: a 'map' of the base address, then shape and strides; records calls."""
    calls = []

    def make_tensordesc_arg(desc, meta):
        calls.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]
    monkeypatch.setattr(tuning, "_make_tensordesc_arg", lambda: make_tensordesc_arg)
    monkeypatch.setattr(tuning, "_current_stream", lambda device: "stream")
    return calls


SIGNATURE = {"desc": "tensordesc<bf16[64, 64]>", "out": "*bf16", "cu": "*i32", "n": "i32", "BLOCK": "constexpr"}


def _recorded(kernel, args, roles):
    q, out, cu = args
    desc = FakeDescriptor(q, [100, 192], [192, 1])
    bound = {"desc": desc, "out": out, "cu": cu, "n": 48, "BLOCK": 64}
    return tuning.Replay((3, 16, 2), kernel, bound, 0, roles)


def test_replay_substitutes_addresses_and_reencodes_a_moved_descriptor(encoder):
    kernel = ReplayKernel(SIGNATURE)
    q, out, cu = FakeTensor(4096), FakeTensor(8192), FakeTensor(512)
    replay = _recorded(kernel, (q, out, cu), roles=(q, out, cu))
    assert encoder == [4096]
    assert replay([4096, 16384, 1024])
    # the C launcher's arguments: grid, stream, handles, no scratch, no hooks, then the expanded parameters with
    # the roles' current addresses (the descriptor not re-encoded: its base did not move), constexprs kept in place
    assert kernel.c_calls[-1] == (3, 16, 2, "stream", "fn-handle", False, False, None, None, "meta", None, None, None,
                                  ("map", 4096, 128), 100, 192, 192, 1, 16384, 1024, 48, 64)
    assert encoder == [4096]
    assert replay([2048, 16384, 1024])
    assert kernel.c_calls[-1][13] == ("map", 2048, 128) and encoder == [4096, 2048]
    assert replay([2048, 8192, 512]) and encoder == [4096, 2048]


def test_replay_refuses_hooks_foreign_tensors_scratch_and_unknown_launchers(encoder, monkeypatch):
    q, out, cu = FakeTensor(4096), FakeTensor(8192), FakeTensor(512)
    with pytest.raises(tuning._NotReplayable, match="outside"):
        _recorded(ReplayKernel(SIGNATURE), (q, out, FakeTensor(512)), roles=(q, out, cu))
    with pytest.raises(tuning._NotReplayable, match="scratch"):
        _recorded(ReplayKernel(SIGNATURE, scratch=64), (q, out, cu), roles=(q, out, cu))
    other = ReplayKernel(SIGNATURE)
    other.run.launch = lambda *args: None  # a wrapper that is not Triton's
    with pytest.raises(tuning._NotReplayable, match="wrapper"):
        _recorded(other, (q, out, cu), roles=(q, out, cu))

    kernel = ReplayKernel(SIGNATURE)
    replay = _recorded(kernel, (q, out, cu), roles=(q, out, cu))
    monkeypatch.setattr(tuning.triton.knobs.runtime.launch_enter_hook, "calls", [print])
    assert not replay([4096, 8192, 512]) and kernel.c_calls == []


def test_record_keeps_one_lean_launch_only(lean):
    fn = FakeJit()
    first = tuning.record(lambda: tuning.launch(fn, (1,), "x", 32), roles=())
    assert first is None  # compiled through the JIT: a later call may record
    twice = tuning.record(lambda: [tuning.launch(fn, (1,), "x", 32) for _ in range(2)], roles=())
    assert twice is False
    # one lean launch whose kernel has no C launcher behind it (FakeKernel): not replayable
    assert tuning.record(lambda: tuning.launch(fn, (1,), "x", 32), roles=()) is False
    assert getattr(tuning._recording, "launches", None) is None  # recording ends with the call


def test_tuning_cache_round_trip(tmp_path, monkeypatch, caplog):
    """The service's on-disk cache of the tuner's choices: what one process chose, the next adopts without timing
    (keys it already chose stay); a corrupt file is ignored with a warning; no cache off the GPU or when disabled."""
    import torch

    from kernels import tuning
    from kernels.attention.tiles import TileConfig
    from service.engine.build import load_tuning, save_tuning, tuning_cache
    from service.settings import Settings

    key = ("tma", 1, 1, 72, False, True, torch.bfloat16, torch.device("cuda", 0))
    other = ("ptr", 0, 0, 64, True, True, torch.float16, torch.device("cuda", 0))
    monkeypatch.setattr(tuning, "_choices", {key: TileConfig(128, 64, 8, 2, tma=True, gluon=True)})
    path = tmp_path / "tuning" / "x.pkl"
    save_tuning(path)
    monkeypatch.setattr(tuning, "_choices", {other: TileConfig(64, 64)})
    load_tuning(path)
    assert tuning.tuned_choices() == {key: TileConfig(128, 64, 8, 2, tma=True, gluon=True), other: TileConfig(64, 64)}
    path.write_bytes(b"not a pickle")
    load_tuning(path)
    assert "ignoring the kernel tuning cache" in caplog.text
    assert tuning_cache(Settings(cache_dir=str(tmp_path)), torch.device("cpu")) is None
    assert tuning_cache(Settings(cache_dir=""), torch.device("cuda", 0)) is None


@pytest.mark.parametrize("writable", [True, False])
def test_triton_compiles_into_the_cache_dir_or_a_temporary_one(tmp_path, monkeypatch, caplog, writable):
    """Triton fails every compile where it cannot create its cache directory: a cache volume the server cannot
    write (here a path below a regular file, which even root cannot create) costs a warning and a temporary
    directory, not the start."""
    from service.engine.build import configure_runtime
    from service.settings import Settings

    for name in ("TRITON_CACHE_DIR", "CUBLASLT_WORKSPACE_SIZE"):  # restored as they were after the test
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    (tmp_path / "file").write_bytes(b"")
    cache = tmp_path / ("volume" if writable else "file/volume")
    configure_runtime(Settings(cache_dir=str(cache)))
    triton_dir = os.environ["TRITON_CACHE_DIR"]
    if writable:
        assert triton_dir == str(cache / "triton") and (cache / "triton").is_dir()
        assert "not writable" not in caplog.text
    else:
        assert not triton_dir.startswith(str(tmp_path))
        (Path(triton_dir) / "probe").write_bytes(b"ok")
        assert f"{cache / 'triton'} is not writable" in caplog.text
    monkeypatch.setenv("TRITON_CACHE_DIR", "/elsewhere")  # the user's own choice wins
    configure_runtime(Settings(cache_dir=str(cache)))
    assert os.environ["TRITON_CACHE_DIR"] == "/elsewhere"
