"""A request gets what it asked for, whatever its neighbours in the pack asked for: a safetensors reply with
`deepstack=false` packed beside requests that want DeepStack carries no DeepStack tensor, and the embedding cache
keeps that reply, not the neighbour's. On the single-process server (the CPU's default) and behind an engine
process."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from safetensors.torch import load

from conftest import random_pngs
from servers import serve
from test_engine_process import server as serve_processes


async def _mixed(url: str, image: bytes, n: int = 6):
    """`n` requests wanting DeepStack and one that does not, of the same image, sent together (one pack)."""
    async with httpx.AsyncClient(timeout=60) as c:
        def post(deepstack: bool):
            return c.post(f"{url}/embed", params={"format": "safetensors", "deepstack": str(deepstack).lower()},
                          content=image, headers={"content-type": "image/png"})

        replies = await asyncio.gather(*[post(True) for _ in range(n)], post(False))
        again = await post(False)  # identical to the last: answered from the cache
    return replies, again


def _check(replies, again):
    assert [r.status_code for r in replies] == [200] * len(replies)
    with_ds = load(replies[0].content)
    assert "deepstack.0" in with_ds
    alone = replies[-1]
    tensors = load(alone.content)
    assert "embeds.0" in tensors and not any(k.startswith("deepstack") for k in tensors), sorted(tensors)
    assert again.status_code == 200 and again.headers["x-cache"] == "hit"
    assert again.content == alone.content  # the cache kept what this request asked for
    assert len(alone.content) < len(replies[0].content)


@pytest.mark.parametrize("processes", [False, True])
def test_a_neighbours_options_stay_out_of_a_reply_and_the_cache(processes):
    image = random_pngs(1, seed=77)[0]
    if processes:
        with serve_processes(1, QWEN3VL_MAX_WAIT_MS="300") as (url, _):
            _check(*asyncio.run(_mixed(url, image)))
    else:
        with serve(max_wait_ms=300) as (url, _):
            _check(*asyncio.run(_mixed(url, image)))
