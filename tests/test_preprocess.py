"""Image bytes -> patches, bit-for-bit against transformers' Qwen2VLImageProcessorPil with Qwen3-VL settings."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import encode_bytes, hf_input, photos
from service.errors import ImageTooLarge, InvalidInput, UnsupportedImage
from service.model.preprocess import Preprocessor, PreprocessConfig

PRE = Preprocessor(PreprocessConfig())


def _reference(hf_processor, img, **size):
    kw = {"size": {"shortest_edge": size["min_pixels"], "longest_edge": size["max_pixels"]}} if size else {}
    out = hf_processor(images=[hf_input(img)], return_tensors="np", **kw)
    return out["pixel_values"], tuple(int(x) for x in out["image_grid_thw"][0])


@pytest.mark.parametrize("name", list(photos()))
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"])
def test_formats_and_modes_match_transformers(hf_processor, name, fmt):
    img = photos()[name]
    if fmt in ("JPEG", "BMP") and img.mode == "RGBA":
        pytest.skip(f"{fmt} cannot store alpha")
    data = encode_bytes(img, fmt, **({"lossless": True} if fmt == "WEBP" else {}))
    got = PRE(data)
    ref_pixels, ref_grid = _reference(hf_processor, Image.open(io.BytesIO(data)))
    assert got.grid_thw == ref_grid
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)


@pytest.mark.parametrize("mode", ["L", "LA", "P", "RGBA", "CMYK", "I;16"])
def test_every_mode_converted_like_transformers(hf_processor, mode):
    rng = np.random.default_rng(7)
    base = Image.fromarray(rng.integers(0, 256, (45, 71, 4), dtype=np.uint8), "RGBA")
    img = base.convert(mode) if mode != "P" else base.convert("RGB").quantize(colors=17)
    if mode == "P":
        img.info["transparency"] = 3  # palette transparency: composited on white by transformers
    got = PRE(img)
    ref_pixels, ref_grid = _reference(hf_processor, img)
    assert got.grid_thw == ref_grid
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)


def test_rgba_composited_on_white():
    img = Image.new("RGBA", (64, 64), (10, 20, 30, 0))  # fully transparent
    got = PRE(encode_bytes(img))
    np.testing.assert_allclose(got.pixel_values, 1.0)  # white after (x/255 - 0.5) / 0.5


def test_exif_orientation_is_applied(hf_processor):
    img = photos()["chelsea"]  # 451 wide, 300 high
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    data = encode_bytes(img, "JPEG", exif=exif.tobytes())
    got = PRE(data)
    from PIL import ImageOps

    ref_pixels, ref_grid = _reference(hf_processor, ImageOps.exif_transpose(Image.open(io.BytesIO(data))))
    assert got.grid_thw == ref_grid and ref_grid[1] > ref_grid[2]  # now taller than wide
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)


@pytest.mark.parametrize("min_pixels,max_pixels", [(1024, 4096), (256 * 256, 512 * 512), (4096, 40000), (500_000, 10**7)])
def test_min_max_pixels_overrides(hf_processor, min_pixels, max_pixels):
    img = photos()["coffee"]
    got = PRE(encode_bytes(img), min_pixels=min_pixels, max_pixels=max_pixels)
    ref_pixels, ref_grid = _reference(hf_processor, img, min_pixels=min_pixels, max_pixels=max_pixels)
    assert got.grid_thw == ref_grid
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)


def test_gif_first_frame(hf_processor):
    frames = [Image.new("RGB", (40, 30), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    got = PRE(buf.getvalue())
    first = Image.open(io.BytesIO(buf.getvalue()))
    ref_pixels, _ = _reference(hf_processor, first)
    np.testing.assert_array_equal(got.pixel_values, ref_pixels)
    assert got.pixel_values[:, :256].mean() > 0.9  # red channel of the first frame


def test_extreme_aspect_ratio_refused():
    with pytest.raises(InvalidInput, match=r"aspect ratio 201:1"):
        PRE(encode_bytes(Image.new("RGB", (402, 2))))


@pytest.mark.parametrize("data,match", [
    (b"", "empty image"),
    (b"hello, world" * 10, "not a supported image"),
    (b"%PDF-1.4 not an image", "not a supported image"),
])
def test_garbage_bytes(data, match):
    with pytest.raises(UnsupportedImage, match=match):
        PRE(data)


def test_truncated_image():
    data = encode_bytes(photos()["astronaut"], "PNG")
    with pytest.raises(UnsupportedImage, match="corrupt or truncated"):
        PRE(data[: len(data) // 2])


def _png_header_only(width, height) -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def test_decompression_bomb_refused_before_decoding():
    # a 100000 x 100000 header in 80 bytes: refused from the header, nothing is allocated
    with pytest.raises(ImageTooLarge, match="pixels|bomb"):
        PRE(_png_header_only(100_000, 100_000))


def test_pixel_limit():
    small = Preprocessor(PreprocessConfig(max_image_pixels=10_000))
    with pytest.raises(ImageTooLarge, match=r"201x50 = 10050 pixels exceeds the limit of 10000"):
        small(encode_bytes(Image.new("RGB", (201, 50))))


def test_preprocessor_config_from_checkpoint(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text(
        '{"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 16, "merge_size": 2, '
        '"temporal_patch_size": 2, "image_mean": [0.48, 0.45, 0.4], "image_std": [0.26, 0.26, 0.27]}')
    cfg = PreprocessConfig.from_dir(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.image_mean) == (3136, 12845056, (0.48, 0.45, 0.4))


def test_pack_pixels_equal_each_item_patchified_alone():
    """`Encoder.pixels` patchifies each run of same-shaped items in one pass: the rows of a pack mixing runs of
    equal images (one frame each: the frame repeats to fill the temporal patch), other sizes and a video equal each
    item's own `pixel_values` (the rows tested against transformers above), in order."""
    import torch

    from conftest import make_video
    from service.model.encoder import Encoder

    enc = Encoder.load("random:tiny")
    rng = np.random.default_rng(4)

    def image(w, h):
        return enc.preprocess(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))

    a, b, c = image(64, 64), image(64, 64), image(96, 32)
    video = enc.preprocess(make_video(3, 64, 64), num_frames=3)
    items = [a, b, a, c, video, video, c, c, a]
    got = enc.pixels(items)
    expected = torch.cat([torch.from_numpy(it.pixel_values) for it in items])
    assert torch.equal(got, expected)


