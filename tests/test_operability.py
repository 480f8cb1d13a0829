"""What an operator meets: /docs works without the internet, and hostile bodies do not flood the log."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from servers import serve


@pytest.fixture(scope="module")
def server():
    with serve() as (url, _):
        yield url


def test_docs_load_nothing_from_another_host(server):
    page = httpx.get(f"{server}/docs")
    assert page.status_code == 200 and "swagger" in page.text.lower()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert assets and not [a for a in assets if re.match(r"(https?:)?//", a)], assets
    for asset in assets:
        r = httpx.get(f"{server}{asset}")
        assert r.status_code == 200 and len(r.content) > 100, asset
    js = next(a for a in assets if a.endswith(".js"))
    assert len(httpx.get(f"{server}{js}").content) > 500_000  # the whole Swagger UI bundle, served by us
    assert page.text.count("openapi.json") >= 1 and httpx.get(f"{server}/openapi.json").status_code == 200


def test_a_malformed_multipart_body_is_logged_once_at_most(server, caplog):
    # what fuzzers send: python-multipart warns about each such body on top of raising the error the 422 names
    boundary = "b0undary"
    body = b"no boundary here\r\n" * 20
    with caplog.at_level(logging.DEBUG):
        for _ in range(3):
            r = httpx.post(f"{server}/embed", content=body,
                           headers={"content-type": f"multipart/form-data; boundary={boundary}"})
            assert r.status_code == 422 and r.json()["error"]["type"] == "invalid_multipart", r.text
    noisy = [rec for rec in caplog.records if rec.levelno >= logging.WARNING]
    assert len(noisy) <= 3, [rec.getMessage() for rec in noisy][:5]
    assert not [rec for rec in noisy if rec.name.startswith("python_multipart")], [r.getMessage() for r in noisy]
