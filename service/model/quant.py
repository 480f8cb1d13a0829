"""FP8 blocks (`TowerOptions.quantization = "fp8"`): each block's linear layers become `Fp8Linear`, weights quantised
once at load per output channel, activations per token at every call (`kernels.fp8`). The inputs of qkv and of the
MLP's first GEMMs leave their norm's pass quantised already (`VisionTower` asks the norm for `Quantized` rows where
`takes_quantized` says the consumer is FP8), and fc2's (down_proj's) the activation's (`kernels.act_quant`); only the
attention's output projection quantises its input in front of its GEMM, in one pass on a GPU
(`act_quantize(x, "none")`). The patch and position embeddings, the norms, attention and the mergers stay in the
tower's dtype, and so does a block's linear layer of a width that the FP8 GEMM does not take (`fp8_gemm_shape`: a
multiple of 16; Qwen2.5-VL-7B's MLP, 3420 wide, stays whole in bf16, and its norm and activation then hand it bf16)."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.act_quant import act_quantize
from kernels.fp8 import Quantized, fp8_gemm_shape, fp8_linear, quantize_weight

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

    def forward(self, x: "torch.Tensor | Quantized", residual: torch.Tensor | None = None,
                add_bias: bool = True) -> torch.Tensor:
        """`x @ W.T + bias` (x in the activations' dtype, or quantised already); with `residual`, added into it in
        place (then without the bias unless `add_bias`, as the tower's residual GEMMs leave it to the norm that
        follows)."""
        bias = self.bias if add_bias else None
        lead = None
        if isinstance(x, Quantized):  # from a norm's or activation's FP8 epilogue: no dtype of its own, the bias's
            out_dtype = self.bias.dtype if self.bias is not None else None
        else:
            out_dtype = x.dtype
            if x.is_cuda:  # quantised in one pass of ours, not quantize_rows' several tensor ops
                lead, x = x.shape[:-1], act_quantize(x.reshape(-1, x.shape[-1]), "none")
        out = fp8_linear(x, self.qweight, self.scale, bias, out_dtype=out_dtype)
        if lead is not None:
            out = out.view(*lead, -1)
        return out if residual is None else residual.add_(out)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def takes_quantized(*linears: nn.Module) -> bool:
    """Whether these layers (that read one input) are FP8, so that their input can be handed over quantised."""
    return all(isinstance(linear, Fp8Linear) for linear in linears)


def quantize_blocks(tower: nn.Module) -> int:
    """Replace the blocks' linear layers with `Fp8Linear` in place, those of a shape the FP8 GEMM takes
    (`fp8_gemm_shape`); how many were replaced. An MLP is converted whole or not at all: its gate and up projections
    read one quantised input, and a SwiGLU's activation feeds the output projection."""
    count = 0
    for block in tower.blocks:
        for path in FP8_LINEARS:
            owner_name, _, name = path.rpartition(".")
            owner = block.get_submodule(owner_name)
            linear = getattr(owner, name, None)
            if isinstance(linear, nn.Linear) and _fp8_fits(owner):
                setattr(owner, name, Fp8Linear.from_linear(linear))
                count += 1
    return count


def _fp8_fits(owner: nn.Module) -> bool:
    """Whether every linear layer directly in `owner` (an attention or an MLP) has a shape the FP8 GEMM takes."""
    return all(fp8_gemm_shape(m.in_features, m.out_features) for m in owner.children() if isinstance(m, nn.Linear))
