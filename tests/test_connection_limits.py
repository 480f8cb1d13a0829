"""Every resource a connection can claim is bounded, on a real `serve` with real sockets: header bytes and count (431),
the time to send headers and body (408, then closed: a byte a second, or nothing, holds no connection), idle
keep-alive connections, and the connections of a process (503 with Retry-After). Requests within the limits, kept
alive, are served throughout."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from servers import free_port
from tools.ready import wait_until_ready


@pytest.fixture(scope="module", params=["0", "1"], ids=["one-process", "front-ends"])
def limited(request):
    port = free_port()
    env = {**os.environ, "QWEN3VL_MODEL": "random:tiny", "QWEN3VL_DEVICE": "cpu", "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_PORT": str(port), "QWEN3VL_HTTP_WORKERS": request.param, "QWEN3VL_MAX_HEADER_BYTES": "4096",
           "QWEN3VL_MAX_HEADERS": "20", "QWEN3VL_HEADER_TIMEOUT_S": "1", "QWEN3VL_BODY_TIMEOUT_S": "1",
           "QWEN3VL_KEEP_ALIVE_S": "1", "QWEN3VL_MAX_CONNECTIONS": "8"}
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, proc, timeout_s=120, interval_s=0.1)
        yield port
    finally:
        proc.terminate()
        proc.wait(60)


def _connect(port) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _reply(s: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    out = b""
    with contextlib.suppress(ConnectionResetError, socket.timeout):
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_headers_over_the_byte_limit_get_431(limited):
    with _connect(limited) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n")
        assert _reply(s).startswith(b"HTTP/1.1 431")
    with _connect(limited) as s:  # one header of many megabytes, sent without its end: refused while it arrives
        s.sendall(b"GET /health HTTP/1.1\r\nX-Big: ")
        with contextlib.suppress(OSError):
            for _ in range(64):
                s.sendall(b"a" * 65536)
        assert _reply(s).startswith(b"HTTP/1.1 431")


def test_too_many_headers_get_431(limited):
    with _connect(limited) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(30)) + b"\r\n")
        assert _reply(s).startswith(b"HTTP/1.1 431")


def test_slow_headers_silent_and_stalled_uploads_are_closed(limited):
    start = time.monotonic()
    with _connect(limited) as silent, _connect(limited) as slow, _connect(limited) as stalled:
        stalled.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 100000\r\n\r\n"
                        + b"\x89PNG")

        def drip():
            with contextlib.suppress(OSError):
                for byte in b"GET /health HTTP/1.1\r\nHost: x\r\n":
                    slow.send(bytes([byte]))
                    time.sleep(0.2)

        threading.Thread(target=drip, daemon=True).start()
        replies = [_reply(s) for s in (silent, slow, stalled)]
    assert time.monotonic() - start < 8
    assert replies[0].startswith(b"HTTP/1.1 408") and b"headers" in replies[0]
    assert replies[1].startswith(b"HTTP/1.1 408") and b"headers" in replies[1]
    assert replies[2].startswith(b"HTTP/1.1 408") and b"body" in replies[2]


def test_idle_keep_alive_connections_close_and_a_connection_cap_refuses_cleanly(limited):
    with httpx.Client(base_url=f"http://127.0.0.1:{limited}") as client:  # kept alive: served within the limits
        for _ in range(3):
            assert client.get("/health").status_code == 200
    with _connect(limited) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _reply(s).startswith(b"HTTP/1.1 200")  # then closed after the keep-alive timeout
    held = [_connect(limited) for _ in range(12)]  # beyond 8 per process
    try:
        replies = []
        for s in held:
            s.settimeout(0.5)
            with contextlib.suppress(socket.timeout):
                replies.append(s.recv(4096))
        refused = [r for r in replies if r.startswith(b"HTTP/1.1 503")]
        assert refused and all(b"retry-after: 1" in r.lower() for r in refused), replies
    finally:
        for s in held:
            s.close()
    time.sleep(1.5)
    assert httpx.get(f"http://127.0.0.1:{limited}/health").status_code == 200


# A server of the same protocol and limits as `serve`'s, on uvloop (what `uvicorn[standard]` runs), whose /block
# stalls its event loop for argv[2] seconds, as a collection or a burst of work does.
# argv[3], if given: the Settings' fields as JSON (keep_alive_s 0.5 otherwise).
_STALLING_SERVER = """
import json, sys, time, uvicorn
from service.server import limit_connections
from service.settings import Settings

