"""The position-embedding interpolation and add (`kernels/pos_embed.py`) under the interpreter, against its
reference."""

from __future__ import annotations

import pytest
import torch

from kernels.pos_embed import pos_embed_add_, reference_pos_embed



@pytest.mark.parametrize("tokens,hidden,side", [(1, 64, 4), (131, 96, 7), (300, 1152, 48)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_pos_embed_add(tokens, hidden, side, dtype):
    """Interpolated position embeddings added in place, against a float64 blend of the same taps."""
    g = torch.Generator().manual_seed(tokens + hidden)
    table = torch.randn(side * side, hidden, generator=g).to(dtype)
    index = torch.randint(0, side * side, (tokens, 4), generator=g)
    weight = torch.rand(tokens, 4, generator=g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    out = x.clone()
    assert pos_embed_add_(out, table, index, weight, use_triton=True) is out
    exact = x.double() + (table[index].double() * weight[:, :, None].double()).sum(1)
    ref = x + reference_pos_embed(table, index, weight).to(dtype)  # the unfused PyTorch path
    err = (out.double() - exact).norm() / exact.norm()
    torch_err = (ref.double() - exact).norm() / exact.norm()
    assert err <= 1.01 * torch_err + 1e-7, (err, torch_err)
    fallback = x.clone()
    pos_embed_add_(fallback, table, index, weight, use_triton=False)
    assert torch.equal(fallback, ref)
