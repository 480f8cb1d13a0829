"""The processors' target size (`smart_resize`): images, Qwen2-VL's video frames (each within the image budget) and
Qwen3-VL's videos (all frames within one budget)."""

from __future__ import annotations

import math

from ..errors import InvalidInput

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses anything flatter


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int, num_frames: int = 1,
                 temporal_factor: int = 1, kind: str = "image") -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, `frames * height * width` within [min_pixels, max_pixels],
    aspect kept. An image is one frame (transformers' image `smart_resize`); a video's frames share one size within
    the budget of all of them (its video `smart_resize`, which first scales a side shorter than `factor` up)."""
    if kind == "video" and (height < factor or width < factor):
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInput(f"aspect ratio {max(height, width) / min(height, width):.0f}:1 of a {width}x{height} "
                           f"{kind} exceeds {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
