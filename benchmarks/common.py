"""Shared benchmark plumbing: shapes from the real architectures, timing, and the results file."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

import numpy as np
import torch

from service.model.config import PRESETS
from service.model.tower import window_order

RESULTS = Path(__file__).parent / "results"


def _windows(*sides: int) -> list[int]:
    """The attention windows of Qwen2.5-VL's tower (112 px: 8 x 8 patches of 14 px) over square images of `sides`
    patches: 64-token windows, and shorter ones where an image's edge cuts them."""
    cfg = PRESETS["qwen2.5-vl-7b"]
    return window_order([(1, s, s) for s in sides], cfg.spatial_merge_size, cfg.window_units)[1]


# Attention shapes: 16 heads and the head dims of the real towers (Qwen3-VL 2B/4B: 64; 8B/32B/MoE: 72;
# Qwen2.5-VL: 80).
HEAD_DIMS = {"qwen3-vl-2b": PRESETS["qwen3-vl-2b"].head_dim, "qwen3-vl-8b": PRESETS["qwen3-vl-8b"].head_dim,
             "qwen2.5-vl": PRESETS["qwen2.5-vl-7b"].head_dim}
HEADS = PRESETS["qwen3-vl-2b"].num_heads
ATTENTION_CASES = {
    "1x1024": [1024],
    "1x4096": [4096],
    "1x16384": [16384],
    "8x1024": [1024] * 8,
    "64x256": [256] * 64,
    "mixed8": [256, 784, 1024, 2304, 4096, 576, 1600, 3136],
    "32x784": [784] * 32,
    # Qwen2.5-VL's windowed blocks: 32 images of 448 px (512 windows of 64), one of 1036 px (74 x 74 patches: 64-,
    # 32-, 16- and 4-token windows), photos of mixed sizes
    "win-32x448px": _windows(*[32] * 32),
    "win-1x1036px": _windows(74),
    "win-mixed8": _windows(16, 28, 36, 54, 74, 20, 40, 56),
}


def packed_qkv(lengths, head_dim, generator=None):
    """Random bf16 attention inputs on the GPU in the tower's layout: one fused `(T, 3, HEADS, head_dim)` QKV
    buffer, whose `unbind(1)` gives q, k and v as strided views, and int32 `cu_seqlens` for `lengths`."""
    qkv = torch.randn(sum(lengths), 3, HEADS, head_dim, device="cuda", dtype=torch.bfloat16, generator=generator)
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    return qkv, cu


def batched_cudnn(q, k, v, lengths):
    """Batched cuDNN SDPA over equal-length segments, on `(B, HEADS, n, head_dim)` views of q, k, v `(T, HEADS,
    head_dim)` (no copies), as a callable; None where the lengths differ."""
    if len(set(lengths)) != 1:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qb, kb, vb = (t.view(len(lengths), lengths[0], *t.shape[1:]).transpose(1, 2) for t in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qb, kb, vb)
    return cudnn


@contextlib.contextmanager
def overriding(*settings):
    """(module, attribute, value) settings in force for the block's duration, the old values restored after."""
    saved = [(module, name, getattr(module, name)) for module, name, _ in settings]
    for module, name, value in settings:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


def attention_flops(lengths, head_dim) -> int:
    """4 * sum(n_i^2) * heads * head_dim: QK^T and PV over every segment."""
    return 4 * sum(n * n for n in lengths) * HEADS * head_dim


@contextlib.contextmanager
def revision_trees(revisions: list[str], work: Path):
    """{revision: its tree}: `.` is this working tree, any other a git revision checked out in a worktree under
    `work`, removed again on the way out (also where a later checkout fails)."""
    root = Path(__file__).resolve().parents[1]
    trees: dict[str, Path] = {}
    try:
        for rev in revisions:
            if rev == ".":
                trees[rev] = root
            else:
                path = work / rev
                subprocess.run(["git", "-C", str(root), "worktree", "add", "-f", "--detach", str(path), rev],
                               check=True, capture_output=True)
                trees[rev] = path
        yield trees
    finally:
        for path in trees.values():
            if path != root:
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(path)],
                               capture_output=True)


