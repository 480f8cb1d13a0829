"""The Hopper kernel's inputs (`kernels/attention/remainder.py`): the layout it takes, and the transposed copy of
K's and V's columns past a power-of-two head dim, under the interpreter against a gather in PyTorch."""

from __future__ import annotations

import pytest
import torch

from kernels.attention.launch import triton_varlen_attention
from kernels.attention.remainder import hopper_layout_ok, kv_remainder_t
from kernels.attention.tiles import GluonTile, head_dim_split, remainder_rows

from conftest import make_inputs


def test_the_hopper_kernel_needs_16_byte_rows_and_heads_in_q_and_out():
    """The Hopper kernel reads q through descriptors and stores O in 16-byte pieces: a q or out whose rows or heads
    do not start on 16 bytes, or data not in half precision, is refused, not misread."""
    q, k, v, cu = make_inputs([7, 33], 2, 72, torch.float16)
    config = GluonTile(64, 64)
    assert hopper_layout_ok(q, k, v, torch.empty_like(q))
    assert not hopper_layout_ok(q.float(), k.float(), v.float())
    skewed = torch.empty(q.shape[0], 2, 76, dtype=q.dtype)[..., :72]  # heads 152 bytes apart
    assert not hopper_layout_ok(skewed, k, v) and not hopper_layout_ok(q, k, v, skewed)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(skewed.copy_(q), k, v, cu, 33, config=config)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(q, k, v, cu, 33, out=skewed, config=config)


@pytest.mark.parametrize("lengths,head_dim", [([1, 7, 33, 8], 72), ([16, 3], 80), ([5, 40], 96)])
def test_kv_remainder_t_layout(lengths, head_dim, monkeypatch):
    """The transposed remainder the Hopper kernel reads: per head K's remainder rows, V's, and a row of ones
    where the remainder leaves a spare column; every column written (data, or zeros in the gaps between
    segments), each segment from a 16-byte aligned column."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    heads = 3
    q, k, v, cu = make_inputs(lengths, heads, head_dim, torch.float16, seed=head_dim)
    d0, w1, _ = head_dim_split(head_dim)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))  # poisoned
    r = kv_remainder_t(k, v, cu, max(lengths))
    monkeypatch.undo()
    rest = head_dim - d0
    rows = remainder_rows(head_dim)
    assert rows == 2 * rest + (rest < w1) and r.shape[0] == heads * rows
    expected = torch.zeros(heads, rows, r.shape[1], dtype=r.dtype)
    if rest < w1:
        expected[:, 2 * rest] = 1  # PV's dot sums P's rows with it (the kernel's sum_mma)
    start = 0
    for seg, (tok0, n) in enumerate(zip(cu[:-1].tolist(), lengths)):
        start = -(-tok0 // 8) * 8 + 8 * seg
        assert start * r.element_size() % 16 == 0
        for which, t in enumerate((k, v)):
            expected[:, which * rest:(which + 1) * rest, start:start + n] = t[tok0:tok0 + n, :, d0:].permute(1, 2, 0)
    assert torch.equal(r.view(heads, rows, -1), expected)
