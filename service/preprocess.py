"""Image bytes -> patch rows and `grid_thw`, numerically identical to transformers' Qwen2-VL PIL processor.

The steps are the processor's own: decode, EXIF orientation, RGB conversion (anything with alpha is
composited on white), `smart_resize` to multiples of patch*merge, a PIL bicubic resize in uint8, then
rescale+normalise and the merge-block patch order the tower expects. Rescale and normalise map each
uint8 value to one float32 per channel, so they are done with a 256-entry lookup table that holds
exactly the values transformers computes (float64 rescale, float32 normalise).
"""

from __future__ import annotations

import io
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from .errors import ImageTooLarge, InvalidInput, UnsupportedImage

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses anything flatter


@dataclass(frozen=True)
class PreprocessConfig:
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    min_pixels: int = 65536
    max_pixels: int = 16777216
    resample: int = int(Image.Resampling.BICUBIC)
    # Decoded-size limit (width*height) checked from the header, before any pixel is decoded.
    max_image_pixels: int = 64_000_000

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def from_dir(cls, path: Path, **overrides) -> "PreprocessConfig":
        """Settings from `preprocessor_config.json` when the checkpoint has one, else Qwen3-VL's."""
        file = path / "preprocessor_config.json"
        kw: dict = {}
        if file.is_file():
            raw = json.loads(file.read_text())
            size = raw.get("size") or {}
            for key, src in (
                ("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                ("merge_size", "merge_size"), ("resample", "resample"),
            ):
                if raw.get(src) is not None:
                    kw[key] = int(raw[src])
            for key in ("image_mean", "image_std"):
                if raw.get(key) is not None:
                    kw[key] = tuple(float(v) for v in raw[key])
            min_px = raw.get("min_pixels") or size.get("shortest_edge") or size.get("min_pixels")
            max_px = raw.get("max_pixels") or size.get("longest_edge") or size.get("max_pixels")
            if min_px:
                kw["min_pixels"] = int(min_px)
            if max_px:
                kw["max_pixels"] = int(max_px)
        kw.update(overrides)
        return cls(**kw)


@dataclass
class Preprocessed:
    """One item ready for the tower: `pixel_values` [t*h*w, C*T*P*P] float32 rows in merge-block order."""

    pixel_values: np.ndarray
    grid_thw: tuple[int, int, int]
    meta: dict = field(default_factory=dict)

    @property
    def num_patches(self) -> int:
        return self.pixel_values.shape[0]


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


def decode_image(data: bytes, max_image_pixels: int) -> Image.Image:
    """Bytes -> RGB PIL image, oriented by EXIF, transparency composited on white (as transformers does)."""
    if not data:
        raise UnsupportedImage("empty image: zero bytes")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = img.size
            if width * height > max_image_pixels:
                raise ImageTooLarge(
                    f"image of {width}x{height} = {width * height} pixels exceeds the limit of {max_image_pixels}"
                )
            img.load()  # GIF and TIFF: the first frame
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageTooLarge(f"decompression bomb refused: {e}") from e
    except UnidentifiedImageError as e:
        raise UnsupportedImage(
            f"not a supported image: the bytes are none of {', '.join(FORMATS)} ({len(data)} bytes)"
        ) from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise UnsupportedImage(f"corrupt or truncated image: {e}") from e
    if width == 0 or height == 0:
        raise UnsupportedImage(f"image has no pixels ({width}x{height})")
    try:
        img = ImageOps.exif_transpose(img)
    except Exception:  # a broken EXIF block is ignored, as browsers do
        pass
    return to_rgb(img)


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


class ImagePreprocessor:
    def __init__(self, config: PreprocessConfig):
        self.config = config
        # float64 rescale then float32 cast, then float32 normalise: transformers' exact arithmetic.
        scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None]
        self._lut = ((scaled[None, :] - mean) / std).astype(np.float32)  # [C, 256]

    def target_size(self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None):
        c = self.config
        return smart_resize(height, width, c.factor, min_pixels or c.min_pixels, max_pixels or c.max_pixels)

    def __call__(self, data: bytes | Image.Image, min_pixels: int | None = None, max_pixels: int | None = None):
        c = self.config
        img = decode_image(data, c.max_image_pixels) if isinstance(data, (bytes, bytearray, memoryview)) else to_rgb(data)
        orig_w, orig_h = img.size
        height, width = self.target_size(orig_h, orig_w, min_pixels, max_pixels)
        img = img.resize((width, height), resample=c.resample)
        pixels = np.asarray(img)  # [H, W, 3] uint8
        chw = np.stack([self._lut[ch][pixels[..., ch]] for ch in range(3)])  # [3, H, W] float32
        patches, grid = self.patchify(chw[None])
        return Preprocessed(patches, grid, {"width": orig_w, "height": orig_h, "resized": (width, height)})

    def patchify(self, frames: np.ndarray) -> tuple[np.ndarray, tuple[int, int, int]]:
        """[F, C, H, W] float32 -> rows [t*h*w, C*T*P*P] in merge-block order, and (t, h, w).

        A single image is repeated over the temporal patch, as transformers does.
        """
        c = self.config
        tp, p, m = c.temporal_patch_size, c.patch_size, c.merge_size
        if frames.shape[0] % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], tp - frames.shape[0] % tp, axis=0)])
        n_frames, channels, height, width = frames.shape
        t, gh, gw = n_frames // tp, height // p, width // p
        x = frames.reshape(t, tp, channels, gh // m, m, p, gw // m, m, p)
        # (t, gh/m, gw/m, m, m, C, tp, p, p): merge blocks outermost, each patch flattened as (C, tp, p, p)
        x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return np.ascontiguousarray(x).reshape(t * gh * gw, channels * tp * p * p), (t, gh, gw)
