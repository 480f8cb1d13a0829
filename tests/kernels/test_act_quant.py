"""The MLP's activation with its FP8 quantisation in one pass (`kernels/act_quant.py`), under the interpreter and on
the GPU, against float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_e4m3_rows, exact_e4m3_rows, gpu
from kernels.act_quant import ACTIVATIONS, act_quantize, reference_act_quantize
from kernels.fp8 import quantize_rows

_EXACT = {"gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
          "none": lambda h: h}


def _exact_codes(h, act, up, dtype):
    """float64 activation, rounded to the activations' dtype (and the product with `up` again), quantised per row
    in float64."""
    a = _EXACT[act](h.double())
    if up is not None:
        a = a.to(dtype).double() * up.double()
    return exact_e4m3_rows(a, dtype)


def _inputs(rows, cols, dtype, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    h = 3 * torch.randn(rows, cols, generator=g, device=device)
    h[:, :: max(1, cols // 5)] *= 60  # outlier channels
    return h.to(dtype), torch.randn(rows, cols, generator=g, device=device).to(dtype)


@pytest.mark.parametrize("rows,cols", [(1, 64), (7, 1023), (131, 4096), (9, 72), (3, 3420)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("act,gated", [("gelu_pytorch_tanh", False), ("gelu", False), ("silu", True),
                                      ("none", False)])
def test_act_quantize(rows, cols, dtype, act, gated):
    """Codes within one e4m3 step of float64's on at most 1% of values (rounding boundaries), scales within
    float32 rounding; SwiGLU's product rounded as the unfused code rounds it."""
    h, up = _inputs(rows, cols, dtype, rows * cols)
    q, scale = act_quantize(h, act, up if gated else None, use_triton=True)
    assert_e4m3_rows(q, scale, *_exact_codes(h, act, up if gated else None, dtype))


def test_reference_is_quantize_rows_of_the_unfused_activation():
    h, up = _inputs(5, 96, torch.float32, 1)
    for act in ACTIVATIONS:
        q, scale = reference_act_quantize(h, act, up)
        rq, rscale = quantize_rows(_EXACT[act](h) * up)
        assert torch.equal(q.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(scale, rscale)


def test_act_quantize_refuses_what_it_cannot_do():
    h = torch.randn(4, 8)
    with pytest.raises(ValueError, match="activation"):
        act_quantize(h, "relu")
    with pytest.raises(ValueError, match="shape"):
        act_quantize(h, "silu", torch.randn(4, 9))


@gpu
@pytest.mark.parametrize("rows,cols", [(1, 4096), (784, 4304), (25088, 4096), (131, 3420)])
@pytest.mark.parametrize("act,gated", [("gelu_pytorch_tanh", False), ("silu", True), ("none", False)])
def test_act_quantize_on_the_gpu(rows, cols, act, gated):
    """The compiled kernel in bfloat16 at the towers' MLP widths (2B, 8B, Qwen2.5-VL), with outlier channels."""
    h, up = _inputs(rows, cols, torch.bfloat16, rows + cols, device="cuda")
    q, scale = act_quantize(h, act, up if gated else None)
    assert_e4m3_rows(q, scale, *_exact_codes(h.cpu(), act, up.cpu() if gated else None, torch.bfloat16))
