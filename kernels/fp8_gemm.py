"""The FP8 (e4m3) GEMM with the tower's epilogues fused, on Hopper: `out = (xq * x_scale) @ (wq * w_scale)^T`,
dequantised from the float32 accumulator, then

- `bias` added (any mode),
- `rope`: Q and K rotated, as `qkv_rope.qkv_rope_linear` does for the bf16 projection (whole heads per tile), so the
  QKV projection needs no RoPE pass over its output;
- `residual`: added into the residual stream in place (`residual += x @ W^T`, one rounding), as the bf16 tower's
  `addmm_(beta=1)` does, instead of cuBLASLt's output then a separate add that reads and writes the stream again.

cuBLASLt's `scaled_mm` offers the bias alone in its epilogue; each of the two passes it leaves reads and writes the
tokens' widest rows, which at the tower's sizes costs about as much as FP8 saves in the GEMM (docs/PERFORMANCE.md).
The choice between this kernel's tiles and cuBLASLt followed by the pass is timed per shape class on first use
(`runtime.choose`), so where cuBLASLt plus the pass is faster, it runs.

Operands as `kernels.fp8`: codes `[M, K]` and `[N, K]` (both K-major, as FP8 wgmma needs), one float32 scale per row
of each. TMA descriptors need 16-byte aligned rows: K a multiple of 16 (`fp8.fp8_gemm_shape`). Triton's FP8 dot
accumulates at the tensor cores' own precision (cuBLASLt promotes to float32 every few steps): at K = 4304 the
product's error is up to 1.6x cuBLASLt's, 0.26% of its norm, beside the 3-4% of rounding the operands to e4m3
(`tests/kernels/test_fp8_gemm.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .act_quant import ACTIVATIONS, apply_activation
from .fp8 import E4M3, GEMM_MULTIPLE, Quantized, act_row_scales, quantize_with, scaled_linear
from .qkv_rope import TensorDescriptor, qkv_rope_  # (None: Triton without host tensor descriptors)
from .runtime import cdiv, choose, interpreting, is_hopper, launch, size_class, sm_count

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:
    from .act_quant import activation
    from .fp8 import _Q_MAX
    from .qkv_rope import _bias_rope_store, _tile_origin

    @triton.jit
    def _fp8_tile(a_desc, b_desc, off_m, off_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, K_TILES: tl.constexpr):
        """The tile's float32 accumulator (of the codes: the scales come in the epilogue)."""
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in range(K_TILES):
            acc = tl.dot(a_desc.load([off_m, kt * BLOCK_K]), b_desc.load([off_n, kt * BLOCK_K]).T, acc)
        return acc

    @triton.jit
    def _fp8_epilogue(acc, off_m, off_n, X_SCALE, W_SCALE, BIAS, OUT, RES, COS, SIN, INV_NORM, OUT_SCALE, M, N,
                      stride_om, stride_rm, stride_c, ROPE_N, SQRT_K, BOUND, HAS_BIAS: tl.constexpr,
                      HAS_RES: tl.constexpr, ROPE: tl.constexpr, ACT_FN: tl.constexpr, FAST_TANH: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """Dequantise the tile (row scale times column scale), then bias, RoPE, the residual or the activation
        quantised to e4m3 (ACT_FN >= 0, below), one rounding, store."""
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        x_s = tl.load(X_SCALE + rows, mask=rows < M, other=0.0)
        w_s = tl.load(W_SCALE + cols, mask=cols < N, other=0.0)
        acc = acc * x_s[:, None] * w_s[None, :]
        if ROPE:  # N is a whole number of tiles there (the host checks), and the bias always given
            _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, stride_om, stride_c, ROPE_N, HEAD_DIM,
                             BLOCK_M, BLOCK_N)
        else:
            mask = (rows < M)[:, None] & (cols < N)[None, :]
            if HAS_BIAS:
                acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
            if HAS_RES:
                acc += tl.load(RES + rows[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mask,
                               other=0.0).to(tl.float32)
            if ACT_FN >= 0:
                # the activation of the float32 product (as cuBLASLt's GELU epilogue computes the bf16 tower's), over
                # its column's weight norm, in e4m3 at the row's scale `fp8.act_row_scales` (known before the
                # product: no row's absmax, which no tile holds whole)
                act = activation(acc, ACT_FN, FAST_TANH) * tl.load(INV_NORM + cols, mask=cols < N, other=0.0)[None, :]
                scale = SQRT_K * x_s + BOUND / _Q_MAX
                acc = tl.minimum(tl.maximum(act * (1.0 / scale)[:, None], -_Q_MAX), _Q_MAX)
                if off_n == 0:
                    tl.store(OUT_SCALE + rows, scale, mask=rows < M)
            out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
            tl.store(out, acc.to(OUT.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_gemm(a_desc, b_desc, X_SCALE, W_SCALE, BIAS, OUT, RES, COS, SIN, INV_NORM, OUT_SCALE, M, N, stride_om,
                  stride_rm, stride_c, ROPE_N, SQRT_K, BOUND, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
                  ROPE: tl.constexpr, ACT_FN: tl.constexpr, FAST_TANH: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
        """One program per output tile."""
        off_m, off_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = _fp8_tile(a_desc, b_desc, off_m, off_n, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES)
        _fp8_epilogue(acc, off_m, off_n, X_SCALE, W_SCALE, BIAS, OUT, RES, COS, SIN, INV_NORM, OUT_SCALE, M, N,
                      stride_om, stride_rm, stride_c, ROPE_N, SQRT_K, BOUND, HAS_BIAS, HAS_RES, ROPE, ACT_FN,
                      FAST_TANH, HEAD_DIM, BLOCK_M, BLOCK_N)

    @triton.jit
    def _fp8_gemm_persistent(a_desc, b_desc, X_SCALE, W_SCALE, BIAS, OUT, RES, COS, SIN, INV_NORM, OUT_SCALE, M, N,
                             stride_om, stride_rm, stride_c, ROPE_N, SQRT_K, BOUND, HAS_BIAS: tl.constexpr,
                             HAS_RES: tl.constexpr, ROPE: tl.constexpr, ACT_FN: tl.constexpr,
                             FAST_TANH: tl.constexpr, HEAD_DIM: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, K_TILES: tl.constexpr, NUM_SMS: tl.constexpr):
        """One program per SM looping over the tiles (the next tile's loads overlap this one's epilogue)."""
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = _fp8_tile(a_desc, b_desc, off_m, off_n, BLOCK_M, BLOCK_N, BLOCK_K, K_TILES)
            _fp8_epilogue(acc, off_m, off_n, X_SCALE, W_SCALE, BIAS, OUT, RES, COS, SIN, INV_NORM, OUT_SCALE, M, N,
                          stride_om, stride_rm, stride_c, ROPE_N, SQRT_K, BOUND, HAS_BIAS, HAS_RES, ROPE, ACT_FN,
                          FAST_TANH, HEAD_DIM, BLOCK_M, BLOCK_N)


# (block_m, block_n, block_k, warps, stages, persistent): 128-byte K rows (block_k 128 in e4m3) fill the swizzle
class Fp8Tile(NamedTuple):
    """One launch configuration of the FP8 GEMM: its output tile, its K step, warps, pipeline stages, and whether
    its programs are persistent (one per SM, walking the tiles) rather than one per tile."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    persistent: bool = False


class Rope(NamedTuple):
    """The QKV projection's epilogue: the weight is a fused QKV `[3 * hidden, K]` of `heads` heads, and Q and K are
    rotated by the float32 tables `cos`, `sin` `(M, head_dim / 2)`."""
    cos: torch.Tensor
    sin: torch.Tensor
    heads: int


class Activation(NamedTuple):
    """The MLP's first GEMM's epilogue: activation `name` of the float32 product, divided by each column's norm
    (`inv_norms`, `fp8.act_norms` of the layer), quantised to e4m3 rows at `fp8.act_row_scales(.., bound)`."""
    name: str
    inv_norms: torch.Tensor
    bound: float


FP8_TILES = [Fp8Tile(128, 256, 128, 8, 3), Fp8Tile(128, 128, 128, 4, 4), Fp8Tile(128, 128, 128, 8, 4),
             Fp8Tile(256, 128, 128, 8, 3), Fp8Tile(128, 256, 128, 8, 4), Fp8Tile(64, 256, 128, 4, 4),
             Fp8Tile(128, 256, 64, 8, 4), Fp8Tile(128, 256, 128, 8, 3, True), Fp8Tile(128, 128, 128, 8, 4, True)]
# the candidate that runs cuBLASLt's scaled_mm and then the epilogue's work as separate passes
UNFUSED = "unfused"


def fp8_gemm_supported(x: Quantized, wq: torch.Tensor) -> bool:
    """Whether `fp8_gemm` can run its kernel for these operands: Hopper (or the interpreter), contiguous codes with
    16-byte aligned rows and bases (TMA)."""
    xq = x.codes
    if triton is None or TensorDescriptor is None or xq.dim() != 2 or wq.dim() != 2 or xq.shape[1] != wq.shape[1]:
        return False
    if xq.shape[1] % GEMM_MULTIPLE or not xq.is_contiguous() or not wq.is_contiguous():
        return False
    if xq.data_ptr() % 16 or wq.data_ptr() % 16:
        return False
    return is_hopper(xq.device) if xq.is_cuda else interpreting()


def _rope_tiles(hidden: int, head_dim: int) -> list[Fp8Tile]:
    """The tiles that cover whole heads and never straddle Q, K and V (and so divide N); none for a head dim that is
    not a power of two (the epilogue splits a tile into heads and halves by reshapes)."""
    if head_dim < 16 or head_dim & (head_dim - 1):
        return []
    return [c for c in FP8_TILES if c.block_n % head_dim == 0 and hidden % c.block_n == 0]


def fp8_gemm(x: Quantized, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
             out_dtype: torch.dtype = torch.bfloat16, residual: torch.Tensor | None = None,
             rope: Rope | None = None, act: Activation | None = None, out: torch.Tensor | None = None,
             tile: "Fp8Tile | str | None" = None, use_triton: bool | None = None) -> "torch.Tensor | Quantized":
    """`x @ W^T (+ bias)` from e4m3 codes and row scales, dequantised in the epilogue, `[M, N]` in `out_dtype`.

    `residual` (`[M, N]`, rows contiguous): the product is added into it in place and it is returned (its dtype is
    the output's). `rope` (`Rope`): W is a fused QKV weight `[3 * hidden, K]`; the result `(M, 3, heads, head_dim)`
    with Q and K rotated, into `out` if given. `act` (`Activation`): the activation of the float32 product (unfused:
    of the product in `out_dtype`, in that dtype) divided by each column's norm, as `Quantized` e4m3 rows for the
    next FP8 GEMM, whose weight carries the norms (`fp8.fold_norms`): no pass between the two. At most one of
    `residual`, `rope` and `act`. `tile` pins an `Fp8Tile` (one of `FP8_TILES`) or `UNFUSED` (tests, benchmarks);
    otherwise the fastest for the shape class is chosen on first use.
    `use_triton` (None: on a GPU; the CPU tests force it under the interpreter): where the kernel cannot or may not
    run (`fp8_gemm_supported`), cuBLASLt (or the reference off Hopper) and the passes."""
    if (residual is not None) + (rope is not None) + (act is not None) > 1:
        raise ValueError("fp8_gemm: a residual, RoPE or an activation, not two")
    rope = None if rope is None else Rope(*rope)
    act = None if act is None else Activation(*act)
    if act is not None and act.name not in ACTIVATIONS:
        raise ValueError(f"activation {act.name!r}: one of {', '.join(ACTIVATIONS)}")
    xq, x_scale = x
    m, k = xq.shape
    n = wq.shape[0]
    if residual is not None:
        if residual.shape != (m, n) or residual.stride(1) != 1:
            raise ValueError(f"residual must be ({m}, {n}) with contiguous rows; got {tuple(residual.shape)}")
        out_dtype = residual.dtype
    head_dim = hidden = 0
    if rope is not None:
        cos, sin, heads = rope.cos, rope.sin, rope.heads
        hidden = n // 3
        head_dim = hidden // heads
        if n != 3 * heads * head_dim or cos.shape != (m, head_dim // 2) or sin.shape != cos.shape:
            raise ValueError(f"rope: a QKV weight of {heads} heads and ({m}, head_dim / 2) tables; got N = {n}, "
                             f"cos {tuple(cos.shape)}")
        if out is not None and (out.shape != (m, 3, heads, head_dim) or not out.is_contiguous()):
            raise ValueError(f"out must be a contiguous {(m, 3, heads, head_dim)} tensor; got {tuple(out.shape)}")
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        if bias is None:
            bias = torch.zeros(n, dtype=out_dtype, device=xq.device)  # the RoPE epilogue always adds one
    candidates = list(FP8_TILES) if rope is None else _rope_tiles(hidden, head_dim)
    if residual is not None:
        dest = residual
    elif out is not None:
        dest = out.view(m, n)
    else:
        dest = torch.empty((m, n), dtype=E4M3 if act is not None else out_dtype, device=xq.device)
    act_scale = None if act is None else torch.empty(m, dtype=torch.float32, device=xq.device)

    def run(c, into: torch.Tensor) -> torch.Tensor:
        """Candidate `c` into `into` (the residual itself in that mode, else the output); returns it."""
        if c == UNFUSED:
            if act is not None:  # the activation in the output's dtype, as the unfused layer computes it
                y = apply_activation(scaled_linear(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype), act.name)
                act_scale.copy_(act_row_scales(x_scale, k, act.bound))
                return into.copy_(quantize_with(y.float() * act.inv_norms, act_scale))
            if residual is not None:
                return into.add_(scaled_linear(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype))
            y = scaled_linear(xq, x_scale, wq, w_scale, bias, out_dtype=out_dtype, out=into)
            return y if rope is None else qkv_rope_(y.view(m, 3, heads, head_dim), cos, sin).view(m, n)
        bm, bn, bk, warps, stages, persistent = c  # an Fp8Tile (or the plain tuple a tuning cache restored)
        a_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(wq, [n, k], [wq.stride(0), 1], [bn, bk])
        tiles = cdiv(m, bm) * cdiv(n, bn)
        unread = x_scale  # the pointer arguments of the modes not taken
        args = (a_desc, b_desc, x_scale, w_scale, unread if bias is None else bias, into,
                into if residual is not None else unread, unread if rope is None else cos,
                unread if rope is None else sin, unread if act is None else act.inv_norms,
                unread if act is None else act_scale, m, n, into.stride(0), into.stride(0),
                0 if rope is None else cos.stride(0), 2 * hidden, float(k) ** 0.5, 0.0 if act is None else act.bound)
        meta = dict(HAS_BIAS=bias is not None, HAS_RES=residual is not None, ROPE=rope is not None,
                    ACT_FN=-1 if act is None else ACTIVATIONS[act.name], FAST_TANH=not interpreting(),
                    HEAD_DIM=max(head_dim, 1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                    GROUP_M=8, K_TILES=cdiv(k, bk), num_warps=warps, num_stages=stages)
        if persistent:
            sms = min(sm_count(xq.device) if xq.is_cuda else 4, tiles)
            launch(_fp8_gemm_persistent, (sms,), *args, NUM_SMS=sms, **meta)
        else:
            launch(_fp8_gemm, (tiles,), *args, **meta)
        return into

    if use_triton is None:
        use_triton = xq.is_cuda or tile not in (None, UNFUSED)
    if not use_triton or not fp8_gemm_supported(x, wq) or (tile is None and not candidates):
        tile = UNFUSED
    elif tile is None and interpreting():
        tile = Fp8Tile(32, head_dim or 32, 32, 4, 2)  # small tiles: the interpreter's cost grows with the tile
    elif tile is None:
        mode = "rope" if rope is not None else "residual" if residual is not None else act.name if act else "plain"
        scratch = []  # timed into scratch (made on the first timing only): the residual must not take their sums

        def timed(c):
            scratch[:] = scratch or [torch.empty_like(dest)]
            return run(c, scratch[0])

        tile = choose(("fp8_gemm", mode, size_class(m), n, k, head_dim, bias is not None, out_dtype, xq.device),
                      lambda: [*candidates, UNFUSED], timed)
    elif tile != UNFUSED and rope is not None and (tile[1] % head_dim or hidden % tile[1]):
        raise ValueError(f"tile {tile}: block_n must be a multiple of head_dim {head_dim} dividing {hidden}")
    result = run(tile, dest)
    if act is not None:
        return Quantized(result, act_scale)
    return result.view(m, 3, heads, head_dim) if rope is not None else result
