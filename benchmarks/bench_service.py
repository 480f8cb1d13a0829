"""Service throughput vs the tower's own, on the same images, in one run.

1. Tower: the same 448px JPEGs, preprocessed once, encoded through `Encoder.encode` in packs of the
   server's patch budget: images/s of the model path alone (H2D, patchify, forward, D2H).
2. Service: `qwen3vl-encoder serve` in its own process; N concurrent clients (spread over several
   load-generator processes so the clients do not share the server's GIL) POST raw JPEGs to /embed for
   a fixed time after a warm-up. Reports sustained images/s, p50/p99 latency and the ratio.

With `--video-every N`, every N-th input is a 4 s 448px MP4 clip instead of a JPEG (8 frames sampled
at 2 fps: a (4, 18, 18) grid, 1296 patches against an image's 784). Both sides then run the same mix, and
the ratio compares patches/s.

Usage: python -m benchmarks.bench_service [--clients 64] [--seconds 20] [--model random:qwen3-vl-2b]
       [--video-every 8]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

import numpy as np

from benchmarks.common import environment, wait_until_ready, write_results
from service.model.video import encode_video


def jpegs(n: int, side: int = 448) -> list[bytes]:
    from PIL import Image

    try:
        import skimage.data as data

        base = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket()]
    except ImportError:
        base = [np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)]
    out = []
    for i in range(n):
        img = Image.fromarray(base[i % len(base)]).resize((side, side))
        buf = io.BytesIO()
        img.rotate(i % 360).save(buf, "JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def clip(side: int = 448, seconds: int = 4, rate: int = 24, seed: int = 0) -> bytes:
    """An H.264 MP4 of a photograph panning across the frame."""
    from PIL import Image

    base = np.asarray(Image.open(io.BytesIO(jpegs(1, side)[0])).convert("RGB"))
    return encode_video((np.roll(base, 4 * i + seed, axis=1) for i in range(seconds * rate)), rate)


def tower_throughput(model, images, budget, seconds, device="cuda", dtype="bfloat16"):
    import torch

    from service.model.encoder import Encoder, pack_by_budget

    enc = Encoder.load(model, device, dtype)
    items = [enc.preprocess(b) for b in images]
    packs = pack_by_budget([it.num_patches for it in items], budget, 64)
    for pack in packs[:2]:
        enc.encode([items[i] for i in pack], deepstack=False)
    if device == "cuda":
        torch.cuda.synchronize()
    n, patches, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for pack in packs:
            enc.encode([items[i] for i in pack], deepstack=False)
            n += len(pack)
            patches += sum(items[i].num_patches for i in pack)
    elapsed = time.perf_counter() - start
    sizes = [it.num_patches for it in items]
    del enc
    torch.cuda.empty_cache()
    return {"images_per_s": n / elapsed, "patches_per_s": patches / elapsed, "pack_images": len(packs[0]),
            "patches": sizes}


def _client_proc(url, images, sizes, clients, warmup_s, seconds, params, conn):
    import httpx

    async def run():
        lat, errors, done, patches, videos, video_lat = [], {}, 0, 0, 0, []
        t_start = time.perf_counter()
        t_measure, t_end = t_start + warmup_s, t_start + warmup_s + seconds
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
            async def loop(k):
                nonlocal done, patches, videos
                i = k
                while time.perf_counter() < t_end:
                    t0 = time.perf_counter()
                    body = images[i % len(images)]
                    is_video = body[4:8] == b"ftyp"
                    r = await c.post(f"{url}/embed", params=params, content=body,
                                     headers={"content-type": "video/mp4" if is_video else "image/jpeg"})
                    t1 = time.perf_counter()
                    if t0 >= t_measure and t1 <= t_end:
                        if r.status_code == 200:
                            (video_lat if is_video else lat).append(t1 - t0)
                            done += 1
                            videos += is_video
                            patches += sizes[i % len(images)]
                        else:
                            errors[r.status_code] = errors.get(r.status_code, 0) + 1
                    i += clients
            await asyncio.gather(*(loop(k) for k in range(clients)))
        return {"latencies": lat, "video_latencies": video_lat, "done": done, "videos": videos, "patches": patches,
                "errors": errors}

    conn.send(asyncio.run(run()))


def service_throughput(model, images, sizes, clients, procs, warmup_s, seconds, params, env_extra, device="cuda",
                       dtype="bfloat16"):
    import httpx

    port = 18777
    env = {**os.environ, "QWEN3VL_MODEL": model, "QWEN3VL_PORT": str(port), "QWEN3VL_HOST": "127.0.0.1",
           "QWEN3VL_DEVICE": device, "QWEN3VL_DTYPE": dtype, **env_extra}
    server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve"], env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_until_ready(url, server, timeout_s=300):
            raise RuntimeError("server did not become ready")
        ctx = mp.get_context("spawn")
        pipes, workers = [], []
        for p in range(procs):
            a, b = ctx.Pipe()
            w = ctx.Process(target=_client_proc, args=(url, images[p::procs], sizes[p::procs], clients // procs,
                                                       warmup_s, seconds, params, b))
            w.start()
            pipes.append(a)
            workers.append(w)
        profiler = None
        if os.environ.get("PROFILE_SERVER"):
            time.sleep(warmup_s + 2)
            profiler = subprocess.Popen(["py-spy", "record", "-p", str(server.pid), "-d", "8", "-r", "250", "-f", "raw",
                                         "--threads", "--subprocesses", "--nonblocking", "-o", os.environ["PROFILE_SERVER"]],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        outs = [a.recv() for a in pipes]
        if profiler is not None:
            profiler.wait(60)
        for w in workers:
            w.join()
        info = httpx.get(f"{url}/info").json()
    finally:
        server.terminate()
        server.wait(60)
    lat = np.array(sum((o["latencies"] for o in outs), []))
    errors: dict = {}
    for o in outs:
        for k, v in o["errors"].items():
            errors[k] = errors.get(k, 0) + v
    done = sum(o["done"] for o in outs)
    videos = sum(o["videos"] for o in outs)
    out = {"images_per_s": done / seconds, "requests": done, "errors": errors,
           "patches_per_s": sum(o["patches"] for o in outs) / seconds,
           "p50_ms": float(np.percentile(lat, 50) * 1000), "p99_ms": float(np.percentile(lat, 99) * 1000),
           "mean_ms": float(lat.mean() * 1000), "forwards": info.get("engine", {}).get("forwards"),
           "attention_backend": info.get("attention_backend")}
    if videos:
        vlat = np.array(sum((o["video_latencies"] for o in outs), []))
        out.update({"videos_per_s": videos / seconds, "video_p50_ms": float(np.percentile(vlat, 50) * 1000),
                    "video_p99_ms": float(np.percentile(vlat, 99) * 1000)})
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="random:qwen3-vl-2b")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--warmup", type=float, default=5)
    ap.add_argument("--images", type=int, default=256)
    ap.add_argument("--format", default="safetensors")
    ap.add_argument("--budget", type=int, default=32768)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--server-env", nargs="*", default=[], help="extra KEY=VALUE settings for the server")
    ap.add_argument("--video-every", type=int, default=0, help="every N-th input is an MP4 clip (0: images only)")
    ap.add_argument("--name", default="service", help="results file name (without .json)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    images = jpegs(args.images)
    if args.video_every:
        images = [clip(seed=i) if i % args.video_every == args.video_every - 1 else b for i, b in enumerate(images)]
    tower = tower_throughput(args.model, images, args.budget, min(args.seconds, 10), args.device, dtype)
    sizes = tower.pop("patches")
    print(f"tower: {tower['images_per_s']:.1f} inputs/s, {tower['patches_per_s']:.0f} patches/s", flush=True)
    params = {"format": args.format, "deepstack": "false"}
    env_extra = {"QWEN3VL_MAX_BATCH_PATCHES": str(args.budget), "QWEN3VL_MAX_QUEUE_ITEMS": "4096",
                 "QWEN3VL_PREPROCESS_WORKERS": str(max(4, (os.cpu_count() or 8) - args.procs - 2)),
                 "QWEN3VL_MAX_WAIT_MS": "5", **dict(kv.split("=", 1) for kv in args.server_env)}
    svc = service_throughput(args.model, images, sizes, args.clients, args.procs, args.warmup, args.seconds, params,
                             env_extra, args.device, dtype)
    ratio = svc["patches_per_s"] / tower["patches_per_s"]
    print(f"service: {svc['images_per_s']:.1f} images/s ({ratio:.1%} of the tower), p50 {svc['p50_ms']:.1f} ms, "
          f"p99 {svc['p99_ms']:.1f} ms, errors {svc['errors']}, forwards {svc['forwards']}")
    if svc.get("videos_per_s"):
        print(f"videos: {svc['videos_per_s']:.1f}/s, p50 {svc['video_p50_ms']:.1f} ms, p99 {svc['video_p99_ms']:.1f} ms")
    payload = {"benchmark": "service", "env": environment(), "model": args.model, "clients": args.clients,
               "image": "448x448 JPEG", "video_every": args.video_every,
               "video": "4 s 448px H.264 MP4, 8 frames sampled" if args.video_every else None, "params": params, "server_env": env_extra, "tower": tower, "service": svc,
               "ratio": ratio}
    write_results(args.name, payload, args.out)
    print(json.dumps({"benchmark": "service", "tower_images_per_s": round(tower["images_per_s"], 1),
                      "service_images_per_s": round(svc["images_per_s"], 1), "ratio": round(ratio, 3),
                      "p50_ms": round(svc["p50_ms"], 1), "p99_ms": round(svc["p99_ms"], 1)}))


if __name__ == "__main__":
    main()
