"""The FP8 GEMM with fused epilogues (`kernels/fp8_gemm.py`): plain (bias), residual in place, and QKV with RoPE, each
against float64 of the dequantised operands; under Triton's interpreter on the CPU, at every candidate tile on a
Hopper GPU. The e4m3 operands are the same for both sides, so what is compared is the epilogue and the accumulation:
the product of two e4m3 codes is exact in float32, so the kernel's error is float32 accumulation plus one rounding to
the output's dtype."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import Quantized, quantize_rows
from kernels.fp8_gemm import Activation, Rope
from kernels.rope import vision_rope_cos_sin, vision_rope_inv_freq

from conftest import as_hardware_would, gpu, interpreted, rel_err


def operands(m, k, n, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed + m * k + n)
    x = torch.randn(m, k, device=device, generator=g)
    x[:, :3] *= 50  # outlier channels
    w = torch.randn(n, k, device=device, generator=g) / k**0.5
    return Quantized(*quantize_rows(x)), quantize_rows(w), torch.randn(n, device=device, generator=g)


def exact_product(x: Quantized, w) -> torch.Tensor:
    (xq, xs), (wq, ws) = x, w
    return (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()


def rotated(lin: torch.Tensor, cos, sin, heads: int) -> torch.Tensor:
    """Q and K of `lin [M, 3 * heads * D]` rotated (rotate-half), in float64."""
    m = lin.shape[0]
    qkv = lin.view(m, 3, heads, -1).clone()
    half = qkv.shape[-1] // 2
    c, s = cos.double()[:, None, :], sin.double()[:, None, :]
    for i in (0, 1):
        x1, x2 = qkv[:, i, :, :half].clone(), qkv[:, i, :, half:].clone()
        qkv[:, i] = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)
    return qkv


def rounding(exact: torch.Tensor, dtype) -> float:
    """The error of rounding `exact` to `dtype` once: what a single-rounding epilogue cannot avoid."""
    return rel_err(exact.to(dtype), exact)


TILES = [(32, 32, 32, 4, 2, False), (16, 64, 32, 4, 3, False), (32, 32, 32, 4, 2, True)]


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])  # N and K tails, one row
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("bias", [True, False])
def test_plain_interpreted(m, k, n, tile, bias):
    from kernels.fp8_gemm import fp8_gemm

    x, w, b = operands(m, k, n)
    exact = exact_product(x, w) + (b.double() if bias else 0)
    out = fp8_gemm(x, *w, b if bias else None, out_dtype=torch.float32, tile=tile)
    assert out.shape == (m, n) and out.dtype == torch.float32
    assert rel_err(out, exact) <= 1e-6


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])
@pytest.mark.parametrize("tile", TILES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_residual_in_place_interpreted(m, k, n, tile, dtype):
    """`residual += x @ W^T` with one rounding: the residual tensor itself is returned, its error that of rounding
    the exact sum once (the unfused path, which rounds the product first, may not be better)."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm

    x, w, _ = operands(m, k, n)
    g = torch.Generator().manual_seed(m)
    residual = (torch.randn(m, n, generator=g) * 3).to(dtype)
    exact = exact_product(x, w) + residual.double()
    unfused = fp8_gemm(x, *w, residual=residual.clone(), tile=UNFUSED)
    out = fp8_gemm(x, *w, residual=residual, tile=tile)
    assert out.data_ptr() == residual.data_ptr() and out.dtype == dtype
    assert rel_err(out, exact) <= 1.5 * rounding(exact, dtype) + 1e-6
    assert rel_err(out, exact) <= rel_err(unfused, exact) + 1e-6


@pytest.mark.parametrize("m,k,heads,head_dim", [(1, 64, 2, 32), (131, 96, 2, 64), (70, 48, 4, 16)])
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("into", [False, True])
def test_qkv_rope_interpreted(m, k, heads, head_dim, persistent, into):
    """The QKV projection with bias, Q and K rotated in the epilogue, against float64; into a given buffer, the
    same values in it."""
    from kernels.fp8_gemm import fp8_gemm

    n = 3 * heads * head_dim
    x, w, b = operands(m, k, n)
    b = b.half()
    cos, sin = vision_rope_cos_sin(torch.randint(0, 50, (m, 2)), vision_rope_inv_freq(head_dim))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, heads)
    buf = torch.full((m, 3, heads, head_dim), float("nan"), dtype=torch.float16) if into else None
    out = fp8_gemm(x, *w, b, out_dtype=torch.float16, rope=Rope(cos, sin, heads), out=buf,
                   tile=(32, head_dim, 32, 4, 2, persistent))
    assert out.shape == (m, 3, heads, head_dim) and out.dtype == torch.float16
    assert buf is None or out.data_ptr() == buf.data_ptr()
    assert rel_err(out, exact) <= 1.5 * rounding(exact, torch.float16) + 1e-6


