"""The engine's way in on a GPU: frames read from a page-locked shared arena, and the patchify kernel in bfloat16."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from kernels.patchify import patchify, reference_patchify
from service.engine.shm import Arena, attach, page_lock, page_unlock
from service.model.encoder import Encoder

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("batch,frames,height,width,patch", [(1, 1, 448, 448, 16), (5, 1, 224, 640, 16),
                                                            (1, 3, 56, 84, 14), (2, 16, 448, 252, 14)])
def test_patchify_kernel_bf16(batch, frames, height, width, patch):
    g = torch.Generator(device="cuda").manual_seed(height + frames)
    pixels = torch.randint(0, 256, (batch, frames, height, width, 3), generator=g, dtype=torch.uint8, device="cuda")
    table = torch.randn(256, 3, generator=g, device="cuda").to(torch.bfloat16)
    rows = batch * -(-frames // 2) * (height // patch) * (width // patch)
    expected = reference_patchify(pixels, table, torch.empty(rows, 6 * patch * patch, dtype=torch.bfloat16,
                                                             device="cuda"), 2, patch, 2)
    got = patchify(pixels, table, torch.full_like(expected, float("nan")), 2, patch, 2)
    assert torch.equal(got, expected)


def test_frames_from_a_page_locked_arena_equal_staged_ones():
    """Items whose frames lie in the engine's page-locked mapping of a front-end's arena (`pinned`: copied by the GPU
    from there, all in one call) give the pack the same rows as the same frames in pageable memory (staged through
    pinned memory), mixed in one pack; and an all-pinned pack and an all-pageable one the same as each alone."""
    enc = Encoder.load("random:tiny", "cuda", "bfloat16")
    rng = np.random.default_rng(3)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((64, 64), (64, 64), (32, 96), (448, 448))]
    items = [enc.preprocess(Image.fromarray(img)) for img in images]
    arena = Arena(8 << 20)
    try:
        offsets = [arena.put(np.ascontiguousarray(it.frames)) for it in items]
        mapping = attach(arena.path)
        locked = page_lock(mapping, enc.device)
        assert locked is not None
        try:
            mapped = [enc.preprocessor.item(np.frombuffer(mapping, np.uint8, it.frames.size, at).reshape(
                it.frames.shape), it.grid_thw, it.meta, pinned=True) for it, at in zip(items, offsets)]
            assert torch.from_numpy(mapped[0].frames.reshape(-1)).is_pinned()
            pack = [mapped[0], items[1], mapped[2], mapped[3], items[0]]  # locked and pageable, interleaved
            got = enc.pixels(pack)
            expected = torch.cat([torch.from_numpy(it.pixel_values) for it in pack]).to("cuda", torch.bfloat16)
            assert torch.equal(got, expected)
            for alike in (mapped, items):
                want = torch.cat([torch.from_numpy(it.pixel_values) for it in alike]).to("cuda", torch.bfloat16)
                assert torch.equal(enc.pixels(alike), want)
        finally:
            page_unlock(locked, enc.device)
        assert not torch.from_numpy(mapped[0].frames.reshape(-1)).is_pinned()
    finally:
        arena.close()


def test_a_lone_frame_from_its_frames_equals_its_pixel_rows_path():
    """A lone image or two-frame video enters the whole-forward graph through `BucketedTower.frame` (its frames
    copied to the device, from a page-locked arena or pageable memory, and patchified inside a graph that reads their
    shape there): the same tokens, DeepStack features and pooled vector, bit for bit, as the same item through its
    patch rows (`Encoder.pixels`, then the bucket's graph), for sizes in turn and after a pack of two."""
    enc = Encoder.load("random:qwen3-vl-2b", "cuda", "bfloat16", graph_buckets=(256, 800, 2048, 4096))
    enc.capture_graphs()
    rng = np.random.default_rng(5)
    sizes = [(448, 448), (448, 448), (224, 672), (1024, 512), (32, 32), (896, 1024)]
    items = [enc.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))) for h, w in sizes]
    items.append(enc.preprocessor.item(rng.integers(0, 256, (2, 256, 384, 3), dtype=np.uint8), (1, 16, 24),
                                       {"kind": "video"}))
    arena = Arena(32 << 20)
    mapping = attach(arena.path)
    locked = page_lock(mapping, enc.device)
    try:
        for k, it in enumerate(items):
            if k % 2:  # every other one from the page-locked arena, as the engine reads them
                at = arena.put(np.ascontiguousarray(it.frames))
                it = enc.preprocessor.item(np.frombuffer(mapping, np.uint8, it.frames.size, at).reshape(
                    it.frames.shape), it.grid_thw, it.meta, pinned=True)
            before = enc.forward.whole_forwards
            got = enc.encode([it], deepstack=True, tokens=True)[0]
            assert enc.forward.whole_forwards == before + 1, it.grid_thw
            with torch.inference_mode():
                merged, ds = enc.forward(enc.pixels([it]), [it.grid_thw], True)
            assert torch.equal(got.embeds, merged.cpu()) and torch.equal(got.deepstack, ds.cpu()), it.grid_thw
            assert torch.equal(got.pooled, merged.float().mean(0).cpu())
            if k == 3:
                enc.encode(items[:2])  # a pack of two in between: the pieces' way
    finally:
        page_unlock(locked, enc.device)
        arena.close()


def test_packs_launched_back_to_back_get_their_own_outputs():
    """A pack's frames go to the device on a stream of their own while the forward before it computes, and its
    outputs come back on another while the next one does: eight packs of fresh images (mixed sizes, some from a
    page-locked arena), each launched before any is finished, give bit for bit what each pack gives encoded alone
    on an idle device."""
    enc = Encoder.load("random:qwen3-vl-2b", "cuda", "bfloat16", graph_buckets=(1024, 4096, 8192, 16384))
    enc.capture_graphs()
    rng = np.random.default_rng(7)
    sizes = [(448, 448), (224, 672), (896, 448), (64, 64), (1024, 1024), (448, 448)]
    arena = Arena(256 << 20)
    mapping = attach(arena.path)
    locked = page_lock(mapping, enc.device)
    try:
        packs = []
        for p in range(8):
            pack = []
            for k in range(1 + p % 5):
                it = enc.preprocess(Image.fromarray(rng.integers(0, 256, (*sizes[(p + k) % len(sizes)], 3),
                                                                 dtype=np.uint8)))
                if (p + k) % 2:
                    at = arena.put(np.ascontiguousarray(it.frames))
                    it = enc.preprocessor.item(np.frombuffer(mapping, np.uint8, it.frames.size, at).reshape(
                        it.frames.shape), it.grid_thw, it.meta)
                pack.append(it)
            packs.append(pack)
        pending = [enc.launch(pack, deepstack=True, tokens=True) for pack in packs]
        got = [enc.finish(p) for p in pending]
        for pack, results in zip(packs, got):
            alone = enc.encode(pack, deepstack=True, tokens=True)
            torch.cuda.synchronize()
            for a, b in zip(results, alone):
                assert torch.equal(a.embeds, b.embeds) and torch.equal(a.deepstack, b.deepstack)
                assert torch.equal(a.pooled, b.pooled)
    finally:
        page_unlock(locked, enc.device)
        arena.close()