class ClockLog:
    """Samples the GPU's SM clock, power draw and active clock-limit reasons with `nvidia-smi -lms`
    while the block runs; `summary()` gives their medians (MHz, W) and the reasons seen. Empty where
    nvidia-smi is missing."""

    QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"

    def __init__(self, interval_ms: int = 50):
        self.interval_ms = interval_ms
        self.proc = None
        self.lines: list[str] = []

    def __enter__(self):
        if not torch.cuda.is_available():
            return self
        try:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                 f"-lms={self.interval_ms}", f"--id={torch.cuda.current_device()}"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except (FileNotFoundError, RuntimeError):
            self.proc = None
        return self

    def __exit__(self, *exc):
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.lines = [line for line in out.splitlines() if line.strip()]

    def summary(self) -> dict:
        samples = []
        for line in self.lines:
            parts = [p.strip() for p in line.split(",")]
            try:
                samples.append((float(parts[0]), float(parts[1]), parts[2]))
            except (ValueError, IndexError):
                continue
        if not samples:
            return {}

        def median(xs):
            xs = sorted(xs)
            return xs[len(xs) // 2]

        return {"sm_mhz_median": median([s[0] for s in samples]), "sm_mhz_min": min(s[0] for s in samples),
                "power_w_median": median([s[1] for s in samples]), "samples": len(samples),
                "clock_event_reasons": sorted({s[2] for s in samples})}


def bench(fn, warmup_ms=100, rep_ms=500) -> float:
    """Median milliseconds over many runs, timed with CUDA events (triton.testing.do_bench)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def host() -> dict:
    """The CPU the host timings ran on (a lease's host shifts a lone request's latency by up to 0.5 ms)."""
    model, virtual = platform.processor(), False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and model in ("", platform.machine()):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    virtual = "hypervisor" in line.split()
                    break
    except OSError:
        pass
    return {"cpu": model, "cpus": os.cpu_count(), "virtual_machine": virtual}


def environment() -> dict:
    import transformers
    import triton

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        rev = ""
    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else "",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": host(),
        "git_revision": os.environ.get("GIT_REVISION", rev),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "settings": {k: v for k, v in os.environ.items() if k.startswith(("QWEN3VL_", "CUBLAS"))},
        "event_loop": event_loop(),
    }


def event_loop() -> str:
    """The server's event loop where this Python runs it: uvloop where installed (uvicorn[standard], which the
    package and the image install, brings it), else asyncio's. Carry its wheel to a machine that lacks it, or the
    HTTP figures are not what a user's install gets."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    return f"uvloop {uvloop.__version__}"


