"""FP8 blocks (`TowerOptions.quantization = "fp8"`): each block's linear layers become `Fp8Linear`, weights quantised
once at load per output channel, activations per token at every call (`kernels.fp8`). The inputs of qkv and of the
MLP's first GEMMs leave their norm's pass quantised already (`VisionTower` asks the norm for `Quantized` rows where
`takes_quantized` says the consumer is FP8), and fc2's (down_proj's) the activation's (`kernels.act_quant`); only the
attention's output projection quantises its input in front of its GEMM, in one pass on a GPU
(`act_quantize(x, "none")`). The patch and position embeddings, the norms, attention and the mergers stay in the
tower's dtype. An MLP of a width that the FP8 GEMM does not take (`fp8_gemm_shape`: a multiple of 16; Qwen2.5-VL's,
3420) is padded with zeros to one it does (`pad_mlp`)."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.act_quant import act_quantize
from kernels.fp8 import GEMM_MULTIPLE, Quantized, fp8_gemm_shape, quantize_rows, quantize_weight
from kernels.fp8_gemm import UNFUSED, fp8_gemm

QUANTIZATIONS = ("none", "fp8")
# the blocks' linear layers that run in FP8, by their attribute paths in a block
FP8_LINEARS = ("attn.qkv", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2", "mlp.gate_proj", "mlp.up_proj",
               "mlp.down_proj")


class Fp8Linear(nn.Module):
    """An `nn.Linear` with its weight in e4m3 and one float32 scale per output channel; the bias in the
    activations' dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        q, scale = quantize_weight(linear.weight.detach())
        return cls(q, scale, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: "torch.Tensor | Quantized", residual: torch.Tensor | None = None, add_bias: bool = True,
                rope: tuple[torch.Tensor, torch.Tensor, int] | None = None, out: torch.Tensor | None = None,
                use_triton: bool | None = None) -> torch.Tensor:
        """`x @ W.T + bias` (x in the activations' dtype, or quantised already) through `kernels.fp8_gemm`: with
        `residual`, added into it in place (then without the bias unless `add_bias`, as the tower's residual GEMMs
        leave it to the norm that follows); with `rope = (cos, sin, heads)` (the QKV projection), `(T, 3, heads,
        head_dim)` with Q and K rotated, into `out` if given. `use_triton`: the fused kernel (None: on a GPU)."""
        bias = self.bias if add_bias else None
        lead = None
        if isinstance(x, Quantized):  # from a norm's or activation's FP8 epilogue: no dtype of its own, the bias's
            out_dtype = self.bias.dtype if self.bias is not None else torch.bfloat16
        else:
            out_dtype, lead = x.dtype, x.shape[:-1]
            rows = x.reshape(-1, x.shape[-1])
            # on a GPU quantised in one pass of ours, not quantize_rows' several tensor ops
            x = act_quantize(rows, "none") if rows.is_cuda else Quantized(*quantize_rows(rows))
        y = fp8_gemm(x, self.qweight, self.scale, bias, out_dtype=out_dtype, residual=residual, rope=rope, out=out,
                     tile=None if use_triton is not False else UNFUSED, use_triton=use_triton)
        return y if lead is None or residual is not None or rope is not None else y.view(*lead, -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def takes_quantized(*linears: nn.Module) -> bool:
    """Whether these layers (that read one input) are FP8, so that their input can be handed over quantised."""
    return all(isinstance(linear, Fp8Linear) for linear in linears)


def quantize_blocks(tower: nn.Module) -> int:
    """Replace the blocks' linear layers with `Fp8Linear` in place; how many were replaced. An MLP whose width the FP8
    GEMM does not take (`fp8_gemm_shape`: Qwen2.5-VL's 3420) is first padded to one it does (`pad_mlp`: the same
    function); an attention or MLP whose other dimensions it does not take stays whole in the tower's dtype: an
    MLP's input projections read one quantised input, and its activation feeds the output projection."""
    count = 0
    for block in tower.blocks:
        pad_mlp(block.mlp, GEMM_MULTIPLE)
        for path in FP8_LINEARS:
            owner_name, _, name = path.rpartition(".")
            owner = block.get_submodule(owner_name)
            linear = getattr(owner, name, None)
            if isinstance(linear, nn.Linear) and _fp8_fits(owner):
                setattr(owner, name, Fp8Linear.from_linear(linear))
                count += 1
    return count


def pad_mlp(mlp: nn.Module, multiple: int) -> bool:
    """Widen an MLP's intermediate size to a multiple of `multiple` with zeros, in place: its input projections (fc1,
    or gate and up) get zero rows and zero biases, its output projection zero columns. The padded channels are
    act(0) (* 0) = 0 for GELU and SiLU, and add nothing: the same function. Whether it padded."""
    output = mlp.output
    inputs = [m for m in mlp.children() if isinstance(m, nn.Linear) and m is not output]
    width = output.in_features
    if width % multiple == 0 or not inputs or any(m.out_features != width for m in inputs):
        return False
    pad = -width % multiple
    for name, m in mlp.named_children():
        if m is output:
            wider = nn.Linear(width + pad, m.out_features, bias=m.bias is not None, device=m.weight.device,
                              dtype=m.weight.dtype)
            with torch.no_grad():
                wider.weight.zero_()[:, :width].copy_(m.weight)
                if m.bias is not None:
                    wider.bias.copy_(m.bias)
        elif m in inputs:
            wider = nn.Linear(m.in_features, width + pad, bias=m.bias is not None, device=m.weight.device,
                              dtype=m.weight.dtype)
            with torch.no_grad():
                wider.weight.zero_()[:width].copy_(m.weight)
                if m.bias is not None:
                    wider.bias.zero_()[:width].copy_(m.bias)
        else:
            continue
        setattr(mlp, name, wider.requires_grad_(False))
    return True


def _fp8_fits(owner: nn.Module) -> bool:
    """Whether every linear layer directly in `owner` (an attention or an MLP) has a shape the FP8 GEMM takes."""
    return all(fp8_gemm_shape(m.in_features, m.out_features) for m in owner.children() if isinstance(m, nn.Linear))
