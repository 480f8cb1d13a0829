"""FP8's error against the unquantised tower, per preset and weight set: `fp8_error.json`.

For each preset, three weight sets: `random` (the presets' std-0.02 initialisation, where blocks barely move the
residual stream), `unit-gain` (the blocks' linear weights at std 1/sqrt(fan_in): every block moves the stream as
trained ones do) and `unit-gain+outliers` (the same, with channels at 50-200x planted before the projections,
`tools.synthetic.plant_outliers`, the float function unchanged). Inputs: photographs (scikit-image's, where installed,
else synthetic ones) and awkward images (tiny, thin, grey), at most `--max-pixels`, and a 4-frame video.
Per weight set: per-token cosine (mean and worst) of the merged tokens and every DeepStack level together, each
part on its own, and the residual stream after each block (`service.model.quant_check.compare`).

On a GPU with FP8 tensor cores the FP8 GEMMs are the served ones (`kernels.fp8_gemm`: on Hopper each shape's
fastest of its Triton kernel and cuBLASLt's); elsewhere they are computed in float32 from the same e4m3 operands
and scales (`kernels.fp8.reference_scaled_linear`), which the JSON records as `fp8_gemm`.

Usage: python -m benchmarks.fp8_error [--presets qwen3-vl-2b ...] [--device cuda] [--dtype bfloat16] [--out DIR]
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import time

import numpy as np
import torch
from PIL import Image

from benchmarks.common import environment, write_results
from kernels.fp8 import fp8_tensor_cores
from service.model.encoder import Encoder
from service.model.quant_check import all_tokens, compare, fp8_copy
from tools.synthetic import encode_video, plant_outliers, unit_gain

WEIGHT_SETS = ("random", "unit-gain", "unit-gain+outliers")


def _png(array) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, "PNG")
    return buf.getvalue()


def inputs() -> dict[str, bytes]:
    rng = np.random.default_rng(7)
    try:
        import skimage.data as data

        photos = {"astronaut": data.astronaut(), "coffee": data.coffee(), "chelsea": data.chelsea(),
                  "rocket": data.rocket()}
    except ImportError:
        ramp = np.linspace(0, 255, 512, dtype=np.uint8)
        photos = {"gradient": np.stack([np.tile(ramp, (384, 1))] * 3, -1),
                  "noise": rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)}
    out = {name: _png(img) for name, img in photos.items()}
    out["tiny-28x28"] = _png(rng.integers(0, 256, (28, 28, 3), dtype=np.uint8))
    out["thin-1000x40"] = _png(rng.integers(0, 256, (1000, 40, 3), dtype=np.uint8))
    out["grey"] = _png(np.full((300, 200, 3), 128, np.uint8))
    frames = []
    for t in range(4):
        frame = np.full((240, 320, 3), 30, np.uint8)
        frame[40 + 20 * t:100 + 20 * t, 60 + 30 * t:140 + 30 * t] = 230
        frames.append(frame)
    out["video-4x320x240"] = encode_video(frames, rate=2)
    return out


def run(preset: str, device: str, dtype: str, max_pixels: int) -> list[dict]:
    rows = []
    data = inputs()
    for weights in WEIGHT_SETS:
        start = time.time()
        encoder = Encoder.load(f"random:{preset}", device, dtype)
        if weights != "random":
            unit_gain(encoder.tower)
        if weights.endswith("+outliers"):
            plant_outliers(encoder.tower)
        items = [encoder.preprocess(b, max_pixels=max_pixels) for b in data.values()]
        report = compare(encoder, fp8_copy(encoder.tower), items)
        row = {"preset": preset, "weights": weights, **all_tokens(report), "merged": report["merged"],
               "deepstack": report["deepstack"], "layers": report["layers"], "inputs": list(data),
               "tokens": sum(it.num_patches for it in items), "seconds": round(time.time() - start, 1)}
        rows.append(row)
        print(f"{preset} {weights}: mean {row['mean_token_cosine']:.5f}, worst {row['min_token_cosine']:.5f} "
              f"({row['seconds']} s)", flush=True)
        del encoder
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["qwen3-vl-2b", "qwen3-vl-8b", "qwen2.5-vl-7b"])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-pixels", type=int, default=448 * 448)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    rows = [r for p in args.presets for r in run(p, args.device, args.dtype, args.max_pixels)]
    device = torch.device(args.device)
    payload = {"benchmark": "fp8_error", "env": environment(), "device": args.device, "dtype": args.dtype,
               "fp8_gemm": "kernels.fp8_gemm (served)" if fp8_tensor_cores(device) else "float32 from the e4m3 operands",
               "targets": {"mean_token_cosine": 0.999, "min_token_cosine": 0.99}, "rows": rows}
    path = write_results("fp8_error", payload, args.out)
    print(json.dumps({"benchmark": "fp8_error", "path": str(path),
                      "rows": [(r["preset"], r["weights"], round(r["mean_token_cosine"], 5),
                                round(r["min_token_cosine"], 5)) for r in rows]}))


if __name__ == "__main__":
    main()
