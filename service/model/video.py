"""Video bytes -> sampled, resized uint8 frames and `grid_thw`, as transformers' Qwen3-VL video processor
computes them when it decodes with PyAV (Qwen2.5-VL's, `Qwen2VLVideoProcessor`, differs in two steps, marked
below and set by `VideoConfig.for_family`).

The steps are `Qwen3VLVideoProcessor`'s own:
- decode with PyAV to RGB24, keeping the frames at `round(linspace(0, total - 1, n))`, where
  `n = clamp(int(total / source_fps * fps), min_frames, min(max_frames, total))` (or the requested `num_frames`);
  Qwen2-VL: `n` floored to a multiple of the temporal patch, the frames at `int(arange(0, total, total / n))`;
- the video `smart_resize`: one size for every frame, chosen so that `frames * height * width` lies within
  the processor's pixel budget (`size.shortest_edge` .. `size.longest_edge`); Qwen2-VL: the image `smart_resize`,
  the budget bounding each frame;
- torchvision's uint8 bicubic antialiased resize on the CPU, which is `torch.nn.functional.interpolate` on
  uint8 (so torchvision is not needed);
- rescale and normalise fused as `(x - mean / rescale) / (std / rescale)` in float32 (a 256-entry lookup
  table, applied on the tower's device by `preprocess.patchify`, like the image path's);
- an odd frame count padded by repeating the last frame, then the merge-block patch order.

Limits: the container must sniff as MP4/MOV, Matroska/WebM or AVI; the server refuses files with more than
`max_source_frames` frames (413) before decoding them, and frames larger than the image pixel limit.
"""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ImageTooLarge, UnsupportedVideo, VideoTooLong
from .sizing import smart_resize

log = logging.getLogger(__name__)


# OpenAI CLIP's normalisation, Qwen2.5-VL's processors' (transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VideoConfig:
    """The video processor's settings (`video_preprocessor_config.json`), plus the server's decode limit."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    do_sample_frames: bool = True
    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: over all frames together (per frame with per_frame)
    max_pixels: int = 768 * 32 * 32  # size.longest_edge: over all frames together (per frame with per_frame)
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    # Server limit: frames in the file (decoding is sequential, so this bounds the CPU time of one video).
    max_source_frames: int = 9000
    # Qwen2-VL's processor (Qwen2.5-VL): its frame sampling, and the pixel budget bounding each frame.
    per_frame: bool = False

    @classmethod
    def for_family(cls, family: str, **overrides) -> "VideoConfig":
        """The video processor's defaults for a tower family ('qwen3_vl' or 'qwen2_5_vl'). Qwen2-VL's processor
        keeps every frame unless asked to sample (`do_sample_frames=False`, for backward compatibility); the
        server samples at 2 fps, as Qwen2.5-VL's own toolkit (qwen-vl-utils) does, so one video's cost is bounded."""
        if family == "qwen2_5_vl":
            return cls(**{**dict(min_pixels=128 * 28 * 28, max_pixels=768 * 28 * 28, per_frame=True,
                                 image_mean=CLIP_MEAN, image_std=CLIP_STD), **overrides})
        return cls(**overrides)

    @classmethod
    def from_dir(cls, path: Path, family: str = "qwen3_vl", **overrides) -> "VideoConfig":
        """`video_preprocessor_config.json`, else the `video_processor` entry of `processor_config.json`, else
        the family's defaults."""
        raw: dict = {}
        if (path / "video_preprocessor_config.json").is_file():
            raw = json.loads((path / "video_preprocessor_config.json").read_text())
        elif (path / "processor_config.json").is_file():
            raw = json.loads((path / "processor_config.json").read_text()).get("video_processor") or {}
        kw: dict = {}
        for key in ("fps", "rescale_factor"):
            if raw.get(key) is not None:
                kw[key] = float(raw[key])
        for key in ("min_frames", "max_frames"):
            if raw.get(key) is not None:
                kw[key] = int(raw[key])
        if raw.get("do_sample_frames") is not None:
            kw["do_sample_frames"] = bool(raw["do_sample_frames"])
        for key in ("image_mean", "image_std"):
            if raw.get(key) is not None:
                kw[key] = tuple(float(v) for v in raw[key])
        size = raw.get("size") or {}
        if size.get("shortest_edge"):
            kw["min_pixels"] = int(size["shortest_edge"])
        if size.get("longest_edge"):
            kw["max_pixels"] = int(size["longest_edge"])
        kw.update(overrides)
        return cls.for_family(family, **kw)

    def lut(self) -> np.ndarray:
        """[C, 256] float32: uint8 value -> normalised value, with the fused float32 arithmetic of
        transformers' torchvision backend (mean and std scaled by 1/rescale, then subtract and divide)."""
        import torch

        mean = torch.tensor(self.image_mean) * (1.0 / self.rescale_factor)
        std = torch.tensor(self.image_std) * (1.0 / self.rescale_factor)
        values = torch.arange(256, dtype=torch.float32)[None, :]
        return ((values - mean[:, None]) / std[:, None]).numpy()


