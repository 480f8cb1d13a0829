"""Attention's entry points (`kernels/attention/__init__.py`, `launch.py`, `tiles.py`): input checks, the backend
dispatcher, tile choice, launch plans (recorded, then replayed: on the GPU, bit for bit), padded rows, the lean
launch against the JIT's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import attention as attn_mod
from kernels.attention import launch as launch_mod, tiles
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention, sdpa_varlen_attention
from kernels.attention.tiles import head_dim_split

from conftest import gpu, make_inputs, rel_err


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


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="Hopper only")


@gpu
@hopper
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("lengths", [[1024], [1, 7, 131, 1023], [64] * 100], ids=lambda l: f"{len(l)}seg_max{max(l)}")
def test_lean_launch_equals_jit_launch(lengths, head_dim, monkeypatch):
    """The lean launch (compiled kernels by the binder's specialisation) gives bit-identical results to Triton's
    own JIT launch, for the pointer kernel, (72) the remainder copy and the Gluon kernel, and the second call takes the lean path: on the Triton this machine has, which must be
    one of the releases `triton_internals` reads (pyproject's range), the fast path is on."""
    from kernels import runtime
    from kernels.runtime import triton_internals

    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=7, device="cuda")
    m = max(lengths)
    calls = [dict(block_m=64, block_n=64)] + [dict(config=c) for c in tiles.gluon_candidates(head_dim)]
    lean, jit = [], []
    for kwargs in calls:
        for _ in range(2):  # the first call with a specialisation compiles through the JIT, the second is lean
            lean.append(triton_varlen_attention(q, k, v, cu, m, **kwargs))
    assert triton_internals.supported(), triton_internals.version()
    assert runtime.launch_status()["lean"] is True and runtime.LAUNCHER.kernels, runtime.launch_status()
    monkeypatch.setattr(runtime.LAUNCHER, "lean", False)
    for kwargs in calls:
        jit.append(triton_varlen_attention(q, k, v, cu, m, **kwargs))
    torch.cuda.synchronize()
    for i, out in enumerate(jit):
        assert torch.equal(lean[2 * i], out) and torch.equal(lean[2 * i + 1], out), calls[i].keys()


@gpu
@hopper
@pytest.mark.parametrize("kernel", ["gluon", "gluon-copy", "pointer"])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("lengths", [[1024], [1, 7, 131, 1023], [256] * 64], ids=lambda l: f"{len(l)}seg_max{max(l)}")
def test_replayed_launch_equals_full_path(lengths, head_dim, kernel, monkeypatch):
    """The automatic path's launch plan (kernels.runtime.Replay), for each kernel it may pick: once recorded, a call
    with the same layout launches through it, bit-identical to the full path; on a buffer at another address
    (descriptors re-encoded) and back; into a caller's poisoned `out`; with cu_seqlens 4 bytes off 16 (another key,
    its own plan); under CUDA-graph capture; and through the JIT where a launch hook is installed. The Gluon kernel
    reading the remainder's copy at 72 launches twice per call (the copy first) and is never replayed."""
    import triton

    from kernels import runtime

    monkeypatch.setattr(runtime.TUNER, "choices", {})
    monkeypatch.setattr(launch_mod, "_plans", {})
    if kernel == "gluon":  # in place
        monkeypatch.setattr(launch_mod, "hopper_candidates", lambda d, m=None: [
            dataclasses.replace(tiles.gluon_candidates(d)[-1], rem_copy=False)])
    elif kernel == "gluon-copy":  # the remainder copied where the head dim has one
        monkeypatch.setattr(launch_mod, "hopper_candidates", lambda d, m=None: [
            dataclasses.replace(tiles.gluon_candidates(d)[-1], rem_copy=True)])
    else:
        monkeypatch.setattr(launch_mod, "_hopper_default", lambda q: False)
    replayable = not (kernel == "gluon-copy" and head_dim == 72)
    replays = []
    replay_call = runtime.Replay.__call__
    monkeypatch.setattr(runtime.Replay, "__call__", lambda self, a: replays.append(1) or replay_call(self, a))

    m = max(lengths)
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=3, device="cuda")
    q2, k2, v2, _ = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=4, device="cuda")
    padded = torch.zeros(len(cu) + 4, dtype=torch.int32, device="cuda")
    padded[1:len(cu) + 1] = cu
    odd_cu = padded[1:len(cu) + 1]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
    replayed = []  # per call that must have been a replay: whether it was

    def call(q, k, v, cu, must_replay=False, **kwargs):
        before = len(replays)
        result = triton_varlen_attention(q, k, v, cu, m, **kwargs).clone()
        if must_replay:
            replayed.append(len(replays) - before)
        return result

    full = [call(q, k, v, cu)]  # tuned (through replays), compiled; maybe recorded
    launch_mod._plans.clear()
    full += [call(q, k, v, cu), call(q, k, v, cu, True)]  # recorded, replayed
    moved = call(q2, k2, v2, cu, True)
    back = call(q, k, v, cu, True)
    into = [call(q, k, v, cu, i > 0, out=out.fill_(float("nan"))) for i in range(2)]  # another key
    odd = [call(q, k, v, odd_cu, i > 1) for i in range(3)]  # another key, maybe another specialisation
    torch.cuda.synchronize()
    assert replayed == [int(replayable)] * 5
    assert sum(1 for p in launch_mod._plans.values() if p) == (3 if replayable else 0), launch_mod._plans
    for other in (*full[1:], back, *into, *odd):
        assert torch.equal(other, full[0])
    ref = reference_varlen_attention(q, k, v, cu)
    assert rel_err(full[0], ref) <= 2 * rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    monkeypatch.setattr(launch_mod, "_plans", {})
    assert torch.equal(moved, triton_varlen_attention(q2, k2, v2, cu, m))  # the full path at q2's address

    graph_out = torch.empty_like(q)
    for _ in range(2):
        triton_varlen_attention(q, k, v, cu, m, out=graph_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        triton_varlen_attention(q, k, v, cu, m, out=graph_out)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, full[0])

    hooked = []
    monkeypatch.setattr(triton.knobs.runtime.launch_enter_hook, "calls", [hooked.append])
    before = len(replays)
    assert torch.equal(triton_varlen_attention(q, k, v, cu, m), full[0]) and hooked
    assert len(replays) == before + replayable  # asked, and declined: the JIT ran it with the hook


