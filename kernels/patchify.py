"""uint8 frames -> normalised patch rows in the tower's merge-block order, in one pass.

The PyTorch version is a lookup (a long copy of the frames, an index tensor, a gather), a permutation and a copy
into the output: about six launches and their host time per run of same-shaped items, which a lone image's latency
pays in full. The kernel reads each output row's pixels straight from the frames, looks each value up in the table
and writes the row: one launch, the same values (a lookup copies table entries; nothing is computed).
"""

from __future__ import annotations

import torch

from .runtime import cdiv, launch, next_power_of_2

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None


def reference_patchify(frames: torch.Tensor, table: torch.Tensor, out: torch.Tensor, temporal: int, patch: int,
                       merge: int) -> torch.Tensor:
    """uint8 `[B, F, H, W, C]` -> `out` `[B*t*h*w, C*temporal*patch*patch]`: each value replaced by `table[value, c]`
    (`table` `[256, C]`, in out's dtype), rows in merge-block order (merge x merge patches together), each row one
    patch flattened as (C, temporal, patch, patch). A trailing odd frame fills its temporal patch by repetition (an
    image's one frame is read for both halves)."""
    tp, p, m = temporal, patch, merge
    batch, n_frames, height, width, channels = frames.shape
    x = table[frames.long(), torch.arange(channels, device=frames.device)]  # [B, F, H, W, C] normalised
    if n_frames == 1:
        x = x.expand(batch, tp, height, width, channels)
    elif n_frames % tp:
        x = torch.cat([x, x[:, -1:].expand(-1, tp - n_frames % tp, -1, -1, -1)], dim=1)
    t, gh, gw = x.shape[1] // tp, height // p, width // p
    x = x.view(batch, t, tp, gh // m, m, p, gw // m, m, p, channels)
    # -> (B, t, gh/m, gw/m, m, m, C, tp, p, p): merge blocks outermost, each patch flattened as (C, tp, p, p)
    x = x.permute(0, 1, 3, 6, 4, 7, 9, 2, 5, 8)
    out.view(batch, t, gh // m, gw // m, m, m, channels, tp, p, p).copy_(x)
    return out


if triton is not None:

    @triton.jit
    def _patchify_rows(FRAMES, TABLE, OUT, rows, n_rows, n_frames, height, width, grid_w, rows_per_frame,
                       C: tl.constexpr, TP: tl.constexpr, P: tl.constexpr, M: tl.constexpr, BLOCK_C: tl.constexpr):
        # rows: item b, temporal patch t, merge block (bh, bw), patch (mh, mw) within it; rows_per_frame = h * w
        cols = tl.arange(0, BLOCK_C)
        row_mask = rows < n_rows
        rows64 = rows.to(tl.int64)
        t_all = rows64 // rows_per_frame  # b * t + t_idx
        rest = rows % rows_per_frame
        blocks_w = grid_w // M
        block, within = rest // (M * M), rest % (M * M)
        gy = (block // blocks_w) * M + within // M
        gx = (block % blocks_w) * M + within % M
        n_t = (n_frames + TP - 1) // TP
        b, t_idx = t_all // n_t, t_all % n_t
        # columns: channel c, temporal half tp, pixel (py, px)
        c = cols // (TP * P * P)
        half = (cols // (P * P)) % TP
        py, px = (cols // P) % P, cols % P
        frame = tl.minimum(t_idx[:, None] * TP + half[None, :], n_frames - 1)  # a trailing odd frame repeats
        y = gy[:, None] * P + py[None, :]
        x = gx[:, None] * P + px[None, :]
        src = (((b[:, None] * n_frames + frame) * height + y) * width + x) * C + c[None, :]
        mask = row_mask[:, None] & (cols < C * TP * P * P)[None, :]
        value = tl.load(FRAMES + src, mask=mask, other=0).to(tl.int32)
        normalised = tl.load(TABLE + value * C + c[None, :], mask=mask)
        tl.store(OUT + rows64[:, None] * (C * TP * P * P) + cols[None, :], normalised, mask=mask)

    # The shape arguments are not specialised: Triton compiles a kernel anew for each integer argument's class
    # (equal to 1, divisible by 16, neither), and here the classes follow the image's size, so a warm-up of a few
    # sizes missed the most common one (448 px: 28 patches a row, 784 a frame) and its first request compiled for
    # a quarter-second while every other waited. The loads are per-channel gathers: nothing vectorises on them.
    @triton.jit(do_not_specialize=["n_rows", "n_frames", "height", "width", "grid_w", "rows_per_frame"])
    def _patchify_kernel(FRAMES, TABLE, OUT, n_rows, n_frames, height, width, grid_w, rows_per_frame,
                         C: tl.constexpr, TP: tl.constexpr, P: tl.constexpr, M: tl.constexpr,
                         BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        _patchify_rows(FRAMES, TABLE, OUT, rows, n_rows, n_frames, height, width, grid_w, rows_per_frame, C, TP, P,
                       M, BLOCK_C)

    @triton.jit
    def _patchify_dims_kernel(FRAMES, TABLE, OUT, DIMS, C: tl.constexpr, TP: tl.constexpr, P: tl.constexpr,
                              M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # one item whose frame count, height and width are read from DIMS on the device (a CUDA graph replays this
        # launch for any frame); programs past its rows exit
        n_frames, height, width = tl.load(DIMS), tl.load(DIMS + 1), tl.load(DIMS + 2)
        grid_w = width // P
        rows_per_frame = (height // P) * grid_w
        n_rows = rows_per_frame * ((n_frames + TP - 1) // TP)
        first = tl.program_id(0) * BLOCK_R
        if first < n_rows:
            rows = first + tl.arange(0, BLOCK_R)
            _patchify_rows(FRAMES, TABLE, OUT, rows, n_rows, n_frames, height, width, grid_w, rows_per_frame, C, TP,
                           P, M, BLOCK_C)


def _tiles(cols: int) -> tuple[int, int]:
    block_c = next_power_of_2(cols)
    return max(1, 4096 // block_c), block_c


def patchify(frames: torch.Tensor, table: torch.Tensor, out: torch.Tensor, temporal: int, patch: int, merge: int,
             use_triton: bool | None = None) -> torch.Tensor:
    """`reference_patchify`'s result in `out`; by the kernel where it runs (`use_triton` None: on a CUDA device with
    Triton)."""
    batch, n_frames, height, width, channels = frames.shape
    cols = channels * temporal * patch * patch
    rows = batch * -(-n_frames // temporal) * (height // patch) * (width // patch)
    if frames.dtype != torch.uint8 or table.shape != (256, channels) or out.shape != (rows, cols) \
            or height % (patch * merge) or width % (patch * merge):
        raise ValueError(f"patchify: frames {tuple(frames.shape)} {frames.dtype}, table {tuple(table.shape)}, out "
                         f"{tuple(out.shape)} do not fit patch {patch}, temporal {temporal}, merge {merge}")
    if use_triton is None:
        use_triton = triton is not None and out.is_cuda
    if not use_triton or not (frames.is_contiguous() and out.is_contiguous()):
        return reference_patchify(frames, table, out, temporal, patch, merge)
    block_r, block_c = _tiles(cols)
    launch(_patchify_kernel, (cdiv(rows, block_r),), frames, table.contiguous(), out, rows, n_frames, height, width,
           width // patch, (height // patch) * (width // patch), C=channels, TP=temporal, P=patch, M=merge,
           BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out


def patchify_dims(frames: torch.Tensor, dims: torch.Tensor, table: torch.Tensor, out: torch.Tensor, temporal: int,
                  patch: int, merge: int, use_triton: bool | None = None) -> torch.Tensor:
    """`patchify` of one item whose shape is data: `frames` a flat uint8 buffer holding its `[F, H, W, C]` frames
    first, `dims` an int32 tensor (F, H, W) on the same device. The kernel reads the shape there, so one launch,
    captured in a CUDA graph, serves any item; it writes the item's rows of `out` (`[max_rows, C*T*P*P]`, max_rows
    bounding every item it is given) and leaves the rest. Elsewhere the shape is read to the host and
    `reference_patchify` fills the same rows."""
    cols, channels = out.shape[1], table.shape[1]
    if frames.dtype != torch.uint8 or dims.dtype != torch.int32 or cols != channels * temporal * patch * patch:
        raise ValueError(f"patchify_dims: frames {frames.dtype}, dims {dims.dtype}, table {tuple(table.shape)}, out "
                         f"{tuple(out.shape)} do not fit patch {patch}, temporal {temporal}")
    if use_triton is None:
        use_triton = triton is not None and out.is_cuda
    if not use_triton:
        n_frames, height, width = (int(v) for v in dims.tolist())
        rows = -(-n_frames // temporal) * (height // patch) * (width // patch)
        item = frames[:n_frames * height * width * channels].view(1, n_frames, height, width, channels)
        return reference_patchify(item, table, out[:rows], temporal, patch, merge)
    block_r, block_c = _tiles(cols)
    launch(_patchify_dims_kernel, (cdiv(out.shape[0], block_r),), frames, table, out, dims, C=channels, TP=temporal,
           P=patch, M=merge, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)
    return out
