"""`--model` resolution: a checkpoint directory or `random:<preset>` -> a ready tower on its device."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from .checkpoint import load_vision_state_dict
from .config import RANDOM_PREFIX, TowerConfig, model_tower_config
from ..errors import CheckpointError
from .preprocess import PreprocessConfig
from .quant import quantize_blocks
from .tower import RMSNorm, TowerOptions, VisionTower, pad_mlp

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)}") from None


def set_cublaslt_workspace(kib: int | None) -> None:
    """The cuBLASLt workspace of this process, in KiB (None: PyTorch's default, 32 MiB on Hopper). With one, the
    tower's GEMMs run stream-K kernels that need zeroed semaphores, a memset before each GEMM (81 per 2B forward);
    without, cuBLASLt picks statically scheduled kernels of the same tiles (faster per forward,
    docs/PERFORMANCE.md). PyTorch reads CUBLASLT_WORKSPACE_SIZE at its first cuBLASLt call, so this must run
    before any GEMM; a value already in the environment wins."""
    if kib is not None:
        os.environ.setdefault("CUBLASLT_WORKSPACE_SIZE", str(kib))


def random_tower(cfg: TowerConfig, device, dtype, seed: int = 0, options: TowerOptions = TowerOptions()
                 ) -> VisionTower:
    """Random weights at a realistic scale (std 0.02, like the checkpoints' init), drawn on `device` itself (a 2B
    tower's 400M values take seconds on a CPU): deterministic for a seed and device type. The tower is built on the
    meta device and given its weights as a checkpoint's are (`to_empty` would run torch's Python reference of
    `empty_like`, which imports sympy: seconds of a start)."""
    device = torch.device(device)
    with torch.device("meta"):
        tower = VisionTower(cfg, options)
    gen = torch.Generator(device=device).manual_seed(seed)
    norms = {f"{name}.weight" for name, m in tower.named_modules() if isinstance(m, (torch.nn.LayerNorm, RMSNorm))}
    state = {}
    for name, p in tower.named_parameters():
        noise = 0.02 * torch.randn(p.shape, generator=gen, device=device)
        if name in norms:
            noise += 1.0
        state[name] = noise.to(dtype)
    tower.load_state_dict(state, assign=True, strict=True)
    return _prepared(tower.eval())


def model_configs(model: str) -> tuple[TowerConfig, PreprocessConfig]:
    """The tower's architecture and its preprocessing for `model` (a checkpoint directory or `random:<preset>`),
    without reading any weight."""
    cfg = model_tower_config(model)
    if model.startswith(RANDOM_PREFIX):
        return cfg, PreprocessConfig.for_family(cfg.family, patch_size=cfg.patch_size,
                                                temporal_patch_size=cfg.temporal_patch_size,
                                                merge_size=cfg.spatial_merge_size)
    path = Path(model)
    pre = PreprocessConfig.from_dir(path, cfg.family)
    if (pre.patch_size, pre.temporal_patch_size, pre.merge_size) != (
        cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size
    ):
        raise CheckpointError(
            f"{path / 'preprocessor_config.json'}: patch/temporal/merge sizes "
            f"{(pre.patch_size, pre.temporal_patch_size, pre.merge_size)} disagree with config.json "
            f"{(cfg.patch_size, cfg.temporal_patch_size, cfg.spatial_merge_size)}"
        )
    return cfg, pre


def load_tower(model: str, device="cpu", dtype="float32", options: TowerOptions = TowerOptions()
               ) -> tuple[VisionTower, PreprocessConfig]:
    """Load the tower named by `model`: a local HF checkpoint directory, or `random:<preset>`."""
    device, dtype = torch.device(device), parse_dtype(dtype)
    cfg, pre = model_configs(model)
    if model.startswith(RANDOM_PREFIX):
        log.warning(
            "RANDOM WEIGHTS: %s has no trained weights; its embeddings are MEANINGLESS. "
            "Pass a Qwen3-VL or Qwen2.5-VL checkpoint directory for real embeddings.", model,
        )
        return random_tower(cfg, device, dtype, options=options), pre
    path = Path(model)
    with torch.device("meta"):
        tower = VisionTower(cfg, options)
    expected = {k: (v.shape, True) for k, v in tower.state_dict().items()}
    state = load_vision_state_dict(path, expected, dtype)
    tower.load_state_dict(state, assign=True, strict=True)
    tower = tower.to(device).eval()
    log.info("loaded vision tower from %s: %d blocks, hidden %d, %s on %s", path, cfg.depth, cfg.hidden_size,
             dtype, device)
    return _prepared(tower), pre


def _prepared(tower: VisionTower) -> VisionTower:
    """The loaded tower as it is served: MLPs padded to GEMM-friendly widths (`tower.pad_mlp`: Qwen2.5-VL's 3420),
    and its blocks' linear layers in FP8 where its options say so (`quant.quantize_blocks`)."""
    for block in tower.blocks:
        pad_mlp(block.mlp)
    if tower.options.quantization == "fp8":
        count = quantize_blocks(tower)
        log.info("FP8 on: %d linear layers of the blocks (QKV and MLP) in e4m3 (weights per output channel, "
                 "activations per token); embeddings, norms, attention, its output projection and the mergers in %s",
                 count, tower.dtype)
    return tower
