"""Waiting for a server process to come up, for the tests and the benchmarks that start one."""

from __future__ import annotations

import time


def wait_until_ready(url: str, server, timeout_s: float, interval_s: float = 0.5) -> bool:
    """Poll `url`/ready until it answers 200 (True), or the deadline passes or the server process `server` (a
    Popen) exits (False)."""
    import httpx

    deadline = time.time() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return True
        except httpx.TransportError:
            pass
        if time.time() > deadline or server.poll() is not None:
            return False
        time.sleep(interval_s)
