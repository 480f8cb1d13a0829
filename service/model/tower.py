"""The vision towers of Qwen3-VL and Qwen2.5-VL, written for serving.

Parameter names mirror transformers' `Qwen3VLVisionModel` and `Qwen2_5_VisionTransformerPretrainedModel`, so
checkpoints load with a plain `load_state_dict`. The two share one forward (`config.TowerConfig` lists what
differs); Qwen2.5-VL's windows are a token order and a second set of attention segments in the plan: the pack's
patches are put in window order before the first block (every window's patches contiguous, each frame's windows
inside the frame's span), the windowed blocks attend over the windows as segments of one varlen call, the
full-attention blocks over the frames, and the merged tokens are put back in patch order after the merger.
What differs from transformers is how the forward is organised:
- everything that depends only on the pack's grids (cu_seqlens, rotary tables, position-embedding
  interpolation taps) is built once per forward by `PackPlan.build`, vectorised on the device, with
  no per-image Python loop and no device->host reads;
- on Hopper the QKV projection rotates Q and K in its own epilogue (`kernels.qkv_rope.qkv_rope_linear`,
  power-of-two head dims); elsewhere one Triton pass rotates them in place in the projection's output.
  Attention then runs through `kernels.attention` (one Triton launch per block on CUDA;
  elsewhere SDPA, once per run of equal-length segments, on views of the fused QKV buffer);
- the position embeddings are interpolated and added in one pass (`kernels.pos_embed`);
- the attention's and the MLP's output projections add the residual in their GEMM, and the
  LayerNorm after each is one pass that also adds back the biases those GEMMs left out.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from kernels.attention import check_backend
from kernels import resolve_backend, varlen_attention, vision_rope_cos_sin, vision_rope_inv_freq
from kernels.act_quant import ACTIVATIONS as QUANTIZED_ACTIVATIONS, act_quantize
from kernels.add_layernorm import add_layernorm, layernorm_offset
from kernels.fp8 import GEMM_MULTIPLE, Quantized
from kernels.fp8_gemm import Rope
from kernels.pos_embed import pos_embed_add_
from kernels.qkv_rope import fused_qkv_rope_supported, linear_then_rope, qkv_rope_linear

from .config import TowerConfig
from .quant import QUANTIZATIONS, takes_quantized

@dataclass(frozen=True)
class TowerOptions:
    """How the forward is organised. Every combination computes the same function (the parity tests run them);
    the defaults are the fastest measured (docs/PERFORMANCE.md).

    attention_backend: 'auto' (Triton kernels where they run, else SDPA), 'triton' or 'sdpa'.
    fused_qkv_rope: Triton backend: the QKV projection adds its bias and rotates Q and K in its own epilogue
      (`kernels.qkv_rope.qkv_rope_linear`, Hopper, power-of-two head dims) instead of cuBLAS plus an in-place pass.
    residual_in_gemm: the output projections (attention proj, MLP fc2) add the residual in their GEMM's epilogue
      (cuBLAS addmm, beta = 1) and the LayerNorm that follows only normalises (`_bias_offsets`): two passes over
      the activations per residual instead of four. None: on for Qwen3-VL, off for Qwen2.5-VL, whose bf16 error
      against float32 it raised above transformers' own (docs/PERFORMANCE.md).
    """

    attention_backend: str = "auto"
    fused_qkv_rope: bool = True
    residual_in_gemm: bool | None = None
    quantization: str = "none"

    def __post_init__(self):
        check_backend(self.attention_backend)
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r}: use one of {QUANTIZATIONS}")


def segment_lengths(grids) -> list[int]:
    """Attention segment lengths of a pack of grids `(t, h, w)`: one segment of h * w per frame."""
    return [h * w for t, h, w in grids for _ in range(t)]


def layer_segments(cfg: TowerConfig, grids) -> list[list[int]]:
    """Each block's attention segment lengths: the frames, or in a windowed tower's windowed blocks the windows (the
    same list objects repeat: one per distinct set)."""
    frames = segment_lengths(grids)
    if not cfg.windowed:
        return [frames] * cfg.depth
    windows = window_order(grids, cfg.spatial_merge_size, cfg.window_units)[1]
    return [frames if layer in cfg.fullatt_block_indexes else windows for layer in range(cfg.depth)]


@dataclass
class PackPlan:
    """Per-forward metadata for a pack of grids `(t, h, w)` (in patches)."""

    grids: tuple[tuple[int, int, int], ...]
    seqlens: list[int] | None  # host copy of the segment lengths (one per frame); None: on the device only (padded)
    cu_seqlens: torch.Tensor  # int32 [segments + 1]
    max_seqlen: int
    cos: torch.Tensor  # float32 [T, head_dim / 2], in the tower's token order
    sin: torch.Tensor
    interp_index: torch.Tensor | None  # long [T, 4]: bilinear taps into the learned position grid (Qwen3-VL)
    interp_weight: torch.Tensor | None  # float32 [T, 4]
    # Windowed towers (Qwen2.5-VL): the tower's token order (indices into the pack's patch rows), its inverse for
    # the merged tokens, and the windows as attention segments.
    token_order: torch.Tensor | None = None  # long [T]
    merged_order: torch.Tensor | None = None  # long [T / merge_unit]
    window_seqlens: list[int] | None = None
    window_cu_seqlens: torch.Tensor | None = None  # int32 [windows + 1]
    window_max_seqlen: int = 0
    # Rows past the segments are padding (a CUDA graph bucket's plan, whose segments are device inputs)
    padded: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(t * h * w for t, h, w in self.grids)

    def segments(self, windowed: bool) -> tuple[torch.Tensor, int, list[int]]:
        """(cu_seqlens, max_seqlen, seqlens) of the windows, or of the frames."""
        if windowed:
            return self.window_cu_seqlens, self.window_max_seqlen, self.window_seqlens
        return self.cu_seqlens, self.max_seqlen, self.seqlens

    @staticmethod
    def build(grids, cfg: TowerConfig, device) -> "PackPlan":
        grids = tuple(tuple(int(x) for x in g) for g in grids)
        m = cfg.spatial_merge_size
        for t, h, w in grids:
            if t < 1 or h < m or w < m or h % m or w % m:
                raise ValueError(f"grid {(t, h, w)} is not a positive multiple of the merge size {m}")
        seqlens = segment_lengths(grids)
        total = sum(seqlens)
        host = [np.array([0, *itertools.accumulate(seqlens), *itertools.chain.from_iterable(grids)], np.int64)]
        if cfg.windowed:
            order, windows = window_order(grids, m, cfg.window_units)
            host += [np.array([0, *itertools.accumulate(windows)], np.int64), order]
        # One host->device copy, from pinned memory: a copy from pageable memory would wait for the
        # stream to drain, stalling the GPU between back-to-back forwards.
        host = torch.from_numpy(np.concatenate(host))
        device = torch.device(device)
        if device.type == "cuda":
            host = host.pin_memory()
        meta = host.to(device, non_blocking=True)
        cu_seqlens = meta[:len(seqlens) + 1].to(torch.int32)
        g = meta[len(seqlens) + 1:len(seqlens) + 1 + 3 * len(grids)].view(-1, 3)  # [N, 3]
        counts = g.prod(1)
        heights = torch.repeat_interleave(g[:, 1], counts, output_size=total)
        widths = torch.repeat_interleave(g[:, 2], counts, output_size=total)
        starts = torch.repeat_interleave(counts.cumsum(0) - counts, counts, output_size=total)
        within = (torch.arange(total, device=device) - starts) % (heights * widths)  # index inside a frame
        # Tokens are laid out in merge-block order: (block_row, block_col, in_row, in_col).
        block_col = (within // (m * m)) % (widths // m)
        block_row = within // (m * m * (widths // m))
        row = block_row * m + (within // m) % m
        col = block_col * m + within % m
        if cfg.windowed:
            n_cu = len(windows) + 1
            start = len(seqlens) + 1 + 3 * len(grids)
            window_cu = meta[start:start + n_cu].to(torch.int32)
            token_order = meta[start + n_cu:]
            row, col = row[token_order], col[token_order]
            merged_order = torch.empty_like(token_order[::m * m])
            merged_order[token_order[::m * m] // (m * m)] = torch.arange(len(merged_order), device=device)

        cos, sin = vision_rope_cos_sin(torch.stack([row, col], 1), vision_rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, device=device))
        if cfg.windowed:
            return PackPlan(grids, seqlens, cu_seqlens, max(seqlens), cos, sin, None, None, token_order, merged_order,
                            list(windows), window_cu, max(windows))
        side = cfg.num_grid_per_side
        r_taps, r_w = _bilinear_taps(row, heights, side)
        c_taps, c_w = _bilinear_taps(col, widths, side)
        index = (r_taps[:, :, None] * side + c_taps[:, None, :]).reshape(total, 4)
        weight = (r_w[:, :, None] * c_w[:, None, :]).reshape(total, 4)
        return PackPlan(grids, seqlens, cu_seqlens, max(seqlens), cos, sin, index, weight)


@functools.lru_cache(maxsize=4096)
def _frame_windows(height: int, width: int, merge: int, units: int) -> tuple[np.ndarray, tuple[int, ...]]:
    """One frame of `height` x `width` patches: its merged patches in window order (windows of `units` x `units`
    merged patches, row-major from the top-left corner, the last row and column of windows cut short by the frame's
    edge; row-major inside each window), and each window's length in patches: transformers' `get_window_index`."""
    grid = np.arange((height // merge) * (width // merge)).reshape(height // merge, width // merge)
    windows = [grid[r:r + units, c:c + units] for r in range(0, grid.shape[0], units)
               for c in range(0, grid.shape[1], units)]
    return np.concatenate([w.ravel() for w in windows]), tuple(w.size * merge * merge for w in windows)


def window_order(grids, merge: int, units: int) -> tuple[np.ndarray, list[int]]:
    """The pack's patch rows in window order (int64 indices into the pack's rows, every frame's windows within its
    span) and the windows' lengths, frame after frame."""
    unit = merge * merge
    orders, lengths, base = [], [], 0
    for t, h, w in grids:
        order, windows = _frame_windows(h, w, merge, units)
        frames = base + np.arange(t)[:, None] * len(order)  # first merged patch of each frame
        orders.append((frames + order[None, :]).ravel())
        lengths.extend(windows * t)
        base += t * len(order)
    merged = np.concatenate(orders)
    return (merged[:, None] * unit + np.arange(unit)).ravel(), lengths


