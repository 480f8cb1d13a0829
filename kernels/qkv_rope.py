"""2D vision RoPE on the fused QKV projection's output: in place, or in the projection's epilogue.

The tower's QKV GEMM writes `(T, 3, H, D)`; `qkv_rope_` rotates the Q and K slices in place (float32
arithmetic, one rounding, as transformers does) so the attention kernel reads plain Q/K with no
per-tile rotation work. Measured against rotating inside the attention kernel (kernels/varlen_attention
with cos/sin): rotating every K tile once per query tile costs far more than one pass here
(docs/PERFORMANCE.md).

`qkv_rope_linear` goes one step further on Hopper: the projection itself (TMA + wgmma GEMM) adds the
bias and rotates Q and K in its epilogue, from the float32 accumulator, so the pass and its read and
write of Q and K disappear. A column's rotate-half partner must be in the same output tile:
- power-of-two head dims (64): each tile covers whole heads (block_n a multiple of head_dim);
- head dims that are a power of two plus a smaller one (72 = 64 + 8, 80 = 64 + 16): the kernel reads
  a copy of the weight whose Q and K rows are regrouped (`split_order`): first every head's "main"
  block of D0 = 64 rows (the pairs 0..31: channels 0..31 and their partners 36..67), then every head's
  remainder block (pairs 32..35: channels 32..35 and 68..71), then V. Tiles then cover whole blocks,
  rotate each with the power-of-two shapes Triton needs, and store every column at its place in the
  usual `(T, 3, H, D)` layout: the result is the unsplit one. The copy is made once per weight
  (re-made if the weight changes) and costs the QKV weight's size again.
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from .rope import apply_vision_rope
from .tuning import choose, interpreting, is_hopper

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - Triton without host tensor descriptors
    TensorDescriptor = None


if triton is not None:

    @triton.jit
    def _qkv_rope_kernel(QKV, COS, SIN, n_tokens, stride_t, stride_s, stride_h, stride_c,
                         HALF: tl.constexpr, PAIRS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_T: tl.constexpr,
                         FIRST: tl.constexpr):
        """Rotates all heads of Q (or K) of BLOCK_T tokens. Lane p of a token is the rotate-half pair
        (p // HALF's head, columns i and i + HALF with i = p % HALF), loaded, rotated and stored by the
        one thread that owns it (in place: no thread may read what another writes). Lanes run over every
        head of the token, so a head dim like 72 fills the tile instead of a 64-wide tile per head."""
        pid_t = tl.program_id(0)
        which = tl.program_id(1) + FIRST  # 0: Q, 1: K
        rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        p = tl.arange(0, BLOCK_P)
        i = p % HALF
        col = (p // HALF) * stride_h + i
        mask = (rows < n_tokens)[:, None] & (p < PAIRS)[None, :]
        lo = QKV + rows[:, None].to(tl.int64) * stride_t + which * stride_s + col[None, :]
        x1 = tl.load(lo, mask=mask, other=0.0)
        x2 = tl.load(lo + HALF, mask=mask, other=0.0)
        cs = rows[:, None] * stride_c + i[None, :]
        c = tl.load(COS + cs, mask=mask, other=0.0)
        s = tl.load(SIN + cs, mask=mask, other=0.0)
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(lo, (a * c - b * s).to(x1.dtype), mask=mask)
        tl.store(lo + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


def _check_tables(cos, sin, tokens: int, half: int):
    if cos.shape != (tokens, half) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 ({tokens}, {half}); got {cos.dtype} {tuple(cos.shape)}")


def qkv_rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_triton: bool | None = None,
              k_only: bool = False) -> torch.Tensor:
    """Rotate Q and K (only K with `k_only`: the attention kernel rotates Q as it loads it) of `qkv`
    `(T, 3, H, D)` in place with float32 `(T, D/2)` tables; returns qkv."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be (T, 3, H, D) with a contiguous last dim; got {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    tokens, _, heads, head_dim = qkv.shape
    half = head_dim // 2
    _check_tables(cos, sin, tokens, half)
    if use_triton is None:
        use_triton = triton is not None and qkv.is_cuda
    if not use_triton:
        for i in (1,) if k_only else (0, 1):
            qkv[:, i] = apply_vision_rope(qkv[:, i], cos, sin)
        return qkv
    block_p = triton.next_power_of_2(heads * half)
    block_t = max(1, 2048 // block_p)  # ~16 pairs per thread at 4 warps
    grid = (triton.cdiv(tokens, block_t), 1 if k_only else 2)
    _qkv_rope_kernel[grid](qkv, cos, sin, tokens, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0),
                           HALF=half, PAIRS=heads * half, BLOCK_P=block_p, BLOCK_T=block_t, FIRST=int(k_only),
                           num_warps=4)
    return qkv


if triton is not None:

    @triton.jit
    def _tile_origin(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Grouped order: GROUP_M row blocks sweep the columns together, so their A tiles stay in L2."""
        grid_m = tl.cdiv(M, BLOCK_M)
        per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
        first_m = (tile // per_group) * GROUP_M
        group_m = min(grid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % per_group) % group_m
        pid_n = (tile % per_group) // group_m
        return pid_m * BLOCK_M, pid_n * BLOCK_N

    @triton.jit
    def _rotated(acc, rows, M, COS, SIN, stride_c, C0: tl.constexpr, SUB: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
        """acc `[BLOCK_M, BLOCK_N]` as blocks of SUB columns, each SUB/2 rotate-half pairs (columns i and
        i + SUB/2) at the angles C0 .. C0 + SUB/2 of cos/sin: rotated, `[BLOCK_M, blocks, 2, SUB/2]` (the
        columns' order: reshaped, the tile as it came)."""
        W: tl.constexpr = SUB // 2
        x = tl.permute(tl.reshape(acc, [BLOCK_M, BLOCK_N // SUB, 2, W]), [0, 1, 3, 2])
        x1, x2 = tl.split(x)  # [BLOCK_M, blocks, W]: each block's first and second half
        cs = rows[:, None] * stride_c + C0 + tl.arange(0, W)[None, :]
        c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)[:, None, :]
        s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)[:, None, :]
        return tl.permute(tl.join(x1 * c - x2 * s, x2 * c + x1 * s), [0, 1, 3, 2])

    @triton.jit
    def _block_cols(base, HALF: tl.constexpr, W: tl.constexpr, BLOCK_N: tl.constexpr):
        """The output columns of a tile of blocks `[blocks, 2, W]` (the order `_rotated` returns), flattened:
        block b's column h * W + i goes to base[b] + h * HALF + i."""
        cols = base[:, None, None] + (tl.arange(0, 2) * HALF)[None, :, None] + tl.arange(0, W)[None, None, :]
        return tl.reshape(cols, [BLOCK_N])

    @triton.jit
    def _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, heads, ROPE_N,
                         HEAD_DIM: tl.constexpr, REM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The epilogue: + bias, rotate when the tile is in Q or K, round once, store the rows that exist.
        REM == 0: tiles of whole heads, columns below ROPE_N (Q and K) rotated. REM > 0: split order
        (module docstring), main blocks below ROPE_N, remainder blocks up to Q and K's end."""
        cols = off_n + tl.arange(0, BLOCK_N)
        rows = off_m + tl.arange(0, BLOCK_M)
        acc += tl.load(BIAS + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        HALF: tl.constexpr = HEAD_DIM // 2
        if REM == 0:
            if off_n < ROPE_N:
                acc = tl.reshape(_rotated(acc, rows, M, COS, SIN, stride_c, 0, HEAD_DIM, BLOCK_M, BLOCK_N),
                                 [BLOCK_M, BLOCK_N])
        else:  # (one store after the branches: stores inside them break the persistent loop's flattening)
            D0: tl.constexpr = HEAD_DIM - REM
            hidden = heads * HEAD_DIM
            if off_n < ROPE_N:  # main blocks: head (off_n // D0 + b) % heads of Q (then K), pairs 0 .. D0/2
                acc = tl.reshape(_rotated(acc, rows, M, COS, SIN, stride_c, 0, D0, BLOCK_M, BLOCK_N),
                                 [BLOCK_M, BLOCK_N])
                blk = off_n // D0 + tl.arange(0, BLOCK_N // D0)
                cols = _block_cols((blk // heads) * hidden + (blk % heads) * HEAD_DIM, HALF, D0 // 2, BLOCK_N)
            elif off_n < 2 * hidden:  # remainder blocks: pairs D0/2 .. HALF
                acc = tl.reshape(_rotated(acc, rows, M, COS, SIN, stride_c, D0 // 2, REM, BLOCK_M, BLOCK_N),
                                 [BLOCK_M, BLOCK_N])
                blk = (off_n - ROPE_N) // REM + tl.arange(0, BLOCK_N // REM)
                cols = _block_cols((blk // heads) * hidden + (blk % heads) * HEAD_DIM + D0 // 2, HALF, REM // 2,
                                   BLOCK_N)
        out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])

    @triton.jit
    def _qkv_rope_gemm(a_desc, b_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, heads, ROPE_N,
                       HEAD_DIM: tl.constexpr, REM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
        """OUT[M, N] = A[M, K] @ B[N, K]^T + BIAS, with columns below ROPE_N (Q and K) rotated: one
        program per output tile."""
        off_m, off_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in tl.range(0, K_TILES):
            acc = tl.dot(a_desc.load([off_m, kt * BLOCK_K]), b_desc.load([off_n, kt * BLOCK_K]).T, acc)
        _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, heads, ROPE_N,
                         HEAD_DIM, REM, BLOCK_M, BLOCK_N)

    @triton.jit
    def _qkv_rope_gemm_persistent(a_desc, b_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, heads, ROPE_N,
                                  HEAD_DIM: tl.constexpr, REM: tl.constexpr, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr,
                                  BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_TILES: tl.constexpr,
                                  NUM_SMS: tl.constexpr):
        """The same GEMM with one program per SM looping over tiles; the flattened loop lets the
        pipeliner load the next tile's operands during this tile's epilogue."""
        num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
            off_m, off_n = _tile_origin(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for kt in range(K_TILES):
                acc = tl.dot(a_desc.load([off_m, kt * BLOCK_K]), b_desc.load([off_n, kt * BLOCK_K]).T, acc)
            _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, heads, ROPE_N,
                             HEAD_DIM, REM, BLOCK_M, BLOCK_N)


# (block_m, block_n, block_k, warps, stages, persistent) candidates, timed once per shape class on first use
GEMM_TILES = [(128, 256, 64, 8, 3, False), (128, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False),
              (128, 256, 64, 8, 4, False), (256, 128, 64, 8, 3, False), (64, 256, 64, 4, 4, False),
              (128, 256, 128, 8, 2, False), (256, 128, 128, 8, 2, False),
              (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (128, 128, 64, 8, 4, True)]


def head_split(head_dim: int) -> tuple[int, int] | None:
    """(D0, REM): head_dim as a power of two plus a smaller power of two (72 -> (64, 8)), REM 0 for a
    power of two; None where the fused kernel cannot take the head dim."""
    if head_dim < 16 or head_dim % 2:
        return None
    d0 = 1 << (head_dim.bit_length() - 1)
    rem = head_dim - d0
    return (d0, rem) if rem == 0 or (rem >= 4 and rem & (rem - 1) == 0) else None


def split_order(heads: int, head_dim: int) -> torch.Tensor:
    """Row order of the QKV weight for a split head dim (module docstring): the Q then K heads' main
    blocks, their remainder blocks, then V as it is."""
    d0, rem = head_split(head_dim)
    half = head_dim // 2

    def block(first_pair: int, width: int) -> torch.Tensor:  # pairs' first channels, then their partners
        i = torch.arange(first_pair, first_pair + width // 2)
        return torch.cat((i, i + half))

    starts = torch.arange(2 * heads)[:, None] * head_dim
    return torch.cat(((starts + block(0, d0)).flatten(), (starts + block(d0 // 2, rem)).flatten(),
                      2 * heads * head_dim + torch.arange(heads * head_dim)))


def block_n_fits(block_n: int, hidden: int, head_dim: int) -> bool:
    """Whether output tiles `block_n` wide never straddle Q, K and V and cover whole heads (power-of-two
    head dims) or whole main blocks and the remainder blocks' region in whole tiles (split head dims)."""
    split = head_split(head_dim)
    if split is None:
        return False
    d0, rem = split
    if rem == 0:
        return block_n % head_dim == 0 and hidden % block_n == 0
    heads = hidden // head_dim
    return block_n % d0 == 0 and (2 * heads * d0) % block_n == 0 and (2 * heads * rem) % block_n == 0


def gemm_candidates(hidden: int, head_dim: int) -> list[tuple]:
    """The candidate tiles whose block_n fits (`block_n_fits`)."""
    return [c for c in GEMM_TILES if block_n_fits(c[1], hidden, head_dim)]


_SPLIT_WEIGHTS: dict[int, tuple] = {}  # id(weight) -> (versions, weight copy, bias copy); dropped with the weight


def _split_weights(weight: torch.Tensor, bias: torch.Tensor, heads: int, head_dim: int):
    """The weight and bias rows in `split_order`, made once per weight and re-made when the weight or
    bias changes (in place: version counter; or replaced: storage)."""

    def version(t):
        try:
            return t._version, t.data_ptr()
        except RuntimeError:  # inference tensors keep no version counter
            return 0, t.data_ptr()

    key = (version(weight), version(bias))
    hit = _SPLIT_WEIGHTS.get(id(weight))
    if hit is None or hit[0] != key:
        if hit is None:
            weakref.finalize(weight, _SPLIT_WEIGHTS.pop, id(weight), None)
        order = split_order(heads, head_dim).to(weight.device)
        hit = (key, weight[order].contiguous(), bias[order].contiguous())
        _SPLIT_WEIGHTS[id(weight)] = hit
    return hit[1], hit[2]


def reference_qkv_rope_linear(x, weight, bias, cos, sin, heads):
    """The unfused computation: the projection (rounded to x's dtype), then the in-place rotation."""
    qkv = F.linear(x, weight, bias).view(x.shape[0], 3, heads, -1)
    return qkv_rope_(qkv, cos, sin, use_triton=False)


def fused_qkv_rope_supported(x, weight, heads) -> bool:
    """Whether `qkv_rope_linear` runs its fused kernel for these operands (else the projection and the pass):
    Hopper (TMA) or the interpreter, half precision (or float32 in the interpreter), head dims that
    `head_split` takes (64, 72, 80, ...); unpinned calls also need a candidate tile (`gemm_candidates`)."""
    if triton is None or TensorDescriptor is None or x.dim() != 2 or weight.dim() != 2:
        return False
    hidden = weight.shape[0] // 3
    head_dim = hidden // heads if heads and hidden % heads == 0 else 0
    if not any(block_n_fits(b, hidden, head_dim) for b in (16, 32, 64, 128, 256)) or x.shape[1] % 16:
        return False
    if x.dtype != weight.dtype or not x.is_contiguous() or not weight.is_contiguous():
        return False
    if x.data_ptr() % 16 or weight.data_ptr() % 16:  # tensor descriptors need 16-byte aligned bases
        return False
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16) and is_hopper(x.device)
    return interpreting()


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def qkv_rope_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, heads: int, *, tile: tuple | None = None) -> torch.Tensor:
    """`(T, 3, H, D)` = x `(T, hidden)` @ weight `(3 * hidden, hidden)`^T + bias, Q and K rotated with
    float32 `(T, D/2)` tables. One kernel where `fused_qkv_rope_supported` (for a split head dim it reads
    a regrouped copy of weight and bias, `_split_weights`), else the projection and the in-place pass.
    `tile` pins (block_m, block_n, block_k, warps, stages, persistent) (tests, benchmarks)."""
    tokens, k_dim = x.shape
    n = weight.shape[0]
    head_dim = n // 3 // heads
    _check_tables(cos, sin, tokens, head_dim // 2)
    hidden = n // 3
    if not fused_qkv_rope_supported(x, weight, heads) or (
            tile is None and not interpreting() and not gemm_candidates(hidden, head_dim)):
        return qkv_rope_(F.linear(x, weight, bias).view(tokens, 3, heads, head_dim), cos, sin)
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device)
    if bias is None:
        bias = torch.zeros(n, dtype=x.dtype, device=x.device)
    d0, rem = head_split(head_dim)
    rope_n = 2 * hidden if rem == 0 else 2 * heads * d0  # the rotated columns (REM > 0: the main blocks)
    if rem:
        weight, bias = _split_weights(weight, bias, heads, head_dim)

    def launch(c):
        bm, bn, bk, warps, stages, persistent = c
        a_desc = TensorDescriptor(x, [tokens, k_dim], [x.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(weight, [n, k_dim], [weight.stride(0), 1], [bn, bk])
        tiles = triton.cdiv(tokens, bm) * triton.cdiv(n, bn)
        args = (a_desc, b_desc, bias, out, cos, sin, tokens, n, out.stride(0), cos.stride(0), heads, rope_n)
        meta = dict(HEAD_DIM=head_dim, REM=rem, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                    K_TILES=triton.cdiv(k_dim, bk), num_warps=warps, num_stages=stages)
        if persistent:
            sms = _sm_count(x.device) if x.is_cuda else 4
            _qkv_rope_gemm_persistent[(min(sms, tiles),)](*args, NUM_SMS=min(sms, tiles), **meta)
        else:
            _qkv_rope_gemm[(tiles,)](*args, **meta)

    if tile is None and interpreting():  # small tiles: the interpreter's cost grows with the tile
        tile = (32, next(b for b in (16, 32, 64, 128, 256) if block_n_fits(b, hidden, head_dim)), 32, 4, 2, False)
    if tile is None:
        size_class = 0 if tokens <= 4096 else 1 if tokens <= 16384 else 2  # a new pack size never re-tunes
        tile = choose(("qkv_rope_gemm", size_class, n, k_dim, head_dim, x.dtype, x.device),
                      lambda: gemm_candidates(hidden, head_dim), launch)
    elif not block_n_fits(tile[1], hidden, head_dim):
        raise ValueError(f"tile {tile}: block_n does not cover whole heads (or main and remainder blocks) "
                         f"of head_dim {head_dim}")
    launch(tile)
    return out.view(tokens, 3, heads, head_dim)
