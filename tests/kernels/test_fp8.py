"""FP8 (e4m3) quantisation and the scaled GEMM (`kernels/fp8.py`) against float64, on the CPU (the GEMM computed as
the GPU's epilogue does, in float32); on a GPU with FP8 tensor cores, cuBLASLt's against the same reference."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import (E4M3, E4M3_MAX, fp8_linear, fp8_tensor_cores, quantize_rows, reference_scaled_linear,
                         scaled_linear)

from conftest import gpu, rel_err

# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself
E4M3_STEP = 2.0**-4


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 72), (131, 1024), (3, 4304)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_rows_round_trip(rows, cols, dtype):
    """Each row's scale is its absmax / 448, so the row's largest value lands on e4m3's largest; every element comes
    back within half an e4m3 step of itself, or within the subnormal step for the tiniest."""
    g = torch.Generator().manual_seed(rows * cols)
    x = (torch.randn(rows, cols, generator=g) * torch.logspace(-2, 2, rows)[:, None]).to(dtype)
    q, scale = quantize_rows(x)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (rows,)
    xd = x.double()
    torch.testing.assert_close(scale.double(), xd.abs().amax(-1) / E4M3_MAX, rtol=1e-6, atol=0)
    back = q.double() * scale.double()[:, None]
    bound = E4M3_STEP * xd.abs() + 2.0**-9 * scale.double()[:, None]  # relative, or the subnormal step
    assert ((back - xd).abs() <= bound).all()
    assert (q.float().abs().amax(-1) == E4M3_MAX).all()


def test_a_zero_row_quantises_to_zeros():
    q, scale = quantize_rows(torch.zeros(3, 64))
    assert torch.equal(q.float(), torch.zeros(3, 64)) and (scale > 0).all()


def test_per_token_scales_keep_the_tokens_that_massive_activations_would_flush():
    """Two tokens with channels 3 x 10^5 times the others' (massive activations) set a per-tensor scale under which the
    other tokens' values fall into e4m3's subnormals; per-token scales leave every token its full precision."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1024, generator=g)
    x[[5, 40], :4] = 3e5
    q, scale = quantize_rows(x)
    per_token = q.float() * scale[:, None]
    tensor_scale = x.abs().max() / E4M3_MAX
    per_tensor = (x / tensor_scale).to(E4M3).float() * tensor_scale
    ordinary = torch.ones(64, dtype=torch.bool)
    ordinary[[5, 40]] = False
    token_err = rel_err(per_token[ordinary], x[ordinary])
    tensor_err = rel_err(per_tensor[ordinary], x[ordinary])
    assert token_err <= 0.03 and tensor_err >= 5 * token_err, (token_err, tensor_err)


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (131, 1024, 3072), (7, 4304, 1152)])
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_linear_reference(m, k, n, bias):
    """The reference GEMM equals the float64 product of the dequantised operands, up to float32 accumulation."""
    g = torch.Generator().manual_seed(m + k + n)
    xq, xs = quantize_rows(torch.randn(m, k, generator=g))
    wq, ws = quantize_rows(torch.randn(n, k, generator=g) / k**0.5)
    b = torch.randn(n, generator=g) if bias else None
    out = reference_scaled_linear(xq, xs, wq, ws, b, out_dtype=torch.float32)
    exact = (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()
    if bias:
        exact = exact + b.double()
    assert rel_err(out, exact) <= 1e-6


@pytest.mark.parametrize("m,k,n", [(1, 64, 96), (131, 1024, 3072), (7, 4304, 1152)])
def test_fp8_linear_error_against_float64(m, k, n):
    """x @ W.T with both in e4m3: per-element rounding of 2^-4 at most, so the product's error is a few percent
    (independent roundings average over K); a residual is added after."""
    g = torch.Generator().manual_seed(m * k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    wq, ws = quantize_rows(w)
    residual = torch.randn(m, n, generator=g)
    exact = x.double() @ w.double().t()
    out = fp8_linear(x, wq, ws)
    assert out.dtype == x.dtype and rel_err(out, exact) <= 0.05
    with_residual = fp8_linear(x, wq, ws, residual=residual.clone())
    torch.testing.assert_close(with_residual, out + residual)


@gpu
@pytest.mark.parametrize("m,k,n", [(1, 1024, 3072), (784, 1024, 4096), (25088, 4096, 1024)])
def test_cublas_scaled_mm_matches_the_reference(m, k, n):
    """On FP8 tensor cores: cuBLASLt's row-wise scaled GEMM (bf16 out) equals the float32 reference up to bf16
    rounding of the output."""
    device = torch.device("cuda")
    if not fp8_tensor_cores(device):
        pytest.skip("no FP8 tensor cores")
    g = torch.Generator(device=device).manual_seed(m)
    xq, xs = quantize_rows(torch.randn(m, k, generator=g, device=device))
    wq, ws = quantize_rows(torch.randn(n, k, generator=g, device=device) / k**0.5)
    b = torch.randn(n, generator=g, device=device).bfloat16()
    out = scaled_linear(xq, xs, wq, ws, b)
    ref = reference_scaled_linear(xq, xs, wq, ws, b, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) <= 4e-3


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
@pytest.mark.parametrize("k,n", [(64, 96), (1024, 4096)])
def test_act_row_scales_bound_every_value(act, k, n):
    """`act_norms` + `act_row_scales`: every |GELU(h_j)| / c_j of a row stays within 448 times the row's scale, so no
    code is clamped, with one channel of a hundred times the others' norm, zero channels (padding), outlier input
    channels and large biases among them; the zero channels' norms are raised to a sixteenth of the median."""
    from kernels.act_quant import apply_activation
    from kernels.fp8 import act_norms, act_row_scales

    g = torch.Generator().manual_seed(k + n)
    x = torch.randn(257, k, generator=g)
    x[:, :3] *= 100
    x[5] = 0  # a zero row: GELU of the bias alone
    w = torch.randn(n, k, generator=g) / k**0.5
    w[7] *= 100
    w[-16:] = 0
    b = torch.randn(n, generator=g) * 3
    xq, xs = quantize_rows(x)
    wq, ws = quantize_rows(w)
    wd = wq.float() * ws[:, None]
    norms, bound = act_norms(wd, b)
    assert (norms[-16:] == norms.median() / 16).all()
    a = apply_activation((xq.double() * xs.double()[:, None]) @ wd.double().t() + b.double(), act) / norms.double()
    scale = act_row_scales(xs, k, bound)
    assert (a.abs() <= E4M3_MAX * scale.double()[:, None]).all()
    # and not absurdly loose: within 2^9 of the row's absmax here (e4m3 keeps normal values down to 2^-15 of it)
    assert (E4M3_MAX * scale.double() / a.abs().amax(1)).max() < 2**9


def test_folding_the_norms_keeps_the_mlp():
    """fc2's weight with its columns scaled by fc1's channel norms, applied to fc1's activation divided by them:
    the same MLP (float64)."""
    from kernels.fp8 import act_norms, fold_norms

    g = torch.Generator().manual_seed(3)
    w1, b1, w2 = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(48, 96, generator=g)
    norms, _ = act_norms(w1, b1)
    x = torch.randn(5, 64, generator=g)
    h = torch.nn.functional.gelu(x @ w1.t() + b1)
    assert torch.allclose((h / norms) @ fold_norms(w2, norms).t(), h @ w2.t(), rtol=1e-5, atol=1e-4)
