import importlib, json, torch
va = importlib.import_module("kernels.varlen_attention")
from kernels import tuning
from benchmarks.common import packed_qkv, environment
import os
out = []
for hd in (64, 72):
    lengths = [1024] * 8
    qkv, cu = packed_qkv(lengths, hd, torch.Generator(device="cuda").manual_seed(0))
    q, k, v = qkv.unbind(1)
    for c in va.tma_candidates(hd):
        before = set(tuning._kernels)
        va.triton_varlen_attention(q, k, v, cu, 1024, config=c)
        torch.cuda.synchronize()
        for key in set(tuning._kernels) - before:
            kern = tuning._kernels[key]
            out.append({"head_dim": hd, "tile": f"{c.block_m}/{c.block_n}/{c.num_warps}/{c.num_stages}",
                        "kernel": kern.name, "n_regs": kern.n_regs, "n_spills": kern.n_spills,
                        "shared": kern.metadata.shared})
            print(out[-1])
json.dump({"benchmark": "kernel registers on the GPU (JIT launch)", "env": environment(), "rows": out}, open(os.environ["OUT"] + "/registers_h100.json", "w"), indent=1)
