"""The MLP's activation and the quantisation of its output, for an FP8 fc2 (or down projection), in one pass.

Unfused, the activation reads and writes the MLP's widest tensor ([T, intermediate]), and quantising it per row
reads it twice more (absmax, then divide and round) before the GEMM. Here one pass reads fc1's output (with SwiGLU,
gate's and up's), applies the activation in float32, rounds each value to the activations' dtype as the unfused
code does (and the product act(gate) * up again), and writes e4m3 codes with one float32 scale per row (absmax /
448): `kernels.fp8.quantize_rows` of the unfused output.

The served tower runs it for Qwen2.5-VL's SwiGLU (`silu` of gate, times up); Qwen3-VL's GELU is written in e4m3 by
fc1's own epilogue instead (`kernels.fp8_gemm`, `act=`), which this kernel's `activation` also serves. `none`
quantises `h` as it is, in one pass rather than the several of `quantize_rows`' tensor ops (an FP8 layer's input
that no norm handed over quantised).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import E4M3, Quantized, quantize_rows
from .runtime import cdiv, choose, interpreting, launch, next_power_of_2, size_class

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

ACTIVATIONS = {"gelu_pytorch_tanh": 0, "gelu": 1, "silu": 2, "none": 3}
_TORCH = {"gelu_pytorch_tanh": lambda h: F.gelu(h, approximate="tanh"), "gelu": F.gelu, "silu": F.silu,
          "none": lambda h: h}


def apply_activation(h: torch.Tensor, act: str) -> torch.Tensor:
    """`act` (one of `ACTIVATIONS`) of `h` in its dtype, as the unfused model computes it."""
    return _TORCH[act](h)


def reference_act_quantize(h: torch.Tensor, act: str, up: torch.Tensor | None = None) -> Quantized:
    """The unfused arithmetic: act(h) (times `up`) in h's dtype, then `quantize_rows`."""
    a = apply_activation(h, act)
    return Quantized(*quantize_rows(a if up is None else a * up))


if triton is not None:
    from .fp8 import TL_DTYPES, e4m3_rows

    @triton.jit
    def activation(h, ACT_FN: tl.constexpr, FAST_TANH: tl.constexpr = False):
        """The activation of float32 `h`: ACT_FN 0 tanh GELU, 1 erf GELU, 2 SiLU, 3 none. FAST_TANH (GPU only): tanh
        GELU's tanh as the one `tanh.approx` instruction (error about 2^-11, so up to 2^-12 of |h| in the GELU)
        instead of an exponential and a division, two special-function instructions, which a GEMM's epilogue does
        not hide behind memory as this pass does."""
        a = h
        if ACT_FN == 0:
            inner = 0.7978845608028654 * (h + 0.044715 * h * h * h)
            if FAST_TANH:
                a = 0.5 * h * (1.0 + tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [inner],
                                                               dtype=tl.float32, is_pure=True, pack=1))
            else:
                a = 0.5 * h * (2.0 / (1.0 + tl.exp(-2.0 * inner)))  # 1 + tanh(inner), without overflow
        elif ACT_FN == 1:
            a = 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
        elif ACT_FN == 2:
            a = h / (1.0 + tl.exp(-h))
        return a

    @triton.jit
    def _act_quant_kernel(H, UP, Q, SCALE, n_rows, n_cols, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                          ACT_FN: tl.constexpr, HAS_UP: tl.constexpr, ACT: tl.constexpr):
        # ROWS rows per program; ACT: the activations' dtype
        rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_N)[None, :]
        mask = (rows < n_rows)[:, None] & (cols < n_cols)
        offs = rows[:, None] * n_cols + cols
        a = activation(tl.load(H + offs, mask=mask, other=0.0).to(tl.float32), ACT_FN)
        if HAS_UP:  # act(gate) rounded as the unfused code rounds it, then the product (rounded in e4m3_rows)
            a = a.to(ACT).to(tl.float32) * tl.load(UP + offs, mask=mask, other=0.0).to(tl.float32)
        q, scale = e4m3_rows(a, mask, ACT)
        tl.store(SCALE + rows, scale, mask=rows < n_rows)
        tl.store(Q + offs, q.to(Q.dtype.element_ty), mask=mask)


# (rows per program, warps): timed per width and pack size class on first use
LAUNCHES = [(1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]


def act_quantize(h: torch.Tensor, act: str, up: torch.Tensor | None = None,
                 use_triton: bool | None = None) -> Quantized:
    """`h [T, I]` (and `up`, same shape and dtype, for SwiGLU) -> act(h) (* up) as e4m3 rows with per-row scales;
    Triton on CUDA, else the unfused arithmetic."""
    if act not in ACTIVATIONS:
        raise ValueError(f"activation {act!r}: one of {', '.join(ACTIVATIONS)}")
    if h.dim() != 2 or up is not None and (up.shape != h.shape or up.dtype != h.dtype):
        raise ValueError(f"h must be 2-D and up (if given) of its shape and dtype; got {tuple(h.shape)} {h.dtype}"
                         + ("" if up is None else f", {tuple(up.shape)} {up.dtype}"))
    if use_triton is None:
        use_triton = triton is not None and h.is_cuda
    if not use_triton:
        return reference_act_quantize(h, act, up)
    h = h.contiguous()
    rows, cols = h.shape
    q = torch.empty(h.shape, dtype=E4M3, device=h.device)
    scale = torch.empty(rows, dtype=torch.float32, device=h.device)
    block_n = next_power_of_2(cols)

    def run(c):
        per, warps = c
        launch(_act_quant_kernel, (cdiv(rows, per),), h, h if up is None else up.contiguous(), q, scale, rows, cols,
               ROWS=per, BLOCK_N=block_n, ACT_FN=ACTIVATIONS[act], HAS_UP=up is not None, ACT=TL_DTYPES[h.dtype],
               num_warps=warps)

    if interpreting():
        choice = (2, 4)
    else:  # at most 16k values a program (registers)
        choice = choose(("act_quant", act, up is not None, cols, size_class(rows), h.dtype, h.device),
                        lambda: [c for c in LAUNCHES if c[0] * block_n <= 16384] or [(1, 8)], run)
    run(choice)
    return Quantized(q, scale)
