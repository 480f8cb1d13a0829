"""The hot in-process floor of one image's latency: decode + resize of a 448 px JPEG, and the engine's own encode
of it (pooled vector only, launch to outputs on the host), each the median of 200 back-to-back runs with the
server's default settings; to set against the `X-Preprocess-Time-Ms` / `X-Inference-Time-Ms` of a single request
(`benchmarks.bench_service`'s `single_image`).

Usage: python -m tools.single_image [--out DIR]   (CUDA; writes single_image.json)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench_service import photo_jpegs
from benchmarks.common import environment, write_results
from service.engine.build import configure_runtime, warmup
from service.model.encoder import Encoder
from service.settings import Settings


def median_ms(fn, n: int = 200) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = Settings()
    configure_runtime(settings)
    jpeg = photo_jpegs([(448, 448)])[0]
    enc = Encoder.load(settings.model, "cuda", "bfloat16", graph_buckets=settings.graph_buckets())
    decode = median_ms(lambda: enc.preprocess(jpeg))
    warmup(enc, settings)
    item = enc.preprocess(jpeg)
    px = enc.pixels([item])

    def launch_host_ms():
        start = time.perf_counter()
        pending = enc.launch([item], deepstack=False, tokens=False)
        host = time.perf_counter() - start
        enc.finish(pending)
        return host * 1e3

    row = {"decode_resize_ms": decode,
           "encode_pooled_ms": median_ms(lambda: enc.encode([item], deepstack=False, tokens=False)),
           "pixels_ms": median_ms(lambda: (enc.pixels([item]), torch.cuda.synchronize())),
           "bucketed_forward_ms": median_ms(lambda: (enc.forward(px, [item.grid_thw]), torch.cuda.synchronize())),
           "launch_host_ms": statistics.median(launch_host_ms() for _ in range(200))}
    print(row)
    write_results("single_image", {"benchmark": "single_image", "env": environment(), "model": settings.model,
                                   **row}, args.out)


if __name__ == "__main__":
    main()
