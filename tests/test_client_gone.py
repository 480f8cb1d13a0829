"""A client that closes its upload half-way is its own doing: counted as 499 (as nginx does), never as a 500, and
logged without an error or a traceback."""

from __future__ import annotations

import logging
import socket
import time

import httpx

from servers import serve


def test_an_upload_closed_half_way_is_a_499_not_a_500(caplog):
    with serve() as (url, _):
        port = int(url.rsplit(":", 1)[1])
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n"
                          b"\r\n" + b"\x89PNG" + b"\0" * 5000)
                time.sleep(0.2)
        time.sleep(0.5)
        metrics = httpx.get(f"{url}/metrics").text
        assert 'qwen3vl_requests_total{route="/embed",status="499"} 3.0' in metrics, [
            line for line in metrics.splitlines() if line.startswith("qwen3vl_requests_total")]
        assert 'status="500"' not in metrics
        assert httpx.get(f"{url}/health").status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
