"""The kernels' runtime (`kernels.runtime`), each part built by the test rather than patched: the tuner with a
scripted timer (what it times, what it keeps), the lean launcher with a fake JIT function (what compiles, what
launches lean, when it steps aside), and launch replays with a fake C launcher."""

from __future__ import annotations

import os

import pytest

from kernels.runtime import triton_internals
from kernels.runtime.launcher import Launcher
from kernels.runtime.replay import NotReplayable, Replay
from kernels.runtime.tuner import Tuner


def scripted(script, capturing=False):
    """A tuner whose timer follows a script (candidate -> its timings, one per call in order); the calls it made."""
    calls = []

    def timer(fn, warmup, rep):
        c = fn()
        calls.append((c, rep))
        return script[c][sum(1 for x, _ in calls if x == c) - 1]
    return Tuner(timer, capturing=lambda: capturing), calls


R = Tuner.ROUNDS


def test_close_candidates_are_retimed_longer():
    # "b" looks best in the short timings by 2%, "a" wins the longer ones; "c" is 20% off and not re-timed
    tuner, calls = scripted({"a": [1.02] * R + [0.98] * R, "b": [1.00] * R + [1.01] * R, "c": [1.20] * R})
    assert tuner.choose(("k", 1), lambda: ["a", "b", "c"], lambda c: c) == "a"
    assert [c for c, rep in calls if rep > 40] == ["a", "b"] * R
    # the rounds interleave the candidates
    assert [c for c, _ in calls[:3 * R]] == ["a", "b", "c"] * R
    # chosen once: later calls with the key neither list nor time candidates
    assert tuner.choose(("k", 1), lambda: pytest.fail("re-listed"), lambda c: pytest.fail("re-timed")) == "a"
    # what the choice rested on, for benchmarks: every candidate's short median, then the re-timed ones'
    first, final = tuner.timings[("k", 1)]
    assert first == [("a", 1.02), ("b", 1.00), ("c", 1.20)] and final == [("a", 0.98), ("b", 1.01)]


def test_clear_winner_is_not_retimed():
    tuner, calls = scripted({"a": [1.0] * R, "b": [1.5] * R})
    assert tuner.choose(("k", 2), lambda: ["a", "b"], lambda c: c) == "a"
    assert len(calls) == 2 * R


def test_one_slow_round_does_not_decide():
    # the host's slow spell lands on "a"'s first timing: its median still wins, and "b" is more than 5% off
    tuner, _ = scripted({"a": [3.0] + [1.0] * (R - 1), "b": [1.1] * R})
    assert tuner.choose(("k", 6), lambda: ["a", "b"], lambda c: c) == "a"


def test_failing_candidates_are_skipped_and_all_failing_raises():
    tuner, _ = scripted({"a": [1.0] * R})

    def launch(c):
        if c == "bad":
            raise RuntimeError("out of resources")
        return c

    assert tuner.choose(("k", 3), lambda: ["bad", "a"], launch) == "a"
    with pytest.raises(RuntimeError, match="out of resources"):
        tuner.choose(("k", 4), lambda: ["bad", "bad"], launch)


def test_under_graph_capture_the_first_candidate_untimed():
    tuner, calls = scripted({}, capturing=True)
    assert tuner.choose(("k", 5), lambda: ["x", "y"], lambda c: pytest.fail("timed under capture")) == "x"
    assert calls == []


class FakeKernel:
    """What a lean launch uses of Triton's CompiledKernel; records its launches."""

    function = "fn-handle"
    packed_metadata = "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *args):
        self.log.append(("lean", args))


