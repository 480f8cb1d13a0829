"""FP8 (e4m3) linear layers: weights quantised once per output channel, activations per token, products accumulated
in float32 and scaled back in the GEMM's epilogue.

Scales are absmax / 448 (e4m3's largest finite value), so every row uses the format's whole range: a token whose
channels span 200x (a ViT's outlier channels) keeps its small channels at e4m3's relative step (2^-3 of the value's
binade) instead of flushing them, as a per-tensor scale would.

`scaled_linear` runs `torch._scaled_mm` on GPUs with FP8 tensor cores (compute capability 8.9 and later; row-wise
scales, bf16 out) and elsewhere the same arithmetic in float32 (`reference_scaled_linear`): the CPU tests, and
`quant-check` on machines without such a GPU, see the quantisation error the GPU path has, up to the order of its
float32 accumulation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
# the smallest scale: an all-zero row quantises to zeros instead of dividing by zero
MIN_SCALE = 1e-12


if triton is not None:
    _Q_MAX = tl.constexpr(E4M3_MAX)
    _Q_MIN_SCALE = tl.constexpr(MIN_SCALE)
    TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}

    @triton.jit
    def e4m3_rows(y, mask, ACT: tl.constexpr):
        """The fused kernels' epilogue: the rows of a float32 tile `y [R, N]` (`mask`: its valid elements), each
        value rounded to ACT (the activations' dtype, as the unfused output is), as e4m3 codes (float32 values,
        clamped to the format's range; the caller casts them on store) and one scale per row (absmax / 448):
        `quantize_rows` of the unfused output."""
        y = tl.where(mask, y.to(ACT).to(tl.float32), 0.0)
        scale = tl.maximum(tl.max(tl.abs(y), 1) / _Q_MAX, _Q_MIN_SCALE)
        # times the row's reciprocal, not a division per value: a division is a special-function instruction, of
        # which an SM issues a sixteenth of its arithmetic rate, and the GELU's pass already spends two per value
        return tl.minimum(tl.maximum(y * (1.0 / scale)[:, None], -_Q_MAX), _Q_MAX), scale


class Quantized(NamedTuple):
    """Activations already in e4m3 (`codes [M, K]`) with one float32 scale per row: what the norm kernels' FP8
    epilogue (`add_layernorm(..., quantize=True)`) and the activation's (`act_quant.act_quantize`) hand the next GEMM,
    which then skips quantising."""

    codes: torch.Tensor
    scale: torch.Tensor


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of `x [M, K]` to e4m3 with its own scale: (q [M, K] e4m3, scale [M] float32), x ≈ q * scale."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / E4M3_MAX).clamp_min(MIN_SCALE)
    return quantize_with(xf, scale), scale


def quantize_with(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row of `x [M, K]` to e4m3 codes at a given scale `[M]` (values beyond 448 scales clamped)."""
    return (x.float() / scale[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


# the largest |GELU(h)| for h <= 0 (tanh and erf forms: -0.170 at h = -0.75), below any bound of a positive input
GELU_FLOOR = 0.17


def act_norms(w: torch.Tensor, bias: torch.Tensor | None, floor: float = GELU_FLOOR) -> tuple[torch.Tensor, float]:
    """For the GELU of a linear layer `h = x @ W^T + bias` (W as the GEMM sees it, dequantised), handed to an FP8 GEMM
    by `act_row_scales`: each output channel's norm `c [N]` (float32; no smaller than a sixteenth of their median, so
    that a zero row, as padding makes, divides nothing) and the bound `B` of `max(|bias_j|, floor) / c_j`.

    With `a_j = GELU(h_j) / c_j`: |h_j| <= |x|_2 |W_j|_2 + |bias_j| (Cauchy-Schwarz) and |GELU(h)| <= max(|h|, 0.17),
    so |a_j| <= |x|_2 + B: one bound for every channel of a row, which the layer knows from its input alone. The
    division by c_j (undone in the next layer's weight columns, `fold_norms`) keeps one large-norm channel from
    loosening the bound of all the others."""
    c = w.float().norm(dim=1)
    c = torch.maximum(c, c.median() / 16).clamp_min(1e-30)
    b = torch.zeros_like(c) if bias is None else bias.float().abs()
    return c, float((torch.clamp_min(b, floor) / c).max())


def fold_norms(w: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """The weight `[N, K]` of the layer that reads `act_norms`' normalised activation, its input columns scaled back
    by the norms (float32): the same product."""
    return w.float() * norms[None, :]


def act_row_scales(x_scale: torch.Tensor, k: int, bound: float) -> torch.Tensor:
    """The e4m3 scale of each row of `a = GELU(x @ W^T + b) / c` (`act_norms`) from the row's input scale alone:
    `(|x|_2 + B) / 448` with `|x|_2 <= sqrt(K) * 448 * x_scale` (every code at most 448). No value of the row reaches
    448 times it, so none is clamped; the bound is loose (tens of times the row's absmax on random weights), which
    costs e4m3 nothing while values stay above its normal range's floor (2^-6 of 448 times the scale, about 2^-15 of
    the bound): the codes' relative error is the format's, 2^-4 at most, as with a scale of absmax / 448
    (docs/PERFORMANCE.md). So the GEMM that makes the activation writes its codes, with no pass for a row's absmax."""
    return k**0.5 * x_scale.float() + bound / E4M3_MAX


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight `[N, K]` per output channel: (q [N, K] e4m3, scale [N] float32)."""
    return quantize_rows(w)


def reference_scaled_linear(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """`(xq * x_scale) @ (wq * w_scale).T + bias` in float32, rounded to `out_dtype` once at the end: what the GEMM
    with a dequantising epilogue computes."""
    out = (xq.float() @ wq.float().t()) * x_scale[:, None] * w_scale[None, :]
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# cuBLASLt's FP8 GEMM (torch._scaled_mm) takes only operands whose every dimension is a multiple of 16
GEMM_MULTIPLE = 16


def fp8_gemm_shape(in_features: int, out_features: int) -> bool:
    """Whether a linear layer of this shape can run as an FP8 GEMM (`GEMM_MULTIPLE`): Qwen2.5-VL-7B's MLP, of width
    3420, cannot."""
    return in_features % GEMM_MULTIPLE == 0 and out_features % GEMM_MULTIPLE == 0


@functools.lru_cache(maxsize=None)
def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 on its tensor cores (sm89 and later)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def scaled_linear(xq, x_scale, wq, w_scale, bias=None, out_dtype=torch.bfloat16, out=None) -> torch.Tensor:
    """The FP8 GEMM with row-wise scales (`x_scale [M]`, `w_scale [N]`), bias and the cast to `out_dtype` in its
    epilogue: cuBLASLt where the device has FP8 tensor cores, else `reference_scaled_linear`; into `out` (contiguous
    `[M, N]` of `out_dtype`) if given."""
    if fp8_tensor_cores(xq.device):
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], bias=bias,
                                out_dtype=out_dtype, **({} if out is None else {"out": out}))
    y = reference_scaled_linear(xq, x_scale, wq, w_scale, bias, out_dtype)
    return y if out is None else out.copy_(y)


def fp8_linear(x: "torch.Tensor | Quantized", wq: torch.Tensor, w_scale: torch.Tensor,
               bias: torch.Tensor | None = None, residual: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`x @ W.T + bias (+ residual)` with W given quantised, the reference composition the tests hold the served
    layer (`quant.Fp8Linear`, `fp8_gemm`) to: x quantised per token by `quantize_rows` (or given as `Quantized`), the
    product dequantised in the GEMM, in x's dtype (`out_dtype` for a `Quantized` x: the bias's by default), the
    residual added after it."""
    if isinstance(x, Quantized):
        (xq, x_scale), lead = x, x.codes.shape[:-1]
        out_dtype = out_dtype or (bias.dtype if bias is not None else torch.bfloat16)
    else:
        lead, out_dtype = x.shape[:-1], out_dtype or x.dtype
        xq, x_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
    out = scaled_linear(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype)
    out = out.view(*lead, wq.shape[0])
    return out if residual is None else out.add_(residual)
