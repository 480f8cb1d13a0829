"""Qwen2.5-VL's tower (RMSNorm, SwiGLU, windows, head dim 80) against transformers: checkpoints written by
transformers' own save_pretrained (full model, vision-only, sharded), the window order against
`get_vision_window_index`, the whole bytes -> embeddings path against its processor and
`Qwen2_5_VisionTransformerPretrainedModel`, on CPU in float32."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import encode_bytes, hf_input, make_video, photos, rel_err
from service.errors import CheckpointError
from service.model.config import PRESETS, preset, tower_config_from_dir
from service.model.encoder import Encoder
from service.model.graphs import BucketedTower
from service.model.preprocess import PreprocessConfig, Preprocessor
from service.model.tower import TowerOptions, window_order
from service.model.video import VideoConfig, sample_indices

TOL = 1e-5  # float32 on CPU

# Head dim 80 (the real towers'), an MLP width that is no multiple of 16 (the real towers' 3420: the loader pads it),
# windows of 2 x 2 merged patches (56 px), so that images of a few patches already have several windows and windows
# cut by the frame's edge; full attention in blocks 1 and 3.
TINY_VISION = dict(depth=4, hidden_size=160, intermediate_size=90, num_heads=2, out_hidden_size=48, window_size=56,
                   fullatt_block_indexes=[1, 3], patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
TINY_TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 28 * 28 * 1280, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"}


def _randomize(model):
    # transformers initialises biases to 0 and norms to 1; random values make the parity bite
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln_q" in name:
                p.add_(0.05 * torch.randn_like(p))


@pytest.fixture(scope="module")
def hf_full(tmp_path_factory):
    """A full Qwen2_5_VLForConditionalGeneration checkpoint, and the model."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=TINY_VISION, text_config=TINY_TEXT))
    _randomize(model)
    path = tmp_path_factory.mktemp("qwen2_5_vl_full")
    model.save_pretrained(path, safe_serialization=True)
    (path / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return path, model.eval()


@pytest.fixture(scope="module")
def visual(hf_full):
    return hf_full[1].model.visual


@pytest.fixture(scope="module")
def encoder(hf_full):
    return Encoder.load(str(hf_full[0]))


def _hf_merged(visual, pixels, grids):
    with torch.no_grad():
        out = visual(pixels, grid_thw=torch.tensor(grids))
    return out.pooler_output if hasattr(out, "pooler_output") else out


GRIDS = [
    [(1, 6, 10)],  # 3 x 5 merged patches: windows of 2 x 2 cut at the right and bottom
    [(1, 8, 8), (2, 4, 6), (1, 2, 2)],  # exact windows, a video of two temporal patches, one merged patch
    [(1, 2, 26), (3, 10, 4), (1, 14, 6)],  # a strip, a three-frame video, a tall image
]


@pytest.mark.parametrize("units", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("grids", GRIDS + [[(1, 16, 16), (1, 28, 30), (2, 34, 18)]])
def test_window_order_matches_transformers(grids, units):
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor(grids), spatial_merge_size=2, window_size=units * 28,
                                        patch_size=14)
    order, lengths = window_order(grids, 2, units)
    np.testing.assert_array_equal(order.reshape(-1, 4)[:, 0] // 4, index.numpy())
    np.testing.assert_array_equal(order.reshape(-1, 4) % 4, np.tile(np.arange(4), (len(index), 1)))
    np.testing.assert_array_equal(np.concatenate([[0], np.cumsum(lengths)]), cu.numpy())


@pytest.mark.parametrize("grids", GRIDS)
@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_tower_matches_transformers(hf_full, visual, grids, backend):
    """Images and videos, awkward grids, windows cut by edges: the SDPA fallback and the Triton path (interpreter:
    varlen attention at head dim 80, the RoPE pass, RMSNorm passes with the residual in the GEMMs)."""
    enc = Encoder.load(str(hf_full[0]), options=TowerOptions(attention_backend=backend))
    for p in enc.tower.parameters():
        p.data = p.data.clone()  # weights mapped from the file may be unaligned; tensor descriptors need 16 B
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, enc.config.patch_dim, generator=torch.Generator().manual_seed(n))
    with torch.no_grad():
        merged, deepstack = enc.tower(pixels, enc.tower.plan(grids))
    assert deepstack.shape == (0, n // 4, 48)
    assert rel_err(merged, _hf_merged(visual, pixels, grids)) <= TOL


def test_residual_in_gemm_matches_transformers(hf_full, visual):
    """The residual added in the GEMMs (off by default for this family: see TowerOptions) computes the same."""
    enc = Encoder.load(str(hf_full[0]), options=TowerOptions(residual_in_gemm=True))
    assert not Encoder.load(str(hf_full[0])).tower.residual_in_gemm
    grids = GRIDS[1]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), enc.config.patch_dim)
    with torch.no_grad():
        merged, _ = enc.tower(pixels, enc.tower.plan(grids))
    assert rel_err(merged, _hf_merged(visual, pixels, grids)) <= TOL


