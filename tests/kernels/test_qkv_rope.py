"""The QKV projection with 2D RoPE in its epilogue and the in-place RoPE pass (`kernels/qkv_rope.py`), under the
interpreter and on the GPU, against PyTorch and float64."""

from __future__ import annotations

import pytest
import torch

from kernels.qkv_rope import qkv_rope_
from kernels.rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq

from conftest import gpu, rel_err


@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 2, 64), (131, 3, 72), (70, 2, 80), (65, 1, 16),
                                                   (9, 16, 72), (5, 12, 80)])  # the last two: full-width rows (8B: 16 heads of 72)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qkv_rope_in_place(tokens, heads, head_dim, dtype):
    g = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=g).to(dtype)
    pos = torch.randint(0, 50, (tokens, 2), generator=g)
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim))
    out = qkv.clone()
    assert qkv_rope_(out, cos, sin, use_triton=True) is out
    assert torch.equal(out[:, 0], apply_vision_rope(qkv[:, 0], cos, sin))
    assert torch.equal(out[:, 1], apply_vision_rope(qkv[:, 1], cos, sin))
    assert torch.equal(out[:, 2], qkv[:, 2])  # V untouched
    ref = qkv.clone()
    qkv_rope_(ref, cos, sin, use_triton=False)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("pad", [2, 8])
def test_qkv_rope_in_place_strided(pad):
    """A (T, 3, H, D) view inside a wider buffer: head strides of D + 2 force one pair per chunk, of D + 8
    keep chunks of 4 (head dim 72); padding and V untouched."""
    tokens, heads, head_dim = 37, 4, 72
    g = torch.Generator().manual_seed(pad)
    buf = torch.randn(tokens, 3, heads, head_dim + pad, generator=g).half()
    qkv = buf[..., :head_dim]
    pos = torch.randint(0, 50, (tokens, 2), generator=g)
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim))
    before = buf.clone()
    sin = sin.t().contiguous().t()  # a column-major table: other strides than cos's
    qkv_rope_(qkv, cos, sin, use_triton=True, pairs_per_program=100)  # rounded up to whole chunks of 2^k
    for i in (0, 1):
        assert torch.equal(qkv[:, i], apply_vision_rope(before[:, i, :, :head_dim], cos, sin))
    assert torch.equal(buf[:, 2], before[:, 2]) and torch.equal(buf[..., head_dim:], before[..., head_dim:])


def test_qkv_rope_validates():
    qkv = torch.randn(5, 3, 2, 16)
    cos, sin = vision_rope_cos_sin(torch.zeros(5, 2), vision_rope_inv_freq(16))
    with pytest.raises(ValueError, match="cos/sin"):
        qkv_rope_(qkv, cos[:, :4], sin)
    with pytest.raises(ValueError, match="qkv must be"):
        qkv_rope_(qkv[:, :2], cos, sin)


@pytest.mark.parametrize("tokens,k_dim,heads,head_dim,tile", [
    (131, 96, 2, 64, (32, 64, 32, 4, 2, False)),  # row tail, a K tail (TMA zero fill), one head per tile
    (1, 64, 2, 32, (16, 64, 16, 4, 2, False)),    # one token, two heads per tile
    (70, 48, 4, 16, (64, 32, 16, 4, 3, False)),   # head_dim 16, K = 3 tiles
    (131, 96, 2, 64, (32, 64, 32, 4, 2, True)),   # persistent: 4 programs loop over 30 tiles
    (70, 48, 4, 16, (16, 32, 16, 4, 3, True)),
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_qkv_rope_linear_interpreted(tokens, k_dim, heads, head_dim, tile, dtype, monkeypatch):
    """The QKV projection with bias and RoPE in its epilogue, against the projection then the rotation,
    both against a float64 computation of the same function."""
    from kernels.qkv_rope import fused_qkv_rope_supported, qkv_rope_linear, reference_qkv_rope_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(tokens * k_dim)
    hidden = heads * head_dim
    x = torch.randn(tokens, k_dim, generator=g).to(dtype)
    w = (torch.randn(3 * hidden, k_dim, generator=g) / k_dim**0.5).to(dtype)
    b = torch.randn(3 * hidden, generator=g).to(dtype)
    pos = torch.randint(0, 50, (tokens, 2), generator=g)
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim))
    assert fused_qkv_rope_supported(x, w, heads)
    out = qkv_rope_linear(x, w, b, cos, sin, heads, tile=tile)
    assert out.shape == (tokens, 3, heads, head_dim) and out.dtype == dtype
    lin = (x.double() @ w.double().T + b.double()).view(tokens, 3, heads, head_dim)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    exact = lin.clone()
    for i in (0, 1):
        x1, x2 = lin[:, i, :, :head_dim // 2], lin[:, i, :, head_dim // 2:]
        exact[:, i] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    ref = reference_qkv_rope_linear(x, w, b, cos, sin, heads)
    err = (out.double() - exact).norm() / exact.norm()
    torch_err = (ref.double() - exact).norm() / exact.norm()
    assert err <= 2 * torch_err + 1e-7, (err, torch_err)
    assert not out.isnan().any()


def test_qkv_rope_linear_falls_back():
    """Where the fused kernel cannot run (CPU without the interpreter, head_dim 72) the same call runs
    the projection and the pass."""
    from kernels.qkv_rope import fused_qkv_rope_supported, qkv_rope_linear, reference_qkv_rope_linear

    x, w, b = torch.randn(9, 144), torch.randn(3 * 144, 144), torch.randn(3 * 144)
    cos, sin = vision_rope_cos_sin(torch.randint(0, 9, (9, 2)), vision_rope_inv_freq(72))
    assert not fused_qkv_rope_supported(x, w, 2)
    assert torch.equal(qkv_rope_linear(x, w, b, cos, sin, 2), reference_qkv_rope_linear(x, w, b, cos, sin, 2))


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tokens,heads,head_dim", [(1, 1, 64), (7, 2, 72), (131, 3, 80)])
def test_linear_then_rope_into_a_buffer(tokens, heads, head_dim, bias):
    """The unfused projection and rotation (the tower's path where the fused kernel does not run): into a
    given buffer, it equals the allocating call bit for bit, and both are within float32 rounding of a float64
    computation."""
    from kernels.qkv_rope import linear_then_rope

    g = torch.Generator().manual_seed(tokens * head_dim)
    hidden = heads * head_dim
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(3 * hidden, hidden, generator=g) / hidden**0.5
    b = torch.randn(3 * hidden, generator=g) if bias else None
    cos, sin = vision_rope_cos_sin(torch.randint(0, 40, (tokens, 2), generator=g), vision_rope_inv_freq(head_dim))
    got = linear_then_rope(x, w, b, cos, sin, heads, use_triton=False)
    buf = torch.full((tokens, 3, heads, head_dim), float("nan"))
    into = linear_then_rope(x, w, b, cos, sin, heads, out=buf, use_triton=False)
    assert into.data_ptr() == buf.data_ptr() and torch.equal(into, got)
    lin = x.double() @ w.double().T + (b.double() if bias else 0)
    lin = lin.view(tokens, 3, heads, head_dim)
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    half = head_dim // 2
    exact = lin.clone()
    for i in (0, 1):
        x1, x2 = lin[:, i, :, :half], lin[:, i, :, half:]
        exact[:, i] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    torch.testing.assert_close(got.double(), exact, rtol=1e-4, atol=1e-4)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="TMA kernel: Hopper only")


@gpu
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


@gpu
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
