"""Image (or video) bytes -> patch rows and `grid_thw`, numerically identical to transformers' processors.

Images follow the Qwen2-VL PIL image processor (Qwen3-VL's and Qwen2.5-VL's, with each family's defaults);
videos (sniffed by their container signature) follow the family's video processor (`service.video`).

The steps are the processor's own: decode (a plain RGB JPEG by libjpeg-turbo directly into an array, the same
library and settings as PIL's decoder, so the same pixels; anything else by PIL), EXIF orientation, RGB
conversion (anything with alpha is composited on white), `smart_resize` to multiples of patch*merge, a PIL bicubic
resize in uint8, then rescale+normalise and the merge-block patch order the tower expects. Rescale and normalise
map each uint8 value to one float32 per channel, so they are done with a 256-entry lookup table that holds exactly
the values transformers computes (float64 rescale, float32 normalise). The lookup and the patch reordering run on
the tower's device (`patchify`); the CPU only decodes and resizes.
"""

from __future__ import annotations

import io
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

try:  # libjpeg-turbo straight into a numpy array: the same pixels as PIL's decoder, in about 3/4 of its time
    import simplejpeg
except ImportError:  # pragma: no cover - a dependency; without it PIL decodes every JPEG
    simplejpeg = None

from .sizing import smart_resize
from .video import CLIP_MEAN, CLIP_STD, VideoConfig, decode as decode_video_frames, is_video
from ..errors import ImageTooLarge, InvalidInput, UnsupportedImage

FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")


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
    video: VideoConfig = field(default_factory=VideoConfig)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    @classmethod
    def for_family(cls, family: str, **overrides) -> "PreprocessConfig":
        """The processor's defaults for a tower family: Qwen3-VL's (patch 16, mean and std 0.5), or Qwen2.5-VL's
        (`Qwen2VLImageProcessor`: patch 14, CLIP's mean and std, 56*56 to 28*28*1280 pixels)."""
        if family == "qwen2_5_vl":
            defaults = dict(patch_size=14, image_mean=CLIP_MEAN, image_std=CLIP_STD, min_pixels=56 * 56,
                            max_pixels=28 * 28 * 1280, video=VideoConfig.for_family(family))
            overrides = {**defaults, **overrides}
        return cls(**overrides)

    @classmethod
    def from_dir(cls, path: Path, family: str = "qwen3_vl", **overrides) -> "PreprocessConfig":
        """Settings from `preprocessor_config.json` when the checkpoint has one, else the family's defaults."""
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
        kw["video"] = VideoConfig.from_dir(path, family)
        kw.update(overrides)
        return cls.for_family(family, **kw)


@dataclass
class Preprocessed:
    """One item ready for the tower: resized uint8 frames `[F, H, W, C]` and its grid `(t, h, w)`.

    Normalisation and patchification happen on the tower's device (`patchify`), so only uint8 pixels
    travel there: 8x fewer bytes than float32 patch rows with the temporal repeat.
    """

    frames: np.ndarray
    grid_thw: tuple[int, int, int]
    lut: np.ndarray  # [C, 256] float32: uint8 value -> normalised value, per channel
    config: "PreprocessConfig"
    meta: dict = field(default_factory=dict)
    # the frames lie in page-locked host memory (an engine's registered arena): the copy engine reads them where
    # they lie, with no copy through a pinned buffer first
    pinned: bool = False

    @property
    def kind(self) -> str:
        """"image" or "video"."""
        return self.meta.get("kind", "image")

    @property
    def num_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w

    @property
    def pixel_values(self) -> np.ndarray:
        """The float32 rows `[t*h*w, C*T*P*P]` transformers' processor returns for this item."""
        import torch  # lazily: decoding worker processes never need torch

        out = torch.empty((self.num_patches, patch_dim(self.config, self.frames.shape[-1])), dtype=torch.float32)
        patchify(torch.from_numpy(self.frames), lut_table(self.lut, out.dtype), self.config, out)
        return out.numpy()


def patch_dim(config: "PreprocessConfig", channels: int = 3) -> int:
    return channels * config.temporal_patch_size * config.patch_size**2


def patchify(frames, table, config: "PreprocessConfig", out):
    """uint8 `[F, H, W, C]` -> `out` `[t*h*w, C*T*P*P]`: normalised through `table` (`lut_table`), merge-block order.
    A batch of items of one shape, `[B, F, H, W, C]`, fills `out` `[B*t*h*w, C*T*P*P]` item after item, in one pass.

    A trailing odd frame is repeated to fill the temporal patch (a single image becomes two equal frames), as
    transformers does. Runs on whatever device the tensors are on: one kernel on a GPU (`kernels.patchify`).
    """
    from kernels.patchify import patchify as patchify_frames  # lazily: decoding workers never import torch

    if frames.dim() == 4:
        frames = frames.unsqueeze(0)
    return patchify_frames(frames, table, out, config.temporal_patch_size, config.patch_size, config.merge_size)


def lut_table(lut, dtype, device=None):
    """`[C, 256]` per-channel lookup table -> the `[256, C]` `patchify` indexes, in `dtype` on `device`."""
    import torch

    return torch.as_tensor(lut).t().to(device=device, dtype=dtype).contiguous()


