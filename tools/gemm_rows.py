"""The tower's three cuBLAS GEMMs of a block by row count: where cuBLAS's choice of kernel makes a row count slower
than larger ones. A graph bucket's row count is the M of every GEMM of its packs, so a bucket on such a row count
makes each of its packs pay for it.

For each M: the attention's output projection and the MLP's fc2 with the residual added in the GEMM
(`residual.addmm_(x, W.t())`, as `tower._project` runs them), and fc1 with its bias and tanh-GELU in the epilogue
(`torch._addmm_activation`, as the Qwen3-VL MLP runs it); bf16, microseconds, the median of `do_bench`.
`--tunableop`: the same with PyTorch's TunableOp tuning each shape first (`PYTORCH_TUNABLEOP_*`, set before CUDA is
initialised), to see whether it picks better kernels than cuBLAS's heuristics.

Usage: python -m tools.gemm_rows [--preset qwen3-vl-2b] [--rows START STOP STEP] [--tunableop] [--out DIR]
(CUDA; writes gemm_rows.json, or gemm_rows_tunableop.json)
"""

from __future__ import annotations

import argparse
import os
import tempfile


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-vl-2b")
    ap.add_argument("--rows", type=int, nargs=3, default=(192, 4224, 32), metavar=("START", "STOP", "STEP"))
    ap.add_argument("--tunableop", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.tunableop:  # read when CUDA initialises
        os.environ.update(PYTORCH_TUNABLEOP_ENABLED="1", PYTORCH_TUNABLEOP_TUNING="1",
                          PYTORCH_TUNABLEOP_FILENAME=os.path.join(tempfile.mkdtemp(), "tunableop%d.csv"))
    import torch
    from triton.testing import do_bench

    from benchmarks.common import environment, write_results
    from service.model.config import preset

    cfg = preset(args.preset)
    hidden, inner, device, dtype = cfg.hidden_size, cfg.intermediate_size, torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    w_proj = torch.randn(hidden, hidden, device=device, dtype=dtype) * 0.02
    w_fc1 = torch.randn(inner, hidden, device=device, dtype=dtype) * 0.02
    b_fc1 = torch.randn(inner, device=device, dtype=dtype)
    w_fc2 = torch.randn(hidden, inner, device=device, dtype=dtype) * 0.02

    def us(fn) -> float:
        return round(do_bench(fn, warmup=5, rep=15, return_mode="median") * 1000, 2)

    rows = []
    start, stop, step = args.rows
    for m in range(start, stop + 1, step):
        x = torch.randn(m, hidden, device=device, dtype=dtype)
        h = torch.randn(m, inner, device=device, dtype=dtype)
        residual = torch.randn(m, hidden, device=device, dtype=dtype)
        rows.append({"rows": m,
                     "proj_residual_us": us(lambda: residual.addmm_(x, w_proj.t())),
                     "fc1_bias_gelu_us": us(lambda: torch._addmm_activation(b_fc1, x, w_fc1.t(), use_gelu=True)),
                     "fc2_residual_us": us(lambda: residual.addmm_(h, w_fc2.t()))})
        print(rows[-1], flush=True)
    payload = {"benchmark": "gemm_rows", "env": environment(), "preset": args.preset,
               "shapes": {"proj": [hidden, hidden], "fc1": [hidden, inner], "fc2": [inner, hidden]}, "rows": rows}
    if args.tunableop:  # which solution TunableOp kept for each shape ("Default": cuBLAS's own pick)
        payload["tunableop_results"] = [list(map(str, r)) for r in torch.cuda.tunable.get_results()]
        payload["benchmark"] = "gemm_rows_tunableop"
    write_results(payload["benchmark"], payload, args.out)


if __name__ == "__main__":
    main()
