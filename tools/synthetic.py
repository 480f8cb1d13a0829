"""Synthetic inputs and weights for the tests and benchmarks: random towers that behave like trained ones under
quantisation (`unit_gain`, `plant_outliers`), and video files made from frames (`encode_video`). Not served code."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from service.model.tower import VisionTower


def unit_gain(tower: VisionTower, seed: int = 0) -> None:
    """Redraw the blocks' linear weights at std 1/sqrt(fan_in), so that every block changes the residual stream as
    much as trained blocks do (at the presets' std 0.02 the stream is the patch embedding, nearly unchanged, and
    any quantisation looks free)."""
    gen = torch.Generator(device=tower.device).manual_seed(seed)
    with torch.no_grad():
        for block in tower.blocks:
            for module in block.modules():
                if isinstance(module, torch.nn.Linear):
                    w = module.weight
                    w.copy_(torch.randn(w.shape, generator=gen, device=w.device) / w.shape[1] ** 0.5)


def plant_outliers(tower: VisionTower, channels=(3, 17, 40, 101), factors=(50.0, 100.0, 150.0, 200.0)) -> None:
    """Outlier channels where trained ViTs have them, without changing the function: each norm before a projection
    (norm1 before qkv, norm2 before fc1 or gate/up) scales `channels` by `factors`, and the projections after it
    divide the same input columns by them. The float tower computes what it did; the FP8 one sees activations whose
    few channels are 50-200x the rest, and weight columns that much smaller."""
    with torch.no_grad():
        for block in tower.blocks:
            hidden = block.norm2.weight.shape[0]
            mlp_in = [m for m in block.mlp.children() if isinstance(m, torch.nn.Linear) and m.in_features == hidden]
            for norm, linears in ((block.norm1, [block.attn.qkv]), (block.norm2, mlp_in)):
                for c, f in zip(channels, factors):
                    if c >= norm.weight.shape[0]:
                        continue
                    norm.weight[c] *= f
                    if getattr(norm, "bias", None) is not None:
                        norm.bias[c] *= f
                    for linear in linears:
                        linear.weight[:, c] /= f


def encode_video(frames, rate: int, fmt: str = "mp4", codec: str = "libx264", faststart: bool = False) -> bytes:
    """Encode RGB uint8 frames `[H, W, 3]` (all one size) with PyAV into a video file's bytes (the tests, benchmarks
    and load test make their clips with it). `faststart` (MP4): the index, with its frame count, before the data,
    as streaming sites write it."""
    import tempfile

    import av

    frames = list(frames)
    height, width = frames[0].shape[:2]
    tmp = tempfile.NamedTemporaryFile(suffix=f".{fmt}") if faststart else None  # the muxer rewrites the file
    buf = tmp.name if tmp else io.BytesIO()
    with av.open(buf, mode="w", format=fmt, options={"movflags": "faststart"} if faststart else {}) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    if tmp:
        with tmp:
            return Path(tmp.name).read_bytes()
    return buf.getvalue()
