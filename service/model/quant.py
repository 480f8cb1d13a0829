"""FP8 blocks (`TowerOptions.quantization = "fp8"`): each block's linear layers become `Fp8Linear`, weights quantised
once at load per output channel, activations per token at every call (`kernels.fp8`). The inputs of qkv and of the
MLP's first GEMMs leave their norm's pass quantised already (`VisionTower` asks the norm for `Quantized` rows where
`takes_quantized` says the consumer is FP8); fc2's is written in e4m3 by fc1's epilogue, at per-token scales bounded
from fc1's input (`kernels.fp8.act_norms`: fc2's weight carries fc1's channel norms), and down_proj's by the SwiGLU's
pass (`kernels.act_quant`). The GEMMs run `kernels.fp8_gemm`, with the QKV projection's RoPE, the GELU and the
residual add in their epilogues. The patch and position embeddings, the norms, attention, the attention's output
projection (`FP8_LINEARS`) and the mergers stay in the tower's dtype."""

from __future__ import annotations

import torch
import torch.nn as nn

from kernels.act_quant import act_quantize
from kernels.fp8 import Quantized, act_norms, fold_norms, fp8_gemm_shape, quantize_rows, quantize_weight
from kernels.fp8_gemm import Activation, Rope, fp8_gemm

QUANTIZATIONS = ("none", "fp8")
# the activations an FP8 fc1 hands its FP8 fc2 in e4m3 from its epilogue (`fp8.act_norms` bounds their values); the
# others (Qwen2.5-VL's SwiGLU, whose product of two projections no such bound covers) through `act_quant`'s pass
ACT_HANDED = ("gelu_pytorch_tanh", "gelu")
# the blocks' linear layers that run in FP8, by their attribute paths in a block
# (the attention's output projection stays in bf16: its GEMM is the block's smallest, and in FP8, with its input
# quantised in a pass of its own, it is slower than in bf16 with the residual in cuBLAS's epilogue; docs/PERFORMANCE.md)
FP8_LINEARS = ("attn.qkv", "mlp.linear_fc1", "mlp.linear_fc2", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class Fp8Linear(nn.Module):
    """An `nn.Linear` with its weight in e4m3 and one float32 scale per output channel; the bias in the
    activations' dtype."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # set by `quantize_blocks` where this layer hands its GELU to an FP8 layer (`fp8.act_norms`): 1 / its
        # channels' norms, and the bound
        self.register_buffer("act_inv_norm", None)
        self.act_bound = 0.0

    @classmethod
    def from_linear(cls, linear: nn.Linear, in_norms: torch.Tensor | None = None) -> "Fp8Linear":
        """`linear` in e4m3; `in_norms`: its input arrives divided by these (`fp8.act_norms`), so its weight's
        columns are scaled back by them (`fp8.fold_norms`) before quantising."""
        w = linear.weight.detach()
        q, scale = quantize_weight(w if in_norms is None else fold_norms(w, in_norms))
        return cls(q, scale, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: "torch.Tensor | Quantized", residual: torch.Tensor | None = None, add_bias: bool = True,
                rope: Rope | None = None, out: torch.Tensor | None = None,
                act: str | None = None, use_triton: bool | None = None) -> "torch.Tensor | Quantized":
        """`x @ W.T + bias` (x in the activations' dtype, or quantised already) through `kernels.fp8_gemm`: with
        `residual`, added into it in place (then without the bias unless `add_bias`, as the tower's residual GEMMs
        leave it to the norm that follows); with `rope` (`Rope(cos, sin, heads)`: the QKV projection), `(T, 3, heads,
        head_dim)` with Q and K rotated, into `out` if given; with `act` (a layer `quantize_blocks` prepared), the
        activation as `Quantized` rows for the next layer, from the GEMM's epilogue. `use_triton`: the fused kernel
        (None: on a GPU)."""
        bias = self.bias if add_bias else None
        lead = None
        if isinstance(x, Quantized):  # from a norm's or activation's FP8 epilogue: no dtype of its own, the bias's
            out_dtype = self.bias.dtype if self.bias is not None else torch.bfloat16
        else:
            out_dtype, lead = x.dtype, x.shape[:-1]
            rows = x.reshape(-1, x.shape[-1])
            # on a GPU quantised in one pass of ours, not quantize_rows' several tensor ops
            x = act_quantize(rows, "none") if rows.is_cuda else Quantized(*quantize_rows(rows))
        if act is not None and self.act_inv_norm is None:
            raise ValueError(f"{act}: this layer hands no activation on (quantize_blocks did not prepare it)")
        y = fp8_gemm(x, self.qweight, self.scale, bias, out_dtype=out_dtype, residual=residual, rope=rope, out=out,
                     act=None if act is None else Activation(act, self.act_inv_norm, self.act_bound),
                     use_triton=use_triton)
        if act is not None:
            return y if lead is None else Quantized(y.codes.view(*lead, -1), y.scale.view(lead))
        return y if lead is None or residual is not None or rope is not None else y.view(*lead, -1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel"


def takes_quantized(*linears: nn.Module) -> bool:
    """Whether these layers (that read one input) are FP8, so that their input can be handed over quantised."""
    return all(isinstance(linear, Fp8Linear) for linear in linears)


def quantize_blocks(tower: nn.Module) -> int:
    """Replace the blocks' linear layers named in `FP8_LINEARS` with `Fp8Linear` in place; how many were replaced.
    An attention or MLP with a dimension the FP8 GEMM does not take (`fp8_gemm_shape`; the loader pads MLPs to
    widths it takes, `tower.pad_mlp`) stays whole in the tower's dtype: an MLP's input projections read one quantised
    input, and its activation feeds the output projection. A GELU MLP's fc1 is prepared to hand fc2 its activation in
    e4m3 (`fp8.act_norms` of fc1's e4m3 weight), and fc2's weight quantised with fc1's channel norms folded in."""
    count = 0
    for block in tower.blocks:
        for path in FP8_LINEARS:
            owner_name, _, name = path.rpartition(".")
            owner = block.get_submodule(owner_name)
            linear = getattr(owner, name, None)
            if isinstance(linear, nn.Linear) and _fp8_fits(owner):
                if name == "linear_fc2" and isinstance(owner.linear_fc1, Fp8Linear) and owner.hidden_act in ACT_HANDED:
                    fc1 = owner.linear_fc1  # hands fc2 its GELU in e4m3 from its epilogue
                    norms, fc1.act_bound = act_norms(fc1.qweight.float() * fc1.scale[:, None], fc1.bias)
                    fc1.act_inv_norm = 1.0 / norms
                    setattr(owner, name, Fp8Linear.from_linear(linear, in_norms=norms))
                else:
                    setattr(owner, name, Fp8Linear.from_linear(linear))
                count += 1
    return count


def _fp8_fits(owner: nn.Module) -> bool:
    """Whether every linear layer directly in `owner` (an attention or an MLP) has a shape the FP8 GEMM takes."""
    return all(fp8_gemm_shape(m.in_features, m.out_features) for m in owner.children() if isinstance(m, nn.Linear))
