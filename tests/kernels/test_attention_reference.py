"""The SDPA fallback (`kernels/attention/reference.py`) against the plain per-segment reference, float32: 1e-5
relative."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.reference import reference_varlen_attention, sdpa_gathers, sdpa_varlen_attention, segment_runs

from conftest import ATTENTION_CASES as CASES, make_inputs, rel_err


@pytest.mark.parametrize("lengths,head_dim", CASES + [([1023], 64), ([300, 4096 // 8] * 3, 80)])
def test_sdpa_fallback(lengths, head_dim):
    q, k, v, cu = make_inputs(lengths, 3, head_dim, torch.float32, seed=head_dim)
    ref = reference_varlen_attention(q, k, v, cu)
    out = sdpa_varlen_attention(q, k, v, cu, max(lengths))
    assert rel_err(out, ref) <= 1e-5
    # host lengths given: no read-back, same result
    out2 = sdpa_varlen_attention(q, k, v, cu, max(lengths), seqlens=lengths)
    assert torch.equal(out, out2)


def test_segments_do_not_interact():
    """Changing one segment's keys changes only that segment's outputs."""
    lengths = [9, 14, 5]
    q, k, v, cu = make_inputs(lengths, 2, 64, torch.float32)
    base = sdpa_varlen_attention(q, k, v, cu, 14)
    k2 = k.clone()
    k2[9:23] += 1.0
    moved = sdpa_varlen_attention(q, k2, v, cu, 14)
    assert torch.equal(base[:9], moved[:9]) and torch.equal(base[23:], moved[23:])
    assert not torch.allclose(base[9:23], moved[9:23])


def test_segment_runs():
    assert segment_runs([4, 4, 4, 7, 4, 4, 1]) == [(0, 3, 4), (12, 1, 7), (19, 2, 4), (27, 1, 1)]
    assert segment_runs([5]) == [(0, 1, 5)]
    # views while runs are few; gathered by length when equal lengths are scattered
    assert not sdpa_gathers([784] * 32 + [256] * 3 + [784] * 5)
    assert not sdpa_gathers(list(range(1, 40)))  # every length distinct: nothing to gather
    assert sdpa_gathers([9, 16] * 10)


@pytest.mark.parametrize("lengths", [[16] * 6, [9, 16] * 10, [16, 16, 7, 16, 1, 1, 1, 31], [3, 5] * 3 + [2] * 9])
def test_sdpa_fallback_runs_and_gathers(lengths):
    """Both strategies of the fallback (views of runs, gathers by length), on strided fused-QKV views."""
    q, k, v, cu = make_inputs(lengths, 3, 72, torch.float32, seed=len(lengths))
    out = sdpa_varlen_attention(q, k, v, cu, max(lengths), seqlens=lengths)
    assert out.shape == q.shape
    assert rel_err(out, reference_varlen_attention(q, k, v, cu)) <= 1e-5
