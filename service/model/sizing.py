"""The image processor's target size (Qwen2-VL's `smart_resize`), shared by images and Qwen2-VL's video frames."""

from __future__ import annotations

import math

from ..errors import InvalidInput

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses anything flatter


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Target (height, width): multiples of `factor`, area within [min_pixels, max_pixels], aspect kept."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise InvalidInput(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 of a {width}x{height} image "
            f"exceeds {MAX_ASPECT_RATIO}:1"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar
