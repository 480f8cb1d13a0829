"""Clients of the encoder as the encoder tier of an LLM server (`vllm_client`, `sglang_client`)."""

from __future__ import annotations

import sys
from typing import Callable

import httpx


def run(main: Callable[[], int]) -> None:
    """`sys.exit(main())`, a server's HTTP error or absence said in one line rather than a traceback: what
    answered and what it said, or what could not be reached."""
    try:
        sys.exit(main())
    except httpx.HTTPStatusError as e:
        sys.exit(f"{e.request.url} answered {e.response.status_code}: {e.response.text[:300]}")
    except httpx.RequestError as e:
        sys.exit(f"cannot reach {e.request.url}: {e} (is the server running there?)")
