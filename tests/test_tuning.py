"""The launch-configuration choice (kernels.tuning.choose) with a scripted timer: what it times, what
it keeps."""

from __future__ import annotations

import pytest

import kernels.tuning as tuning


@pytest.fixture
def timer(monkeypatch):
    """do_bench replaced by a script: candidate -> [first timing, re-timing]; records each call."""
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


def test_close_candidates_are_retimed_longer(timer):
    # "b" looks best in the short timing by 2%, "a" wins the longer one; "c" is 20% off and not re-timed
    calls = timer({"a": [1.02, 0.98], "b": [1.00, 1.01], "c": [1.20]})
    assert tuning.choose(("k", 1), lambda: ["a", "b", "c"], lambda c: c) == "a"
    assert [c for c, rep in calls if rep > 40] == ["a", "b"]
    assert len(calls) == 5
    # chosen once: later calls with the key neither list nor time candidates
    assert tuning.choose(("k", 1), lambda: pytest.fail("re-listed"), lambda c: pytest.fail("re-timed")) == "a"


def test_clear_winner_is_not_retimed(timer):
    calls = timer({"a": [1.0], "b": [1.5]})
    assert tuning.choose(("k", 2), lambda: ["a", "b"], lambda c: c) == "a"
    assert len(calls) == 2


def test_failing_candidates_are_skipped_and_all_failing_raises(timer):
    timer({"a": [1.0, 1.0]})

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
