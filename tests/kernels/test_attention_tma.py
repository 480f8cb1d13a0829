"""The Hopper TMA attention kernel (`kernels/attention/tma.py`) and its remainder copy, under the interpreter and on
the GPU, against the float32 reference (2x PyTorch's own error in the dtype)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.attention import launch as launch_mod, tiles
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention
from kernels.attention.tiles import head_dim_split, TmaTile
from kernels.attention.tma import tma_layout_ok

from conftest import GPU_LENGTHS as LENGTHS, check_attention_configs, gpu, make_inputs, rel_err


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
                            config=TmaTile(32, 32 if "narrow" in tail else 16,
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
                            config=TmaTile(32, 32 if narrow else 16, tail_n=8 if narrow else 0,
                                           q_tail=narrow, sum_mma=sum_mma))
    assert not out.isnan().any()
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    assert rel_err(out, ref) <= 2 * torch_err, (rel_err(out, ref), torch_err)


def test_tma_kernel_needs_16_byte_rows_and_heads_in_q_and_out():
    """The Hopper kernel rounds Q's and O's strides down to multiples of 8 elements so that the compiler sees them
    aligned (at 72 the JIT does not mark the head stride): a q or out whose rows or heads do not start on 16 bytes
    is refused, not misread."""
    q, k, v, cu = make_inputs([7, 33], 2, 72, torch.float16)
    config = TmaTile(32, 16)
    assert tma_layout_ok(q, k, v, torch.empty_like(q))
    skewed = torch.empty(q.shape[0], 2, 76, dtype=q.dtype)[..., :72]  # heads 152 bytes apart
    assert not tma_layout_ok(skewed, k, v) and not tma_layout_ok(q, k, v, skewed)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(skewed.copy_(q), k, v, cu, 33, config=config)
    with pytest.raises(ValueError, match="16-byte aligned rows and heads"):
        triton_varlen_attention(q, k, v, cu, 33, out=skewed, config=config)


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
                         cwd=Path(__file__).parents[2], timeout=300)
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


def test_device_descriptor_launch_sets_triton_allocator_in_its_own_thread(monkeypatch):
    """Triton's allocator lives in a ContextVar, so it is per thread. The served tower launches from the
    engine's worker thread, not the thread that imported the kernels: the device-descriptor launch must
    set the allocator in whichever thread launches (a set-once flag gave 500s under load on the H100)."""
    from concurrent.futures import ThreadPoolExecutor

    from triton.runtime import _allocation

    seen = []

    class FakeKernel:  # stands in for the Hopper kernel: records the allocator visible at launch
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(_allocation._allocator.get())

    monkeypatch.setattr(launch_mod, "_varlen_attn_fwd_tma", FakeKernel())
    q, k, v, cu = make_inputs([7, 131], 2, 64, torch.float16)
    cfg = TmaTile(64, 64, 4, 2, device_desc=True)
    for _ in range(2):  # two fresh threads: each starts with Triton's null allocator
        with ThreadPoolExecutor(1) as pool:
            pool.submit(launch_mod.triton_varlen_attention, q, k, v, cu, 131, config=cfg).result()
    assert seen == [launch_mod._scratch, launch_mod._scratch]


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="TMA kernel: Hopper only")


@gpu
@hopper
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}seg_max{max(l)}")
@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])
def test_tma_kernel_every_candidate(lengths, head_dim):
    """Each configuration the tuner may pick (the Gluon kernel's too, at 64, 72 and 80), and the automatic call,
    against fp32 (bf16)."""
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=head_dim, device="cuda")
    check_attention_configs(q, k, v, cu, [*tiles.hopper_candidates(head_dim, True), None])


@gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("lengths", [[1024], [1, 7, 131, 1023], [64] * 100], ids=lambda l: f"{len(l)}seg_max{max(l)}")
def test_tma_device_descriptors_equal_host_ones(lengths, head_dim, monkeypatch):
    """Descriptors built by each program give bit-identical results to host-encoded ones, at every TMA tile;
    the automatic path builds them on the device for a small eager call no launch plan replays, on the host for one
    a plan replays and under CUDA-graph capture, with equal results."""
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=5, device="cuda")
    m = max(lengths)
    for cfg in tiles.tma_candidates(head_dim):
        host = triton_varlen_attention(q, k, v, cu, m, config=dataclasses.replace(cfg, device_desc=False))
        device = triton_varlen_attention(q, k, v, cu, m, config=dataclasses.replace(cfg, device_desc=True))
        assert torch.equal(host, device), cfg
    monkeypatch.setattr(launch_mod, "_options", launch_mod.LaunchOptions(tma_descriptors="auto"))
    assert launch_mod._device_descriptors(sum(lengths) * m * 16 * head_dim)  # all three shapes are small eager calls
    assert not launch_mod._device_descriptors(sum(lengths) * m * 16 * head_dim, replayable=True)
    eager = triton_varlen_attention(q, k, v, cu, m)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not launch_mod._device_descriptors(sum(lengths) * m * 16 * head_dim)
        triton_varlen_attention(q, k, v, cu, m, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
@hopper
def test_small_call_from_a_worker_thread(monkeypatch):
    """The service launches from worker threads; a small eager call (device descriptors in auto mode) works
    there and equals the same call from the main thread."""
    from concurrent.futures import ThreadPoolExecutor

    q, k, v, cu = make_inputs([7, 131, 1000], 16, 64, torch.bfloat16, seed=2, device="cuda")
    monkeypatch.setattr(launch_mod, "_options", launch_mod.LaunchOptions(tma_descriptors="auto"))  # small eager calls: device descriptors
    main = triton_varlen_attention(q, k, v, cu, 1000)
    for _ in range(2):
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(triton_varlen_attention, q, k, v, cu, 1000).result()
        torch.cuda.synchronize()
        assert torch.equal(main, other)