def metric_sums(url: str, names) -> dict[str, float]:
    """The server's /metrics values of `names`, each summed over the label sets it does not name (a name with
    `{...}` is that one series); 0 where absent."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        for key in names:
            if name == key or ("{" not in key and name.split("{")[0] == key):
                out[key] += float(value)
    return out


def read_forward_trace(trace: Path, t0: float = float("-inf"), t1: float = float("inf")) -> list[tuple]:
    """The engines' forwards between unix times t0 and t1 from their trace (`Settings.forward_trace`), in order:
    (unix time, items, patches, GPU ms, launch-to-outputs ms, launch ms, GPU idle ms before it, ms its end was
    predicted late, 1.0 where it ran eagerly, the launch model's wait ms for a launch on an idle GPU, then the
    launch's ms in its inputs' upload, its forward and its outputs' copies, then how many ms the launch returned after
    the GPU finished the forward before), the last nine nan where the line has none (an older revision's trace, the
    GPU's times unread, or a launch that returned in time); none where the file is missing."""
    if not trace.exists():
        return []
    rows = []
    for line in trace.read_text().splitlines():
        t, _device, items, patches, gpu_ms, wall_ms, *more = line.split(",")
        if t0 <= float(t) <= t1:
            more = [float(x) for x in more[:9]] + [float("nan")] * (9 - len(more[:9]))
            rows.append((float(t), int(items), int(patches), float(gpu_ms), float(wall_ms), *more))
    return rows


def forward_gaps(rows: list[tuple], seconds: float, devices: int = 1) -> dict:
    """What a trace's forwards (`read_forward_trace`) say of the GPUs between them over a window of `seconds`: the
    idle time between one engine's forwards as a fraction of the window (over `devices` engines) and per forward
    (10th, 50th and 90th percentiles), how late the batcher predicted their ends, their launches' host time, and the
    share of them that ran eagerly, with those launches' host time apart, and the launches' host time in its parts
    (the inputs' upload, the forward, the outputs' copies): where a slow launch spent it; and the launches that
    returned after the GPU had finished the forward before (`exposed`: their share, and the ms by which, summed over
    the window as a fraction of it: the most the GPU can have waited for launches within its busy time)."""
    def pct(values):
        values = [v for v in values if v == v]  # not nan
        return [round(float(np.percentile(values, q)), 2) for q in (10, 50, 90)] if values else None

    idle = [r[6] for r in rows if r[6] == r[6]]
    exposed = [r[13] for r in rows if r[13] == r[13]]
    return {"forwards": len(rows), "images": pct([r[1] for r in rows]),
            "gpu_idle_fraction": round(sum(max(0.0, i) for i in idle) / 1e3 / seconds / devices, 4) if idle else None,
            "gpu_idle_ms": pct(idle), "predicted_late_ms": pct([r[7] for r in rows]),
            "launch_ms": pct([r[5] for r in rows]), "launch_to_outputs_ms": pct([r[4] for r in rows]),
            "eager_fraction": round(sum(r[8] == 1 for r in rows) / len(rows), 3) if rows else None,
            "eager_launch_ms": pct([r[5] for r in rows if r[8] == 1]), "model_wait_ms": pct([r[9] for r in rows]),
            "launch_parts_ms": {part: pct([r[10 + i] for r in rows])
                                for i, part in enumerate(("inputs", "forward", "outputs"))},
            # of the forwards whose GPU times were read (`idle`): those that can show exposure
            "exposed": {"fraction_of_forwards": round(len(exposed) / len(idle), 3) if idle else None,
                        "ms": pct(exposed),
                        "fraction_of_window": round(sum(exposed) / 1e3 / seconds / devices, 4) if idle else None}}


def write_results(name: str, payload: dict, out_dir: str | None = None) -> Path:
    out = Path(out_dir or os.environ.get("OUT") or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.3f}"
    return str(v)


def py_spy(pid: int, seconds: float, path: Path, rate: int = 100, gil: bool = True) -> subprocess.Popen | None:
    """py-spy (where installed) recording process `pid` for `seconds` in the background, raw stacks to `path` (for
    `top_frames`): with `gil`, the threads holding the interpreter lock (what bounds a process); else the threads on a
    CPU whatever they hold (a thread spinning in a CUDA wait shows there). None without py-spy."""
    import shutil

    if shutil.which("py-spy") is None:
        return None
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate",
                             str(rate), "--nonblocking", "--format", "raw", "--output", str(path),
                             *(["--gil"] if gil else [])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def top_frames(path: Path, n: int = 25, within: str = "") -> list[str]:
    """The `n` frames where most samples of a py-spy raw profile end, with their shares; `within`: only the samples
    whose stack holds that frame."""
    counts: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, k = line.rpartition(" ")
        if within not in stack:
            continue
        frame = stack.rsplit(";", 1)[-1]
        counts[frame] = counts.get(frame, 0) + int(k)
        total += int(k)
    return [f"{c / total:.1%} {f}" for f, c in sorted(counts.items(), key=lambda x: -x[1])[:n]]
