"""The Triton varlen attention kernel at full size on a CUDA GPU (run on the H100; skipped in CI)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_err
from kernels.rope import apply_vision_rope
from kernels.attention import launch as va
from kernels.attention import tiles
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention, sdpa_varlen_attention
from test_varlen_attention import make_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LENGTHS = [[1], [7], [131], [1023], [4096], [1, 7, 131, 1023, 4096], [64] * 100, [3, 256, 784, 1, 1024, 2304, 17]]


@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}seg_max{max(l)}")
@pytest.mark.parametrize("head_dim,dtype", [(64, torch.bfloat16), (72, torch.bfloat16), (80, torch.bfloat16),
                                            (128, torch.bfloat16), (72, torch.float16), (64, torch.float16)])
def test_kernel_vs_fp32_reference(lengths, head_dim, dtype):
    torch.manual_seed(sum(lengths) + head_dim)
    q, k, v, cu = make_inputs(lengths, 16, head_dim, dtype, seed=head_dim, device="cuda")
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    # one pinned tile shape keeps the matrix fast; the tuned path is covered below
    triton_varlen_attention(q, k, v, cu, max(lengths), out=out, block_m=128, block_n=64)
    torch.cuda.synchronize()
    assert not out.isnan().any(), "unwritten output elements"
    ref = reference_varlen_attention(q, k, v, cu)
    low = reference_varlen_attention(q, k, v, cu, upcast=False)
    err, torch_err = rel_err(out, ref), rel_err(low, ref)
    assert err <= 2 * torch_err, (err, torch_err)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="TMA kernel: Hopper only")


@hopper
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}seg_max{max(l)}")
@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])
def test_tma_kernel_every_candidate(lengths, head_dim):
    """Each configuration the tuner may pick (the Gluon kernel's too, at 64, 72 and 80), and the automatic call,
    against fp32 (bf16)."""
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=head_dim, device="cuda")
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    for cfg in [*tiles.hopper_candidates(head_dim, True), None]:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        triton_varlen_attention(q, k, v, cu, max(lengths), out=out, config=cfg)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output elements with {cfg}"
        assert rel_err(out, ref) <= 2 * torch_err, (cfg, rel_err(out, ref), torch_err)


@hopper
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda l: f"{len(l)}seg_max{max(l)}")
@pytest.mark.parametrize("head_dim", tiles.GLUON_HEAD_DIMS)
def test_gluon_kernel_fp16(lengths, head_dim):
    """The Gluon kernel's candidates on fp16 inputs against fp32, output poisoned before each call; past 64 also
    with the remainder copied and P's row sums summed in registers."""
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.float16, seed=11, device="cuda")
    ref = reference_varlen_attention(q, k, v, cu)
    torch_err = rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    configs = tiles.gluon_candidates(head_dim)
    assert configs
    if head_dim > 64:  # the remainder copied, its row sums off (80 has none; 72's candidates have them on)
        configs.append(dataclasses.replace(configs[0], rem_copy=True, sum_mma=False))
    for cfg in configs:
        out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="cuda")
        triton_varlen_attention(q, k, v, cu, max(lengths), out=out, config=cfg)
        torch.cuda.synchronize()
        assert not out.isnan().any(), f"unwritten output elements with {cfg}"
        assert rel_err(out, ref) <= 2 * torch_err, (cfg, rel_err(out, ref), torch_err)


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
    monkeypatch.setattr(va, "_options", va.LaunchOptions(tma_descriptors="auto"))
    assert va._device_descriptors(sum(lengths) * m * 16 * head_dim)  # all three shapes are small eager calls
    assert not va._device_descriptors(sum(lengths) * m * 16 * head_dim, replayable=True)
    eager = triton_varlen_attention(q, k, v, cu, m)
    out = torch.empty_like(q)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        assert not va._device_descriptors(sum(lengths) * m * 16 * head_dim)
        triton_varlen_attention(q, k, v, cu, m, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@hopper
def test_small_call_from_a_worker_thread(monkeypatch):
    """The service launches from worker threads; a small eager call (device descriptors in auto mode) works
    there and equals the same call from the main thread."""
    from concurrent.futures import ThreadPoolExecutor

    q, k, v, cu = make_inputs([7, 131, 1000], 16, 64, torch.bfloat16, seed=2, device="cuda")
    monkeypatch.setattr(va, "_options", va.LaunchOptions(tma_descriptors="auto"))  # small eager calls: device descriptors
    main = triton_varlen_attention(q, k, v, cu, 1000)
    for _ in range(2):
        with ThreadPoolExecutor(1) as pool:
            other = pool.submit(triton_varlen_attention, q, k, v, cu, 1000).result()
        torch.cuda.synchronize()
        assert torch.equal(main, other)


@hopper
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("lengths", [[1024], [1, 7, 131, 1023], [64] * 100], ids=lambda l: f"{len(l)}seg_max{max(l)}")
def test_lean_launch_equals_jit_launch(lengths, head_dim, monkeypatch):
    """The lean launch (compiled kernels by the binder's specialisation) gives bit-identical results to Triton's
    own JIT launch, for the TMA kernel with host and device descriptors, the pointer kernel, (72) the remainder copy
    and the Gluon kernel, and the second call takes the lean path: on the Triton this machine has, which must be
    one of the releases `triton_internals` reads (pyproject's range), the fast path is on."""
    from kernels import runtime
    from kernels.runtime import triton_internals

    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, seed=7, device="cuda")
    m = max(lengths)
    calls = [dict(config=dataclasses.replace(c, device_desc=d)) for c in tiles.tma_candidates(head_dim)[:2]
             for d in (False, True)] + [dict(block_m=64, block_n=64)]
    calls += [dict(config=c) for c in tiles.gluon_candidates(head_dim)]
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


