"""The launch-configuration choice (kernels.tuning.choose) with a scripted timer: what it times, what
it keeps."""

from __future__ import annotations

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
