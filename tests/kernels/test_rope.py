"""The rotary tables and rotation (`kernels/rope.py`) against transformers' own."""

from __future__ import annotations

import torch

from kernels.rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq

from conftest import make_inputs


def test_rope_reference_matches_transformers():
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

    q, k, _, _ = make_inputs([50], 4, 72, torch.bfloat16)
    pos = torch.randint(0, 64, (50, 2), generator=torch.Generator().manual_seed(0))
    cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(72))
    full_cos, full_sin = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1)
    ref_q, ref_k = apply_rotary_pos_emb_vision(q, k, full_cos, full_sin)
    assert torch.equal(apply_vision_rope(q, cos, sin), ref_q)
    assert torch.equal(apply_vision_rope(k, cos, sin), ref_k)