def is_video(data) -> bool:
    """Container signatures: ISO base media (MP4, MOV, 3GP), Matroska/WebM, AVI."""
    head = bytes(data[:12])
    return head[4:8] == b"ftyp" or head[:4] == b"\x1a\x45\xdf\xa3" or (head[:4] == b"RIFF" and head[8:12] == b"AVI ")


def sample_indices(total: int, source_fps: float | None, config: VideoConfig, fps: float | None = None,
                   num_frames: int | None = None, temporal_patch_size: int = 2) -> np.ndarray:
    """Which frames to keep: `Qwen3VLVideoProcessor.sample_frames`, or with `config.per_frame`
    `Qwen2VLVideoProcessor.sample_frames` (a requested `num_frames` is capped at `total`, where transformers would
    ask for frames that do not exist)."""
    if not config.do_sample_frames and fps is None and num_frames is None:
        return np.arange(min(total, config.max_frames))
    if config.per_frame:
        return _sample_qwen2(total, source_fps, config, fps, num_frames, temporal_patch_size)
    if num_frames is None:
        n = int(total / (source_fps or 24) * (fps if fps is not None else config.fps))
        num_frames = min(max(n, config.min_frames), config.max_frames, total)
    num_frames = min(num_frames, total)
    return np.linspace(0, total - 1, num_frames).round().astype(int)


def _sample_qwen2(total: int, source_fps: float | None, config: VideoConfig, fps: float | None,
                  num_frames: int | None, temporal: int) -> np.ndarray:
    if num_frames is not None:
        n = min(round(num_frames / temporal) * temporal, total)
    else:
        most = math.floor(min(config.max_frames, total) / temporal) * temporal
        n = total / (source_fps or 24) * (fps if fps is not None else config.fps)
        n = math.floor(min(max(n, config.min_frames), most, total) / temporal) * temporal
    import torch

    n = max(n, temporal)
    return torch.arange(0, total, total / n).int().numpy()[:n]