def _fused(backend: str) -> bool | None:
    """Triton for the small fused kernels: always with the Triton backend (also when forced under the
    interpreter), otherwise whenever the tensors are on a GPU."""
    return True if backend == "triton" else None


def _add_norm(x, y, norm: "nn.LayerNorm | RMSNorm", backend: str, merged_norm: nn.LayerNorm | None = None,
              offset: torch.Tensor | None = None, quantize: bool = False):
    """(x + y, norm(x + y)), or without y (the GEMM added the residual) (x, norm(x + offset)) with the
    float32 `offset` (or none); plus `merged_norm` of the same rows grouped into merged tokens. `quantize`: the
    norm as `Quantized` rows, for an FP8 GEMM, from the same pass."""
    merged = None if merged_norm is None else (merged_norm.weight, merged_norm.bias, merged_norm.eps)
    if y is None:
        out = x, *layernorm_offset(x, offset, norm.weight, norm.bias, norm.eps, use_triton=_fused(backend),
                                   merged_norm=merged, quantize=quantize)
    else:
        out = add_layernorm(x, y, norm.weight, norm.bias, norm.eps, use_triton=_fused(backend), merged_norm=merged,
                            quantize=quantize)
    return (out[0], Quantized(out[1], out[2]), *out[3:]) if quantize else out


