"""Architecture of the vision towers served: Qwen3-VL's and Qwen2.5-VL's.

`TowerConfig` is the only architecture description the rest of the package sees. It is built from a
checkpoint's `config.json` through transformers' own config classes (so every alias and default that
transformers knows about is honoured), or from a named preset for runs without weights.

The two families share the block structure (fused QKV with 2D RoPE, output projection, MLP, merger of 2x2
patches). Qwen3-VL: LayerNorm, GELU MLP, learned position embeddings, DeepStack taps, patch 16, attention over
whole frames. Qwen2.5-VL: RMSNorm, SwiGLU MLP, no position embeddings, patch 14, attention within windows of
`window_size` pixels in every block but `fullatt_block_indexes`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointError


QWEN3_VL = "qwen3_vl"
QWEN2_5_VL = "qwen2_5_vl"
FAMILIES = (QWEN3_VL, QWEN2_5_VL)


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
    family: str = QWEN3_VL
    # Qwen2.5-VL: windows of `window_size` pixels per side, except in the full-attention blocks.
    window_size: int = 0
    fullatt_block_indexes: tuple[int, ...] = ()
    # Informational: what the weights came from ("random:<preset>" or a checkpoint path).
    source: str = field(default="", compare=False)

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise CheckpointError(f"unknown tower family {self.family!r}; known: {FAMILIES}")
        if self.hidden_size % self.num_heads:
            raise CheckpointError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 4:
            raise CheckpointError(f"head_dim {self.head_dim} must be divisible by 4 for the 2D rotary embedding")
        side = int(round(self.num_position_embeddings**0.5))
        if side * side != self.num_position_embeddings:
            raise CheckpointError(f"num_position_embeddings {self.num_position_embeddings} is not a square")
        for name in ("deepstack_visual_indexes", "fullatt_block_indexes"):
            bad = [i for i in getattr(self, name) if not 0 <= i < self.depth]
            if bad:
                raise CheckpointError(f"{name} {bad} outside the tower's {self.depth} blocks")
        if self.windowed and self.window_units < 1:
            raise CheckpointError(f"window_size {self.window_size} is smaller than one merged patch "
                                  f"({self.patch_size * self.spatial_merge_size} pixels)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def windowed(self) -> bool:
        """Whether blocks attend within windows (Qwen2.5-VL) rather than over whole frames."""
        return self.family == QWEN2_5_VL

    @property
    def window_units(self) -> int:
        """Merged patches per window side (transformers' `window_size // spatial_merge_size // patch_size`)."""
        return self.window_size // self.spatial_merge_size // self.patch_size

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
        d["fullatt_block_indexes"] = list(self.fullatt_block_indexes)
        d["head_dim"] = self.head_dim
        return d


def _qwen2_5_vl(out_hidden_size: int, **kw) -> TowerConfig:
    """A Qwen2.5-VL tower: every published size (3B, 7B, 32B, 72B) has the same 32-block tower (hidden 1280,
    16 heads of 80, windows of 112 px, full attention in blocks 7, 15, 23 and 31); the merger projects into
    the language model's width."""
    base = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, deepstack_visual_indexes=(),
                patch_size=14, num_position_embeddings=0, hidden_act="silu", family=QWEN2_5_VL, window_size=112,
                fullatt_block_indexes=(7, 15, 23, 31))
    return TowerConfig(out_hidden_size=out_hidden_size, **{**base, **kw})


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
    "qwen2.5-vl-3b": _qwen2_5_vl(2048),
    "qwen2.5-vl-7b": _qwen2_5_vl(3584),
    "qwen2.5-vl-32b": _qwen2_5_vl(5120),
    "qwen2.5-vl-72b": _qwen2_5_vl(8192),
    # CPU tests: head_dim 16, windows of 2x2 merged patches, full attention in blocks 1 and 3.
    "tiny-qwen2.5": _qwen2_5_vl(96, depth=4, hidden_size=64, intermediate_size=128, num_heads=4, window_size=56,
                                fullatt_block_indexes=(1, 3)),
}

# Vision configs of the towers served. Qwen3-VL-MoE shares Qwen3-VL's tower unchanged.
_VISION_MODEL_TYPES = {"qwen3_vl_vision", "qwen3_vl_moe_vision", "qwen2_5_vl_vision"}
_FULL_MODEL_TYPES = {"qwen3_vl", "qwen3_vl_moe", "qwen2_5_vl"}


def preset(name: str) -> TowerConfig:
    try:
        return dataclasses.replace(PRESETS[name], source=f"random:{name}")
    except KeyError:
        raise CheckpointError(f"unknown preset 'random:{name}'; known presets: {sorted(PRESETS)}") from None


RANDOM_PREFIX = "random:"


def model_tower_config(model: str) -> TowerConfig:
    """The tower's architecture for `model`, a checkpoint directory or `random:<preset>`, from its config.json or
    the preset alone (no weights, no torch): `CheckpointError` naming what is wrong."""
    if model.startswith(RANDOM_PREFIX):
        return preset(model[len(RANDOM_PREFIX):])
    path = Path(model)
    if not path.is_dir():
        raise CheckpointError(f"{model}: not a directory (use a local checkpoint directory or random:<preset>)")
    return tower_config_from_dir(path)


def tower_config_from_dir(path: Path) -> TowerConfig:
    """Read `config.json` of a full Qwen3-VL(-MoE) or Qwen2.5-VL checkpoint, or a vision-only one."""
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
            f"{cfg_file}: model_type {model_type!r} is not a Qwen3-VL or Qwen2.5-VL checkpoint "
            f"(expected one of {sorted(_FULL_MODEL_TYPES | _VISION_MODEL_TYPES)})"
        )
    hf = _hf_vision_config(family, vision, cfg_file)
    rope = getattr(hf, "rope_parameters", None) or {}
    if family == QWEN2_5_VL:
        return TowerConfig(
            depth=hf.depth, hidden_size=hf.hidden_size, intermediate_size=hf.intermediate_size, num_heads=hf.num_heads,
            out_hidden_size=hf.out_hidden_size, deepstack_visual_indexes=(), patch_size=hf.patch_size,
            temporal_patch_size=hf.temporal_patch_size, spatial_merge_size=hf.spatial_merge_size,
            in_channels=hf.in_channels, num_position_embeddings=0, hidden_act=hf.hidden_act,
            rope_theta=float(rope.get("rope_theta", 10000.0)), family=QWEN2_5_VL, window_size=hf.window_size,
            fullatt_block_indexes=tuple(hf.fullatt_block_indexes), source=str(path),
        )
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
    elif family == QWEN2_5_VL:
        from transformers import Qwen2_5_VLConfig as Full
    else:
        from transformers import Qwen3VLConfig as Full
    vision = {k: v for k, v in vision.items() if k != "model_type"}
    try:
        return Full(vision_config=vision).vision_config
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_file}: invalid vision_config ({e})") from e