def test_unfused_and_fallbacks():
    """Where the kernel may not run (the CPU without `use_triton`, head dim 72 with RoPE) the same call runs
    `scaled_linear` and the passes, within the same error."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm, fp8_gemm_supported

    x, w, b = operands(9, 144, 3 * 144)
    cos, sin = vision_rope_cos_sin(torch.randint(0, 9, (9, 2)), vision_rope_inv_freq(72))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, 2)
    assert fp8_gemm_supported(x, w[0])  # the interpreter could, but head dim 72 has no tile
    for kw in ({}, {"use_triton": True}, {"tile": UNFUSED}):
        out = fp8_gemm(x, *w, b, out_dtype=torch.float32, rope=Rope(cos, sin, 2), **kw)
        assert rel_err(out, exact) <= 1e-6
    with pytest.raises(ValueError, match="block_n"):
        fp8_gemm(x, *w, b, out_dtype=torch.float32, rope=Rope(cos, sin, 2), tile=(32, 64, 32, 4, 2, False))
    with pytest.raises(ValueError, match="not two"):
        fp8_gemm(x, *w, residual=torch.zeros(9, 3 * 144), rope=Rope(cos, sin, 2))


def test_choosing_a_tile_never_adds_into_the_residual(monkeypatch):
    """The first call of a shape class times every candidate (`runtime.choose`); in residual mode each timing run
    adds a product, so they run on scratch: the residual takes the product once, from the chosen candidate."""
    import kernels.fp8_gemm as mod

    monkeypatch.setattr(mod, "interpreting", lambda: False)  # take the tuning path, still interpreted
    monkeypatch.setattr(mod, "fp8_gemm_supported", lambda *a: True)
    timed = []

    def choose(key, candidates, launch):
        listed = candidates()
        for c in (listed[0], mod.UNFUSED):
            launch(c)
            timed.append(c)
        return listed[0]

    monkeypatch.setattr(mod, "choose", choose)
    x, w, _ = operands(7, 128, 128)
    residual = torch.randn(7, 128, generator=torch.Generator().manual_seed(1))
    exact = exact_product(x, w) + residual.double()
    mod.fp8_gemm(x, *w, residual=residual, use_triton=True)
    assert len(timed) == 2 and rel_err(residual, exact) <= 1e-6


def act_operands(m, k, n, dtype, device="cpu"):
    """`operands` with the bias in `dtype`, and the layer's `act_norms` (1 / norms, bound)."""
    from kernels.fp8 import act_norms

    x, w, b = operands(m, k, n, device=device)
    b = b.to(dtype)
    norms, bound = act_norms(w[0].float() * w[1][:, None], b)
    return x, w, b, 1.0 / norms, bound


def assert_act_codes(got: Quantized, plain: torch.Tensor, act: str, inv_norms, x_scale, k, bound,
                     h_err: float = 0.0) -> None:
    """The activation epilogue's rows against float64 from the plain epilogue's output at the same tile (the same
    product, rounded once to the activations' dtype): scales `act_row_scales` (float32 rounding); each code within
    e4m3's rounding of the value (2^-4 of it, or half a subnormal step) and two units of bf16's rounding (the
    unfused path's activation), plus `h_err` of the product (the kernel's activation reads it unrounded, and on a
    GPU through `tanh.approx`); under the interpreter its known conversion defects aside. No value reaches the
    clamp: the bound holds."""
    from kernels.act_quant import apply_activation
    from kernels.fp8 import E4M3, act_row_scales

    scale = act_row_scales(x_scale, k, bound).double()[:, None]
    assert got.codes.dtype == E4M3 and torch.allclose(got.scale.double(), scale[:, 0], rtol=1e-6, atol=0)
    exact = apply_activation(plain.double(), act) * inv_norms.double() / scale
    codes = as_hardware_would(got.codes, exact.to(E4M3)).double() if interpreted() else got.codes.double()
    slack = (2**-4 + 2**-7) * exact.abs() + 2**-10 + h_err * plain.double().abs() * inv_norms.double() / scale
    assert ((codes - exact).abs() <= slack).all(), (codes - exact).abs().max()
    assert exact.abs().max() < 448


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (7, 96, 80), (131, 208, 112)])
@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_activation_epilogue_interpreted(m, k, n, act, dtype):
    """`act=`: the GELU of the biased product over each channel's norm, written as e4m3 codes at each row's bound
    scale, at tiles with one and several column tiles per row, and unfused."""
    from kernels.fp8_gemm import UNFUSED, fp8_gemm

    x, w, b, inv_norms, bound = act_operands(m, k, n, dtype)
    for tile in [(32, 32, 32, 4, 2, False), (16, 64, 32, 4, 3, True), UNFUSED]:
        got = fp8_gemm(x, *w, b, out_dtype=dtype, act=Activation(act, inv_norms, bound), tile=tile)
        assert isinstance(got, Quantized) and got.codes.shape == (m, n)
        plain = fp8_gemm(x, *w, b, out_dtype=dtype, tile=tile)
        # the kernel's activation reads the product before its rounding to dtype (GELU' <= 1.13)
        h_err = 0.0 if tile == UNFUSED else 1.13 * (2**-11 if dtype == torch.float16 else 2**-24)
        assert_act_codes(got, plain, act, inv_norms, x.scale, k, bound, h_err)


hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                            reason="TMA + FP8 wgmma: Hopper only")


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("k,n", [(1024, 1024), (4096, 1024), (4304, 1152), (1024, 4096)])
def test_every_tile_on_the_gpu(m, k, n):
    """Residual (bf16, in place) and plain (bias) epilogues at every tile and the tuned call, against float64: one
    rounding, within 2x of the error of cuBLASLt's scaled_mm (then the add). Triton's FP8 dot on Hopper accumulates
    at the tensor cores' reduced precision, where cuBLASLt promotes to float32 every few steps: at K = 4304 and one
    row, measured 0.26% of the output's norm against cuBLASLt's 0.17% (bf16's rounding alone 0.17%); the e4m3
    rounding of the operands is 3-4%."""
    from kernels.fp8_gemm import FP8_TILES, UNFUSED, fp8_gemm

    x, w, b = operands(m, k, n, device="cuda")
    b = b.bfloat16()
    g = torch.Generator(device="cuda").manual_seed(m)
    residual = torch.randn(m, n, device="cuda", generator=g).bfloat16()
    exact_res = exact_product(x, w) + residual.double()
    exact_plain = exact_product(x, w) + b.double()
    unfused = rel_err(fp8_gemm(x, *w, residual=residual.clone(), tile=UNFUSED), exact_res)
    unfused_plain = rel_err(fp8_gemm(x, *w, b, tile=UNFUSED), exact_plain)
    for tile in [*FP8_TILES, None]:
        got = fp8_gemm(x, *w, residual=residual.clone(), tile=tile)
        assert rel_err(got, exact_res) <= max(2 * unfused, 1.5 * rounding(exact_res, torch.bfloat16)), tile
        plain = fp8_gemm(x, *w, b, tile=tile)
        assert rel_err(plain, exact_plain) <= max(2 * unfused_plain, 1.5 * rounding(exact_plain, torch.bfloat16))


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("hidden,heads", [(1024, 16), (2048, 16)])
def test_qkv_rope_every_tile_on_the_gpu(m, hidden, heads):
    from kernels.fp8_gemm import UNFUSED, _rope_tiles, fp8_gemm

    head_dim = hidden // heads
    x, w, b = operands(m, hidden, 3 * hidden, device="cuda")
    b = b.bfloat16()
    pos = torch.randint(0, 64, (m, 2), device="cuda")
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim, device="cuda"))
    exact = rotated(exact_product(x, w) + b.double(), cos, sin, heads)
    unfused = rel_err(fp8_gemm(x, *w, b, rope=Rope(cos, sin, heads), tile=UNFUSED), exact)
    assert _rope_tiles(hidden, head_dim)
    for tile in [*_rope_tiles(hidden, head_dim), None]:
        out = torch.empty(m, 3, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        got = fp8_gemm(x, *w, b, rope=Rope(cos, sin, heads), out=out, tile=tile)
        assert got.data_ptr() == out.data_ptr()
        assert rel_err(got, exact) <= max(2 * unfused, 1.5 * rounding(exact, torch.bfloat16)), tile


@gpu
@hopper
@pytest.mark.parametrize("m", [1, 131, 25088])
@pytest.mark.parametrize("k,n", [(1024, 4096), (1152, 4304)])
def test_activation_epilogue_every_tile_on_the_gpu(m, k, n):
    """The tanh-GELU epilogue (`tanh.approx`: 2^-11 of tanh, so 2^-12 of the product in the GELU, read before its
    rounding to bf16: 2^-9 of it) at every tile and unfused, against the plain epilogue's bf16 product at the same
    tile (`assert_act_codes`)."""
    from kernels.fp8_gemm import FP8_TILES, UNFUSED, fp8_gemm

    x, w, b, inv_norms, bound = act_operands(m, k, n, torch.bfloat16, device="cuda")
    for tile in [*FP8_TILES, UNFUSED]:
        got = fp8_gemm(x, *w, b, act=Activation("gelu_pytorch_tanh", inv_norms, bound), tile=tile)
        plain = fp8_gemm(x, *w, b, tile=tile)
        assert_act_codes(got, plain, "gelu_pytorch_tanh", inv_norms, x.scale, k, bound,
                         h_err=2**-12 + 1.13 * 2**-9 if tile != UNFUSED else 0.0)