async def app(scope, receive, send):
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/block":
        time.sleep(float(sys.argv[2]))
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})

config = uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]), loop="uvloop", lifespan="off",
                        log_level="warning")
limit_connections(config, Settings(**json.loads(sys.argv[3] if len(sys.argv) > 3 else '{"keep_alive_s": 0.5}')))
uvicorn.Server(config).run()
"""


@contextlib.contextmanager
def _stalling_server(stall_s: float, settings: dict | None = None):
    """`_STALLING_SERVER` on a free port, once it accepts; yields the port."""
    port = free_port()
    argv = [sys.executable, "-c", _STALLING_SERVER, str(port), str(stall_s)]
    if settings is not None:
        argv.append(json.dumps(settings))
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=5).close()
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(30)


def _response(s: socket.socket) -> bytes:
    """One response of `_STALLING_SERVER` (its body is 2 bytes), or what came before the connection closed."""
    out = b""
    with contextlib.suppress(ConnectionResetError, socket.timeout):
        while not (b"\r\n\r\n" in out and out.endswith(b"ok")):
            chunk = s.recv(4096)
            if not chunk:
                break
            out += chunk
    return out


def test_a_request_that_arrives_as_its_connection_idles_out_is_answered():
    """A client reuses its keep-alive connection just as the server's idle timeout for it comes due, while the
    server's event loop is stalled: the request's bytes wait in the socket past the timer's due time. Closing the
    connection then would reset it under a request already sent (the client sees 'connection reset', and a POST is
    not retried: the soaks' two dropped requests looked so); the server answers it, and the connection idles out
    later."""
    with _stalling_server(0.6) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as a:
        a.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(a).startswith(b"HTTP/1.1 200")
        idle_since = time.monotonic()  # the idle timeout comes due 0.5 s from here
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as b:
            b.sendall(b"GET /block HTTP/1.1\r\nHost: x\r\n\r\n")  # the loop stalls until ~0.9 s
            time.sleep(max(0.0, idle_since + 0.45 - time.monotonic()))
            a.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")  # read only after the timeout came due
            assert _response(b).startswith(b"HTTP/1.1 200")
        assert _response(a).startswith(b"HTTP/1.1 200")
        a.settimeout(3)
        assert a.recv(1) == b""  # and idle again, it is closed


def test_a_refusal_reaches_a_client_still_sending_its_request():
    """A connection over the cap is refused (503) as its client sends a 2 MB upload: the client reads the 503.
    Closed at once, the server's socket would reset under the bytes still arriving, and the reset discards the reply
    (every one of 40 such clients saw 'connection reset' before the lingering close)."""
    body = b"x" * 2_000_000
    request = b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    with _stalling_server(0, {"max_connections": 1}) as port, socket.create_connection(("127.0.0.1", port)):
        replies = []
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                try:
                    s.sendall(request)
                    replies.append(_reply(s)[:12])
                except (BrokenPipeError, ConnectionResetError) as e:
                    replies.append(repr(e))
    assert replies == [b"HTTP/1.1 503"] * 20, replies


def test_an_idle_connection_outlives_common_clients_idle_timeouts():
    """At the defaults, a keep-alive connection idle for longer than uvicorn's 5 s is still served: the client's
    idle timeout (Go's 90 s, a load balancer's 60 s) should close it first, since a server closing an idle
    connection as its client reuses it resets a request already sent."""
    with _stalling_server(0, {}) as port, socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /fast HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _response(s).startswith(b"HTTP/1.1 200")
        time.sleep(6)
        s.sendall(b"POST /fast HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        assert _response(s).startswith(b"HTTP/1.1 200")
