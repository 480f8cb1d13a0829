"""What FP8 does to a checkpoint's embeddings, before a user turns it on (`qwen3vl-encoder quant-check`).

The tower is loaded once in the serving dtype; a copy gets FP8 blocks (`quant.quantize_blocks`). Each input runs
through both, in lockstep, and every token is compared by cosine similarity: the merged tokens, each DeepStack level,
and, layer by layer, the residual stream after every block (where the error builds up).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from .encoder import Encoder
from .preprocess import Preprocessed
from .quant import quantize_blocks
from .tower import VisionTower


@dataclass
class Cosines:
    """Per-token cosine similarities, pooled over inputs."""

    values: list[torch.Tensor] = field(default_factory=list)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.values.append(F.cosine_similarity(a.float(), b.float(), dim=-1).flatten().cpu())

    def summary(self) -> dict[str, float]:
        v = torch.cat(self.values) if self.values else torch.ones(0)
        return {"mean_token_cosine": float(v.mean()) if v.numel() else float("nan"),
                "min_token_cosine": float(v.min()) if v.numel() else float("nan"), "tokens": int(v.numel())}


def stepwise(tower: VisionTower, pixels: torch.Tensor, grids) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The residual stream after each block, the merged tokens and the DeepStack features of `tower(pixels)`."""
    stream: list[torch.Tensor] = []
    merged, deepstack = tower(pixels, tower.plan(grids), residual_stream=stream)
    return stream, merged, deepstack


def fp8_copy(tower: VisionTower) -> VisionTower:
    """A copy of `tower` with FP8 blocks, as the loader builds it with QUANTIZATION=fp8 (the original untouched)."""
    twin = copy.deepcopy(tower)
    twin.options = replace(tower.options, quantization="fp8")
    quantize_blocks(twin)
    return twin


@torch.inference_mode()
def compare(reference: Encoder, quantized: VisionTower, items: list[Preprocessed]) -> dict:
    """Per-token cosines of `quantized` against `reference.tower` on each item: merged tokens, each DeepStack level,
    and the residual stream after each block."""
    merged, levels, layers = Cosines(), {}, {}
    for item in items:
        pixels = reference.pixels([item])
        ref_layers, ref_merged, ref_ds = stepwise(reference.tower, pixels, [item.grid_thw])
        q_layers, q_merged, q_ds = stepwise(quantized, pixels, [item.grid_thw])
        merged.add(q_merged, ref_merged)
        for level in range(ref_ds.shape[0]):
            levels.setdefault(level, Cosines()).add(q_ds[level], ref_ds[level])
        for layer, (a, b) in enumerate(zip(q_layers, ref_layers)):
            layers.setdefault(layer, Cosines()).add(a, b)
    return {"merged": merged.summary(), "deepstack": [levels[k].summary() for k in sorted(levels)],
            "layers": [layers[k].summary() for k in sorted(layers)], "inputs": len(items)}


def all_tokens(report: dict) -> dict[str, float]:
    """The merged tokens' and every DeepStack level's figures together: the worst and the token-weighted mean."""
    parts = [report["merged"], *report["deepstack"]]
    tokens = sum(p["tokens"] for p in parts)
    return {"mean_token_cosine": sum(p["mean_token_cosine"] * p["tokens"] for p in parts) / max(tokens, 1),
            "min_token_cosine": min(p["min_token_cosine"] for p in parts)}
