"""2D vision RoPE on the fused QKV projection's output: in place, or in the projection's epilogue.

The tower's QKV GEMM writes `(T, 3, H, D)`; `qkv_rope_` rotates the Q and K slices in place (float32
arithmetic, one rounding, as transformers does) so the attention kernel reads plain Q/K with no
per-tile rotation work. Measured against rotating inside the attention kernel (kernels/attention
with cos/sin): rotating every K tile once per query tile costs far more than one pass here
(docs/PERFORMANCE.md).

`qkv_rope_linear` goes one step further on Hopper: the projection itself (TMA + wgmma GEMM) adds the
bias and rotates Q and K in its epilogue, from the float32 accumulator, so the pass and its read and
write of Q and K disappear. Each output tile covers whole heads (block_n a multiple of head_dim), so a
column's rotate-half partner is in the same tile.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .rope import apply_vision_rope
from .runtime import cdiv, choose, interpreting, is_hopper, launch, next_power_of_2, size_class, sm_count

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
    def _qkv_rope_kernel(QKV, COS, SIN, n_chunks, stride_t, stride_s, stride_h, stride_c,
                         HEADS: tl.constexpr, HALF: tl.constexpr, VEC: tl.constexpr, BLOCK: tl.constexpr):
        """Rotates BLOCK chunks of Q and K. A chunk is VEC consecutive rotate-half pairs of one head of one token: VEC
        columns of the first half and their partners, loaded, rotated and stored by the thread that owns them (in place:
        no thread reads what another writes) as vectors, with the chunk's cos/sin read once for Q and K. Chunks run over
        (token, head, pair) without padding, so a head dim like 72 wastes no lanes."""
        CHUNKS: tl.constexpr = HALF // VEC  # per head
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        t = k // (CHUNKS * HEADS)
        pair = (k % CHUNKS) * VEC
        head = (k // CHUNKS) % HEADS
        mask = (k < n_chunks)[:, None]
        j = tl.arange(0, VEC)[None, :]
        # the host checks that strides and the base keep every chunk VEC-aligned
        cs = tl.multiple_of(t * stride_c + pair, VEC)[:, None] + j
        c = tl.load(COS + cs, mask=mask, other=0.0)
        s = tl.load(SIN + cs, mask=mask, other=0.0)
        base = tl.multiple_of(t.to(tl.int64) * stride_t + head * stride_h + pair, VEC)
        for which in tl.static_range(2):
            lo = QKV + (base + which * stride_s)[:, None] + j
            x1 = tl.load(lo, mask=mask, other=0.0)
            x2 = tl.load(lo + HALF, mask=mask, other=0.0)
            a, b = x1.to(tl.float32), x2.to(tl.float32)
            tl.store(lo, (a * c - b * s).to(x1.dtype), mask=mask)
            tl.store(lo + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


def _check_tables(cos, sin, tokens: int, half: int):
    if cos.shape != (tokens, half) or sin.shape != cos.shape or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be float32 ({tokens}, {half}); got {cos.dtype} {tuple(cos.shape)}")


def qkv_rope_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, use_triton: bool | None = None, *,
              pairs_per_program: int = 1024, num_warps: int = 8) -> torch.Tensor:
    """Rotate Q and K of `qkv` `(T, 3, H, D)` in place with float32 `(T, D/2)` tables; returns qkv. The last two
    arguments set the Triton launch (the defaults run close to a plain copy of the same bytes: docs/PERFORMANCE.md)."""
    if qkv.dim() != 4 or qkv.shape[1] != 3 or qkv.stride(-1) != 1:
        raise ValueError(f"qkv must be (T, 3, H, D) with a contiguous last dim; got {tuple(qkv.shape)} "
                         f"strides {qkv.stride()}")
    tokens, _, heads, head_dim = qkv.shape
    half = head_dim // 2
    _check_tables(cos, sin, tokens, half)
    if use_triton is None:
        use_triton = triton is not None and qkv.is_cuda
    if not use_triton:
        for i in (0, 1):
            qkv[:, i] = apply_vision_rope(qkv[:, i], cos, sin)
        return qkv
    if sin.stride() != cos.stride() or cos.stride(-1) != 1:  # the kernel indexes both with one row stride
        cos, sin = cos.contiguous(), sin.contiguous()
    # widest chunk of pairs (<= 16 bytes) that every stride and the base keep aligned
    vec = 1
    while (vec < 16 // qkv.element_size() and half % (2 * vec) == 0 and cos.stride(0) % (2 * vec) == 0
           and all(st % (2 * vec) == 0 for st in qkv.stride()[:3])
           and qkv.data_ptr() % (2 * vec * qkv.element_size()) == 0 and cos.data_ptr() % (8 * vec) == 0
           and sin.data_ptr() % (8 * vec) == 0):
        vec *= 2
    chunks = tokens * heads * (half // vec)
    block = next_power_of_2(max(1, pairs_per_program // vec))
    launch(
        _qkv_rope_kernel, (cdiv(chunks, block),), qkv, cos, sin, chunks, qkv.stride(0), qkv.stride(1), qkv.stride(2),
        cos.stride(0), HEADS=heads, HALF=half, VEC=vec, BLOCK=block, num_warps=num_warps)
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
    def _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, stride_om, stride_c, ROPE_N,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """The epilogue: + bias, rotate when the tile is in Q or K (whole heads: a column's rotate-half
        partner is in the tile), round once, store the rows that exist."""
        cols = off_n + tl.arange(0, BLOCK_N)
        rows = off_m + tl.arange(0, BLOCK_M)
        acc += tl.load(BIAS + cols).to(tl.float32)[None, :]
        if off_n < ROPE_N:
            HALF: tl.constexpr = HEAD_DIM // 2
            x = tl.permute(tl.reshape(acc, [BLOCK_M, BLOCK_N // HEAD_DIM, 2, HALF]), [0, 1, 3, 2])
            x1, x2 = tl.split(x)  # [BLOCK_M, heads in tile, HALF]: each head's first and second half
            cs = rows[:, None] * stride_c + tl.arange(0, HALF)[None, :]
            c = tl.load(COS + cs, mask=(rows < M)[:, None], other=0.0)[:, None, :]
            s = tl.load(SIN + cs, mask=(rows < M)[:, None], other=0.0)[:, None, :]
            y = tl.join(x1 * c - x2 * s, x2 * c + x1 * s)
            acc = tl.reshape(tl.permute(y, [0, 1, 3, 2]), [BLOCK_M, BLOCK_N])
        out = OUT + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
        tl.store(out, acc.to(OUT.dtype.element_ty), mask=(rows < M)[:, None])

    @triton.jit
    def _qkv_rope_gemm(a_desc, b_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, ROPE_N,
                       HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, K_TILES: tl.constexpr):
        """OUT[M, N] = A[M, K] @ B[N, K]^T + BIAS, with columns below ROPE_N (Q and K) rotated: one
        program per output tile."""
        off_m, off_n = _tile_origin(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kt in tl.range(0, K_TILES):
            acc = tl.dot(a_desc.load([off_m, kt * BLOCK_K]), b_desc.load([off_n, kt * BLOCK_K]).T, acc)
        _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, stride_om, stride_c, ROPE_N, HEAD_DIM,
                         BLOCK_M, BLOCK_N)

    @triton.jit
    def _qkv_rope_gemm_persistent(a_desc, b_desc, BIAS, OUT, COS, SIN, M, N, stride_om, stride_c, ROPE_N,
                                  HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
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
            _bias_rope_store(acc, off_m, off_n, BIAS, OUT, COS, SIN, M, stride_om, stride_c, ROPE_N, HEAD_DIM,
                             BLOCK_M, BLOCK_N)


# (block_m, block_n, block_k, warps, stages, persistent) candidates, timed once per shape class on first use
GEMM_TILES = [(128, 256, 64, 8, 3, False), (128, 128, 64, 4, 4, False), (128, 128, 64, 8, 4, False),
              (128, 256, 64, 8, 4, False), (256, 128, 64, 8, 3, False), (64, 256, 64, 4, 4, False),
              (128, 256, 128, 8, 2, False), (256, 128, 128, 8, 2, False),
              (128, 256, 64, 8, 3, True), (128, 256, 64, 8, 4, True), (128, 128, 64, 8, 4, True)]


def gemm_candidates(hidden: int, head_dim: int) -> list[tuple]:
    """The tiles that cover whole heads and never straddle Q, K and V."""
    return [c for c in GEMM_TILES if c[1] % head_dim == 0 and hidden % c[1] == 0]


def reference_qkv_rope_linear(x, weight, bias, cos, sin, heads):
    """The unfused computation: the projection (rounded to x's dtype), then the in-place rotation."""
    qkv = F.linear(x, weight, bias).view(x.shape[0], 3, heads, -1)
    return qkv_rope_(qkv, cos, sin, use_triton=False)


def fused_qkv_rope_supported(x, weight, heads) -> bool:
    """Whether `qkv_rope_linear` runs its fused kernel for these operands (else the projection and the pass):
    Hopper (TMA) or the interpreter, half precision (or float32 in the interpreter), power-of-two head
    dims; unpinned calls also need a candidate tile (`gemm_candidates`)."""
    if triton is None or TensorDescriptor is None or x.dim() != 2 or weight.dim() != 2:
        return False
    hidden = weight.shape[0] // 3
    head_dim = hidden // heads if heads and hidden % heads == 0 else 0
    if head_dim < 16 or head_dim & (head_dim - 1) or x.shape[1] % 16:
        return False
    if x.dtype != weight.dtype or not x.is_contiguous() or not weight.is_contiguous():
        return False
    if x.data_ptr() % 16 or weight.data_ptr() % 16:  # tensor descriptors need 16-byte aligned bases
        return False
    if x.is_cuda:
        return x.dtype in (torch.float16, torch.bfloat16) and is_hopper(x.device)
    return interpreting()




def linear_then_rope(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                     sin: torch.Tensor, heads: int, *, out: torch.Tensor | None = None,
                     use_triton: bool | None = None) -> torch.Tensor:
    """What `qkv_rope_linear` fuses, in two steps: the projection (into `out`'s storage if given) and `qkv_rope_`
    in place on it; `use_triton` as `qkv_rope_` takes it. Returns `(T, 3, H, D)`."""
    tokens, n = x.shape[0], weight.shape[0]
    if out is None:
        qkv = F.linear(x, weight, bias)
    elif bias is None:
        qkv = torch.mm(x, weight.t(), out=out.view(tokens, n))
    else:
        qkv = torch.addmm(bias, x, weight.t(), out=out.view(tokens, n))
    return qkv_rope_(qkv.view(tokens, 3, heads, n // 3 // heads), cos, sin, use_triton=use_triton)


def qkv_rope_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, heads: int, *, tile: tuple | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`(T, 3, H, D)` = x `(T, hidden)` @ weight `(3 * hidden, hidden)`^T + bias, Q and K rotated with
    float32 `(T, D/2)` tables. One kernel where `fused_qkv_rope_supported`, else the projection and
    the in-place pass. `tile` pins (block_m, block_n, block_k, warps, stages, persistent) (tests, benchmarks);
    `out`: a contiguous `(T, 3, H, D)` tensor to write into (a CUDA graph's static buffer)."""
    tokens, k_dim = x.shape
    n = weight.shape[0]
    head_dim = n // 3 // heads
    _check_tables(cos, sin, tokens, head_dim // 2)
    hidden = n // 3
    if out is not None and (out.shape != (tokens, 3, heads, head_dim) or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous {(tokens, 3, heads, head_dim)} tensor; got {tuple(out.shape)}")
    if not fused_qkv_rope_supported(x, weight, heads) or (
            tile is None and not interpreting() and not gemm_candidates(hidden, head_dim)):
        return linear_then_rope(x, weight, bias, cos, sin, heads, out=out)
    out = torch.empty((tokens, n), dtype=x.dtype, device=x.device) if out is None else out.view(tokens, n)

    def run(c):
        bm, bn, bk, warps, stages, persistent = c
        a_desc = TensorDescriptor(x, [tokens, k_dim], [x.stride(0), 1], [bm, bk])
        b_desc = TensorDescriptor(weight, [n, k_dim], [weight.stride(0), 1], [bn, bk])
        tiles = cdiv(tokens, bm) * cdiv(n, bn)
        args = (a_desc, b_desc, bias, out, cos, sin, tokens, n, out.stride(0), cos.stride(0), 2 * hidden)
        meta = dict(HEAD_DIM=head_dim, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, K_TILES=cdiv(k_dim, bk),
                    num_warps=warps, num_stages=stages)
        if persistent:
            sms = sm_count(x.device) if x.is_cuda else 4
            launch(_qkv_rope_gemm_persistent, (min(sms, tiles),), *args, NUM_SMS=min(sms, tiles), **meta)
        else:
            launch(_qkv_rope_gemm, (tiles,), *args, **meta)

    if bias is None:
        bias = torch.zeros(n, dtype=x.dtype, device=x.device)
    if tile is None and interpreting():
        tile = (32, head_dim, 32, 4, 2, False)  # small tiles: the interpreter's cost grows with the tile
    if tile is None:
        tile = choose(("qkv_rope_gemm", size_class(tokens), n, k_dim, head_dim, x.dtype, x.device),
                      lambda: gemm_candidates(hidden, head_dim), run)
    elif tile[1] % head_dim or hidden % tile[1]:
        raise ValueError(f"tile {tile}: block_n must be a multiple of head_dim {head_dim} dividing {hidden}")
    run(tile)
    return out.view(tokens, 3, heads, head_dim)