def timestamps(indices, source_fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch (the mean of its first and last frame), as Qwen3-VL's processor writes
    them into the prompt (`<t seconds>` before each frame's tokens)."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    t = [i / (source_fps or 24) for i in idx]
    return [(t[i] + t[i + temporal_patch_size - 1]) / 2 for i in range(0, len(t), temporal_patch_size)]


def decode(data: bytes, config: VideoConfig, max_frame_pixels: int, temporal_patch_size: int, factor: int,
           fps: float | None = None, num_frames: int | None = None) -> tuple[np.ndarray, dict]:
    """Video bytes -> the sampled frames resized for the tower, RGB uint8 `[n, h, w, 3]`, and their metadata.

    Each sampled frame is resized as soon as it is decoded (the size depends only on the frame count and
    the stream's frame size, both known up front), so memory is bounded by the processor's total pixel
    budget rather than by source resolution times frames: 768 sampled 4K frames never coexist."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except (av.error.FFmpegError, ValueError, OSError, EOFError) as e:
        raise UnsupportedVideo(f"corrupt or unsupported video: {e}") from e
    with container:
        if not container.streams.video:
            raise UnsupportedVideo("the container has no video stream")
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if not width or not height:
            raise UnsupportedVideo(f"video stream has no frame size ({width}x{height})")
        if width * height > max_frame_pixels:
            raise ImageTooLarge(f"video frames of {width}x{height} = {width * height} pixels exceed the limit of "
                               f"{max_frame_pixels}")
        try:
            total = stream.frames or _count_frames(container, stream, config.max_source_frames)
            if total > config.max_source_frames:
                raise VideoTooLong(f"video of {total} frames exceeds the limit of {config.max_source_frames} frames")
            if total < temporal_patch_size:
                raise UnsupportedVideo(f"video has {total} frame(s); at least {temporal_patch_size} are needed "
                                       "(send a single frame as an image)")
            source_fps = float(stream.average_rate) if stream.average_rate else None
            indices = sample_indices(total, source_fps, config, fps, num_frames, temporal_patch_size)
            stream.thread_type = "AUTO"  # frame-parallel decoding; the frames are the same

            def target(n):
                if config.per_frame:  # the image smart_resize, the budget bounding each frame
                    return smart_resize(height, width, factor, config.min_pixels, config.max_pixels)
                return smart_resize(height, width, factor, config.min_pixels, config.max_pixels, n, temporal_patch_size,
                                    kind="video")

            size = target(len(indices))
            frames = _decode_resized(container, stream, indices, size, width, height)
            if temporal_patch_size <= len(frames) < len(indices):
                # the header over-counts: keep what decodes; the frame count sets the size, so redo at the new one
                log.warning("video header announces %d frames; sampled %d of the %d wanted", total, len(frames),
                            len(indices))
                indices = indices[:len(frames)]
                if target(len(indices)) != size:
                    container.seek(0)
                    frames = _decode_resized(container, stream, indices, target(len(indices)), width, height)
        except av.error.FFmpegError as e:
            raise UnsupportedVideo(f"corrupt or truncated video: {e}") from e
    if len(frames) < temporal_patch_size:
        raise UnsupportedVideo(f"corrupt or truncated video: {len(frames)} of the {total} frames its header "
                               "announces could be decoded")
    meta = {"kind": "video", "width": width, "height": height, "source_frames": total, "source_fps": source_fps,
            "frame_indices": indices.tolist(), "timestamps": timestamps(indices, source_fps, temporal_patch_size)}
    return np.stack(frames), meta


def _decode_resized(container, stream, indices: np.ndarray, size: tuple[int, int], width: int, height: int):
    """Decode from the start up to the last wanted frame; the wanted ones, resized to `size`, in order."""
    wanted, last, frames = set(indices.tolist()), int(indices[-1]), []
    for i, frame in enumerate(container.decode(stream)):
        if i > last:
            break
        if i in wanted:
            if (frame.width, frame.height) != (width, height):
                raise UnsupportedVideo(f"frame {i} is {frame.width}x{frame.height}; the stream is {width}x{height} "
                                       "(frame size changes are not supported)")
            frames.append(resize(frame.to_ndarray(format="rgb24")[None], *size)[0])
    return frames


def _count_frames(container, stream, limit: int) -> int:
    """Frames in a stream whose header does not say (WebM, some MKV): count its packets, without decoding,
    then rewind. Stops one past `limit`."""
    n = 0
    for packet in container.demux(stream):
        if packet.size:
            n += 1
            if n > limit:
                break
    container.seek(0)
    return n


def resize(frames: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 `[n, H, W, 3]` -> `[n, height, width, 3]`: torchvision's uint8 bicubic antialiased resize on the
    CPU, which is PyTorch's native uint8 kernel."""
    import torch

    if frames.shape[1:3] == (height, width):
        return frames
    x = torch.from_numpy(frames).permute(0, 3, 1, 2).contiguous()
    y = torch.nn.functional.interpolate(x, size=(height, width), mode="bicubic", antialias=True, align_corners=False)
    return y.permute(0, 2, 3, 1).contiguous().numpy()