def _quantizes_activation(output: nn.Module, act: str) -> bool:
    """Whether an MLP hands its FP8 output projection e4m3 rows from the activation's pass (`act_quantize`)."""
    return act in QUANTIZED_ACTIVATIONS and takes_quantized(output)


def _reads_fp8(part: nn.Module) -> bool:
    """Whether the GEMMs that read a block part's input (qkv; fc1, or gate and up) are FP8."""
    if isinstance(part, Attention):
        return takes_quantized(part.qkv)
    if isinstance(part, GatedMLP):
        return takes_quantized(part.gate_proj, part.up_proj)
    return takes_quantized(part.linear_fc1)


def _project(linear: nn.Linear, x, residual, use_triton: bool | None = None):
    """linear(x), or with a residual `residual += x @ W^T` in the GEMM's epilogue (bias left out). `use_triton`: an
    FP8 layer's fused kernel (`quant.Fp8Linear`; None: on a GPU)."""
    if isinstance(linear, nn.Linear):
        return linear(x) if residual is None else residual.addmm_(x, linear.weight.t())
    return linear(x, residual=residual, add_bias=residual is None, use_triton=use_triton)


def _bilinear_taps(index, size, side):
    """Bilinear (align_corners=True) taps and weights of target positions `index` on an axis of `size`
    into a learned axis of `side` entries: `F.interpolate`'s arithmetic, as transformers computes it."""
    src = index.to(torch.float32) * (side - 1) / torch.clamp(size - 1, min=1)
    floor = torch.floor(src)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (src[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights


class RMSNorm(nn.Module):
    """Qwen2.5-VL's norm: `weight` only (`bias` is None, which tells `_add_norm` it is an RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.register_parameter("bias", None)
        self.eps = eps

    def forward(self, x):
        return layernorm_offset(x, None, self.weight, None, self.eps)[0]


def _norm(cfg: TowerConfig, size: int):
    return RMSNorm(size, eps=1e-6) if cfg.windowed else nn.LayerNorm(size, eps=1e-6)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=not cfg.windowed)

    def forward(self, x):
        # A stride == kernel Conv3d over one patch is a matmul: [T, C*t*p*p] @ [C*t*p*p, hidden]
        w = self.proj.weight
        return F.linear(x.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class Attention(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)

    def project_qkv(self, x, cos, sin, backend: str, options: TowerOptions,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """x `[T, hidden]` -> qkv `[T, 3, H, D]`, Q and K rotated, into `out` if given. `backend` is the tower's (it
        decides the fused projection)."""
        if not isinstance(self.qkv, nn.Linear):  # FP8 (`quant.Fp8Linear`; x: `Quantized` rows from the norm's pass)
            return self.qkv(x, rope=Rope(cos, sin, self.num_heads), out=out,
                            use_triton=_fused(backend) if options.fused_qkv_rope else False)
        if (backend == "triton" and options.fused_qkv_rope
                and fused_qkv_rope_supported(x, self.qkv.weight, self.num_heads)):
            return qkv_rope_linear(x, self.qkv.weight, self.qkv.bias, cos, sin, self.num_heads, out=out)
        return linear_then_rope(x, self.qkv.weight, self.qkv.bias, cos, sin, self.num_heads, out=out,
                                use_triton=_fused(backend))

    def attend(self, qkv, plan: "PackPlan", attention: str, out: torch.Tensor | None = None,
               windowed: bool = False) -> torch.Tensor:
        """Block-diagonal attention over the pack's frames (or its windows): qkv `[T, 3, H, D]` -> `[T, H * D]`
        (into `out` if given, contiguous `[T, H * D]`)."""
        q, k, v = qkv.unbind(1)  # 3 x [T, H, D] strided views; the kernel reads them in place
        tokens = qkv.shape[0]
        cu_seqlens, max_seqlen, seqlens = plan.segments(windowed)
        out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, seqlens=seqlens, backend=attention,
                               out=None if out is None else out.view(tokens, self.num_heads, self.head_dim),
                               padded=plan.padded)
        return out.view(tokens, -1)


def activation(name: str) -> nn.Module:
    """The checkpoint's `hidden_act`: the common ones directly (transformers' ACT2FN computes the same functions,
    and importing it costs seconds of every engine start), any other through ACT2FN."""
    common = {"gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"), "gelu": nn.GELU, "silu": nn.SiLU}
    if name in common:
        return common[name]()
    from transformers.activations import ACT2FN  # noqa: PLC0415

    return ACT2FN[name]


class MLP(nn.Module):
    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act_fn = activation(cfg.hidden_act)
        self.hidden_act = cfg.hidden_act
        self.tanh_gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x, residual: torch.Tensor | None = None, use_triton: bool | None = None):
        """The MLP; with `residual`, returns `residual` + the MLP without fc2's bias. `use_triton`: the FP8 layers'
        fused kernels (None: on a GPU)."""
        if self.tanh_gelu and isinstance(self.linear_fc1, nn.Linear) and x.is_cuda and gelu_epilogue_ok(x.device):
            # bias + tanh-GELU in the GEMM's epilogue (cuBLASLt), computed from the fp32 accumulator:
            # saves a read and a write of the widest activation of the block
            h = torch._addmm_activation(self.linear_fc1.bias, x, self.linear_fc1.weight.t(), use_gelu=True)
        elif getattr(self.linear_fc1, "act_inv_norm", None) is not None:  # FP8: e4m3 rows from fc1's epilogue
            h = self.linear_fc1(x, act=self.hidden_act, use_triton=use_triton)
        elif _quantizes_activation(self.linear_fc2, self.hidden_act):  # FP8 (quantised whole: fc1 is FP8 too)
            h = act_quantize(self.linear_fc1(x, use_triton=use_triton), self.hidden_act)  # e4m3 rows from its pass
        else:
            h = self.act_fn(self.linear_fc1(x))
        return _project(self.linear_fc2, h, residual, use_triton)

    @property
    def output(self) -> nn.Linear:
        return self.linear_fc2


class GatedMLP(nn.Module):
    """Qwen2.5-VL's SwiGLU MLP: down(act(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=True)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=True)
        self.act_fn = activation(cfg.hidden_act)
        self.hidden_act = cfg.hidden_act

    def forward(self, x, residual: torch.Tensor | None = None, use_triton: bool | None = None):
        """The MLP; with `residual`, returns `residual` + the MLP without down_proj's bias. `use_triton` as `MLP`'s."""
        if _quantizes_activation(self.down_proj, self.hidden_act):  # FP8 down_proj: e4m3 rows from the SwiGLU's pass
            h = act_quantize(self.gate_proj(x, use_triton=use_triton), self.hidden_act,
                             self.up_proj(x, use_triton=use_triton))
        else:
            h = self.act_fn(self.gate_proj(x)).mul_(self.up_proj(x))
        return _project(self.down_proj, h, residual, use_triton)

    @property
    def output(self) -> nn.Linear:
        return self.down_proj


