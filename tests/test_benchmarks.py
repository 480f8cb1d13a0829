"""The benchmarks' own arithmetic, on made-up inputs with known answers: what the results' summaries report (issue
57's ratios against the forward, in bursts and sustained), the sustained forward's rate and clock, and the soak's
slowest forwards from an engine trace."""

from __future__ import annotations

import time

import pytest

from benchmarks import bench_service
from benchmarks.soak import slowest_forwards


def _row(images_per_s: float, cores: float = 0.4) -> dict:
    return {"images_per_s": images_per_s, "generator": {"cpu_cores": cores, "achieved_requests_per_s": images_per_s}}


def test_the_summary_holds_each_generator_s_ratio_to_the_forward_in_bursts_and_sustained():
    comp = {"c64": _row(850.0), "c256": _row(874.0, 0.5), "epd_c64": _row(700.0, 1.0)}
    aio = {"warm": {"images_per_s": 840.0, "generator": {"max_cpu_fraction": 0.2}, "p50_ms": 75.0, "p99_ms": 150.0}}
    fwd = {"uniform": {"images_per_s": 1000.0, "sustained_images_per_s": 950.0}}
    s = bench_service.generator_summary(comp, aio, fwd)
    assert s["compiled_ratio_c64"] == pytest.approx(0.85) and s["compiled_ratio_c256"] == pytest.approx(0.874)
    assert s["aiohttp_ratio"] == pytest.approx(0.84)
    assert s["compiled_ratio_c64_sustained"] == pytest.approx(850 / 950)
    assert s["compiled_ratio_c256_sustained"] == pytest.approx(874 / 950)
    assert s["aiohttp_ratio_sustained"] == pytest.approx(840 / 950)
    assert s["compiled_generator_cpu_cores"] == 1.0 and s["forward_sustained_images_per_s"] == 950.0
    del fwd["uniform"]["sustained_images_per_s"]  # an older forward without the sustained run: no sustained keys
    assert not [k for k in bench_service.generator_summary(comp, aio, fwd) if "sustained" in k]


def test_the_sustained_forward_counts_whole_cycles_and_takes_the_clock_s_medians(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    clocks = iter(["1600 MHz, 690.00 W", "1700 MHz, 680.00 W", "1650 MHz, 700.00 W"] * 10)
    monkeypatch.setattr(bench_service, "sm_clock", lambda: next(clocks))
    calls = []
    row = bench_service.sustained([lambda: (calls.append(1), time.sleep(0.01))] * 2, images=8, warmup_s=0.1,
                                  seconds=4.5)
    cycles = round(row["images_per_s"] * row["seconds"] / 8)
    assert 4.5 <= row["seconds"] < 5.0 and 90 <= cycles <= 225  # 20 ms a cycle of two 10-ms calls
    assert cycles <= len(calls) // 2  # whole cycles of the measured window only (the warm-up's are not counted)
    # sampled every 2 s: at 2 s and 4 s, the medians of the first two readings
    assert row["sm_clock_mhz"] == 1650.0 and row["power_w"] == 685.0


def test_the_slowest_forwards_are_those_longest_for_their_size(tmp_path):
    start = 1_000_000.0
    lines = [f"{start - 5:.4f},cuda:0,1,784,1.0,1.2"]  # before the soak: left out
    t = start
    for i in range(50):
        t += 0.05
        patches = 784 * (1 + i % 4)
        ms = patches * 0.0015 + (150.0 if i == 30 else 0.0)  # one forward stalled 150 ms
        lines.append(f"{t:.4f},cuda:0,{1 + i % 4},{patches},{ms:.3f},{ms + 0.5:.3f}")
        if i == 30:
            t += 0.15
    trace = tmp_path / "forwards.csv"
    trace.write_text("\n".join(lines) + "\n")
    rows = slowest_forwards(trace, start, n=3)
    stalled = max(rows, key=lambda r: r["launch_to_outputs_ms"] - r["expected_ms"])
    assert len(rows) == 3 and all(r["t_s"] >= 0 for r in rows)
    assert stalled["t_s"] == pytest.approx(31 * 0.05, abs=1e-3) and stalled["launch_to_outputs_ms"] > 150
    assert [r["t_s"] for r in rows] == sorted(r["t_s"] for r in rows)
    assert slowest_forwards(tmp_path / "missing.csv", start) == []