@gpu
@pytest.mark.parametrize("head_dim", [64, 72])
def test_kernel_matches_sdpa_fallback(head_dim):
    lengths = [784] * 5 + [256, 1]
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, device="cuda")
    a = triton_varlen_attention(q, k, v, cu, 784)
    b = sdpa_varlen_attention(q, k, v, cu, 784)
    ref = reference_varlen_attention(q, k, v, cu)
    assert rel_err(a, b) <= 2 * max(rel_err(b, ref), rel_err(a, ref))
    assert rel_err(a, ref) <= 1e-2


def test_each_hopper_tile_type_launches_its_own_kernel_with_its_own_fields(monkeypatch):
    """`_run_hopper` on the CPU, the launches captured: a `GluonTile` reaches `launch_gluon` with its ring, register
    cap, persistence and remainder choice; a `PtrTile` is the pointer kernel's. (The GPU tests run the kernels; this
    guards the dispatch where no GPU is.)"""
    from kernels.attention.launch import _Call, _run_hopper, _run_pointer
    from kernels.attention.tiles import GluonTile, PtrTile

    calls = []
    monkeypatch.setattr(launch_mod, "launch_gluon", lambda *a, **kw: calls.append(("gluon", a, kw)))
    monkeypatch.setattr(launch_mod, "launch", lambda fn, grid, *a, **kw: calls.append((fn.__name__, grid, kw)))
    qkv = torch.randn(40, 3, 2, 64, dtype=torch.float16)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0, 7, 40], dtype=torch.int32)
    call = _Call(q, k, v, torch.empty_like(q), cu, 33, 0.18, (128, 256), padded=True)

    _run_hopper(call, GluonTile(128, 64, 8, ring=3, persistent=2, maxnreg=160, rem_copy=False, sum_mma=False))
    kind, args, kw = calls.pop()
    assert kind == "gluon" and args[6:11] == (128, 64, 8, 3, 160) and args[11] is None  # no remainder at 64
    assert args[13] is False  # sum_mma
    assert kw == {"ws": 2, "padded": True}

    _run_pointer(call, PtrTile(32, 16, 4, 3))
    kind, grid, kw = calls.pop()
    assert kind == "_varlen_attn_fwd" and (kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]) == (32, 16, 3)
    assert not calls