_GELU_EPILOGUE: dict[torch.device, bool] = {}


def gelu_epilogue_ok(device) -> bool:
    """Whether `_addmm_activation(use_gelu=True)` is the tanh GELU on this device (checked once).

    On CUDA PyTorch documents it as the tanh approximation, on CPU it is the exact erf GELU; a wrong
    variant would shift every embedding slightly without failing loudly, so it is verified."""
    if device not in _GELU_EPILOGUE:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(64, 64, device=device, generator=g)
        w = torch.randn(96, 64, device=device, generator=g)
        b = torch.randn(96, device=device, generator=g)
        fused = torch._addmm_activation(b, x, w.t(), use_gelu=True)
        ref = F.gelu(torch.addmm(b, x, w.t()), approximate="tanh")
        _GELU_EPILOGUE[device] = bool(torch.allclose(fused, ref, rtol=1e-3, atol=1e-4))
    return _GELU_EPILOGUE[device]


# cuBLAS's fast (TMA) GEMMs need rows of a multiple of 16 bytes, and the FP8 GEMM widths of a multiple of 16
# (`GEMM_MULTIPLE`): Qwen2.5-VL's 3420-wide MLP (6840-byte rows in bf16) ran on slower kernels
# (docs/PERFORMANCE.md), so the loader pads it (`pad_mlp`) to a width both take
MLP_MULTIPLE = GEMM_MULTIPLE


