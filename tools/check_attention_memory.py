"""Every Hopper attention configuration we may launch (the Gluon kernel's candidates), on small awkward packs, for
compute-sanitizer:

    compute-sanitizer --tool memcheck python -m tools.check_attention_memory

Each launch is also checked against the fp32 reference; prints one line per (head_dim, config)."""

from __future__ import annotations

import torch

from kernels.rope import apply_vision_rope, vision_rope_cos_sin, vision_rope_inv_freq
from kernels.attention.launch import triton_varlen_attention
from kernels.attention.reference import reference_varlen_attention
from kernels.attention.tiles import gluon_candidates


def main():
    lengths = [1, 7, 131, 200, 64, 65, 17]
    for head_dim in (64, 72, 80):
        g = torch.Generator().manual_seed(head_dim)
        total = sum(lengths)
        qkv = torch.randn(total, 3, 2, head_dim, generator=g).to("cuda", torch.bfloat16)
        q, k, v = qkv.unbind(1)
        cu = torch.tensor([0] + lengths).cumsum(0).to("cuda", torch.int32)
        pos = torch.randint(0, 64, (total, 2), generator=g).cuda()
        cos, sin = vision_rope_cos_sin(pos, vision_rope_inv_freq(head_dim, device="cuda"))
        q.copy_(apply_vision_rope(q, cos, sin))  # as the tower's QKV projection leaves them
        k.copy_(apply_vision_rope(k, cos, sin))
        ref = reference_varlen_attention(q, k, v, cu)

        def check(cfg, out):
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"d{head_dim} {cfg}: rel err {err:.2e}", flush=True)
            assert err < 1e-2, err

        for cfg in gluon_candidates(head_dim):
            check(cfg, triton_varlen_attention(q, k, v, cu, max(lengths), config=cfg))


if __name__ == "__main__":
    main()
