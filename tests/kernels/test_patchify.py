"""Frames to normalised patch rows (`kernels/patchify.py`) under the interpreter, against its reference."""

from __future__ import annotations

import inspect

import pytest
import torch

from conftest import gpu
from kernels.patchify import patchify, patchify_dims, reference_patchify



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


def test_the_kernel_compiles_once_whatever_the_items_shape():
    """Triton compiles a kernel anew for each class of its integer arguments (equal to 1, divisible by 16,
    neither). The kernel's are all shapes (rows, frames, height, width, grid width, rows a frame): were they
    specialised, an image size the warm-up never ran compiled on its first request while every other waited (the
    soak at cfe8cd5: 448 px, 28 patches a row, 266 ms). None of them may be."""
    from kernels.patchify import _patchify_kernel

    jit = getattr(_patchify_kernel, "kwargs", None)  # the interpreter keeps the decorator's arguments
    names = (jit.get("do_not_specialize") or []) if jit is not None else \
        [p.name for p in _patchify_kernel.params if p.do_not_specialize]
    arguments = list(inspect.signature(getattr(_patchify_kernel, "fn", _patchify_kernel)).parameters)
    ints = [a for a in arguments[:arguments.index("C")] if a not in ("FRAMES", "TABLE", "OUT")]
    assert ints and set(ints) <= set(names), (ints, names)


@gpu
def test_no_image_or_video_shape_compiles_the_kernel_after_the_first():
    """On the GPU, through the launcher the engine uses: after one image, images of other sizes (divisible by 16
    patches a row and not), a run of three, and videos of one, two and three frames compile nothing more."""
    from kernels.runtime import LAUNCHER

    def run(batch, frames, height, width):
        pixels = torch.randint(0, 256, (batch, frames, height, width, 3), dtype=torch.uint8, device="cuda")
        table = torch.randn(256, 3, device="cuda", dtype=torch.bfloat16)
        rows = batch * -(-frames // 2) * (height // 16) * (width // 16)
        out = torch.empty(rows, 3 * 2 * 16 * 16, dtype=torch.bfloat16, device="cuda")
        got = patchify(pixels, table, out, 2, 16, 2, use_triton=True)
        assert torch.equal(got, reference_patchify(pixels, table, torch.empty_like(out), 2, 16, 2))

    run(1, 1, 512, 512)
    before, serving = LAUNCHER.compiles_while_serving, LAUNCHER.serving
    LAUNCHER.serving = True
    try:
        for shape in [(1, 1, 448, 448), (1, 1, 480, 640), (3, 1, 224, 224), (1, 1, 96, 4096), (1, 2, 448, 448),
                      (1, 3, 320, 544), (2, 4, 64, 64)]:
            run(*shape)
    finally:
        LAUNCHER.serving = serving
    assert LAUNCHER.compiles_while_serving == before