def test_bytes_to_embeddings_match_transformers(hf_full, encoder):
    """The awkward photo set (RGBA, grey, tiny, 1:20, real photographs) through our preprocessing and packed
    forward, against transformers' Qwen2-VL image processor (Qwen2.5-VL's settings) and get_image_features."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    model = hf_full[1]
    processor = Qwen2VLImageProcessorPil(**{k: v for k, v in PREPROCESSOR.items() if "type" not in k
                                            and k != "processor_class"})
    blobs = {name: encode_bytes(img, "JPEG" if name in ("astronaut", "coffee") else "PNG")
             for name, img in photos().items()}
    results = encoder.encode([encoder.preprocess(b) for b in blobs.values()])
    import io

    images = [Image.open(io.BytesIO(b)) for b in blobs.values()]
    inputs = processor(images=[hf_input(img) for img in images], return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
    ref = ref.pooler_output if hasattr(ref, "pooler_output") else ref
    for name, got, grid, want in zip(blobs, results, inputs["image_grid_thw"].tolist(), ref):
        assert list(got.grid_thw) == grid, name
        assert got.embeds.shape == want.shape, name
        assert rel_err(got.embeds, want) <= TOL, name
        assert rel_err(got.pooled, want.mean(0)) <= TOL, name


def test_packing_invariance(encoder):
    items = [encoder.preprocess(encode_bytes(img)) for img in photos().values()]
    together = encoder.encode(items)
    reverse = encoder.encode(items[::-1])[::-1]
    for item, packed, rev in zip(items, together, reverse):
        alone = encoder.encode([item])[0]
        assert alone.grid_thw == packed.grid_thw
        assert rel_err(packed.embeds, alone.embeds) <= TOL
        assert rel_err(rev.embeds, alone.embeds) <= TOL


def test_bucketed_forward_matches_eager(encoder):
    """The bucketed path (graph pieces run eagerly on the CPU) pads a pack to its bucket; the window order goes in
    before the pieces and comes out after: the same embeddings as the plain forward."""
    tower = encoder.tower
    bucketed = BucketedTower(tower, (64, 256, 512))
    bucketed.capture()
    for grids in GRIDS:
        n = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(n, encoder.config.patch_dim)
        with torch.inference_mode():
            want, _ = tower(pixels, tower.plan(grids))
            got, ds = bucketed(pixels, grids)
        assert bucketed.bucket_for(n) is not None
        assert ds.shape[0] == 0
        assert rel_err(got, want) <= TOL


def test_video_matches_transformers(hf_full, encoder, tmp_path):
    """A clip through our decoder and Qwen2-VL's video sampling and per-frame sizing, against the same steps
    written from `Qwen2VLVideoProcessor` (its module needs torchvision, which CPU CI cannot install; its resize
    is PyTorch's uint8 bicubic antialiased interpolate there), then the tower against transformers'."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
    from transformers.video_utils import load_video

    cfg = encoder.preprocessor.config
    assert cfg.video.per_frame and cfg.video.image_mean == tuple(CLIP_MEAN)
    data = make_video(61, 130, 50, "mp4", "libx264", 24, seed=3)
    got = encoder.preprocess(data)

    def sample(metadata):  # Qwen2VLVideoProcessor.sample_frames at fps=2 (the server samples; see VideoConfig)
        total = metadata.total_num_frames
        most = int(min(768, total) // 2 * 2)
        n = min(max(total / metadata.fps * 2, 4), most, total) // 2 * 2
        return torch.arange(0, total, total / n).int().numpy()

    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    frames, meta = load_video(str(path), backend="pyav", sample_indices_fn=sample)
    assert got.meta["frame_indices"] == list(meta.frames_indices)
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    h, w = smart_resize(x.shape[2], x.shape[3], factor=28, min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28)
    x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    mean, std = torch.tensor(CLIP_MEAN) * 255.0, torch.tensor(CLIP_STD) * 255.0
    x = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    if len(x) % 2:
        x = torch.cat([x, x[-1:]])
    t, gh, gw = len(x) // 2, h // 14, w // 14
    ref = x.view(t, 2, 3, gh // 2, 2, 14, gw // 2, 2, 14).permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(t * gh * gw, -1)
    assert got.grid_thw == (t, gh, gw)
    np.testing.assert_allclose(got.pixel_values, ref.numpy(), rtol=0, atol=1e-6)
    (result,) = encoder.encode([got])
    assert rel_err(result.embeds, _hf_merged(hf_full[1].model.visual, ref, [got.grid_thw])) <= TOL


def test_qwen2_sampling_formula():
    cfg = VideoConfig.for_family("qwen2_5_vl")
    for total, fps, want in ((61, 24.0, 4), (240, 24.0, 20), (7, 10.0, 4), (9000, 30.0, 600), (3, 24.0, 2)):
        idx = sample_indices(total, fps, cfg)
        assert len(idx) == want and idx[0] == 0 and all(np.diff(idx) > 0) and idx[-1] < total
    assert len(sample_indices(100, 24.0, cfg, num_frames=7)) == 8  # rounded to the temporal patch


def test_loading_vision_only_and_sharded(hf_full, tmp_path):
    """A vision-only checkpoint (the tower's own save_pretrained) and a sharded full one load to the same tower."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    visual = hf_full[1].model.visual
    vision_dir = tmp_path / "vision"
    visual.save_pretrained(vision_dir, safe_serialization=True)
    assert json.loads((vision_dir / "config.json").read_text())["model_type"] == "qwen2_5_vl_vision"
    cfg = tower_config_from_dir(vision_dir)
    assert (cfg.family, cfg.head_dim, cfg.window_size, cfg.fullatt_block_indexes) == ("qwen2_5_vl", 80, 56, (1, 3))
    grids = GRIDS[0]
    pixels = torch.randn(60, cfg.patch_dim)
    want = _hf_merged(visual, pixels, grids)
    enc = Encoder.load(str(vision_dir))
    assert enc.preprocessor.config.patch_size == 14 and enc.preprocessor.config.image_mean == tuple(CLIP_MEAN)
    with torch.no_grad():
        assert rel_err(enc.tower(pixels, enc.tower.plan(grids))[0], want) <= TOL

    torch.manual_seed(1)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(vision_config=TINY_VISION, text_config=TINY_TEXT))
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, safe_serialization=True, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    enc = Encoder.load(str(sharded))
    with torch.no_grad():
        got = enc.tower(pixels, enc.tower.plan(grids))[0]
    assert rel_err(got, _hf_merged(model.model.visual, pixels, grids)) <= TOL


def test_old_style_full_config(tmp_path):
    """Released Qwen2.5-VL checkpoints name their vision config `qwen2_5_vl` and carry aliases (`in_chans`,
    `spatial_patch_size`); transformers' config class reads them."""
    vision = {"depth": 32, "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "hidden_size": 1280,
              "in_channels": 3, "in_chans": 3, "intermediate_size": 3420, "model_type": "qwen2_5_vl", "num_heads": 16,
              "out_hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "spatial_patch_size": 14,
              "temporal_patch_size": 2, "tokens_per_second": 2, "window_size": 112}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": vision}))
    cfg = tower_config_from_dir(tmp_path)
    assert cfg == preset("qwen2.5-vl-7b")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl", "vision_config": vision}))
    with pytest.raises(CheckpointError, match="Qwen2.5-VL"):
        tower_config_from_dir(tmp_path)


def test_presets():
    for name in ("qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "qwen2.5-vl-72b"):
        cfg = PRESETS[name]
        assert (cfg.family, cfg.head_dim, cfg.patch_size, cfg.window_units, cfg.deepstack_visual_indexes) == \
            ("qwen2_5_vl", 80, 14, 4, ())
    assert [PRESETS[f"qwen2.5-vl-{s}"].out_hidden_size for s in ("3b", "7b", "32b", "72b")] == [2048, 3584, 5120, 8192]
    pre = PreprocessConfig.for_family("qwen2_5_vl")
    assert (pre.patch_size, pre.min_pixels, pre.max_pixels) == (14, 3136, 1003520)
    assert Preprocessor(pre)(encode_bytes(photos()["astronaut"])).grid_thw == (1, 36, 36)


def test_served_over_http(hf_full, encoder):
    """The same service serves the family: /info names it, /embed returns merged tokens, grid and pooled vector
    (the same as the encoder's), a safetensors body without DeepStack, and deepstack=true is a 422 naming why."""
    import httpx
    from safetensors.torch import load

    from servers import serve

    data = encode_bytes(photos()["chelsea"], "PNG")
    ref = encoder.encode([encoder.preprocess(data)])[0]
    with serve(encoder, model=str(hf_full[0]), max_wait_ms=5) as (url, _):
        info = httpx.get(f"{url}/info", timeout=30).json()
        assert info["family"] == "qwen2_5_vl" and info["architecture"]["fullatt_block_indexes"] == [1, 3]
        assert info["preprocessing"]["patch_size"] == 14
        r = httpx.post(f"{url}/embed?pooling=mean", content=data, headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 200, r.text
        (d,) = r.json()["data"]
        assert d["grid_thw"] == list(ref.grid_thw) and "deepstack" not in d
        assert rel_err(torch.tensor(d["embeddings"]), ref.embeds) <= 1e-5
        assert rel_err(torch.tensor(d["pooled"]), ref.pooled) <= 1e-5
        r = httpx.post(f"{url}/embed?format=safetensors", content=data, headers={"content-type": "image/png"},
                       timeout=60)
        assert r.status_code == 200 and sorted(load(r.content)) == ["embeds.0", "grid_thw.0"]
        r = httpx.post(f"{url}/embed?deepstack=true", content=data, headers={"content-type": "image/png"}, timeout=60)
        assert r.status_code == 422 and "DeepStack" in r.text