def _jpeg_corpus() -> dict[str, bytes]:
    """JPEGs of every layout a camera, an editor or a web pipeline writes: chroma subsampling 4:4:4/4:2:2/4:2:0,
    baseline and progressive, optimised Huffman tables, restart markers, RGB stored without YCbCr (Adobe), awkward
    sizes from 1x1 up; photo content and noise."""
    import skimage.data as data

    rng = np.random.default_rng(11)
    photo = Image.fromarray(data.astronaut())
    out = {}
    for w, h in ((1, 1), (7, 131), (131, 7), (1023, 17), (17, 1023), (448, 448), (601, 333)):
        crop = photo.resize((w, h), Image.Resampling.BILINEAR)
        noise = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        for sub in (0, 1, 2):
            quality = int(rng.integers(30, 100))
            out[f"{w}x{h}-sub{sub}-q{quality}"] = encode_bytes(crop, "JPEG", quality=quality, subsampling=sub)
            out[f"{w}x{h}-sub{sub}-progressive"] = encode_bytes(crop, "JPEG", subsampling=sub, progressive=True)
            out[f"{w}x{h}-sub{sub}-noise"] = encode_bytes(noise, "JPEG", quality=95, subsampling=sub)
        out[f"{w}x{h}-optimized"] = encode_bytes(crop, "JPEG", quality=85, optimize=True)
        out[f"{w}x{h}-restart"] = encode_bytes(crop, "JPEG", restart_marker_blocks=3)
        out[f"{w}x{h}-keep-rgb"] = encode_bytes(crop, "JPEG", keep_rgb=True)
    return out


@pytest.mark.parametrize("name", list(_jpeg_corpus()))
def test_plain_jpeg_decoded_into_an_array_as_pil_decodes_it(name, monkeypatch):
    """The array decoder (libjpeg-turbo through simplejpeg) takes every plain RGB JPEG and gives PIL's pixels, bit
    for bit (transformers' processor decodes with PIL)."""
    from service.model import preprocess

    data = _jpeg_corpus()[name]
    calls, decode = [], preprocess.simplejpeg.decode_jpeg
    monkeypatch.setattr(preprocess.simplejpeg, "decode_jpeg", lambda *a, **k: calls.append(1) or decode(*a, **k))
    got = preprocess.decode_image(data, 10**8)
    assert isinstance(got, np.ndarray) and calls == [1]
    np.testing.assert_array_equal(got, np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))


def _jpeg_oddities() -> dict[str, bytes]:
    img = photos()["chelsea"]
    exif = Image.Exif()
    exif[0x0112] = 8
    plain = encode_bytes(img, "JPEG")
    sos = plain.index(b"\xff\xda")
    return {
        "grayscale": encode_bytes(photos()["camera_gray"], "JPEG"),
        "cmyk": encode_bytes(img.convert("CMYK"), "JPEG"),
        "exif-rotated": encode_bytes(img, "JPEG", exif=exif.tobytes()),
        "exif-upright": encode_bytes(img, "JPEG", exif=Image.Exif().tobytes()),
        "truncated": plain[: len(plain) * 2 // 3],
        "cut-in-header": plain[:sos + 4],
        "trailing-garbage": plain + b"\x00garbage" * 100,
        "extraneous-bytes-before-marker": plain[:-2] + b"\x00\x00\x00" + plain[-2:],
        "corrupt-scan": plain[:sos + 600] + bytes(range(256)) * 4 + plain[sos + 1624:],
    }


@pytest.mark.parametrize("name", list(_jpeg_oddities()))
def test_odd_jpegs_get_what_pil_alone_gives(name, monkeypatch):
    """Grayscale, CMYK, EXIF-turned, truncated or damaged JPEGs: the same pixels, or the same error, as when PIL
    decodes everything."""
    from service.model import preprocess

    data = _jpeg_oddities()[name]

    def run():
        try:
            got = PRE(data)
        except UnsupportedImage as e:
            return str(e)
        return got.grid_thw, got.frames

    fast = run()
    monkeypatch.setattr(preprocess, "simplejpeg", None)
    pil = run()
    if isinstance(pil, str):
        assert fast == pil
    else:
        assert fast[0] == pil[0]
        np.testing.assert_array_equal(fast[1], pil[1])
