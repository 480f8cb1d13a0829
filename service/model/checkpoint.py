"""Reading the vision tower's weights out of a Hugging Face checkpoint directory.

Only safetensors are read, and only the tensors under the vision prefix: `safe_open` maps each shard
and copies just the requested tensors, so the tower of a 235B checkpoint loads in a few hundred MB of
host memory. Pickle-based `.bin`/`.pt` files are refused, never opened.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Full checkpoints keep the tower under one of these; a vision-only checkpoint has no prefix.
VISION_PREFIXES = ("model.visual.", "visual.", "")
_PROBE = "patch_embed.proj.weight"


def _weight_map(path: Path) -> dict[str, str]:
    """key -> shard file name, for a single-file or an indexed (sharded) checkpoint."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        return dict(weight_map)
    single = path / SINGLE_FILE
    if single.is_file():
        return {key: SINGLE_FILE for key in _keys(single)}
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    if len(shards) == 1:
        return {key: shards[0] for key in _keys(path / shards[0])}
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
    if pickles:
        raise CheckpointError(
            f"{path}: only pickle weight files found ({', '.join(pickles[:3])}); they are never loaded, "
            "for safety. Convert the checkpoint to safetensors."
        )
    if shards:
        raise CheckpointError(f"{path}: {len(shards)} .safetensors files but no {INDEX_FILE} to say which holds what")
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


def _keys(file: Path) -> list[str]:
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e


def vision_prefix(keys) -> str:
    keys = set(keys)
    for prefix in VISION_PREFIXES:
        if prefix + _PROBE in keys:
            return prefix
    raise CheckpointError(
        f"no vision tower weights found: none of {[p + _PROBE for p in VISION_PREFIXES]} is in the checkpoint"
    )


def load_vision_state_dict(
    path: Path, expected: dict[str, tuple[torch.Size, bool]], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Read the tower's tensors, keyed as in the tower module.

    `expected` maps each module key to (shape, required). Shapes are checked before any tensor is
    read, so a mismatched checkpoint fails fast with the file and key in the message.
    """
    weight_map = _weight_map(path)
    prefix = vision_prefix(weight_map)
    by_file: dict[str, list[str]] = defaultdict(list)
    for key, (_, required) in expected.items():
        full = prefix + key
        if full in weight_map:
            by_file[weight_map[full]].append(key)
        elif required:
            raise CheckpointError(f"{path}: tensor {full!r} missing from the checkpoint")

    state: dict[str, torch.Tensor] = {}
    for file_name, keys in sorted(by_file.items()):
        file = path / file_name
        if not file.is_file():
            raise CheckpointError(f"{file}: shard listed in {INDEX_FILE} does not exist")
        try:
            with safe_open(str(file), framework="pt") as f:
                present = set(f.keys())
                for key in keys:
                    full = prefix + key
                    if full not in present:
                        raise CheckpointError(f"{file}: tensor {full!r} listed in the index but not in the file")
                    shape = torch.Size(f.get_slice(full).get_shape())
                    if shape != expected[key][0]:
                        raise CheckpointError(
                            f"{file}: tensor {full!r} has shape {tuple(shape)}, the config implies "
                            f"{tuple(expected[key][0])}"
                        )
                    state[key] = f.get_tensor(full).to(dtype)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    return state