def padded_width(width: int, multiple: int = MLP_MULTIPLE) -> int:
    """An MLP's width as `pad_mlp` leaves it."""
    return width + -width % multiple


def pad_mlp(mlp: nn.Module, multiple: int = MLP_MULTIPLE) -> bool:
    """Widen an MLP's intermediate size to a multiple of `multiple` with zeros, in place: its input projections (fc1,
    or gate and up) get zero rows and zero biases, its output projection zero columns. The padded channels are
    act(0) (* 0) = 0 for GELU and SiLU, and add nothing: the same function. `state_dict()` still gives the
    checkpoint's shapes (transformers' towers load it). Whether it padded."""
    output = mlp.output
    inputs = [m for m in mlp.children() if isinstance(m, nn.Linear) and m is not output]
    width = output.in_features
    if width % multiple == 0 or not inputs or any(m.out_features != width for m in inputs):
        return False
    wide = padded_width(width, multiple)
    output_name = next(name for name, m in mlp.named_children() if m is output)
    for name, m in list(mlp.named_children()):
        if m is not output and m not in inputs:
            continue
        shape = (wide, m.out_features) if m is output else (m.in_features, wide)
        wider = nn.Linear(*shape, bias=m.bias is not None, device=m.weight.device, dtype=m.weight.dtype)
        with torch.no_grad():
            wider.weight.zero_()
            if m is output:
                wider.weight[:, :width] = m.weight
            else:
                wider.weight[:width] = m.weight
            if m.bias is not None:
                wider.bias.zero_()[:m.bias.shape[0]] = m.bias
        setattr(mlp, name, wider.requires_grad_(False))

    def checkpoint_shapes(module, state, prefix, local_metadata):
        for key in [k for k in state if k.startswith(prefix)]:
            child = key[len(prefix):].split(".")[0]
            t = state[key]
            if child == output_name and t.dim() == 2 and t.shape[1] == wide:
                state[key] = t[:, :width]
            elif child != output_name and t.dim() >= 1 and t.shape[0] == wide:
                state[key] = t[:width]

    mlp.register_state_dict_post_hook(checkpoint_shapes)
    return True


