"""One call of each attention kernel for Nsight Compute: the Triton TMA kernel, the Gluon kernel and cuDNN, on the
same inputs. Each kernel is warmed up (compiled, tuned) outside the profiled range, then called once between
cudaProfilerStart/Stop, so `ncu --profile-from-start off` sees exactly one launch per kernel spec.

Usage (on the GPU machine):
  ncu --profile-from-start off --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
      --section WarpStateStats --section Occupancy --section MemoryWorkloadAnalysis -o REPORT \
      python -m benchmarks.ncu_attention --cases 1x16384 8x1024 --kernels triton:64/128/4/2 gluon:128/128/8/2/128/0 cudnn
  (gluon tiles as probe_gluon_attention.tile_config reads them; add --metrics for metrics no section collects, e.g.
  the L2 ones below)
  python -m benchmarks.ncu_attention --summarise REPORT.ncu-rep   (pipe utilisation, issue, stalls per kernel)
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib
import io
import subprocess

# Raw metrics the summary prints (ncu --page raw names), with a short label; stalls are warps stalled per issue
SUMMARY = {
    "gpu__time_duration.sum": "us",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm %",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "gmma %",
    "sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active": "xu (mufu) %",
    "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_active": "fma %",
    "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_active": "alu %",
    "sm__inst_executed.avg.per_cycle_active": "ipc",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue %",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "occupancy %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
    "dram__bytes_read.sum": "dram read",
    "dram__bytes_write.sum": "dram write",
    "lts__t_sector_hit_rate.pct": "L2 hit %",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "L2 throughput %",
    "lts__t_bytes.sum": "L2 bytes",
    "lts__t_sectors_srcunit_tex_op_read.sum": "L2 sectors read by SMs",
    "launch__registers_per_thread": "regs",
    "launch__occupancy_limit_registers": "ctas/sm (regs)",
    "launch__occupancy_limit_shared_mem": "ctas/sm (smem)",
    "smsp__average_warps_issue_stalled_gmma_per_issue_active.ratio": "stall gmma",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio": "stall long scoreboard",
    "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": "stall wait",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": "stall barrier",
    "smsp__average_warps_issue_stalled_sleeping_per_issue_active.ratio": "stall sleeping",
    "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio": "stall math pipe throttle",
    "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio": "stall short scoreboard",
    "smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio": "stall mio throttle",
    "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio": "stall no instruction",
    "smsp__average_warps_issue_stalled_imc_miss_per_issue_active.ratio": "stall imc miss",
    "smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio": "stall branch resolving",
    "smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio": "stall dispatch stall",
    "smsp__average_warps_issue_stalled_membar_per_issue_active.ratio": "stall membar",
    "smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio": "stall lg throttle",
    "smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio": "stall not selected",
    "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio": "stall selected",
}


def run_kernels(cases, specs, head_dim):
    import torch

    from benchmarks.common import ATTENTION_CASES, batched_cudnn, packed_qkv
    va = importlib.import_module("kernels.varlen_attention")
    for case in cases:
        lengths = ATTENTION_CASES[case]
        qkv, cu = packed_qkv(lengths, head_dim, torch.Generator(device="cuda").manual_seed(0))
        q, k, v = qkv.unbind(1)
        m = max(lengths)
        for spec in specs:
            kind, _, tile = spec.partition(":")
            if kind == "triton":
                bm, bn, w, s = map(int, tile.split("/"))
                config = dataclasses.replace(va.tma_candidates(head_dim)[0], block_m=bm, block_n=bn, num_warps=w,
                                             num_stages=s, q_tail=bm >= 128)
                fn = lambda config=config: va.triton_varlen_attention(q, k, v, cu, m, config=config)  # noqa: E731
            elif kind == "gluon":
                from benchmarks.probe_gluon_attention import tile_config

                config = tile_config(tile)
                fn = lambda config=config: va.triton_varlen_attention(q, k, v, cu, m, config=config)  # noqa: E731
            else:
                fn = batched_cudnn(q, k, v, lengths)
                if fn is None:
                    continue
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            fn()
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
            print(f"profiled {case} {spec}", flush=True)


def summarise(report: str):
    raw = subprocess.run(["ncu", "--import", report, "--page", "raw", "--csv"], capture_output=True, text=True,
                         check=True).stdout
    rows = list(csv.reader(io.StringIO(raw)))
    header, units, data = rows[0], rows[1], rows[2:]
    col = {name: i for i, name in enumerate(header)}
    for r in data:
        print(f"{r[col['Kernel Name']][:60]}  grid {r[col['Grid Size']]}  block {r[col['Block Size']]}")
        for metric, label in SUMMARY.items():
            if metric in col:
                print(f"    {label:<32} {r[col[metric]]} {units[col[metric]]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["1x16384"])
    ap.add_argument("--kernels", nargs="+", default=["triton:64/128/4/2", "gluon:128/128/8/2/128/0", "cudnn"])
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--summarise", default=None, help="an .ncu-rep file: print the summary metrics per kernel")
    args = ap.parse_args()
    if args.summarise:
        summarise(args.summarise)
    else:
        run_kernels(args.cases, args.kernels, args.head_dim)


if __name__ == "__main__":
    main()
