"""The Gluon attention kernel (`kernels/attention/gluon.py`): where it applies and what it compiles to (on the CPU),
and its results against the float32 reference (on the GPU)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.attention import tiles
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention
from kernels.attention.tiles import GLUON_TILES, GluonTile

from conftest import GPU_LENGTHS as LENGTHS, check_attention_configs, gpu, make_inputs, rel_err


def test_gluon_kernel_only_where_it_applies():
    """The automatic Hopper path offers the Gluon kernel only at the head dims it was measured at, and only its
    candidates (the TMA kernel that competed with it won none of the served shapes: removed); a pinned Gluon
    configuration outside those head dims or layouts is refused, not misread."""
    from kernels.attention.gluon import gluon_available
    from kernels.attention.tiles import GLUON_HEAD_DIMS, gluon_candidates, hopper_candidates

    if not gluon_available():
        pytest.skip("this Triton has no Gluon Hopper API")
    assert GLUON_HEAD_DIMS == (64, 72, 80)
    for head_dim in GLUON_HEAD_DIMS:
        assert hopper_candidates(head_dim) == gluon_candidates(head_dim)
        assert gluon_candidates(head_dim) and all(isinstance(c, GluonTile) for c in gluon_candidates(head_dim))
    # at 72 both ways of reading the remainder are candidates: copied (large segments) and in place (short ones)
    assert {c.rem_copy for c in gluon_candidates(72)} == {True, False}
    assert {c.rem_copy for c in hopper_candidates(72, 4096)} == {True, False}
    assert {c.rem_copy for c in hopper_candidates(72, 1024)} == {False}
    assert hopper_candidates(64, 256) == hopper_candidates(64)
    assert not hopper_candidates(96) and not hopper_candidates(128)
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


def gluon_tile_fields(c: GluonTile) -> tuple[int, ...]:
    return c.block_m, c.block_n, c.num_warps, c.ring, c.maxnreg, int(c.rem_copy), c.persistent


GLUON_COMPILES = [(d, t, False) for d, tiles in GLUON_TILES.items() for t in tiles] + \
                 [(d, tiles[-1], True) for d, tiles in GLUON_TILES.items()]


@pytest.mark.parametrize("head_dim,tile,uniform", GLUON_COMPILES,
                         ids=lambda x: "/".join(map(str, gluon_tile_fields(x))) if isinstance(x, GluonTile) else
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

    bm, bn, warps, cap, ws = tile.block_m, tile.block_n, tile.num_warps, tile.maxnreg, tile.persistent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "tools.inspect_sass", "--json", "--head-dims", str(head_dim),
                          "--gluon", "/".join(map(str, gluon_fields(tile)))] + ["--uniform"] * uniform,
                         capture_output=True, text=True, env=env, cwd=Path(__file__).parents[2], timeout=300)
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


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="Hopper only")


@gpu
@hopper
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}seg_max{max(l)}")
@pytest.mark.parametrize("head_dim", tiles.GLUON_HEAD_DIMS)
def test_gluon_kernel_fp16(lengths, head_dim):
    """The Gluon kernel's candidates on fp16 inputs against fp32, output poisoned before each call; past 64 also
    with the remainder copied and P's row sums summed in registers."""
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.float16, seed=11, device="cuda")
    configs = tiles.gluon_candidates(head_dim)
    assert configs
    if head_dim > 64:  # the remainder copied, its row sums off (80 has none; 72's candidates have them on)
        configs.append(dataclasses.replace(configs[0], rem_copy=True, sum_mma=False))
    check_attention_configs(q, k, v, cu, configs)


@gpu
@hopper
@pytest.mark.parametrize("n,rows", [(1, 256), (131, 256), (1023, 1024), (784, 800)])
@pytest.mark.parametrize("head_dim", tiles.GLUON_HEAD_DIMS)
def test_gluon_kernel_padded(n, rows, head_dim):
    """A CUDA graph bucket's call to every Gluon candidate: one segment of n tokens in `rows`, max_seqlen `rows`
    (which unpadded means one full segment): the segment's rows match fp32 over them alone, the padding (large
    values) is neither read nor written."""
    q, k, v, _ = make_inputs([rows], 16, head_dim, torch.float16, seed=n, device="cuda")
    for t in (q, k, v):
        t[n:] = 1e4
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    ref = reference_varlen_attention(q[:n], k[:n], v[:n], cu)
    torch_err = rel_err(reference_varlen_attention(q[:n], k[:n], v[:n], cu, upcast=False), ref)
    for cfg in tiles.gluon_candidates(head_dim):
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        out[n:] = -7
        triton_varlen_attention(q, k, v, cu, rows, out=out, config=cfg, padded=True)
        torch.cuda.synchronize()
        assert not out[:n].isnan().any() and (out[n:] == -7).all(), cfg
        assert rel_err(out[:n], ref) <= max(2 * torch_err, 2e-4), (cfg, rel_err(out[:n], ref), torch_err)
