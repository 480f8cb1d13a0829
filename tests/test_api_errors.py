"""Bad input gets a clear 4xx naming the problem and the item, and never harms other requests."""

from __future__ import annotations

import asyncio
import base64
import struct
import zlib

import httpx
import pytest
import torch
from PIL import Image

from conftest import encode_bytes, make_video, rel_err
from servers import serve

GOOD = encode_bytes(Image.new("RGB", (64, 48), (10, 200, 30)))


def _bomb_png(width=100_000, height=100_000) -> bytes:
    def chunk(kind, body):
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def server():
    with serve(max_body_bytes=200_000, max_inputs_per_request=4, max_image_pixels=1_000_000, max_wait_ms=50,
               api_key="sekret") as (url, app):
        yield url, app


AUTH = {"Authorization": "Bearer sekret"}


def _files(*blobs):
    return [("file", (f"f{i}.png", b, "image/png")) for i, b in enumerate(blobs)]


def _err(r, status, reason, index=None, match=None):
    """Assert an error response; a string in the `index` position is a message fragment."""
    if isinstance(index, str):
        index, match = None, index
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["type"] == reason, err
    if index is not None:
        assert err["index"] == index, err
    if match is not None:
        assert match in err["message"], err
    return err


def test_corrupt_empty_and_unsupported_name_the_item(server):
    url, _ = server
    _err(httpx.post(f"{url}/embed", files=_files(GOOD, b"not an image"), headers=AUTH), 422, "unsupported_image", 1,
         "not a supported image")
    _err(httpx.post(f"{url}/embed", files=_files(GOOD, GOOD, b""), headers=AUTH), 422, "unsupported_image", 2,
         "empty image")
    _err(httpx.post(f"{url}/embed", files=_files(GOOD[: len(GOOD) // 2]), headers=AUTH), 422, "unsupported_image", 0,
         "corrupt or truncated")


def test_size_limits(server):
    url, _ = server
    _err(httpx.post(f"{url}/embed", content=b"x" * 300_000, headers={**AUTH, "content-type": "image/png"}), 413,
         "body_too_large", match="200000")
    _err(httpx.post(f"{url}/embed", files=_files(*[GOOD] * 5), headers=AUTH), 413, "too_many_inputs",
         match="limit is 4")
    _err(httpx.post(f"{url}/embed", files=_files(GOOD, _bomb_png()), headers=AUTH), 413, "image_too_large", 1)
    big = encode_bytes(Image.new("RGB", (1500, 1000)))
    _err(httpx.post(f"{url}/embed", files=_files(big), headers=AUTH), 413, "image_too_large", 0,
         "1500x1000 = 1500000 pixels exceeds the limit of 1000000")


def test_json_and_base64_errors(server):
    url, _ = server
    _err(httpx.post(f"{url}/embed", content=b"{not json", headers={**AUTH, "content-type": "application/json"}), 422,
         "invalid_json")
    _err(httpx.post(f"{url}/embed", json={"images": []}, headers=AUTH), 422, "invalid_json", match="inputs")
    good = base64.b64encode(GOOD).decode()
    _err(httpx.post(f"{url}/embed", json={"inputs": [{"image": good}, {"image": "%%%not-base64"}]}, headers=AUTH), 422,
         "invalid_base64", 1)
    _err(httpx.post(f"{url}/embed", json={"inputs": [{"image": "data:image/png,abc"}]}, headers=AUTH), 422,
         "invalid_base64", 0, "data:")
    _err(httpx.post(f"{url}/embed", json={"inputs": []}, headers=AUTH), 422, "no_inputs")
    _err(httpx.post(f"{url}/v1/embeddings", json={"input": ["@@@"]}, headers=AUTH), 422, "invalid_base64", 0)


def test_content_type_and_options(server):
    url, _ = server
    _err(httpx.post(f"{url}/embed", content=GOOD, headers={**AUTH, "content-type": "text/plain"}), 415,
         "unsupported_media_type")
    _err(httpx.post(f"{url}/embed", params={"format": "xml"}, files=_files(GOOD), headers=AUTH), 422, "invalid_options",
         "format")
    _err(httpx.post(f"{url}/embed", params={"bogus": "1"}, files=_files(GOOD), headers=AUTH), 422, "invalid_options",
         "bogus")
    _err(httpx.post(f"{url}/embed", params={"max_pixels": 10**12}, files=_files(GOOD), headers=AUTH), 422,
         "invalid_options", "outside the server's limits")
    # JSON numbers are float32: a dtype asked of them would be silently ignored
    _err(httpx.post(f"{url}/embed", params={"dtype": "float16"}, files=_files(GOOD), headers=AUTH), 422,
         "invalid_options", "encoding=base64")
    assert httpx.post(f"{url}/embed", params={"dtype": "float16", "encoding": "base64"}, files=_files(GOOD),
                      headers=AUTH).status_code == 200
    _err(httpx.post(f"{url}/embed", files=[("image", ("a.png", GOOD, "image/png"))], headers=AUTH), 422,
         "invalid_multipart", "'image'")
    # httpx writes text fields before file parts: the text 'file' is part 0
    _err(httpx.post(f"{url}/embed", files=[("file", ("a.png", GOOD, "image/png"))], data={"file": "oops"},
                    headers=AUTH), 422, "invalid_multipart", 0, "must be a file part")


def test_api_key(server):
    url, _ = server
    _err(httpx.post(f"{url}/embed", files=_files(GOOD)), 401, "unauthorized")
    _err(httpx.post(f"{url}/embed", files=_files(GOOD), headers={"Authorization": "Bearer wrong"}), 401, "unauthorized")
    _err(httpx.post(f"{url}/v1/embeddings", json={"input": "x"}), 401, "unauthorized")
    for route in ("/health", "/ready", "/metrics"):  # probes and the scrape
        assert httpx.get(f"{url}{route}").status_code == 200, route
    # /info names paths and pids; the docs describe the API: only with the key
    for route in ("/info", "/docs", "/redoc", "/openapi.json", "/nowhere"):
        r = httpx.get(f"{url}{route}")
        _err(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        assert httpx.get(f"{url}{route}", headers=AUTH).status_code == (404 if route == "/nowhere" else 200), route
    token = AUTH["Authorization"].split(" ", 1)[1]
    for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive (RFC 7235)
        assert httpx.get(f"{url}/info", headers={"Authorization": f"{scheme} {token}"}).status_code == 200
    _err(httpx.get(f"{url}/info", headers={"Authorization": f"Basic {token}"}), 401, "unauthorized")
    _err(httpx.get(f"{url}/info", headers={"Authorization": f"Bearer {token}x"}), 401, "unauthorized")
    assert httpx.post(f"{url}/embed", files=_files(GOOD), headers=AUTH).status_code == 200


def test_api_key_file(tmp_path):
    from service.settings import Settings

    path = tmp_path / "key"
    path.write_text("s3cret\n")
    assert Settings(api_key_file=str(path)).api_key.get_secret_value() == "s3cret"
    path.write_text("  \n")
    try:
        Settings(api_key_file=str(path))
    except ValueError as e:
        assert "empty" in str(e)
    else:
        raise AssertionError("an empty key file was accepted")


def test_bad_request_does_not_break_good_ones_in_the_same_window(server):
    """Good and bad requests arrive inside one batching window (max_wait_ms=50): each gets its own answer."""
    url, app = server
    before = httpx.get(f"{url}/info", headers=AUTH).json()["engine"]["forwards"]

    async def go():
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as c:
            return await asyncio.gather(
                c.post(f"{url}/embed", files=_files(GOOD)),
                c.post(f"{url}/embed", files=_files(GOOD, b"garbage")),
                c.post(f"{url}/embed", files=_files(GOOD, GOOD)),
                c.post(f"{url}/embed", files=_files(_bomb_png())),
                c.post(f"{url}/embed", json={"inputs": [{"image": "!!"}]}),
            )

    ok1, bad1, ok2, bad2, bad3 = asyncio.run(go())
    assert ok1.status_code == 200 and ok2.status_code == 200 and len(ok2.json()["data"]) == 2
    a, b = (torch.tensor(r.json()["data"][-1]["embeddings"]) for r in (ok1, ok2))
    assert rel_err(a, b) <= 1e-5  # same image, packed differently
    assert (bad1.status_code, bad2.status_code, bad3.status_code) == (422, 413, 422)
    assert httpx.get(f"{url}/info", headers=AUTH).json()["engine"]["forwards"] - before <= 2  # the good items shared forwards


def test_errors_are_counted_in_metrics(server):
    url, _ = server
    httpx.post(f"{url}/embed", content=GOOD, headers={**AUTH, "content-type": "text/plain"})
    text = httpx.get(f"{url}/metrics").text
    assert 'qwen3vl_errors_total{reason="unsupported_media_type"}' in text
    assert 'qwen3vl_requests_total{route="/embed",status="415"}' in text


def test_video_errors(server):
    url, _ = server
    clip = make_video(12, 32, 32, seed=9)
    _err(httpx.post(f"{url}/embed", files=[*_files(GOOD), ("file", ("v.mp4", clip[: len(clip) // 3], "video/mp4"))],
                    headers=AUTH), 422, "unsupported_video", 1, "corrupt")
    _err(httpx.post(f"{url}/embed", files=[("file", ("v.mp4", make_video(1, 32, 32), "video/mp4"))], headers=AUTH),
         422, "unsupported_video", 0, "at least 2")
    _err(httpx.post(f"{url}/embed", content=clip, params={"fps": 1, "num_frames": 4},
                    headers={**AUTH, "content-type": "video/mp4"}), 422, "invalid_options", match="mutually exclusive")
    _err(httpx.post(f"{url}/embed", content=clip, params={"num_frames": 5000},
                    headers={**AUTH, "content-type": "video/mp4"}), 422, "invalid_options", match="max_frames=768")
    _err(httpx.post(f"{url}/embed", json={"inputs": [{"image": "AAAA", "video": "AAAA"}]}, headers=AUTH), 422,
         "invalid_json", match="exactly one")
    # the server is unharmed: a good video right after succeeds
    ok = httpx.post(f"{url}/embed", content=clip, headers={**AUTH, "content-type": "video/mp4"}, timeout=60)
    assert ok.status_code == 200 and ok.json()["data"][0]["type"] == "video"


def test_video_frame_limit():
    with serve(max_video_frames=10) as (url, _):
        _err(httpx.post(f"{url}/embed", content=make_video(11, 32, 32), headers={"content-type": "video/mp4"}), 413,
             "video_too_long", 0, "11 frames exceeds the limit of 10")


def test_base64_accepts_and_refuses_exactly_what_the_standard_library_does():
    """The SIMD decoder of JSON inputs against `base64.b64decode(validate=True)` on random strings of base64
    characters, padding, whitespace, URL-safe and non-ASCII characters, valid and not: the same bytes, or a 422 that
    quotes the standard library's reason."""
    import binascii
    import random

    from service.http.parsing import decode_base64_input
    from service.http.status import HTTPError

    rng = random.Random(5)
    alphabet = "ABCXYZabcxyz0189+/" * 4 + "==" + " \n-_é$"
    cases = [base64.b64encode(rng.randbytes(n)).decode() for n in (0, 1, 2, 3, 4, 5, 131, 1023, 75_000)]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 24))) for _ in range(3000)]
    cases += [c[:-1] for c in cases[1:9]] + [c + "=" for c in cases[1:9]] + [c + "\n" for c in cases[1:9]]
    accepted = 0
    for case in cases:
        try:
            expected = base64.b64decode(case, validate=True)
        except (binascii.Error, ValueError) as e:
            with pytest.raises(HTTPError) as info:
                decode_base64_input(case, 3)
            assert info.value.status == 422 and info.value.index == 3 and str(e) in info.value.message, case
        else:
            assert decode_base64_input(case, 3) == expected, case
            accepted += 1
    assert 20 < accepted < len(cases) - 1000  # both kinds were exercised