@hopper
@pytest.mark.parametrize("kernel", ["gluon", "tma", "pointer"])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("lengths", [[1024], [1, 7, 131, 1023], [256] * 64], ids=lambda l: f"{len(l)}seg_max{max(l)}")
def test_replayed_launch_equals_full_path(lengths, head_dim, kernel, monkeypatch):
    """The automatic path's launch plan (kernels.runtime.Replay), for each kernel it may pick: once recorded, a call
    with the same layout launches through it, bit-identical to the full path; on a buffer at another address
    (descriptors re-encoded) and back; into a caller's poisoned `out`; with cu_seqlens 4 bytes off 16 (another key,
    its own plan); under CUDA-graph capture; and through the JIT where a launch hook is installed. The TMA kernel at
    72 launches twice per call (the remainder's copy first) and is never replayed."""
    import triton

    from kernels import runtime

    monkeypatch.setattr(runtime.TUNER, "choices", {})
    monkeypatch.setattr(va, "_plans", {})
    if kernel == "gluon":
        monkeypatch.setattr(va, "hopper_candidates", lambda d, gluon, m=None: tiles.gluon_candidates(d)[-1:])
    elif kernel == "tma":
        monkeypatch.setattr(va, "hopper_candidates", lambda d, gluon, m=None: tiles.tma_candidates(d)[:1])
        monkeypatch.setattr(va, "_options", va.LaunchOptions(tma_descriptors="host"))  # device ones need scratch: not replayable
    else:
        monkeypatch.setattr(va, "_tma_default", lambda q: False)
    replayable = not (kernel == "tma" and head_dim == 72)
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
    va._plans.clear()
    full += [call(q, k, v, cu), call(q, k, v, cu, True)]  # recorded, replayed
    moved = call(q2, k2, v2, cu, True)
    back = call(q, k, v, cu, True)
    into = [call(q, k, v, cu, i > 0, out=out.fill_(float("nan"))) for i in range(2)]  # another key
    odd = [call(q, k, v, odd_cu, i > 1) for i in range(3)]  # another key, maybe another specialisation
    torch.cuda.synchronize()
    assert replayed == [int(replayable)] * 5
    assert sum(1 for p in va._plans.values() if p) == (3 if replayable else 0), va._plans
    for other in (*full[1:], back, *into, *odd):
        assert torch.equal(other, full[0])
    ref = reference_varlen_attention(q, k, v, cu)
    assert rel_err(full[0], ref) <= 2 * rel_err(reference_varlen_attention(q, k, v, cu, upcast=False), ref)
    monkeypatch.setattr(va, "_plans", {})
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