class Block(nn.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)). The tower adds each residual in the output projection's
    GEMM and normalises in one pass after it, across block boundaries (`TowerOptions.residual_in_gemm`)."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.norm1 = _norm(cfg, cfg.hidden_size)
        self.norm2 = _norm(cfg, cfg.hidden_size)
        self.attn = Attention(cfg)
        self.mlp = GatedMLP(cfg) if cfg.windowed else MLP(cfg)


class PatchMerger(nn.Module):
    """2x2 neighbouring tokens -> one: optional LayerNorm after the shuffle (DeepStack) or before."""

    def __init__(self, cfg: TowerConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_unit
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.merged, self.merged)
        self.act_fn = nn.GELU()
        self.linear_fc2 = nn.Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x):
        x = self.norm(x.view(-1, self.merged)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged)
        return self.project(x)

    def project(self, x, out=None):
        """The MLP on normalised merged tokens `[T / merge_unit, merged]`, optionally into `out`."""
        h = self.act_fn(self.linear_fc1(x))
        if out is None:
            return self.linear_fc2(h)
        return torch.addmm(self.linear_fc2.bias, h, self.linear_fc2.weight.t(), out=out)


class WindowMerger(nn.Module):
    """Qwen2.5-VL's merger: RMSNorm per patch (`ln_q`), then 2x2 neighbouring patches -> one through an MLP."""

    def __init__(self, cfg: TowerConfig):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.merge_unit
        self.ln_q = RMSNorm(cfg.hidden_size, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.merged, self.merged), nn.GELU(),
                                 nn.Linear(self.merged, cfg.out_hidden_size))

    @property
    def norm(self) -> RMSNorm:
        return self.ln_q

    def forward(self, x):
        return self.project(self.ln_q(x).view(-1, self.merged))

    def project(self, x, out=None):
        fc1, act, fc2 = self.mlp
        h = act(fc1(x))
        return fc2(h) if out is None else torch.addmm(fc2.bias, h, fc2.weight.t(), out=out)