class FakeJit:
    """A `triton.jit` function as the launcher sees it: a per-device binder (alignment-like specialisation of
    ints: divisible by 16 or not) and `fn[grid](...)`, which compiles one kernel per specialisation."""

    def __init__(self):
        self.log, self.compiled = [], {}
        self.device_caches = {0: (None, None, None, None, self.bind)}
        self.arg_names = ["x", "n", "BLOCK"]

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
def launcher(monkeypatch):
    """A launcher as on a GPU with a supported Triton: device 0, a stub stream."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    return Launcher(stream=lambda device: "stream", supported=lambda: True)


def test_launch_compiles_once_per_specialisation_then_launches_lean(launcher):
    fn = FakeJit()
    launcher.launch(fn, (4, 2), "x", 32, BLOCK=128, num_warps=4)
    launcher.launch(fn, (5,), "y", 48, BLOCK=128, num_warps=4)  # same specialisation: lean
    launcher.launch(fn, (6, 1, 3), "z", 7, BLOCK=128, num_warps=4)  # n not divisible by 16: through the JIT
    launcher.launch(fn, (6, 1, 3), "z", 9, BLOCK=128, num_warps=4)
    launcher.launch(fn, (4, 2), "x", 32, BLOCK=128, num_warps=8)  # another option: another kernel
    assert [entry[0] for entry in fn.log] == ["jit", "lean", "jit", "lean", "jit"]
    # the lean launch passes the grid padded to three dims, the stream, the kernel's handles, no hooks,
    # then every parameter in signature order, constexprs included
    assert fn.log[1][1] == (5, 1, 1, "stream", "fn-handle", "meta", None, None, None, "y", 48, 128)
    assert fn.log[3][1][:3] == (6, 1, 3)
    assert launcher.status()["lean"] is True


def test_a_compile_after_warm_up_is_logged_and_counted(launcher, caplog):
    """Every request waits while a kernel compiles: after warm-up (`serving`), a first launch of a new specialisation
    is a warning naming the kernel, and `status` counts it; launches already compiled are silent."""
    fn = FakeJit()
    launcher.launch(fn, (4,), "x", 32, BLOCK=128)  # during warm-up: silent
    launcher.serving = True
    with caplog.at_level("WARNING", logger="kernels.runtime.launcher"):
        launcher.launch(fn, (4,), "y", 48, BLOCK=128)  # compiled already
        assert not caplog.records
        launcher.launch(fn, (4,), "z", 7, BLOCK=128)  # n not divisible by 16: a new specialisation
        message = caplog.records[0].getMessage()
        assert len(caplog.records) == 1 and "compiled while serving" in message
        # what the warm-up missed, against the nearest specialisation compiled: n's divisibility, nothing else
        assert "n: ('i32', '') (compiled: ('i32', 'D'))" in message and "x:" not in message and "BLOCK" not in message
        assert launcher.status()["compiles_while_serving"] == 1
        launcher.launch(fn, (4,), "w", 7, BLOCK=128, num_warps=8)  # other options: nothing compiled to compare with
    assert "none compiled with these options" in caplog.records[-1].getMessage()


def test_launch_goes_through_the_jit_with_a_hook_or_unknown_internals(launcher, monkeypatch, caplog):
    """A launch hook (a profiler's) sends launches through the JIT, which calls it; a Triton whose JIT keeps its
    binders elsewhere, or one outside the releases the internals module was written for, turns the lean path off
    for good, with one warning that says why, and `status` reports it."""
    import triton

    fn = FakeJit()
    launcher.launch(fn, (1,), "x", 32)
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [print])
    launcher.launch(fn, (1,), "x", 32)
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [])
    launcher.launch(fn, (1,), "x", 32)
    assert [entry[0] for entry in fn.log] == ["jit", "jit", "lean"]

    elsewhere = Launcher(stream=lambda device: "stream", supported=lambda: True)
    other = FakeJit()
    del other.device_caches  # a Triton whose JIT functions keep their binders elsewhere
    for _ in range(3):
        elsewhere.launch(other, (1,), "x", 32)
    assert [entry[0] for entry in other.log] == ["jit"] * 3
    assert elsewhere.status()["lean"] is False and "binder" in elsewhere.status()["reason"]

    unsupported = Launcher(stream=lambda device: "stream", supported=lambda: False)
    newer = FakeJit()
    for _ in range(3):
        unsupported.launch(newer, (1,), "x", 32)
    assert [entry[0] for entry in newer.log] == ["jit"] * 3
    assert unsupported.status()["lean"] is False and "outside" in unsupported.status()["reason"]
    assert caplog.text.count("take Triton's own path") == 2


def test_the_lean_path_is_an_operator_choice_that_falls_back_to_the_jit(launcher, monkeypatch):
    """`lean_launch=false` (`Launcher.allow(False)`): every launch through Triton's own path, the kernels compiled
    so far forgotten, `status` saying why; allowed again, the next compiled launch goes lean. The service's
    start-up applies the setting (`configure_runtime`)."""
    fn = FakeJit()
    launcher.launch(fn, (1,), "x", 32)
    launcher.launch(fn, (1,), "x", 32)
    launcher.allow(False)
    for _ in range(2):
        launcher.launch(fn, (1,), "x", 32)
    assert [entry[0] for entry in fn.log] == ["jit", "lean", "jit", "jit"]
    assert launcher.status()["lean"] is False and "lean_launch=false" in launcher.status()["reason"]
    assert not launcher.kernels
    launcher.allow(True)
    launcher.launch(fn, (1,), "x", 32)
    launcher.launch(fn, (1,), "x", 32)
    assert [entry[0] for entry in fn.log][-2:] == ["jit", "lean"] and launcher.status()["lean"] is True

    import kernels.runtime as runtime
    from service.engine.build import configure_runtime
    from service.settings import Settings

    monkeypatch.setattr(runtime, "LAUNCHER", launcher)
    monkeypatch.setenv("TRITON_CACHE_DIR", os.environ.get("TRITON_CACHE_DIR", "/tmp/triton-cache"))  # left as it is
    monkeypatch.setenv("CUBLASLT_WORKSPACE_SIZE", os.environ.get("CUBLASLT_WORKSPACE_SIZE", "0"))
    configure_runtime(Settings(model="random:tiny", lean_launch=False))
    assert runtime.launch_status()["lean"] is False and "lean_launch=false" in runtime.launch_status()["reason"]
    configure_runtime(Settings(model="random:tiny"))
    assert runtime.launch_status()["lean"] is None  # the next compiled launch decides


def test_the_internals_module_knows_its_triton_releases(monkeypatch):
    import triton

    for version, ok in (("3.6.0", True), ("3.9.1", True), ("3.5.0", False), ("3.10.0", False), ("4.0.0", False),
                        ("3.7.0+git1234", True), ("nightly", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert triton_internals.supported() is ok, version


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


class Encoder:
    """Stands for Triton's descriptor encoder: a 'map' of the base address, then shape and strides; records calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, desc, meta):
        self.calls.append(desc.base.data_ptr())
        return [("map", desc.base.data_ptr(), meta["swizzle"]), *desc.shape, *desc.strides]


SIGNATURE = {"desc": "tensordesc<bf16[64, 64]>", "out": "*bf16", "cu": "*i32", "n": "i32", "BLOCK": "constexpr"}


def _recorded(kernel, args, roles, encoder=None, hooked=lambda: False):
    q, out, cu = args
    desc = FakeDescriptor(q, [100, 192], [192, 1])
    bound = {"desc": desc, "out": out, "cu": cu, "n": 48, "BLOCK": 64}
    return Replay((3, 16, 2), kernel, bound, 0, roles, stream=lambda device: "stream", encode=encoder or Encoder(),
                  hooked=hooked)


def test_replay_substitutes_addresses_and_reencodes_a_moved_descriptor():
    kernel = ReplayKernel(SIGNATURE)
    q, out, cu = FakeTensor(4096), FakeTensor(8192), FakeTensor(512)
    encoder = Encoder()
    replay = _recorded(kernel, (q, out, cu), roles=(q, out, cu), encoder=encoder)
    encoder = encoder.calls
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


def test_replay_refuses_hooks_foreign_tensors_scratch_and_unknown_launchers():
    q, out, cu = FakeTensor(4096), FakeTensor(8192), FakeTensor(512)
    with pytest.raises(NotReplayable, match="outside"):
        _recorded(ReplayKernel(SIGNATURE), (q, out, FakeTensor(512)), roles=(q, out, cu))
    with pytest.raises(NotReplayable, match="scratch"):
        _recorded(ReplayKernel(SIGNATURE, scratch=64), (q, out, cu), roles=(q, out, cu))
    other = ReplayKernel(SIGNATURE)
    other.run.launch = lambda *args: None  # a wrapper that is not Triton's
    with pytest.raises(NotReplayable, match="wrapper"):
        _recorded(other, (q, out, cu), roles=(q, out, cu))

    kernel = ReplayKernel(SIGNATURE)
    hooks = []
    replay = _recorded(kernel, (q, out, cu), roles=(q, out, cu), hooked=lambda: bool(hooks))
    hooks.append(print)
    assert not replay([4096, 8192, 512]) and kernel.c_calls == []


def test_record_keeps_one_lean_launch_only(launcher):
    fn = FakeJit()
    first = launcher.record(lambda: launcher.launch(fn, (1,), "x", 32), roles=())
    assert first is None  # compiled through the JIT: a later call may record
    twice = launcher.record(lambda: [launcher.launch(fn, (1,), "x", 32) for _ in range(2)], roles=())
    assert twice is False
    # one lean launch whose kernel has no C launcher behind it (FakeKernel): not replayable
    assert launcher.record(lambda: launcher.launch(fn, (1,), "x", 32), roles=()) is False
    assert getattr(launcher._recording, "launches", None) is None  # recording ends with the call


