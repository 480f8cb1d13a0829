"""Whole-tower throughput on the GPU: our tower against transformers' and against the GEMM floor.

`ours` is the path the server runs: `service.model.graphs.BucketedTower` with the server's graph buckets (the
pack padded to its token bucket, the pieces between attention calls replayed as CUDA graphs captured once, the
attention eager on the real segments). `graphed-upper-bound` is one whole-forward CUDA graph per input shape
(`benchmarks.graphed.GraphedTower`), which the server never runs: an upper bound of what launches cost, not a
served figure. `ours-eager` launches kernel by kernel at the pack's own size; `ours-fp8` is `ours` with
`QUANTIZATION=fp8` (the blocks' linear layers in e4m3, service.model.quant).
Workloads, in pixels (Qwen3-VL, patch 16: 448px -> 28x28 patches = 784 tokens; Qwen2.5-VL, patch 14: 448px ->
32x32 patches, 16 windows of 64 tokens): 8x448px, 32x448px, 1x1024px, 4x768px and one 16-frame 448px video
(8 temporal patches). Baselines in the same run:
- hf-eager: transformers' tower (`Qwen3VLVisionModel` or `Qwen2_5_VisionTransformerPretrainedModel`, its default
  sdpa attention) on the same weights;
- hf-compile: the same under torch.compile (32x448px only: compiling is slow);
- floor: the tower's GEMMs alone (cuBLAS, same shapes, every block and merger) plus batched cuDNN
  attention over the same segments (frames, or windows): what a perfect fusion of everything else would leave.
MFU uses the H100 SXM dense bf16 peak, 989 TFLOPS.

Usage: python -m benchmarks.bench_tower [--presets qwen3-vl-2b qwen3-vl-8b qwen2.5-vl-7b] [--no-compile]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.common import ClockLog, bench, environment, print_table, write_results
from kernels.qkv_rope import gemm_candidates
from service.model.config import preset
from benchmarks.graphed import GraphedTower
from service.model.graphs import BucketedTower
from service.settings import Settings
from service.model.loader import random_tower
from service.model.quant_check import fp8_copy
from service.model.sizing import smart_resize
from service.model.tower import layer_segments, padded_width

PEAK_TFLOPS = 989.0
WORKLOADS = {  # (images, frames, side in pixels)
    "8x448px": (8, 1, 448),
    "32x448px": (32, 1, 448),
    "1x1024px": (1, 1, 1024),
    "4x768px": (4, 1, 768),
    "video16x448px": (1, 16, 448),
    "1x448px": (1, 1, 448),  # a lone image's forward (bench_epd's lone request); asked for by name only
}
DEFAULT_WORKLOADS = ["8x448px", "32x448px", "1x1024px", "4x768px", "video16x448px"]


def workload_grids(cfg, name) -> list[tuple[int, int, int]]:
    """The grids the processor makes of the workload's images for this tower (its patch size)."""
    images, frames, side = WORKLOADS[name]
    factor = cfg.patch_size * cfg.spatial_merge_size
    h, w = smart_resize(side, side, factor, factor * factor, 1 << 40)
    return [(frames // cfg.temporal_patch_size or 1, h // cfg.patch_size, w // cfg.patch_size)] * images


def tower_flops(cfg, grids) -> float:
    tokens = sum(t * h * w for t, h, w in grids)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    merged = tokens // cfg.merge_unit
    mlp = 3 if cfg.windowed else 2  # SwiGLU: gate, up and down
    attention = sum(4 * n * n * h for segs in layer_segments(cfg, grids) for n in segs)
    mergers = (1 + len(cfg.deepstack_visual_indexes)) * 2 * merged * (16 * h * h + 4 * h * cfg.out_hidden_size)
    return cfg.depth * 2 * tokens * (4 * h * h + mlp * h * inter) + attention + 2 * tokens * cfg.patch_dim * h + mergers


def floor_fn(cfg, grids):
    """GEMMs with the tower's exact shapes + batched cuDNN attention, nothing else."""
    tokens = sum(t * h * w for t, h, w in grids)
    # the MLP at the width the loader pads it to (Qwen2.5-VL's 3420 ran on cuBLAS's slow kernels)
    h, inter, m = cfg.hidden_size, padded_width(cfg.intermediate_size), cfg.merge_unit
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(tokens, h, device=dev, dtype=dt)
    w = {n: torch.randn(o, i, device=dev, dtype=dt) * 0.02 for n, (o, i) in {
        "qkv": (3 * h, h), "proj": (h, h), "fc1": (inter, h), "fc2": (h, inter),
        "m1": (m * h, m * h), "m2": (cfg.out_hidden_size, m * h), "pe": (h, cfg.patch_dim)}.items()}
    pix = torch.randn(tokens, cfg.patch_dim, device=dev, dtype=dt)
    mid = torch.randn(tokens, inter, device=dev, dtype=dt)
    xm = torch.randn(tokens // m, m * h, device=dev, dtype=dt)
    inputs = {}  # per segment length: batched q, k, v
    layers = []
    for segs in layer_segments(cfg, grids):
        groups = _group(segs)
        for L, n in groups.items():
            if L not in inputs:
                inputs[L] = torch.randn(3, n, cfg.num_heads, L, cfg.head_dim, device=dev, dtype=dt)
        layers.append([inputs[L][:, :n] for L, n in groups.items()])

    def fn():
        F.linear(pix, w["pe"])
        for qkv in layers:
            F.linear(x, w["qkv"])
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                for q, k, v in qkv:
                    F.scaled_dot_product_attention(q, k, v)
            F.linear(x, w["proj"])
            F.linear(x, w["fc1"])
            if cfg.windowed:  # SwiGLU: the up projection too
                F.linear(x, w["fc1"])
            F.linear(mid, w["fc2"])
        for _ in range(1 + len(cfg.deepstack_visual_indexes)):
            F.linear(F.linear(xm, w["m1"]), w["m2"])
    return fn


def _group(lengths):
    out = {}
    for n in lengths:
        out[n] = out.get(n, 0) + 1
    return out


def hf_tower(cfg, state):
    if cfg.windowed:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        hf_cfg = Qwen2_5_VLVisionConfig(
            depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
            num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size, window_size=cfg.window_size,
            fullatt_block_indexes=list(cfg.fullatt_block_indexes), patch_size=cfg.patch_size)
        with torch.device("cuda"):
            model = Qwen2_5_VisionTransformerPretrainedModel(hf_cfg)
        model.load_state_dict(state)
        return model.to(torch.bfloat16).eval()
    from transformers import Qwen3VLVisionConfig, Qwen3VLVisionModel

    hf_cfg = Qwen3VLVisionConfig(
        depth=cfg.depth, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_heads=cfg.num_heads, out_hidden_size=cfg.out_hidden_size,
        deepstack_visual_indexes=list(cfg.deepstack_visual_indexes), num_position_embeddings=cfg.num_position_embeddings)
    with torch.device("cuda"):
        model = Qwen3VLVisionModel(hf_cfg)
    model.load_state_dict(state)
    return model.to(torch.bfloat16).eval()


def run_preset(name, workloads, compile_hf, fp8=True):
    cfg = preset(name)
    ours = random_tower(cfg, "cuda", torch.bfloat16)
    hf = hf_tower(cfg, ours.state_dict())
    ours_fp8 = fp8_copy(ours) if fp8 else None
    hf_compiled = torch.compile(hf) if compile_hf else None
    # the server's path, its buckets captured once as the engine does at start-up
    buckets = Settings(device="cuda", cuda_graphs=True).graph_buckets()
    served = BucketedTower(ours, buckets)
    served_fp8 = BucketedTower(ours_fp8, buckets) if ours_fp8 is not None else None
    with torch.inference_mode():
        served.capture()
        if served_fp8 is not None:
            served_fp8.capture()
    rows = []
    for wl in workloads:
        grids = workload_grids(cfg, wl)
        n_images = len(grids)
        tokens = sum(t * h * w for t, h, w in grids)
        pixels = torch.randn(tokens, cfg.patch_dim, device="cuda", dtype=torch.bfloat16)
        grid_t = torch.tensor(grids, device="cuda")
        flops = tower_flops(cfg, grids)

        def ours_fn(attention):
            def fn():  # attention None: the served policy (kernels.attention.resolve_backend)
                return ours(pixels, ours.plan(grids), attention)  # plan built inside: it is part of the forward
            return fn

        graphed = GraphedTower(ours)  # a CUDA graph per pack signature: the upper bound, never served
        unfused_graphed = GraphedTower(ours)

        def unfused():  # the served path with cuBLAS's QKV projection and the RoPE pass
            served = ours.options
            ours.options = replace(served, fused_qkv_rope=False)
            try:
                return unfused_graphed(pixels, grids)
            finally:
                ours.options = served

        fns = {"ours": lambda: served(pixels, grids), "graphed-upper-bound": lambda: graphed(pixels, grids),
               "ours-eager": ours_fn(None),
               "ours-triton-attn": ours_fn("triton"), "ours-sdpa-attn": ours_fn("sdpa"),
               "hf-eager": lambda: hf(pixels, grid_thw=grid_t), "floor": floor_fn(cfg, grids)}
        if gemm_candidates(ours.config.hidden_size, ours.config.head_dim):  # the fused projection runs here
            fns["ours-unfused-qkv"] = unfused
        if hf_compiled is not None and wl == "32x448px":
            fns["hf-compile"] = lambda: hf_compiled(pixels, grid_thw=grid_t)
        if ours_fp8 is not None:
            fns["ours-fp8"] = lambda: served_fp8(pixels, grids)
        res = {}
        with torch.inference_mode():
            for key, fn in fns.items():
                t0 = time.time()
                fn()
                torch.cuda.synchronize()
                fn()
                fn()  # the served path captures its CUDA graph on the third call
                with ClockLog() as clocks:  # the clock the sustained run held (power-limited on H100)
                    ms = bench(fn, warmup_ms=200, rep_ms=1000)
                res[key] = {"ms": ms, "images_per_s": n_images * 1000 / ms, "tflops": flops / ms / 1e9,
                            "mfu": flops / ms / 1e9 / PEAK_TFLOPS, "first_call_s": time.time() - t0,
                            "gpu": clocks.summary()}
                print(f"{name} {wl} {key}: {ms:.2f} ms {res[key]['gpu']}", flush=True)
        with torch.inference_mode():  # the graphed forward is the eager one on the backend it chose, bit for bit
            replayed = graphed(pixels, grids)
            eager = ours(pixels, ours.plan(grids), graphed.attention(grids))
        same = all(torch.equal(x, y) for x, y in zip(replayed, eager))
        assert same, f"{name} {wl}: the graphed forward differs from the eager one"
        row = {"preset": name, "workload": wl, "images": n_images, "tokens": tokens, "flops": flops, "results": res,
               "graph_equals_eager": same, "attention_backend": ours.backend, "graph_attention": graphed.attention(grids),
               "graph_attention_ms": graphed.replay_ms(grids),
               "speedup_vs_hf_eager": res["hf-eager"]["ms"] / res["ours"]["ms"],
               "fraction_of_floor": res["floor"]["ms"] / res["ours"]["ms"]}
        if "hf-compile" in res:
            row["speedup_vs_hf_compile"] = res["hf-compile"]["ms"] / res["ours"]["ms"]
        if "ours-fp8" in res:
            row["fp8_speedup"] = res["ours"]["ms"] / res["ours-fp8"]["ms"]
        rows.append(row)
    return rows


PLOTTED = ["ours", "floor", "hf-compile", "hf-eager"]  # bars per workload, in this order


def plot(rows, path):
    """Images/s per workload, one panel per preset: ours (served: graphed), the GEMM + cuDNN floor and
    transformers eager / compiled (compiled at 32x448px only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    presets = list(dict.fromkeys(r["preset"] for r in rows))
    fig, axes = plt.subplots(1, len(presets), figsize=(7 * len(presets), 4.5), squeeze=False)
    width = 0.8 / len(PLOTTED)
    for ax, name in zip(axes[0], presets):
        sub = [r for r in rows if r["preset"] == name]
        for j, key in enumerate(PLOTTED):
            ys = [r["results"].get(key, {}).get("images_per_s", 0) for r in sub]
            bars = ax.bar([i + j * width for i in range(len(sub))], ys, width, label=key)
            if key == "ours":
                ax.bar_label(bars, labels=[f"{r['speedup_vs_hf_eager']:.2f}x" for r in sub], fontsize=7)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(sub))], [r["workload"] for r in sub], rotation=15)
        ax.set_ylabel("images/s (bf16; a video counts as one)")
        ax.set_title(f"{name} tower: images/s (labels: ours / transformers eager)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--plot", metavar="JSON", help="only draw the plot (PNG beside it) of a committed result file")
    ap.add_argument("--presets", nargs="+", default=["qwen3-vl-2b", "qwen3-vl-8b"])
    ap.add_argument("--workloads", nargs="+", default=DEFAULT_WORKLOADS, choices=list(WORKLOADS))
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--no-fp8", action="store_true", help="leave out the ours-fp8 rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text())["rows"], Path(args.plot).with_suffix(".png"))
        return
    rows = []
    for p in args.presets:
        rows += run_preset(p, args.workloads, compile_hf=not args.no_compile, fp8=not args.no_fp8)
        torch.cuda.empty_cache()  # the preset's towers are gone with run_preset's frame
    table = []
    for r in rows:
        res = r["results"]
        table.append({"preset": r["preset"], "workload": r["workload"], "attn": r["attention_backend"], "graph attn": r["graph_attention"],
                      **{f"{k} ms": v["ms"] for k, v in res.items()},
                      "ours img/s": res["ours"]["images_per_s"], "ours TFLOPS": res["ours"]["tflops"],
                      "MFU": res["ours"]["mfu"], "x eager": r["speedup_vs_hf_eager"], "fp8 x": r.get("fp8_speedup"),
                      "x compile": r.get("speedup_vs_hf_compile"), "floor/ours": r["fraction_of_floor"]})
    cols = ["preset", "workload", "attn", "graph attn", "ours ms", "ours-unfused-qkv ms", "ours-eager ms", "ours-triton-attn ms", "ours-sdpa-attn ms", "hf-eager ms",
            "hf-compile ms", "floor ms", "ours-fp8 ms",
            "ours img/s", "ours TFLOPS", "MFU", "x eager", "x compile", "floor/ours", "fp8 x"]
    print_table(table, cols)
    path = write_results("tower", {"benchmark": "tower", "env": environment(), "rows": rows}, args.out)
    try:
        plot(rows, path.with_suffix(".png"))
    except ImportError:  # matplotlib is optional: --plot draws it later from the JSON
        pass
    print(json.dumps({"benchmark": "tower", "rows": [(r["preset"], r["workload"],
                      round(r["results"]["ours"]["images_per_s"], 1), round(r["speedup_vs_hf_eager"], 2),
                      r.get("fp8_speedup") and round(r["fp8_speedup"], 3))
                      for r in rows]}))


if __name__ == "__main__":
    main()
