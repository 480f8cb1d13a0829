"""The operator's pixel limit bounds every image: a tiny GIF that declares a 6000 x 6000 screen is resized to at
most `max_pixels_limit` whether or not its request names max_pixels (it was resized to the checkpoint's 16.7 Mpx,
47 s of one CPU, when the request left max_pixels out), and /info states one limit."""

from __future__ import annotations

import io

import httpx
from PIL import Image

from servers import serve
from service.settings import CPU_MAX_PIXELS


def _large_gif() -> bytes:
    buf = io.BytesIO()
    Image.new("P", (6000, 6000)).save(buf, "GIF")
    return buf.getvalue()


def _pixels(info: dict, grid) -> int:
    patch = info["preprocessing"]["patch_size"]
    return grid[1] * grid[2] * patch * patch


def test_the_limit_bounds_a_request_without_max_pixels():
    gif = _large_gif()
    assert len(gif) < 60_000
    with serve(max_pixels_limit=64 * 64) as (url, _):
        info = httpx.get(f"{url}/info").json()
        assert info["limits"]["max_pixels_limit"] == info["preprocessing"]["max_pixels"] == 64 * 64
        r = httpx.post(f"{url}/embed", params={"pooling": "mean", "embeddings": "false"}, content=gif,
                       headers={"content-type": "image/gif"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _pixels(info, r.json()["data"][0]["grid_thw"]) <= 64 * 64
        r = httpx.post(f"{url}/embed", params={"max_pixels": 128 * 128}, content=gif,
                       headers={"content-type": "image/gif"}, timeout=60)
        assert r.status_code == 422 and "max_pixels" in r.json()["error"]["message"]


def test_the_cpu_default_is_a_megapixel():
    with serve() as (url, _):
        info = httpx.get(f"{url}/info").json()
        assert info["limits"]["max_pixels_limit"] == info["preprocessing"]["max_pixels"] == CPU_MAX_PIXELS
        r = httpx.post(f"{url}/embed", params={"pooling": "mean", "embeddings": "false"}, content=_large_gif(),
                       headers={"content-type": "image/gif"}, timeout=60)
        assert r.status_code == 200, r.text
        assert _pixels(info, r.json()["data"][0]["grid_thw"]) <= CPU_MAX_PIXELS
