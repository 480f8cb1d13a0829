"""Varlen attention: the Triton kernel (under TRITON_INTERPRET=1 on CPU), the SDPA fallback and the
dispatcher, against a float32 per-segment reference. The same kernel runs at full size on the GPU
in tests/gpu/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import rel_err
from kernels import attention as attn_mod
from kernels.attention import launch as launch_mod
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention, sdpa_gathers, sdpa_varlen_attention, segment_runs
from kernels.attention.tiles import GLUON_TILES, TileConfig, head_dim_split
from kernels.attention.tma import tma_layout_ok
from kernels.rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq


def make_inputs(lengths, heads, head_dim, dtype, seed=0, device="cpu"):
    """q, k, v as strided views of one fused QKV buffer, as the tower produces them, and cu_seqlens."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, heads, head_dim, generator=g).to(device=device, dtype=dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + lengths).cumsum(0).to(device=device, dtype=torch.int32)
    return q, k, v, cu


CASES = [
    ([1], 64), ([7], 72), ([131], 80), ([1, 7, 131, 16, 33], 64), ([5] * 24, 72),
    ([40, 1, 17], 128), ([23, 9], 16),
]


@pytest.mark.parametrize("lengths,head_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_kernel_interpreted(lengths, head_dim, dtype):
    q, k, v, cu = make_inputs(lengths, 2, head_dim, dtype, seed=len(lengths) * head_dim)
    out = torch.full(q.shape, float("nan"), dtype=dtype)  # poisoned: unwritten elements show up as NaN
    triton_varlen_attention(q, k, v, cu, max(lengths), out=out, block_m=32, block_n=16)
    assert not out.isnan().any()
    ref = reference_varlen_attention(q, k, v, cu)
    # flash-attention's rule: at most 2x the error of the same math done by PyTorch in this dtype
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    assert rel_err(out, ref) <= max(2 * torch_err, 2e-6), (rel_err(out, ref), torch_err)


@pytest.mark.parametrize("lengths,head_dim", [([1, 7, 40], 64), ([7, 33, 5], 72), ([8, 1, 16, 23], 72), ([19, 5, 1, 45], 80),
                                              ([3, 18], 96), ([40, 1, 17], 128)])
@pytest.mark.parametrize("tail", ["masked", "in_loop", "narrow", "narrow+q_tail"])
def test_tma_kernel_interpreted(lengths, head_dim, tail):
    """The Hopper kernel (K/V through tensor descriptors; past a power-of-two chunk, K's and V's remaining
    columns read transposed). A segment's last keys go in one
    masked tile, in the loop, or in narrow steps of 8 keys after 32-key tiles (where at most 16 remain:
    one step for 1, 3, 5, 7, 8, 33 and 40, two for 16 and 45; 17 to 23 stay one masked tile). With
    q_tail, a segment's last query rows, where at most 16 remain of a 32-row tile, run as a 16-row tile
    (segments of 1 to 16 tokens, and the last rows of 33, 40 and 45)."""
    q, k, v, cu = make_inputs(lengths, 2, head_dim, torch.float16, seed=head_dim)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    triton_varlen_attention(q, k, v, cu, max(lengths), out=out,
                            config=TileConfig(32, 32 if "narrow" in tail else 16, tma=True,
                                              tail_in_loop=tail == "in_loop", tail_n=8 if "narrow" in tail else 0,
                                              q_tail="q_tail" in tail))
    assert not out.isnan().any()
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    assert rel_err(out, ref) <= 2 * torch_err, (rel_err(out, ref), torch_err)


@pytest.mark.parametrize("lengths,head_dim", [([1, 7, 40], 64), ([7, 33, 5], 72), ([8, 1, 16, 23], 72),
                                              ([19, 5, 1, 45], 80)])
@pytest.mark.parametrize("tail", ["masked", "narrow+q_tail"])
@pytest.mark.parametrize("sum_mma", [False, True])
def test_tma_kernel_sum_mma_interpreted(lengths, head_dim, tail, sum_mma):
    """P's row sums on the tensor cores (`sum_mma`, on by default: the ones row of the transposed remainder
    at 72; 64 and 80 have no spare column and sum in registers either way): the same tolerance as the
    kernel that sums P in registers, with the last keys in a masked tile or in narrow steps."""
    q, k, v, cu = make_inputs(lengths, 2, head_dim, torch.float16, seed=head_dim + 2)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    narrow = "narrow" in tail
    triton_varlen_attention(q, k, v, cu, max(lengths), out=out,
                            config=TileConfig(32, 32 if narrow else 16, tma=True, tail_n=8 if narrow else 0,
                                              q_tail=narrow, sum_mma=sum_mma))
    assert not out.isnan().any()
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    assert rel_err(out, ref) <= 2 * torch_err, (rel_err(out, ref), torch_err)


@pytest.mark.parametrize("bad,problem", [
    (lambda q: torch.empty(q.shape[0], 2, 71, dtype=q.dtype), "shape"),
    (lambda q: torch.empty_like(q, dtype=torch.float32), "dtype"),
    (lambda q: torch.empty(q.shape[0], 72, 2, dtype=q.dtype).transpose(1, 2), "last dim"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_out_is_checked_before_any_kernel_writes_it(bad, problem):
    """A caller's `out` of another shape, dtype or with a strided last dim is refused with a clear error: every
    kernel writes its rows with the last dim contiguous, at q's shape."""
    q, k, v, cu = make_inputs([7, 33], 2, 72, torch.float16)
    with pytest.raises(ValueError, match="out must be torch.float16 \\(40, 2, 72\\)"):
        triton_varlen_attention(q, k, v, cu, 33, out=bad(q))


def test_tma_kernel_needs_16_byte_rows_and_heads_in_q_and_out():
    """The Hopper kernel rounds Q's and O's strides down to multiples of 8 elements so that the compiler sees them
    aligned (at 72 the JIT does not mark the head stride): a q or out whose rows or heads do not start on 16 bytes
    is refused, not misread."""
    q, k, v, cu = make_inputs([7, 33], 2, 72, torch.float16)
    config = TileConfig(32, 16, tma=True)
    assert tma_layout_ok(q, k, v, torch.empty_like(q))
    skewed = torch.empty(q.shape[0], 2, 76, dtype=q.dtype)[..., :72]  # heads 152 bytes apart
    assert not tma_layout_ok(skewed, k, v) and not tma_layout_ok(q, k, v, skewed)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(skewed.copy_(q), k, v, cu, 33, config=config)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(q, k, v, cu, 33, out=skewed, config=config)


def test_gluon_kernel_only_where_it_applies():
    """The automatic Hopper path offers the Gluon kernel only at the head dims it was measured at, without RoPE in
    the kernel and with q in the fused QKV layout (its Q arrives by TMA too); a pinned Gluon configuration outside
    those is refused, not misread."""
    from kernels.attention.gluon import gluon_available
    from kernels.attention.tiles import GLUON_HEAD_DIMS, gluon_candidates, hopper_candidates, tma_candidates

    if not gluon_available():
        pytest.skip("this Triton has no Gluon Hopper API")
    assert GLUON_HEAD_DIMS == (64, 72, 80)
    for head_dim in GLUON_HEAD_DIMS:
        assert hopper_candidates(head_dim, True) == tma_candidates(head_dim) + gluon_candidates(head_dim)
        assert gluon_candidates(head_dim) and all(c.gluon and c.tma for c in gluon_candidates(head_dim))
        assert hopper_candidates(head_dim, False) == tma_candidates(head_dim)
    # at 72 both ways of reading the remainder are candidates: copied (large segments) and in place (short ones)
    assert {c.rem_copy for c in gluon_candidates(72)} == {True, False}
    assert {c.rem_copy for c in hopper_candidates(72, True, 4096) if c.gluon} == {True, False}
    assert {c.rem_copy for c in hopper_candidates(72, True, 1024) if c.gluon} == {False}
    assert hopper_candidates(64, True, 256) == hopper_candidates(64, True)
    assert hopper_candidates(96, True) == tma_candidates(96) and not gluon_candidates(128)
    for head_dim in (64, 72, 96):
        q, k, v, cu = make_inputs([7, 33], 2, head_dim, torch.float16)
        config = gluon_candidates(min(head_dim, 72))[0]
        if head_dim == 96:  # 32 columns past 64: more than the kernel's 16-wide remainder
            with pytest.raises(ValueError, match="Gluon kernel needs at most 16"):
                triton_varlen_attention(q, k, v, cu, 33, config=config)
            continue
        with pytest.raises(ValueError, match="Gluon kernel needs"):
            triton_varlen_attention(q.contiguous().transpose(0, 1).contiguous().transpose(0, 1), k, v, cu, 33,
                                    config=config)
        with pytest.raises(ValueError, match="Gluon kernel needs"):  # three buffers, not one buffer's rows
            triton_varlen_attention(q.contiguous(), k.contiguous(), v.contiguous(), cu, 33, config=config)


def test_qkv_columns_only_for_one_buffers_rows():
    """The Gluon kernel reads q, k and v through descriptors over q's rows: only where they are the three parts
    of one buffer's rows, k's and v's heads after q's."""
    from kernels.attention.gluon import qkv_columns

    qkv = torch.randn(40, 3, 2, 72, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    assert qkv_columns(q, k, v) == (144, 288)
    assert qkv_columns(q, v, k) == (288, 144)
    assert qkv_columns(k, q, v) is None  # q's rows start after k's heads
    assert qkv_columns(q, k, k) is None  # k and v overlap
    assert qkv_columns(q.contiguous(), k, v) is None  # another row stride
    assert qkv_columns(*(t.contiguous() for t in (q, k, v))) is None  # three buffers
    wide = torch.randn(40, 4, 2, 72, dtype=torch.float16)  # q, k, v and a fourth part in each row
    assert qkv_columns(wide[:, 0], wide[:, 2], wide[:, 3]) == (288, 432)
    heads_apart = torch.randn(40, 2, 3, 72, dtype=torch.float16).transpose(1, 2)  # (T, 3, H, D) read as H-major
    assert qkv_columns(*heads_apart.unbind(1)) is None


def test_launch_plan_key_holds_what_the_launch_depends_on():
    """A replayed launch skips every check and choice, so its key must change with anything they read: layouts, k's
    and v's place in q's rows, scalars, `out`, and each address's 16-byte alignment (Triton's pointer
    specialisation); and stay equal for a new buffer of the same layout, whose addresses are then substituted."""
    from kernels.attention.launch import _plan_key

    def key(q, k, v, cu, m=33, scale=None, out=None):
        return _plan_key(q, k, v, cu, m, scale, out)

    q, k, v, cu = make_inputs([1, 7, 33], 2, 72, torch.float16)
    q2, k2, v2, cu2 = make_inputs([1, 7, 33], 2, 72, torch.float16, seed=1)
    base, addresses = key(q, k, v, cu)
    assert addresses == [q.data_ptr(), k.data_ptr(), v.data_ptr(), 0, cu.data_ptr()]
    fresh, fresh_addresses = key(q2, k2, v2, cu2)
    assert fresh == base and fresh_addresses[0] != addresses[0]
    wide = torch.randn(41, 3 * 2 * 72 + 8, dtype=torch.float16)  # rows 16 bytes longer: another layout
    shifted = torch.randn(41 * 3 * 2 * 72 + 4, dtype=torch.float16)[4:].view(41, 3, 2, 72)  # q 8 bytes off 16
    padded = torch.zeros(8, dtype=torch.int32)
    padded[1:5] = cu
    others = [
        key(q, v, k, cu),  # k and v swapped in the row
        key(*wide[:, :432].view(41, 3, 2, 72).unbind(1), cu),
        key(*shifted.unbind(1), cu),
        key(q, k, v, padded[1:5]),  # cu_seqlens 4 bytes off 16
        key(q, k, v, cu, m=34),
        key(q, k, v, cu, scale=0.1),
        key(q, k, v, cu, out=torch.empty_like(q)),
        key(q, k, v, cu, out=torch.empty(41, 2, 80, dtype=torch.float16)[..., :72]),
        key(q.float(), k.float(), v.float(), cu),
        key(q[:40], k[:40], v[:40], cu),
        _plan_key(q, k, v, cu, 33, None, None, True),  # padded rows
    ]
    assert all(other[0] != base for other in others)
    assert len({other[0] for other in others}) == len(others)


@pytest.mark.parametrize("lengths,head_dim", [([1, 7, 33, 8], 72), ([16, 3], 80), ([5, 40], 96)])
def test_kv_remainder_t_layout(lengths, head_dim, monkeypatch):
    """The transposed remainder the Hopper kernel reads: per head K's remainder rows, V's, and a row of ones
    where the remainder leaves a spare column; every column written (data, or zeros in the gaps between
    segments), each segment from a 16-byte aligned column."""
    from kernels.attention.tiles import remainder_rows
    from kernels.attention.tma import kv_remainder_t

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


def test_triton_kernel_interpreted_long_segment():
    q, k, v, cu = make_inputs([1023, 4], 1, 72, torch.float16, seed=3)
    out = triton_varlen_attention(q, k, v, cu, 1023, block_m=64, block_n=64)
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    assert rel_err(out, ref) <= 2 * torch_err


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


def test_rope_reference_matches_transformers():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    q, k, _, _ = make_inputs([50], 4, 72, torch.bfloat16)
    pos = torch.randint(0, 64, (50, 2), generator=torch.Generator().manual_seed(0))
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(72))
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    ref_q, ref_k = apply_rotary_pos_emb_vision(q, k, full_cos, full_sin)
    assert torch.equal(apply_vision_rope(q, cos, sin), ref_q)
    assert torch.equal(apply_vision_rope(k, cos, sin), ref_k)


@pytest.mark.parametrize("head_dim,split", [(64, (64, 0, 0)), (72, (64, 16, 64)), (80, (64, 16, 64)),
                                            (128, (128, 0, 0)), (96, (64, 32, 64)), (16, (16, 0, 0)),
                                            (136, (128, 16, 64)), (200, (128, 128, 128))])
def test_head_dim_split(head_dim, split):
    assert head_dim_split(head_dim) == split


@pytest.mark.parametrize("head_dim", [40, 12, 260, 66])
def test_head_dim_refused(head_dim):
    with pytest.raises(ValueError, match="head_dim"):
        head_dim_split(head_dim)


def test_input_validation():
    q, k, v, cu = make_inputs([4, 4], 2, 64, torch.float16)
    with pytest.raises(ValueError, match="int32"):
        sdpa_varlen_attention(q, k, v, cu.long(), 4)
    with pytest.raises(ValueError, match="max_seqlen"):
        sdpa_varlen_attention(q, k, v, cu, 0)
    with pytest.raises(ValueError, match="share one"):
        triton_varlen_attention(q, k[:4], v, cu, 4)


def test_dispatcher(monkeypatch):
    attn_mod._resolve.cache_clear()
    assert attn_mod.resolve_backend("cpu") == "sdpa"
    assert attn_mod.resolve_backend("cpu", forced="auto") == "sdpa"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="cannot run here"):
        attn_mod.resolve_backend("cpu", forced="triton")
    with pytest.raises(ValueError, match="expected one of"):
        attn_mod.resolve_backend("cpu", forced="bogus")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attn_mod.resolve_backend("cpu", forced="triton") == "triton"
    assert attn_mod.resolve_backend("cpu", forced="sdpa") == "sdpa"
    attn_mod._resolve.cache_clear()


@pytest.mark.parametrize("hopper,gluon", [(True, True), (True, False), (False, True)])
def test_dispatcher_head_dims_past_a_power_of_two(hopper, gluon, monkeypatch):
    """Where Triton is the device's backend: 72 and 80 on it only where the Gluon kernel takes them (Hopper, Gluon's
    API present), SDPA otherwise; 96 (no Gluon tile) always on SDPA; powers of two always on Triton."""
    monkeypatch.setattr(attn_mod, "_resolve", lambda *a: "triton")
    monkeypatch.setattr(attn_mod, "is_hopper", lambda device: hopper)
    monkeypatch.setattr(attn_mod, "gluon_available", lambda: gluon)
    cuda = torch.device("cuda", 0)
    on_gluon = "triton" if hopper and gluon else "sdpa"
    assert [attn_mod.resolve_backend(cuda, d) for d in (64, 72, 80, 96, 128)] == \
        ["triton", on_gluon, on_gluon, "sdpa", "triton"]


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("n,rows,head_dim", [(1, 16, 64), (7, 7 + 9, 72), (131, 160, 80)])
def test_padded_rows_are_neither_read_nor_written(backend, n, rows, head_dim):
    """A CUDA graph bucket's call: one segment of n tokens in a buffer of `rows`, max_seqlen the whole buffer (so
    total == segments * max_seqlen, which unpadded means one full segment). The segment's rows equal the attention
    over them alone; the padding rows, filled with large values, change nothing and are left as they were."""
    q, k, v, _ = make_inputs([rows], 2, head_dim, torch.float32, seed=n)
    for t in (q, k, v):
        t[n:] = 1e4
    cu = torch.tensor([0, n], dtype=torch.int32)
    out = torch.full(q.shape, -7.0)
    attn_mod.varlen_attention(q, k, v, cu, rows, backend=backend, out=out, padded=True)
    ref = reference_varlen_attention(q[:n], k[:n], v[:n], cu)
    assert rel_err(out[:n], ref) <= 1e-5
    assert (out[n:] == -7.0).all()


def test_both_backends_agree_through_public_function():
    q, k, v, cu = make_inputs([3, 50, 17], 2, 80, torch.float32)
    a = attn_mod.varlen_attention(q, k, v, cu, 50, backend="triton")
    b = attn_mod.varlen_attention(q, k, v, cu, 50, backend="sdpa")
    assert rel_err(a, b) <= 1e-5


def test_device_descriptor_launch_sets_triton_allocator_in_its_own_thread(monkeypatch):
    """Triton's allocator lives in a ContextVar, so it is per thread. The served tower launches from the
    engine's worker thread, not the thread that imported the kernels: the device-descriptor launch must
    set the allocator in whichever thread launches (a set-once flag gave 500s under load on the H100)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime import _allocation

    va = launch_mod
    seen = []

    class FakeKernel:  # stands in for the Hopper kernel: records the allocator visible at launch
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(_allocation._allocator.get())

    monkeypatch.setattr(va, "_varlen_attn_fwd_tma", FakeKernel())
    q, k, v, cu = make_inputs([7, 131], 2, 64, torch.float16)
    cfg = TileConfig(64, 64, 4, 2, tma=True, device_desc=True)
    for _ in range(2):  # two fresh threads: each starts with Triton's null allocator
        with ThreadPoolExecutor(1) as pool:
            pool.submit(va.triton_varlen_attention, q, k, v, cu, 131, config=cfg).result()
    assert seen == [va._scratch, va._scratch]


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


@pytest.mark.parametrize("head_dim,tile", [(64, (64, 128, 4, 2)), (72, (128, 64, 4, 3))])
def test_hopper_kernel_compiles_to_a_wgmma_pipeline(head_dim, tile):
    """The Hopper kernel's most-chosen tile per head dim, compiled for sm90 here (ptxas, no GPU) the way the JIT
    specialises the benchmark's calls: no spills, wgmmas not serialised, at least two programs per SM, and a
    steady-state step holding every wgmma of QK^T and PV (64: 4 + 8; 72: 5 + 8 per 64-row half, remainder dots
    included) with one exp2 per score plus the rows' rescale factors."""
    bm, bn, warps, stages = tile
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled, not interpreted
    run = subprocess.run([sys.executable, "-m", "tools.inspect_sass", "--json", "--head-dims", str(head_dim),
                          "--tiles", "/".join(map(str, tile))], capture_output=True, text=True, env=env,
                         cwd=Path(__file__).parents[1], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["spill_bytes"] == 0 and report["wgmma_serialised"] is None, report
    assert report["programs_per_sm"] >= 2, report
    ops = dict(report["loop_ops"])
    halves = bm // 64 // (warps // 4)  # m64 wgmmas per warpgroup
    rem = head_dim > 64
    qk = 64 // 16 + rem  # QK^T: 16 columns per wgmma, the remainder's 8 padded to 16
    pv = bn // 16 * (1 + rem)  # PV: 16 keys per wgmma, for chunk 0 and for the remainder
    assert ops.get("HGMMA") == halves * (qk + pv), report
    scores = bm * bn // (32 * warps)
    assert scores <= ops.get("MUFU", 0) <= scores + 2 * halves, report


def gluon_tile_fields(c: TileConfig) -> tuple[int, ...]:
    return c.block_m, c.block_n, c.num_warps, c.num_stages, c.maxnreg, int(c.rem_copy), c.ws


# every candidate; the variant for packs of equal lengths at the short-segment tiles, where the tuner picks it
GLUON_COMPILES = [(d, t, False) for d, tiles in GLUON_TILES.items() for t in tiles] + \
                 [(d, tiles[-1], True) for d, tiles in GLUON_TILES.items()]


@pytest.mark.parametrize("head_dim,tile,uniform", GLUON_COMPILES,
                         ids=lambda x: "/".join(map(str, gluon_tile_fields(x))) if isinstance(x, TileConfig) else
                         ("uniform" if x else "varlen") if isinstance(x, bool) else f"d{x}")
def test_gluon_kernel_compiles_to_a_wgmma_pipeline(head_dim, tile, uniform):
    """Each Gluon candidate, compiled for sm90 here: no spills (the 128-row tile runs capped at 128 registers), no
    serialised wgmmas, at least two CTAs per SM (the persistent tiles: as many as they launch per SM), and a
    steady-state step of one key tile's PV and the next one's QK^T (4 + block_n / 16 wgmmas per warpgroup, and past
    64 one more for QK^T's remainder and block_n / 16 more for PV's) with one exp2 per score plus the rescale
    factors."""
    from kernels.attention.gluon import gluon_available

    if not gluon_available():
        pytest.skip("this Triton has no Gluon Hopper API")
    from tools.inspect_sass import gluon_fields

    bm, bn, warps, cap, ws = tile.block_m, tile.block_n, tile.num_warps, tile.maxnreg, tile.ws
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tools.inspect_sass", "--json", "--head-dims", str(head_dim),
                          "--gluon", "/".join(map(str, gluon_fields(tile)))] + ["--uniform"] * uniform,
                         capture_output=True, text=True, env=env, cwd=Path(__file__).parents[1], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert report["spill_bytes"] == 0 and report["wgmma_serialised"] is None, report
    # persistent programs (ws per SM) must all fit; the others need two per SM to overlap one's softmax with another's
    # wgmmas
    assert report["programs_per_sm"] == ws if ws else report["programs_per_sm"] >= 2, report
    assert not cap or report["registers"] <= cap, report
    ops = dict(report["loop_ops"])
    rem = head_dim > 64
    assert ops.get("HGMMA") == 64 // 16 + rem + bn // 16 * (1 + rem), report
    scores = bm * bn // (32 * warps)
    assert scores <= ops.get("MUFU", 0) <= scores + 2, report
