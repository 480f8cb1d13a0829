"""Architecture of the Qwen3-VL vision tower and the image-preprocessing settings that go with it.

`TowerConfig` is the only architecture description the rest of the package sees. It is built from a
checkpoint's `config.json` through transformers' own config classes (so every alias and default that
transformers knows about is honoured), or from a named preset for runs without weights.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError


@dataclass(frozen=True)
class TowerConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    deepstack_visual_indexes: tuple[int, ...]
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    num_position_embeddings: int = 2304
    hidden_act: str = "gelu_pytorch_tanh"
    rope_theta: float = 10000.0
    # Informational: what the weights came from ("random:<preset>" or a checkpoint path).
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise CheckpointError(f"head_dim {self.head_dim} must be divisible by 4 for the 2D rotary embedding")
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise CheckpointError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        bad = [i for i in self.deepstack_visual_indexes if not 0 <= i < self.depth]
        if bad:
            raise CheckpointError(f"deepstack_visual_indexes {bad} outside the tower's {self.depth} blocks")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size**2

    @property
    def num_grid_per_side(self) -> int:
        return int(round(self.num_position_embeddings**0.5))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["deepstack_visual_indexes"] = list(self.deepstack_visual_indexes)
        d["head_dim"] = self.head_dim
        return d


PRESETS: dict[str, TowerConfig] = {
    "qwen3-vl-2b": TowerConfig(
        depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2048,
        deepstack_visual_indexes=(5, 11, 17),
    ),
    "qwen3-vl-8b": TowerConfig(
        depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
        deepstack_visual_indexes=(8, 16, 24),
    ),
    # Small enough for CPU tests and demos; head_dim 16, two DeepStack taps.
    "tiny": TowerConfig(
        depth=4, hidden_size=64, intermediate_size=128, num_heads=4, out_hidden_size=96,
        deepstack_visual_indexes=(1, 2), num_position_embeddings=64,
    ),
}

# Vision configs that describe this exact tower. The MoE family shares the vision tower unchanged.
_VISION_MODEL_TYPES = {"qwen3_vl_vision", "qwen3_vl_moe_vision"}
_FULL_MODEL_TYPES = {"qwen3_vl", "qwen3_vl_moe"}


def preset(name: str) -> TowerConfig:
    try:
        return dataclasses.replace(PRESETS[name], source=f"random:{name}")
    except KeyError:
        raise CheckpointError(f"unknown preset 'random:{name}'; known presets: {sorted(PRESETS)}") from None


def tower_config_from_dir(path: Path) -> TowerConfig:
    """Read `config.json` of a full Qwen3-VL(-MoE) checkpoint or a vision-only one."""
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{cfg_file}: missing; a Hugging Face checkpoint directory needs a config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{cfg_file}: unreadable JSON ({e})") from e
    model_type = raw.get("model_type")
    if model_type in _FULL_MODEL_TYPES:
        vision = raw.get("vision_config")
        if not isinstance(vision, dict):
            raise CheckpointError(f"{cfg_file}: model_type {model_type!r} but no vision_config")
        family = model_type
    elif model_type in _VISION_MODEL_TYPES:
        vision, family = raw, model_type.removesuffix("_vision")
    else:
        raise CheckpointError(
            f"{cfg_file}: model_type {model_type!r} is not a Qwen3-VL checkpoint "
            f"(expected one of {sorted(_FULL_MODEL_TYPES | _VISION_MODEL_TYPES)})"
        )
    hf = _hf_vision_config(family, vision, cfg_file)
    rope = getattr(hf, "rope_parameters", None) or {}
    return TowerConfig(
        depth=hf.depth,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_heads=hf.num_heads,
        out_hidden_size=hf.out_hidden_size,
        deepstack_visual_indexes=tuple(hf.deepstack_visual_indexes),
        patch_size=hf.patch_size,
        temporal_patch_size=hf.temporal_patch_size,
        spatial_merge_size=hf.spatial_merge_size,
        in_channels=hf.in_channels,
        num_position_embeddings=hf.num_position_embeddings,
        hidden_act=hf.hidden_act,
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        source=str(path),
    )


def _hf_vision_config(family: str, vision: dict, cfg_file: Path):
    if family == "qwen3_vl_moe":
        from transformers import Qwen3VLMoeConfig as Full
    else:
        from transformers import Qwen3VLConfig as Full
    vision = {k: v for k, v in vision.items() if k != "model_type"}
    try:
        return Full(vision_config=vision).vision_config
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: invalid vision_config ({e})") from e
