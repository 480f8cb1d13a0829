"""Video bytes -> patches, against transformers' Qwen3-VL video processor.

transformers decodes with its own PyAV reader (`load_video(backend="pyav")`) and samples with the
processor's own `sample_frames`; the comparison is exact (same uint8 frames, same float32 patches).
The processor's resize and normalise need torchvision, which CPU CI cannot install: there, the
reference applies them as torchvision does on the CPU (PyTorch's uint8 bicubic antialiased
interpolate; `(x - mean/rescale) / (std/rescale)` in float32). With torchvision installed (the GPU
machine) the processor itself is the reference.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from conftest import make_video
from service.errors import ImageTooLarge, InvalidInput, UnsupportedVideo, VideoTooLong
from service.model.preprocess import PreprocessConfig, Preprocessor
from service.model.video import VideoConfig, is_video, sample_indices

PRE = Preprocessor(PreprocessConfig())
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None


@pytest.fixture(scope="module")
def vp():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor()


def _decode_like_transformers(vp, data: bytes, tmp_path, **sample_kw):
    from transformers.video_utils import load_video

    path = tmp_path / "clip.bin"
    path.write_bytes(data)
    return load_video(str(path), backend="pyav", sample_indices_fn=lambda metadata: vp.sample_frames(metadata, **sample_kw))


def _reference_without_torchvision(vp, frames: np.ndarray):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()  # [T, C, H, W] uint8
    h, w = smart_resize(x.shape[0], x.shape[2], x.shape[3], temporal_factor=vp.temporal_patch_size,
                        factor=vp.patch_size * vp.merge_size, min_pixels=vp.size["shortest_edge"],
                        max_pixels=vp.size["longest_edge"])
    if (h, w) != tuple(x.shape[2:]):
        x = torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True, align_corners=False)
    mean = torch.tensor(vp.image_mean) * (1.0 / vp.rescale_factor)
    std = torch.tensor(vp.image_std) * (1.0 / vp.rescale_factor)
    x = (x.float() - mean.view(-1, 1, 1)) / std.view(-1, 1, 1)
    patches, t, gh, gw = vp.patchify(x[None], vp.patch_size, vp.merge_size, vp.temporal_patch_size)
    return patches[0].numpy(), (t, gh, gw)


CLIPS = [  # frames, width, height, container, codec, frame rate
    (30, 96, 64, "mp4", "mpeg4", 24),  # 1.25 s at 2 fps -> 4 frames (min_frames)
    (75, 130, 50, "mp4", "libx264", 30),  # non-square; 5 sampled frames: the last is repeated
    (7, 40, 300, "avi", "mpeg4", 10),  # tall, short: the sampler is capped by the 7 frames
    (75, 64, 48, "webm", "libvpx-vp9", 25),  # WebM's header has no frame count: counted from packets
]


@pytest.mark.parametrize("clip", CLIPS, ids=lambda c: f"{c[0]}f-{c[1]}x{c[2]}-{c[3]}")
def test_matches_transformers_pyav_pipeline(vp, clip, tmp_path):
    n, w, h, fmt, codec, rate = clip
    data = make_video(n, w, h, fmt, codec, rate, seed=n)
    assert is_video(data)
    got = PRE(data)
    frames, meta = _decode_like_transformers(vp, data, tmp_path) if fmt != "webm" else (None, None)
    if frames is None:  # transformers' PyAV reader trusts the header's frame count, which WebM lacks
        ref_indices = sample_indices(n, rate, VideoConfig())
    else:
        ref_indices = meta.frames_indices
        ref_pixels, ref_grid = _reference_without_torchvision(vp, frames)
        assert got.grid_thw == ref_grid
        np.testing.assert_array_equal(got.pixel_values, ref_pixels)
    np.testing.assert_array_equal(got.meta["frame_indices"], ref_indices)
    assert got.meta["source_frames"] == n and got.grid_thw[0] == -(-len(ref_indices) // 2)


@pytest.mark.skipif(not HAS_TORCHVISION, reason="transformers' video processor needs torchvision (GPU machine)")
@pytest.mark.parametrize("clip", CLIPS[:3], ids=lambda c: f"{c[0]}f-{c[1]}x{c[2]}-{c[3]}")
def test_matches_transformers_video_processor(vp, clip, tmp_path):
    n, w, h, fmt, codec, rate = clip
    data = make_video(n, w, h, fmt, codec, rate, seed=n)
    frames, meta = _decode_like_transformers(vp, data, tmp_path)
    ref = vp(videos=[frames], video_metadata=[meta], do_sample_frames=False, return_tensors="pt")
    got = PRE(data)
    assert got.grid_thw == tuple(int(v) for v in ref["video_grid_thw"][0])
    np.testing.assert_array_equal(got.pixel_values, ref["pixel_values_videos"].numpy())


@pytest.mark.parametrize("kw", [{"fps": 6.0}, {"num_frames": 9}, {"fps": 0.5}])
def test_sampling_options_match_transformers(vp, kw, tmp_path):
    data = make_video(48, 64, 64, seed=3)
    frames, meta = _decode_like_transformers(vp, data, tmp_path, **kw)
    got = PRE(data, **kw)
    np.testing.assert_array_equal(got.meta["frame_indices"], meta.frames_indices)
    ref_pixels, ref_grid = _reference_without_torchvision(vp, frames)
    assert got.grid_thw == ref_grid
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)


def test_header_overcounting_frames_matches_transformers(vp, tmp_path):
    """A cut-off MP4 whose index (written first) announces 40 frames of which 24 decode: the frames that
    decode are kept, and the resize follows their count, as in transformers (the sampled frames are
    resized as they decode, so a changed count means decoding again at the new size)."""
    data = make_video(40, 64, 48, rate=10, seed=4, faststart=True)
    cut = data[: int(len(data) * 0.7)]
    for kw in ({}, {"num_frames": 20}):
        got = PRE(cut, **kw)
        frames, meta = _decode_like_transformers(vp, cut, tmp_path, **kw)
        assert got.meta["source_frames"] == 40 and len(frames) < len(meta.frames_indices)
        assert got.meta["frame_indices"] == list(meta.frames_indices[: len(frames)])
        ref_pixels, ref_grid = _reference_without_torchvision(vp, frames)
        assert got.grid_thw == ref_grid
        np.testing.assert_array_equal(got.pixel_values, ref_pixels)
    with pytest.raises(UnsupportedVideo, match="1 of the 40 frames"):
        PRE(data[: int(len(data) * 0.3)])


def test_timestamps_match_qwen3vl_processor():
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    got = PRE(make_video(61, 64, 64, rate=30, seed=5))
    ref = Qwen3VLProcessor._calculate_timestamps(None, got.meta["frame_indices"], 30.0, 2)
    np.testing.assert_allclose(got.meta["timestamps"], ref)
    assert len(got.meta["timestamps"]) == got.grid_thw[0]


def test_sample_indices_against_transformers(vp):
    from transformers.video_utils import VideoMetadata

    rng = np.random.default_rng(0)
    for _ in range(200):
        total, fps = int(rng.integers(2, 5000)), float(rng.choice([1.0, 12.5, 24.0, 29.97, 60.0]))
        ref = vp.sample_frames(VideoMetadata(total_num_frames=total, fps=fps))
        np.testing.assert_array_equal(sample_indices(total, fps, VideoConfig()), ref)


def test_video_config_from_checkpoint(tmp_path):
    (tmp_path / "video_preprocessor_config.json").write_text(
        '{"fps": 1, "min_frames": 2, "max_frames": 64, "size": {"shortest_edge": 4096, "longest_edge": 25165824}, '
        '"image_mean": [0.48, 0.45, 0.4], "image_std": [0.26, 0.26, 0.27], "patch_size": 16}')
    cfg = PreprocessConfig.from_dir(tmp_path).video
    assert (cfg.fps, cfg.min_frames, cfg.max_frames, cfg.min_pixels, cfg.max_pixels) == (1.0, 2, 64, 4096, 25165824)
    assert cfg.image_mean == (0.48, 0.45, 0.4)
    assert PreprocessConfig.from_dir(tmp_path / "missing").video == VideoConfig()


def test_one_frame_refused():
    with pytest.raises(UnsupportedVideo, match="1 frame"):
        PRE(make_video(1, 32, 32))


def test_truncated_video_refused():
    data = make_video(20, 64, 64)
    with pytest.raises(UnsupportedVideo, match="corrupt|truncated"):
        PRE(data[: len(data) // 3])


def test_garbage_after_signature_refused():
    with pytest.raises(UnsupportedVideo, match="corrupt or unsupported video"):
        PRE(b"\x00\x00\x00\x18ftypisom" + bytes(range(256)) * 4)


def test_frame_limit():
    small = Preprocessor(PreprocessConfig(video=VideoConfig(max_source_frames=20)))
    with pytest.raises(VideoTooLong, match="21 frames exceeds the limit of 20"):
        small(make_video(21, 32, 32))
    with pytest.raises(VideoTooLong, match="exceeds the limit of 20"):  # WebM: counted from packets
        small(make_video(40, 32, 32, "webm", "libvpx-vp9"))


def test_frame_pixel_limit():
    small = Preprocessor(PreprocessConfig(max_image_pixels=1000))
    with pytest.raises(ImageTooLarge, match="64x32 = 2048 pixels exceed the limit of 1000"):
        small(make_video(4, 64, 32))


def test_fps_and_num_frames_exclusive():
    with pytest.raises(InvalidInput, match="mutually exclusive"):
        PRE(make_video(8, 32, 32), fps=1.0, num_frames=4)
