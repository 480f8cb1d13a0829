"""The operator's pixel limit bounds every image: a tiny GIF that declares a 6000 x 6000 screen is resized to at
most `max_pixels_limit` whether or not its request names max_pixels (it was resized to the checkpoint's 16.7 Mpx,
47 s of one CPU, when the request left max_pixels out), and /info states one limit."""

from __future__ import annotations

import io

import httpx
from PIL import Image

from servers import serve
from service.settings import CPU_MAX_PIXELS, CPU_MAX_REQUEST_PATCHES


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


def test_a_request_is_charged_its_patches_against_a_budget():
    """One request's inputs, after resizing, may come to at most `max_request_patches`: more is a 413 that names the
    total, the largest input and the limit, before any forward; within it, the request is served; /info states it,
    and the CPU's default bounds 16 images at the CPU's megapixel."""
    side = 64  # px: 16 patches of 16 px each (random:tiny)
    images = []
    for i in range(4):
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (i, 2 * i, 3 * i)).save(buf, "PNG")
        images.append(buf.getvalue())
    files = [("file", (f"{i}.png", data, "image/png")) for i, data in enumerate(images)]
    with serve(max_request_patches=40) as (url, _):
        info = httpx.get(f"{url}/info").json()
        assert info["limits"]["max_request_patches"] == 40
        patch = info["preprocessing"]["patch_size"]
        per_image = (side // patch) ** 2
        assert 2 * per_image <= 40 < 4 * per_image
        r = httpx.post(f"{url}/embed", files=files, params={"min_pixels": side * side, "max_pixels": side * side},
                       timeout=60)
        assert r.status_code == 413, r.text
        error = r.json()["error"]
        assert error["type"] == "request_too_large" and f"{4 * per_image} patches" in error["message"]
        assert "40" in error["message"] and "max_request_patches" in error["message"]
        r = httpx.post(f"{url}/embed", files=files[:2], params={"min_pixels": side * side, "max_pixels": side * side},
                       timeout=60)
        assert r.status_code == 200, r.text
    with serve() as (url, _):
        info = httpx.get(f"{url}/info").json()
        patch = info["preprocessing"]["patch_size"]
        assert info["limits"]["max_request_patches"] == CPU_MAX_REQUEST_PATCHES == 16 * CPU_MAX_PIXELS // patch**2


def test_memory_returns_to_its_level_after_a_request_of_large_images():
    """32 distinct GIFs of 6000 x 6000 (a few KB each) in one request: each decodes to 36 MB and is resized to the
    CPU's megapixel, and the request is refused for its patches. Afterwards the server's memory is back within 150 MB
    of where it was; with glibc's own thresholds the decoding threads' heaps kept 0.8 GB of it
    (`runtime.return_freed_memory`)."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from servers import free_port
    from tools.ready import wait_until_ready

    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICE": "cpu", "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_PORT": str(port), "QWEN3VL_HTTP_WORKERS": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, proc, timeout_s=120, interval_s=0.2)
        for i in range(3):  # the first requests' one-time costs (imports, the first forward)
            buf = io.BytesIO()
            Image.new("RGB", (64, 64), (i, 0, 0)).save(buf, "PNG")
            assert httpx.post(f"{url}/embed", content=buf.getvalue(), headers={"content-type": "image/png"},
                              timeout=60).status_code == 200
        before = psutil.Process(proc.pid).memory_info().rss
        gifs = []
        for i in range(32):
            buf = io.BytesIO()
            Image.new("P", (6000, 6000), color=i).save(buf, "GIF")
            gifs.append(("file", (f"{i}.gif", buf.getvalue(), "image/gif")))
        r = httpx.post(f"{url}/embed", files=gifs, timeout=300)
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
        time.sleep(1)
        after = psutil.Process(proc.pid).memory_info().rss
        assert after - before < 150 * 2**20, (before >> 20, after >> 20)
    finally:
        proc.terminate()
        proc.wait(60)
