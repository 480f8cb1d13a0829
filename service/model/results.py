"""What an encoded item is (`EncodeResult`), the tensors a reply or file holds for it (`result_tensors`), and how
items go into packs (`pack_size`, `pack_by_budget`): the model's values that the engine's client side and the HTTP
layer handle, in a module of their own so that a front-end process imports torch alone, not the tower, its kernels
and Triton."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch


@dataclass
class EncodeResult:
    embeds: torch.Tensor  # [n_merged, out_hidden] on the CPU; [0, out_hidden] where the tokens were not asked for
    deepstack: torch.Tensor  # [n_deepstack, n_merged, out_hidden], or [0, n_merged, out_hidden]
    grid_thw: tuple[int, int, int]
    pooled: torch.Tensor  # float32 [out_hidden]: the mean of the merged tokens, computed on the device
    num_tokens: int  # merged tokens of the item


def result_tensors(results, start: int = 0, pooled=None) -> dict[str, torch.Tensor]:
    """The shared output layout of the CLI and the API: embeds.{i}, deepstack.{i}, grid_thw.{i}, pooled.{i}; an
    output that was not computed (no tokens or no DeepStack asked for) is left out."""
    out = {}
    for i, r in enumerate(results, start):
        if r.embeds.shape[0] or not r.num_tokens:
            out[f"embeds.{i}"] = r.embeds.contiguous()
        if r.deepstack.shape[0]:
            out[f"deepstack.{i}"] = r.deepstack.contiguous()
        out[f"grid_thw.{i}"] = torch.tensor(r.grid_thw, dtype=torch.int64)
        if pooled is not None:
            out[f"pooled.{i}"] = pooled[i - start].contiguous()
    return out


def pack_size(sizes: Iterable[int], max_patches: int, max_items: int) -> int:
    """How many of `sizes` (items' patch counts, in order) the next pack takes: at most `max_items` items and
    `max_patches` patches, and always the first item (one larger than the budget travels alone)."""
    count = used = 0
    for n in sizes:
        if count and (used + n > max_patches or count >= max_items):
            break
        count += 1
        used += n
    return count


def pack_by_budget(sizes: list[int], max_patches: int, max_items: int) -> list[list[int]]:
    """Item indices in packs, in order, by `pack_size`."""
    packs, start = [], 0
    while start < len(sizes):
        count = pack_size(sizes[start:], max_patches, max_items)
        packs.append(list(range(start, start + count)))
        start += count
    return packs