class VisionTower(nn.Module):
    def __init__(self, cfg: TowerConfig, options: TowerOptions = TowerOptions()):
        super().__init__()
        self.config = cfg
        self.options = options
        self.patch_embed = PatchEmbed(cfg)
        if not cfg.windowed:
            # built without nn.Embedding's own init: the loader fills every weight, and normal_ on the meta device
            # (where the loader builds the tower) imports torch._dynamo, seconds of every start
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size,
                                          _weight=torch.empty(cfg.num_position_embeddings, cfg.hidden_size))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.merger = WindowMerger(cfg) if cfg.windowed else PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )
        self._backend: str | None = None
        self._taps = {layer: i for i, layer in enumerate(cfg.deepstack_visual_indexes)}  # layer -> DeepStack merger
        full = set(cfg.fullatt_block_indexes)
        self._windowed = [cfg.windowed and layer not in full for layer in range(cfg.depth)]

    @property
    def residual_in_gemm(self) -> bool:
        """`TowerOptions.residual_in_gemm`, resolved for this tower's family."""
        chosen = self.options.residual_in_gemm
        return not self.config.windowed if chosen is None else chosen

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def backend(self) -> str:
        """The attention backend this tower runs on its current device ('triton' or 'sdpa')."""
        if self._backend is None:
            self._backend = resolve_backend(self.device, self.config.head_dim, self.options.attention_backend)
        return self._backend

    def plan(self, grids) -> PackPlan:
        return PackPlan.build(grids, self.config, self.device)

    def forward(self, pixel_values: torch.Tensor, plan: PackPlan, attention: str | None = None,
                residual_stream: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """pixel_values [T, C*t*p*p] -> merged tokens [T/4, out], DeepStack [n_deepstack, T/4, out] (n_deepstack 0
        for Qwen2.5-VL).
        `attention`: the attention backend of this forward ('triton' or 'sdpa'; default `backend`); every other kernel
        is the same either way. `residual_stream`: if given, the residual stream after each block is appended to it
        (float32, with the biases the GEMMs leave to the norms added back): `quant_check` compares it layer by layer.

        The steps (`embed`, then per block `project_qkv`, `attend`, `block_tail`, then `merge`) are also what
        `graphs.BucketedTower` runs: everything but the attention as CUDA graphs over padded token counts, between
        `order_tokens` and `restore_order`."""
        if pixel_values.shape[0] != plan.num_tokens:
            raise ValueError(f"{pixel_values.shape[0]} patch rows for grids totalling {plan.num_tokens}")
        attention = attention or self.backend
        offsets = self._bias_offsets() if self.residual_in_gemm else None
        deepstack = self.new_deepstack(pixel_values.shape[0], pixel_values.device)
        x, h = self.embed(self.order_tokens(pixel_values, plan), plan.interp_index, plan.interp_weight)
        for layer in range(len(self.blocks)):
            qkv = self.project_qkv(layer, h, plan.cos, plan.sin)
            x, h = self.block_tail(layer, x, self.attend(layer, qkv, plan, attention), offsets, deepstack)
            if residual_stream is not None:
                residual_stream.append(x.float() + offsets[2 * layer + 1] if offsets is not None else x.float())
        return self.restore_order(self.merge(h), plan), deepstack

    @staticmethod
    def order_tokens(pixel_values, plan: PackPlan, out: torch.Tensor | None = None) -> torch.Tensor:
        """The pack's patch rows in the tower's token order (window order for Qwen2.5-VL), into `out` if given."""
        if plan.token_order is None:
            return pixel_values if out is None else out.copy_(pixel_values)
        return torch.index_select(pixel_values, 0, plan.token_order, out=out)

    @staticmethod
    def restore_order(merged, plan: PackPlan) -> torch.Tensor:
        """Merged tokens from the tower's order back to the pack's (the input itself where the orders agree)."""
        return merged if plan.merged_order is None else merged.index_select(0, plan.merged_order)

    def new_deepstack(self, tokens: int, device) -> torch.Tensor:
        return torch.empty((len(self.config.deepstack_visual_indexes), tokens // self.config.merge_unit,
                            self.config.out_hidden_size), dtype=self.dtype, device=device)

    def embed(self, pixel_values, interp_index, interp_weight) -> tuple[torch.Tensor, torch.Tensor]:
        """Patch embedding plus interpolated position embeddings (Qwen3-VL; Qwen2.5-VL has none): the residual
        stream x and norm1(x) of block 0."""
        x = self.patch_embed(pixel_values)
        if interp_index is not None:
            pos_embed_add_(x, self.pos_embed.weight, interp_index, interp_weight, use_triton=_fused(self.backend))
        _, h = _add_norm(x, None, self.blocks[0].norm1, self.backend, quantize=_reads_fp8(self.blocks[0].attn))
        return x, h

    def project_qkv(self, layer: int, h, cos, sin, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.blocks[layer].attn.project_qkv(h, cos, sin, self.backend, self.options, out)

    def attend(self, layer: int, qkv, plan: PackPlan, attention: str, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.blocks[layer].attn.attend(qkv, plan, attention, out, self._windowed[layer])

    def block_tail(self, layer: int, x, attended, offsets, deepstack) -> tuple[torch.Tensor, torch.Tensor]:
        """After block `layer`'s attention: its output projection, norm2, the MLP, and the norm that follows (the next
        block's norm1, or the merger's), each residual add fused with the norm after it; at a DeepStack tap also that
        merger's post-shuffle norm in the same pass, and its projection into `deepstack`. With `offsets` (the running
        bias sums of `_bias_offsets`; `TowerOptions.residual_in_gemm`) the projections add the residual in their GEMM
        and the norms add the offsets; without, the norms' pass adds the residual. Returns the residual stream and
        the normalised input of what comes next."""
        blocks = self.blocks
        block = blocks[layer]
        in_gemm = offsets is not None
        if in_gemm:
            x, y = _project(block.attn.proj, attended, x), None
        else:
            y = block.attn.proj(attended)
        x, h = _add_norm(x, y, block.norm2, self.backend, offset=offsets[2 * layer] if in_gemm else None,
                         quantize=_reads_fp8(block.mlp))
        if in_gemm:
            x, y = block.mlp(h, residual=x, use_triton=_fused(self.backend)), None
        else:
            y = block.mlp(h, use_triton=_fused(self.backend))
        norm = blocks[layer + 1].norm1 if layer + 1 < len(blocks) else self.merger.norm
        tap = self._taps.get(layer)
        merger = self.deepstack_merger_list[tap] if tap is not None else None
        x, h, *tapped = _add_norm(x, y, norm, self.backend, merger.norm if merger is not None else None,
                                  offset=offsets[2 * layer + 1] if in_gemm else None,
                                  quantize=layer + 1 < len(blocks) and _reads_fp8(blocks[layer + 1].attn))
        if merger is not None:
            merger.project(tapped[0], out=deepstack[tap])
        return x, h

    def merge(self, h) -> torch.Tensor:
        return self.merger.project(h.view(-1, self.merger.merged))

    def _bias_offsets(self) -> torch.Tensor:
        """[2 * depth, hidden] float32: the running sums of the output projections' biases (proj, fc2,
        block by block), which the residual stream lacks when the GEMMs add the residual."""
        biases = [b for block in self.blocks for b in (block.attn.proj.bias, block.mlp.output.bias)]
        return torch.stack(biases).float().cumsum(0)
