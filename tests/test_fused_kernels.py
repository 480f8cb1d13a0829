"""The tower's smaller fused kernels (in-place QKV RoPE, residual add + LayerNorm, position embeddings, patchify), run
by Triton's interpreter on CPU against their PyTorch references; the GPU tower tests cover them at full size."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.add_layernorm import add_layernorm, layernorm_offset, reference_add_layernorm, reference_layernorm_offset
from kernels.patchify import patchify, patchify_dims, reference_patchify
from kernels.pos_embed import pos_embed_add_, reference_pos_embed
from kernels.qkv_rope import qkv_rope_
from kernels.rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq


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


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 1024), (131, 1152), (9, 72)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_add_layernorm(rows, cols, dtype):
    g = torch.Generator().manual_seed(rows * cols)
    x, y = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
    w, b = 1 + 0.1 * torch.randn(cols, generator=g), 0.1 * torch.randn(cols, generator=g)
    s, out = add_layernorm(x, y, w.to(dtype), b.to(dtype), 1e-6, use_triton=True)
    rs, rout = reference_add_layernorm(x, y, w.to(dtype), b.to(dtype), 1e-6)
    assert torch.equal(s, rs)
    exact = F.layer_norm(rs.double(), (cols,), w.double(), b.double(), 1e-6)
    err = (out.double() - exact).norm() / exact.norm()
    torch_err = (rout.double() - exact).norm() / exact.norm()
    assert err <= 2 * torch_err + 1e-7, (err, torch_err)


@pytest.mark.parametrize("rows,cols,group", [(4, 64, 4), (28, 1024, 4), (132, 1152, 4), (12, 72, 4), (6, 80, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_add_layernorm_merged_norm(rows, cols, group, dtype):
    """The DeepStack merger's post-shuffle LayerNorm (over `group` consecutive rows) from the same pass,
    against float64; the sum and the per-row norm as without it."""
    g = torch.Generator().manual_seed(rows * cols + group)
    x, y = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
    x[::3] += 2.0  # rows of one merged token with different means: the group's statistics must be shared
    w, b = 1 + 0.1 * torch.randn(cols, generator=g), 0.1 * torch.randn(cols, generator=g)
    w2, b2 = 1 + 0.1 * torch.randn(group * cols, generator=g), 0.1 * torch.randn(group * cols, generator=g)
    merged = (w2.to(dtype), b2.to(dtype), 1e-5)
    s, out, out2 = add_layernorm(x, y, w.to(dtype), b.to(dtype), 1e-6, use_triton=True, merged_norm=merged)
    rs, rout, rout2 = reference_add_layernorm(x, y, w.to(dtype), b.to(dtype), 1e-6, merged)
    assert torch.equal(s, rs) and torch.equal(out, add_layernorm(x, y, w.to(dtype), b.to(dtype), 1e-6,
                                                                 use_triton=True)[1])
    assert out2.shape == (rows // group, group * cols)
    exact = F.layer_norm(rs.double().view(-1, group * cols), (group * cols,), w2.double(), b2.double(), 1e-5)
    err = (out2.double() - exact).norm() / exact.norm()
    torch_err = (rout2.double() - exact).norm() / exact.norm()
    assert err <= 2 * torch_err + 1e-7, (err, torch_err)


def test_add_layernorm_merged_norm_validates():
    x = torch.randn(6, 64)
    with pytest.raises(ValueError, match="merged norm"):
        add_layernorm(x, x, torch.ones(64), torch.zeros(64), 1e-6, merged_norm=(torch.ones(256), torch.zeros(256), 1e-6))


@pytest.mark.parametrize("rows,cols,group", [(1, 64, 0), (7, 1024, 0), (131, 1152, 0), (9, 72, 0), (28, 1024, 4),
                                            (12, 72, 4), (6, 80, 2)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_layernorm_offset(rows, cols, group, dtype):
    """LayerNorm of s + a float32 per-column offset (the biases the residual GEMMs left out), and the
    merged norm of the same rows, against float64 of the same sum: at most 2x the error of PyTorch's
    LayerNorm on the rounded sum."""
    g = torch.Generator().manual_seed(rows * cols + group + 1)
    s = torch.randn(rows, cols, generator=g).to(dtype)
    s[::3] += 2.0  # rows with different means
    offset = 3 * torch.randn(cols, generator=g)  # large against s, as a running sum of biases may be
    w, b = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype), (0.1 * torch.randn(cols, generator=g)).to(dtype)
    merged = None
    if group:
        w2 = (1 + 0.1 * torch.randn(group * cols, generator=g)).to(dtype)
        merged = (w2, (0.1 * torch.randn(group * cols, generator=g)).to(dtype), 1e-5)
    outs = layernorm_offset(s, offset, w, b, 1e-6, use_triton=True, merged_norm=merged)
    refs = reference_layernorm_offset(s, offset, w, b, 1e-6, merged)
    exact_sum = s.double() + offset.double()
    torch_sum = (s + offset.to(dtype)).double()  # what an unfused PyTorch path in `dtype` would normalise
    assert len(outs) == len(refs) == (2 if group else 1)
    for out, ref, (width, wt, bs, eps) in zip(outs, refs, [(cols, w, b, 1e-6)] + ([(group * cols, *merged)] if group else [])):
        exact = F.layer_norm(exact_sum.view(-1, width), (width,), wt.double(), bs.double(), eps)
        torch_out = F.layer_norm(torch_sum.view(-1, width).to(dtype), (width,), wt, bs, eps)
        assert out.shape == exact.shape and out.dtype == dtype
        err = (out.double() - exact).norm() / exact.norm()
        torch_err = (torch_out.double() - exact).norm() / exact.norm()
        assert err <= 2 * torch_err + 1e-7, (err, torch_err)
        assert (ref.double() - exact).norm() / exact.norm() <= 2 * torch_err + 1e-7


def _rms64(s, w, eps):
    s = s.double()
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 1280), (131, 80), (33, 1152)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rmsnorm_add_and_offset(rows, cols, dtype):
    """RMSNorm (bias None: Qwen2.5-VL's norms) after a residual add and after a float32 offset, Triton against
    float64: at most 2x the error of transformers' Qwen2.5-VL RMSNorm arithmetic on the same input."""
    g = torch.Generator().manual_seed(rows * cols + 7)
    x, y = (torch.randn(rows, cols, generator=g).to(dtype) for _ in range(2))
    x[::3] += 2.0
    offset = 3 * torch.randn(cols, generator=g)
    w = (1 + 0.1 * torch.randn(cols, generator=g)).to(dtype)

    def hf_rms(v):  # Qwen2_5_VLRMSNorm: float32 statistics, rounded to the input's dtype, then times the weight
        vf = v.float()
        return w * (vf * torch.rsqrt(vf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(v.dtype)

    s, out = add_layernorm(x, y, w, None, 1e-6, use_triton=True)
    rs, rout = reference_add_layernorm(x, y, w, None, 1e-6)
    assert torch.equal(s, rs) and torch.equal(s, x + y)
    (off,) = layernorm_offset(x, offset, w, None, 1e-6, use_triton=True)
    (roff,) = reference_layernorm_offset(x, offset, w, None, 1e-6)
    for got, ref, exact, hf in ((out, rout, _rms64(s, w, 1e-6), hf_rms(s)),
                                (off, roff, _rms64(x.double() + offset.double(), w, 1e-6), hf_rms(x + offset.to(dtype)))):
        assert got.dtype == dtype and got.shape == exact.shape
        hf_err = (hf.double() - exact).norm() / exact.norm()
        for o in (got, ref):
            assert (o.double() - exact).norm() / exact.norm() <= 2 * hf_err + 1e-7


@pytest.mark.parametrize("rows,cols", [(1, 64), (131, 1152), (9, 72)])
def test_layernorm_without_offset(rows, cols):
    """The same pass as a plain LayerNorm (the tower's first norm1), against float64."""
    g = torch.Generator().manual_seed(rows + cols)
    s = torch.randn(rows, cols, generator=g).half()
    w, b = (1 + 0.1 * torch.randn(cols, generator=g)).half(), (0.1 * torch.randn(cols, generator=g)).half()
    (out,) = layernorm_offset(s, None, w, b, 1e-6, use_triton=True)
    exact = F.layer_norm(s.double(), (cols,), w.double(), b.double(), 1e-6)
    torch_err = (F.layer_norm(s, (cols,), w, b, 1e-6).double() - exact).norm() / exact.norm()
    assert (out.double() - exact).norm() / exact.norm() <= 2 * torch_err + 1e-7


def test_layernorm_offset_validates():
    s = torch.randn(6, 64)
    with pytest.raises(ValueError, match="offset float32"):
        layernorm_offset(s, torch.zeros(64, dtype=torch.float16), torch.ones(64), torch.zeros(64), 1e-6)
    with pytest.raises(ValueError, match="offset float32"):
        layernorm_offset(s, torch.zeros(32), torch.ones(64), torch.zeros(64), 1e-6)


@pytest.mark.parametrize("tokens,hidden,side", [(1, 64, 4), (131, 96, 7), (300, 1152, 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_pos_embed_add(tokens, hidden, side, dtype):
    """Interpolated position embeddings added in place, against a float64 blend of the same taps."""
    g = torch.Generator().manual_seed(tokens + hidden)
    table = torch.randn(side * side, hidden, generator=g).to(dtype)
    index = torch.randint(0, side * side, (tokens, 4), generator=g)
    weight = torch.rand(tokens, 4, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    out = x.clone()
    assert pos_embed_add_(out, table, index, weight, use_triton=True) is out
    exact = x.double() + (table[index].double() * weight[:, :, None].double()).sum(1)
    ref = x + reference_pos_embed(table, index, weight).to(dtype)  # the unfused PyTorch path
    err = (out.double() - exact).norm() / exact.norm()
    torch_err = (ref.double() - exact).norm() / exact.norm()
    assert err <= 1.01 * torch_err + 1e-7, (err, torch_err)
    fallback = x.clone()
    pos_embed_add_(fallback, table, index, weight, use_triton=False)
    assert torch.equal(fallback, ref)


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


@pytest.mark.parametrize("batch,frames,height,width,channels,patch", [
    (1, 1, 32, 32, 3, 16),  # one merge block
    (1, 1, 64, 160, 3, 16),  # not square
    (3, 1, 96, 32, 3, 16),  # a run of same-sized images
    (1, 3, 56, 84, 3, 14),  # a video with an odd frame count: the last frame fills its temporal patch
    (2, 4, 28, 56, 3, 14),
    (1, 5, 32, 64, 1, 16),  # one channel
])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_patchify_kernel(batch, frames, height, width, channels, patch, dtype):
    """uint8 frames -> normalised rows in merge-block order: the kernel's rows equal the PyTorch lookup and
    permutation's exactly (both copy table entries), every row and column written."""
    g = torch.Generator().manual_seed(height * width + frames)
    pixels = torch.randint(0, 256, (batch, frames, height, width, channels), generator=g, dtype=torch.uint8)
    table = torch.randn(256, channels, generator=g).to(dtype)
    rows = batch * -(-frames // 2) * (height // patch) * (width // patch)
    expected = reference_patchify(pixels, table, torch.empty(rows, channels * 2 * patch * patch, dtype=dtype), 2,
                                  patch, 2)
    got = patchify(pixels, table, torch.full_like(expected, float("nan")), 2, patch, 2, use_triton=True)
    assert torch.equal(got, expected)
    # the reference itself, on one item: the value of pixel (y, x, c) of frame f sits in its patch's row
    item = pixels[-1]
    t, y, x, c = frames - 1, height - 1, patch + 3, channels - 1
    block_w = width // patch // 2
    gy, gx = y // patch, x // patch
    row = (((t // 2) * (height // patch // 2) + gy // 2) * block_w + gx // 2) * 4 + (gy % 2) * 2 + gx % 2
    col = ((c * 2 + t % 2) * patch + y % patch) * patch + x % patch
    per_item = rows // batch
    assert expected[(batch - 1) * per_item + row, col] == table[item[t, y, x, c].long(), c]


@pytest.mark.parametrize("use_triton", [True, False])
def test_patchify_dims_reads_each_items_shape_from_the_device(use_triton):
    """One launch configuration (the CUDA graph of a lone frame's way in) for items of any shape: frame count, height
    and width read from `dims`, written into the first rows of one large buffer, equal to `patchify` of the item;
    rows past the item's keep what they held (NaN here), including after a larger item wrote them."""
    g = torch.Generator().manual_seed(7)
    patch, channels, max_rows = 14, 3, 96
    cols = channels * 2 * patch * patch
    table = torch.randn(256, channels, generator=g)
    out = torch.full((max_rows, cols), float("nan"))
    buffer = torch.zeros(max_rows * cols, dtype=torch.uint8)
    for n_frames, height, width in [(1, 56, 84), (1, 28, 28), (2, 112, 56), (1, 84, 56), (1, 28, 392), (2, 56, 56)]:
        frames = torch.randint(0, 256, (1, n_frames, height, width, channels), generator=g, dtype=torch.uint8)
        buffer[:frames.numel()] = frames.view(-1)
        rows = (height // patch) * (width // patch)
        stale = out[rows:].clone()
        got = patchify_dims(buffer, torch.tensor([n_frames, height, width], dtype=torch.int32), table, out, 2, patch,
                            2, use_triton=use_triton)
        assert got is out or got.data_ptr() == out.data_ptr()
        expected = patchify(frames, table, torch.empty(rows, cols), 2, patch, 2)
        assert torch.equal(out[:rows], expected), (n_frames, height, width)
        assert torch.equal(out[rows:].isnan(), stale.isnan()) and torch.equal(out[rows:].nan_to_num(),
                                                                              stale.nan_to_num())
    with pytest.raises(ValueError, match="do not fit"):
        patchify_dims(buffer, torch.tensor([1, 28, 28]), table, out, 2, patch, 2)


def test_patchify_refuses_what_does_not_fit():
    frames = torch.zeros(1, 1, 32, 48, 3, dtype=torch.uint8)  # 48 is not a multiple of patch * merge
    with pytest.raises(ValueError, match="do not fit"):
        patchify(frames, torch.zeros(256, 3), torch.empty(6, 1536), 2, 16, 2)