def decode_image(data: bytes, max_image_pixels: int) -> Image.Image | np.ndarray:
    """Bytes -> an RGB image, oriented by EXIF, transparency composited on white (as transformers does): a PIL
    image, or a uint8 array `[H, W, 3]` for a JPEG that needs no turning or conversion (`_decode_plain_jpeg`)."""
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
            pixels = _decode_plain_jpeg(img, data)
            if pixels is not None:
                return pixels
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
        ImageOps.exif_transpose(img, in_place=True)  # in place: no copy of an image that needs no turning
    except Exception:  # a broken EXIF block is ignored, as browsers do
        pass
    return to_rgb(img)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of a JPEG from its header (a few microseconds), or None for anything else."""
    if simplejpeg is None or not data.startswith(b"\xff\xd8"):
        return None
    try:
        height, width, _, _ = simplejpeg.decode_jpeg_header(data)
    except Exception:  # noqa: BLE001 - not a JPEG simplejpeg can read: the caller treats it as any other input
        return None
    return height, width


def _decode_plain_jpeg(img: Image.Image, data: bytes) -> np.ndarray | None:
    """A 3-channel JPEG with no EXIF turn (`img`: its header, opened by PIL) decoded by libjpeg-turbo into an array:
    PIL's decoder runs the same library with the same settings (accurate integer IDCT, smooth chroma upsampling),
    without PIL's row unpacking and the copy out of the image. None for anything else, and for any stream that
    libjpeg reports a problem with: PIL then decodes it, or names the problem, as it always did."""
    if simplejpeg is None or img.format != "JPEG" or img.mode != "RGB" or 0 in img.size:
        return None
    try:
        if img.getexif().get(ExifTags.Base.Orientation, 1) != 1:
            return None
        return simplejpeg.decode_jpeg(data, colorspace="RGB")
    except Exception:  # noqa: BLE001 - PIL's own decode decides what a broken file gets
        return None


def to_rgb(img: Image.Image) -> Image.Image:
    if img.mode == "RGB":
        return img
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


class Preprocessor:
    """Bytes (or a PIL image) -> `Preprocessed`. Videos are recognised by their container signature."""

    def __init__(self, config: PreprocessConfig):
        self.config = config
        # float64 rescale then float32 cast, then float32 normalise: transformers' exact arithmetic.
        scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
        mean = np.asarray(config.image_mean, dtype=np.float32)[:, None]
        std = np.asarray(config.image_std, dtype=np.float32)[:, None]
        self.lut = ((scaled[None, :] - mean) / std).astype(np.float32)  # [C, 256]
        self._video_lut: np.ndarray | None = None  # built on the first video (it needs torch)

    def target_size(self, height: int, width: int, min_pixels: int | None = None, max_pixels: int | None = None):
        c = self.config
        return smart_resize(height, width, c.factor, min_pixels or c.min_pixels, max_pixels or c.max_pixels)

    def __call__(self, data: bytes | Image.Image, min_pixels: int | None = None, max_pixels: int | None = None,
                 fps: float | None = None, num_frames: int | None = None) -> Preprocessed:
        """`min_pixels`/`max_pixels` apply to images; `fps` or `num_frames` (not both) to videos."""
        c = self.config
        if isinstance(data, (bytes, bytearray, memoryview)):
            if is_video(data):
                return self.decode_video(bytes(data), fps, num_frames)
            img = decode_image(data, c.max_image_pixels)
        else:
            img = to_rgb(data)
        orig_h, orig_w = img.shape[:2] if isinstance(img, np.ndarray) else img.size[::-1]
        height, width = self.target_size(orig_h, orig_w, min_pixels, max_pixels)
        if (orig_h, orig_w) != (height, width):  # the same size would be an exact copy
            if isinstance(img, np.ndarray):
                img = Image.fromarray(img)
            img = img.resize((width, height), resample=c.resample)
        # [1, H, W, 3] uint8, writable (torch.from_numpy needs that)
        frames = img[None] if isinstance(img, np.ndarray) else np.array(img)[None]
        grid = (1, height // c.patch_size, width // c.patch_size)
        return self.item(frames, grid, {"kind": "image", "width": orig_w, "height": orig_h})

    def decode_video(self, data: bytes, fps: float | None = None, num_frames: int | None = None) -> Preprocessed:
        c, vc = self.config, self.config.video
        if fps is not None and num_frames is not None:
            raise InvalidInput("fps and num_frames are mutually exclusive")
        frames, meta = decode_video_frames(data, vc, c.max_image_pixels, c.temporal_patch_size, c.factor, fps,
                                           num_frames)
        n, height, width = frames.shape[:3]
        grid = (-(-n // c.temporal_patch_size), height // c.patch_size, width // c.patch_size)
        return self.item(frames, grid, meta)

    def item(self, frames: np.ndarray, grid: tuple[int, int, int], meta: dict, pinned: bool = False) -> Preprocessed:
        """Wrap resized uint8 frames (e.g. decoded in a worker process) as an item of this preprocessor; `pinned`:
        they lie in page-locked host memory (`Preprocessed.pinned`)."""
        lut = self.lut
        if meta.get("kind") == "video":
            if self._video_lut is None:
                self._video_lut = self.config.video.lut()
            lut = self._video_lut
        return Preprocessed(frames, grid, lut, self.config, meta, pinned)


# -- sandbox processes -------------------------------------------------------------------------------


def decode_in_worker_config(config: PreprocessConfig, data: bytes, min_pixels: int | None, max_pixels: int | None,
                            fps: float | None = None, num_frames: int | None = None):
    """Decode in a process that has no preprocessor yet (a sandbox process, one input each): only the uint8 frames,
    the grid and the metadata go back."""
    item = Preprocessor(config)(data, min_pixels, max_pixels, fps, num_frames)
    return item.frames, item.grid_thw, item.meta