@pytest.mark.parametrize("head_dim", [64, 72])
def test_kernel_matches_sdpa_fallback(head_dim):
    lengths = [784] * 5 + [256, 1]
    q, k, v, cu = make_inputs(lengths, 16, head_dim, torch.bfloat16, device="cuda")
    a = triton_varlen_attention(q, k, v, cu, 784)
    b = sdpa_varlen_attention(q, k, v, cu, 784)
    ref = reference_varlen_attention(q, k, v, cu)
    assert rel_err(a, b) <= 2 * max(rel_err(b, ref), rel_err(a, ref))
    assert rel_err(a, ref) <= 1e-2


@pytest.mark.parametrize("block_m,block_n,lengths", [(64, 64, [1, 63, 64, 65]), (128, 128, [127, 129, 1])])
def test_other_tiles(block_m, block_n, lengths):
    q, k, v, cu = make_inputs(lengths, 16, 72, torch.bfloat16, device="cuda")
    out = triton_varlen_attention(q, k, v, cu, max(lengths), block_m=block_m, block_n=block_n)
    ref = reference_varlen_attention(q, k, v, cu)
    low = reference_varlen_attention(q, k, v, cu, upcast=False)
    assert rel_err(out, ref) <= 2 * rel_err(low, ref)


def test_run_to_run_deterministic():
    q, k, v, cu = make_inputs([1023, 4096, 5], 16, 72, torch.bfloat16, device="cuda")
    a = triton_varlen_attention(q, k, v, cu, 4096)
    b = triton_varlen_attention(q, k, v, cu, 4096)
    assert torch.equal(a, b)


@hopper
@pytest.mark.parametrize("tokens", [1, 131, 6272, 25088])
@pytest.mark.parametrize("hidden,heads", [(1024, 16), (2048, 16)])
def test_qkv_rope_linear_every_tile(tokens, hidden, heads):
    """The QKV projection with bias and RoPE in its epilogue (bf16), at every candidate tile and the
    tuned call, against float64; at most 2x the error of cuBLAS's projection followed by the pass."""
    from kernels.qkv_rope import gemm_candidates, qkv_rope_linear, reference_qkv_rope_linear
    from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(tokens + hidden)
    head_dim = hidden // heads
    x = torch.randn(tokens, hidden, device="cuda", generator=g).bfloat16()
    w = (torch.randn(3 * hidden, hidden, device="cuda", generator=g) / hidden**0.5).bfloat16()
    b = torch.randn(3 * hidden, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, 64, (tokens, 2), device="cuda", generator=g)
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim, device="cuda"))
    lin = (x.double() @ w.double().T + b.double()).view(tokens, 3, heads, head_dim)
    exact = lin.clone()
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    for i in (0, 1):
        x1, x2 = lin[:, i, :, :head_dim // 2], lin[:, i, :, head_dim // 2:]
        exact[:, i] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    ref_err = rel_err(reference_qkv_rope_linear(x, w, b, cos, sin, heads), exact)
    assert gemm_candidates(hidden, head_dim)  # the fused kernel runs (no tile would mean the fallback)
    for tile in [*gemm_candidates(hidden, head_dim), None]:
        out = qkv_rope_linear(x, w, b, cos, sin, heads, tile=tile)
        torch.cuda.synchronize()
        assert rel_err(out, exact) <= 2 * ref_err, (tile, rel_err(out, exact), ref_err)


@pytest.mark.parametrize("tokens", [1, 131, 25088])
@pytest.mark.parametrize("heads,head_dim", [(16, 64), (16, 72), (16, 80)])
def test_qkv_rope_pass(tokens, heads, head_dim):
    """The in-place pass (bf16, the towers' widths) against PyTorch's rotation: equal up to the last
    bit of a few elements (fused multiply-adds); V untouched."""
    from kernels.qkv_rope import qkv_rope_
    from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq

    g = torch.Generator(device="cuda").manual_seed(tokens + head_dim)
    qkv = torch.randn(tokens, 3, heads, head_dim, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, 64, (tokens, 2), device="cuda", generator=g)
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim, device="cuda"))
    out = qkv_rope_(qkv.clone(), cos, sin, use_triton=True)
    for i in (0, 1):
        ref = apply_vision_rope(qkv[:, i], cos, sin)
        assert rel_err(out[:, i], ref) <= 1e-3
        assert (out[:, i] != ref).float().mean() <= 0.01
    assert torch.equal(out[:, 2], qkv[:, 2])
