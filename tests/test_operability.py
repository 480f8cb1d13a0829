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


def test_event_loop_lag_is_what_a_blocked_loop_adds():
    """`qwen3vl_event_loop_lag_seconds`: near zero on an idle loop, and the time the loop was held where it was
    (a saturated front-end's event loop delays every request of that process by as much)."""
    import asyncio
    import time
    import types

    from service.http.app import Service

    observed: list[float] = []
    service = Service.__new__(Service)
    service.metrics = types.SimpleNamespace(loop_lag=types.SimpleNamespace(observe=observed.append))

    async def main():
        watch = asyncio.create_task(service.watch_loop_lag(0.05))
        await asyncio.sleep(0.3)
        idle = list(observed)
        time.sleep(0.4)  # the loop held, as by a burst of requests' Python work
        await asyncio.sleep(0.2)
        watch.cancel()
        return idle

    idle = asyncio.run(main())
    assert idle and max(idle) < 0.05, idle
    assert 0.3 <= max(observed) <= 0.6, observed
