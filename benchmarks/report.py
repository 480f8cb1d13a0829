"""Markdown tables from the committed results: python -m benchmarks.report > /tmp/tables.md"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
ATTN_COLS = ["triton", "loop-flash", "loop-cudnn", "loop-efficient", "batched-flash", "batched-cudnn", "varlen_attn",
             "flex"]


def _f(v, nd=0):
    return "–" if v is None else f"{v:.{nd}f}"


def attention(path=RESULTS / "attention.json"):
    d = json.loads(path.read_text())
    print(f"GPU {d['env']['gpu']}, torch {d['env']['torch']}, triton {d['env']['triton']}, "
          f"rev {d['env']['git_revision']}, {d['env']['date']}\n")
    print("| d | case | " + " | ".join(ATTN_COLS) + " | best baseline | ratio |")
    print("|" + "---|" * (len(ATTN_COLS) + 4))
    for r in d["rows"]:
        cells = [_f(r["results"].get(c, {}).get("tflops")) for c in ATTN_COLS]
        print(f"| {r['head_dim']} | {r['case']} | " + " | ".join(cells) +
              f" | {r['best_baseline']} | {r['ratio_vs_best']:.2f} |")


def tower(path):
    d = json.loads(path.read_text())
    print(f"GPU {d['env']['gpu']}, torch {d['env']['torch']}, transformers {d['env']['transformers']}, "
          f"rev {d['env']['git_revision']}, {d['env']['date']}\n")
    ours = "ours" if "ours" in d["rows"][0]["results"] else "ours-triton"
    keys = list(dict.fromkeys(k for r in d["rows"] for k in r["results"] if k != ours))  # every row's columns
    clocks = "gpu" in d["rows"][0]["results"][ours]  # SM clock and power logged during each measurement
    print(f"| preset | workload | {ours} ms | " + " | ".join(f"{k} ms" for k in keys) +
          " | img/s | TFLOPS | MFU | × eager | × compile | floor/ours |" +
          (f" {ours} MHz / W | hf-eager MHz / W |" if clocks else ""))
    print("|" + "---|" * (len(keys) + 9 + 2 * clocks))
    for r in d["rows"]:
        res = r["results"]
        o = res[ours]
        print(f"| {r['preset'].removeprefix('qwen3-vl-')} | {r['workload']} | {o['ms']:.1f} | " +
              " | ".join(_f(res.get(k, {}).get("ms"), 1) for k in keys) +
              f" | {o['images_per_s']:.0f} | {o['tflops']:.0f} | {o['mfu']:.2f} | {r['speedup_vs_hf_eager']:.2f} | "
              f"{_f(r.get('speedup_vs_hf_compile'), 2)} | {r['fraction_of_floor']:.2f} |" +
              ("".join(f" {_clock(res.get(k, {}).get('gpu'))} |" for k in (ours, "hf-eager")) if clocks else ""))


def _clock(g):
    return "–" if not g else f"{g['sm_mhz_median']:.0f} / {g['power_w_median']:.0f}"


def service():
    print("| result file | GPU | rev | server settings | tower img/s | service img/s | ratio | p50 ms | p99 ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted(RESULTS.glob("service*.json")):
        d = json.loads(path.read_text())
        s = d["service"]
        extra = {k.removeprefix("QWEN3VL_"): v for k, v in d.get("server_env", {}).items()
                 if any(w in k for w in ("PROCESS", "HTTP_WORKERS", "CUDA_GRAPHS"))}
        print(f"| {path.name} | {d['env']['gpu']} | {d['env']['git_revision'] or '–'} | {extra or ''} | "
              f"{d['tower']['images_per_s']:.0f} | {s['images_per_s']:.0f} | {d['ratio']:.2f} | {s['p50_ms']:.0f} | "
              f"{s['p99_ms']:.0f} |")


if __name__ == "__main__":
    print("## Attention (TFLOPS)\n")
    attention()
    for name in ("tower_v1.json", "tower.json"):
        print(f"\n## Tower ({name})\n")
        tower(RESULTS / name)
    print("\n## Service\n")
    service()
