"""Qwen2.5-VL's tower (windows, head dim 80) in bfloat16 on a CUDA GPU against transformers, at the real towers'
dimensions (every size shares the 7B preset's tower).

Tolerance (issue 34): our error against transformers' float32 tower may be at most transformers' own bfloat16
tower's error against the same reference.
"""

from __future__ import annotations

import pytest
import torch

from conftest import encode_bytes, hf_tower, make_video, photos, rel_err
from service.model.config import preset
from service.model.encoder import Encoder
from service.model.graphs import BucketedTower
from service.model.loader import random_tower
from service.model.preprocess import PreprocessConfig, Preprocessor
from service.model.tower import TowerOptions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PRE = Preprocessor(PreprocessConfig.for_family("qwen2_5_vl"))


def hf_merged(model, pixels, grids):
    with torch.no_grad():
        out = model(pixels.to(model.dtype), grid_thw=torch.tensor(grids, device="cuda"))
    return out.pooler_output if hasattr(out, "pooler_output") else out


@pytest.fixture(scope="module")
def towers():
    cfg = preset("qwen2.5-vl-7b")
    state = {k: v.clone() for k, v in random_tower(cfg, "cuda", torch.float32, seed=1).state_dict().items()}
    ours = random_tower(cfg, "cuda", torch.bfloat16, seed=1)
    ref = hf_tower(cfg, state, torch.float32)
    hf_bf16 = hf_tower(cfg, state, torch.bfloat16)
    yield cfg, ours, ref, hf_bf16
    del ours, ref, hf_bf16
    torch.cuda.empty_cache()


def _pack():
    """Real photos at their native sizes, RGBA, grey, a tiny and a 1:20 image, packed together."""
    return [PRE(encode_bytes(img)) for img in photos().values()]


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_tower_bf16_parity(towers, backend):
    cfg, ours, ref, hf_bf16 = towers
    items = _pack()
    grids = [it.grid_thw for it in items]
    pixels = torch.cat([torch.from_numpy(it.pixel_values) for it in items]).cuda()
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_m, hf_m = hf_merged(ref, pixels, grids), hf_merged(hf_bf16, pixels, grids)
    ours._backend = backend
    try:
        with torch.inference_mode():
            m, ds = ours(pixels.to(torch.bfloat16), ours.plan(grids))
    finally:
        ours._backend = None
    err, hf_err = rel_err(m, ref_m), rel_err(hf_m, ref_m)
    print(f"qwen2.5-vl-7b {backend}: merged rel err {err:.3e} (transformers bf16 {hf_err:.3e})")
    assert ds.shape[0] == 0
    assert err <= hf_err


def test_video_and_images_end_to_end(towers):
    """A video and images through the served path (uint8 frames normalised and patchified on the GPU, the pack
    bucketed): within transformers' own bf16 error of its float32 tower; each item encoded alone within 1.5x
    transformers' bf16 error on that item (packing changes the bucket, so the GEMMs' kernels, not the function)."""
    cfg, ours, ref, hf_bf16 = towers
    items = [PRE(make_video(75, 320, 240, "mp4", "libx264", rate=30, seed=1))] + _pack()[:3]
    assert items[0].meta["kind"] == "video" and items[0].grid_thw[0] == 2
    enc = Encoder(ours, PRE, graph_buckets=(4096, 16384))
    enc.capture_graphs()
    cpu = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    with torch.inference_mode():
        assert torch.equal(enc.pixels(items).cpu(), cpu.to(torch.bfloat16))
    grids = [it.grid_thw for it in items]
    ref_m, hf_m = hf_merged(ref, cpu.cuda(), grids), hf_merged(hf_bf16, cpu.cuda(), grids)
    packed = enc.encode(items)
    merged = torch.cat([r.embeds for r in packed]).cuda()
    err, hf_err = rel_err(merged, ref_m), rel_err(hf_m, ref_m)
    print(f"qwen2.5-vl-7b video+images, bucketed: merged rel err {err:.3e} (transformers bf16 {hf_err:.3e})")
    assert err <= hf_err
    start = 0
    for it, r in zip(items, packed):  # alone, an item is padded to another bucket: another bf16 rounding
        n = r.num_tokens
        alone = enc.encode([it])[0].embeds.cuda()
        assert rel_err(alone, ref_m[start:start + n]) <= 1.5 * rel_err(hf_m[start:start + n], ref_m[start:start + n])
        start += n


def test_bucketed_graphs_equal_eager():
    """The bucketed graphs (served) with windows: within 2x the eager forward's own bf16 error against the float32 tower (bit-equal where cuBLAS picks the same kernels)."""
    cfg = preset("qwen2.5-vl-7b")
    tower = random_tower(cfg, "cuda", torch.bfloat16, seed=4)
    ref = random_tower(cfg, "cuda", torch.float32, seed=4, options=TowerOptions(attention_backend="sdpa"))
    bucketed = BucketedTower(tower, (256, 1024, 4096))
    packs = [[(1, 32, 32)], [(1, 16, 40), (2, 8, 8)], [(1, 2, 2)], [(1, 74, 74)], [(1, 32, 32)] * 3]
    with torch.inference_mode():
        bucketed.capture()
        for grids in packs:
            tokens = sum(t * h * w for t, h, w in grids)
            pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
            e_merged, _ = tower(pixels, tower.plan(grids))
            r_merged, _ = ref(pixels.float(), ref.plan(grids))
            e_err = rel_err(e_merged.float(), r_merged)
            merged, ds = bucketed(pixels, grids)
            err = rel_err(merged.float(), r_merged)
            print(f"bucketed {tokens} tokens: rel err {err:.2e} (eager {e_err:.2e}), "
                  f"equal {torch.equal(merged, e_merged)}")
            assert merged.shape == e_merged.shape and ds.shape[0] == 0
            assert err <= 2 * e_err, grids
    assert bucketed.eager == 1  # the 5476-token pack is beyond 4096
