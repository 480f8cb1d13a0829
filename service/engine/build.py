"""Settings -> a loaded, warmed encoder: the one place where the settings that shape the model and its kernels are
passed down (`local.LocalEngine` calls it, in the serving process or in an engine process)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pickle
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ..model.encoder import Encoder, bind_thread
from ..model.kernel_runtime import (allow_lean_launch, configure_attention, kernels_serving, kernels_source_digest,
                                    restore_choices, tuned_choices)
from ..model.loader import set_cublaslt_workspace
from ..model.preprocess import Preprocessor
from ..model.tower import TowerOptions
from ..settings import Settings

log = logging.getLogger(__name__)


def configure_runtime(settings: Settings) -> None:
    """Process-wide switches of the kernels, Triton and cuBLAS, before the model's first forward: Triton compiles
    into `cache_dir` (unless TRITON_CACHE_DIR names another place)."""
    set_cublaslt_workspace(settings.cublaslt_workspace_kib)
    configure_attention(launch_plans=settings.launch_plans)
    allow_lean_launch(settings.lean_launch)
    if settings.cache_dir and "TRITON_CACHE_DIR" not in os.environ:
        os.environ["TRITON_CACHE_DIR"] = _writable_dir(Path(settings.cache_dir) / "triton")


def _writable_dir(path: Path) -> str:
    """`path`, created, where this process can write into it; else a fresh temporary directory, with a warning: a
    cache volume that is read-only or owned by another user costs every start its compiles, not the start itself
    (Triton fails every compile where it cannot write its cache)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        return str(path)
    except OSError as e:
        fallback = tempfile.mkdtemp(prefix="qwen3vl-triton-")
        log.warning("the kernel cache directory %s is not writable (%s); compiling into %s, which is not kept: every "
                    "start compiles and tunes the kernels again. Mount a volume this user can write at "
                    "QWEN3VL_CACHE_DIR.", path, e, fallback)
        return fallback


def _cache_file(settings: Settings, device: torch.device, folder: str, suffix: str, *more: str) -> Path | None:
    """A file in `cache_dir`/`folder` named by the GPU model, the torch and Triton versions, the kernels' source
    digest and `more` (None: no cache, or no GPU): a change to any of them names another file."""
    if not settings.cache_dir or device.type != "cuda":
        return None
    import triton

    ident = "|".join([torch.cuda.get_device_name(device), torch.__version__, triton.__version__,
                      kernels_source_digest(), *more])
    return Path(settings.cache_dir) / folder / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}{suffix}"


def _write_atomically(path: Path, write, mode: str, what: str, then: str) -> None:
    """`write(file)` into a temporary file beside `path`, then renamed onto it (a concurrent reader sees the old
    file or the new one); a failure is a warning naming `what` and what `then` happens."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(mode, dir=path.parent, delete=False) as f:
            write(f)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("could not write %s %s (%s); %s", what, path, e, then)


def tuning_cache(settings: Settings, device: torch.device) -> Path | None:
    """The file of the kernel tuner's choices for this device, kernel source and versions (`_cache_file`)."""
    return _cache_file(settings, device, "tuning", ".pkl")


def load_tuning(path: Path | None) -> bool:
    """Restore the tuner's choices from `path`; whether there were any."""
    if path is None or not path.is_file():
        return False
    try:
        count = restore_choices(pickle.loads(path.read_bytes()))
    except Exception as e:  # noqa: BLE001 - a bad cache file costs a re-tune, never the start
        log.warning("ignoring the kernel tuning cache %s (%s)", path, e)
        return False
    log.info("kernel tuning: %d choices from %s", count, path)
    return count > 0


@contextlib.contextmanager
def tuning_lock(path: Path | None):
    """Held while this process tunes the kernels into `path`: the engines of one host (one per GPU, started
    together) tune once, not N times in a race. The first to take it tunes and saves; the others wait, then load its
    choices. Yields a function that releases the lock early (once the choices came from the cache). An advisory
    lock on a file beside the cache: it is released when its holder exits, however it exits."""
    if path is None:
        yield lambda: None
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_suffix(".lock"), "a+")
    except OSError as e:  # a read-only cache volume: no sharing, each engine tunes itself
        log.warning("cannot lock the kernel tuning cache %s (%s); every engine tunes for itself", path, e)
        yield lambda: None
        return
    with f:
        start = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX)
        waited = time.perf_counter() - start
        if waited > 1:
            log.info("waited %.1f s for another engine of this host to tune the kernels", waited)
        yield lambda: fcntl.flock(f, fcntl.LOCK_UN)
        fcntl.flock(f, fcntl.LOCK_UN)


def save_tuning(path: Path | None) -> None:
    """Write the tuner's choices atomically."""
    if path is not None:
        _write_atomically(path, lambda f: pickle.dump(tuned_choices(), f), "wb", "the kernel tuning cache",
                          "the next start tunes again")


def bucket_timings_file(settings: Settings, enc: Encoder) -> Path | None:
    """The file of the graph buckets' timed forwards for this tower on this GPU model with these versions
    (`_cache_file`): what start-up measures after capturing them, kept so that a restart (an engine's, or the
    server's on its cache volume) takes them instead of timing again."""
    return _cache_file(settings, enc.device, "buckets", ".json", enc.forward.timing_key())


def load_bucket_timings(path: Path | None) -> dict[int, float] | None:
    """The timings saved in `path` (None where there are none, or the file is unreadable: the buckets are timed)."""
    if path is None or not path.is_file():
        return None
    try:
        return {int(tokens): float(ms) for tokens, ms in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError) as e:
        log.warning("ignoring the bucket timings in %s (%s)", path, e)
        return None


def save_bucket_timings(path: Path | None, timings: dict[int, float]) -> None:
    """Write `timings` atomically; nothing where none."""
    if path is not None and timings:
        _write_atomically(path, lambda f: json.dump({str(t): ms for t, ms in timings.items()}, f), "w",
                          "the bucket timings", "the next start times them again")


def tower_options(settings: Settings) -> TowerOptions:
    return TowerOptions(attention_backend=settings.attention_backend, fused_qkv_rope=settings.fused_qkv_rope,
                        residual_in_gemm=settings.residual_in_gemm, quantization=settings.quantization)


def load_encoder(settings: Settings) -> Encoder:
    configure_runtime(settings)
    if settings.model.startswith("random:"):
        log.warning("serving the preset %s with RANDOM WEIGHTS: its embeddings are meaningless. Give --model (or "
                    "QWEN3VL_MODEL) a Qwen3-VL or Qwen2.5-VL checkpoint directory to serve a real model.", settings.model)
    device = settings.resolved_device()
    bind_thread(device)  # this thread (a worker's) launches the kernels of loading, FP8's quantisation say
    return Encoder.load(settings.model, device, settings.resolved_dtype(), tower_options(settings),
                        settings.graph_buckets(), settings.graph_eager_margin())


def apply_limits(enc: Encoder, settings: Settings) -> None:
    """The server's decoded-size, resized-size and video-length limits replace the checkpoint preprocessor's
    defaults: the operator's `max_pixels_limit` bounds every image, also one whose request names no max_pixels (it
    is the preprocessor's max_pixels, which requests may only lower)."""
    cfg = enc.preprocessor.config
    limit = settings.resolved_max_pixels_limit(enc.device.type)
    max_pixels = min(cfg.max_pixels, limit) if limit else cfg.max_pixels
    enc.preprocessor = Preprocessor(replace(cfg, max_image_pixels=settings.max_image_pixels,
                                            max_pixels=max_pixels, min_pixels=min(cfg.min_pixels, max_pixels),
                                            video=replace(cfg.video, max_source_frames=settings.max_video_frames)))


def warmup(enc: Encoder, settings: Settings):
    """Run representative packs once so kernels compile and tune before traffic (`_warm_packs` says which). The
    kernels' tuning keys are coarse classes (`kernels.attention.tiles.seq_bucket` and `load_class`, the QKV
    projection's token classes), so a few sizes cover them; a kernel compiled after this is logged and counted
    (`qwen3vl_kernel_compiles_while_serving`)."""
    bind_thread(enc.device)  # run in a worker thread: its kernels launch on the model's device
    cache = tuning_cache(settings, enc.device)
    with tuning_lock(cache) as release:
        if load_tuning(cache):
            release()  # tuned already (by an earlier start, or by another engine of this host just now)
        _warm_packs(enc, settings)
        save_tuning(cache)
    if not (enc.device.type == "cuda" and enc.forward.buckets):
        log.info("warm-up done (multiples of %d px)", enc.preprocessor.config.factor)
    else:
        start = time.perf_counter()
        timings_file = bucket_timings_file(settings, enc)
        known = load_bucket_timings(timings_file)
        enc.capture_graphs(known)  # after the kernels are compiled and tuned: a capture must not tune
        if known is None or known != enc.forward.bucket_ms:
            save_bucket_timings(timings_file, enc.forward.bucket_ms)
        log.info("warm-up done (multiples of %d px); CUDA graphs captured in %.1f s", enc.preprocessor.config.factor,
                 time.perf_counter() - start)
    kernels_serving()  # a kernel compiled from now on is logged


def _warm_packs(enc: Encoder, settings: Settings) -> None:
    """Compile what serving can meet. Triton compiles a kernel anew for each specialisation of its integer
    arguments (equal to 1, divisible by 16, neither), and a pack's row counts, segment lengths and frame counts are
    such arguments: a first video, or a first pack of equal segments of an odd length, compiled for seconds while
    every request waited (the soak's stalls). So each length class runs with a side whose patch count is divisible
    by 16 and one whose count is not, alone, as a full pack of one size and mixed, and a few of the first, which
    is a pack that does not fill the GPU (`kernels.attention.tiles.load_class`) of several segments whose rows are
    divisible by 16 (a front-end-bound node sends 448 px images five at a time: a second's compile mid-traffic);
    and a two-frame video (four frames) alone, two in a row and among images. Packs of unequal segments come with
    a longest segment of each kind, beside the smallest image and full: the graph buckets pad every pack, so the
    attention kernel sees unequal segments (not `UNIFORM`) whatever the pack, and the longest one's divisibility is
    a specialisation of its own (mixed photos compiled twice in their first seconds without the odd one)."""
    from PIL import Image  # noqa: PLC0415 - only the warm-up makes images

    rng = np.random.default_rng(0)
    pre = enc.preprocessor
    patch, temporal = pre.config.patch_size, pre.config.temporal_patch_size
    cuda = enc.device.type == "cuda"

    def image(side: int):
        px = side * patch
        img = Image.fromarray(rng.integers(0, 256, (px, px, 3), dtype=np.uint8))
        return enc.preprocess(img, min_pixels=px * px, max_pixels=px * px)

    def video(side: int):
        px = side * patch
        frames = rng.integers(0, 256, (2 * temporal, px, px, 3), dtype=np.uint8)
        return pre.item(frames, (2, side, side), {"kind": "video"})

    def full(n: int) -> int:  # items of `n` patches in a full pack
        return max(1, min(settings.max_batch_patches // n, settings.max_batch_items))

    for side in [16, 32, 64, 96] if cuda else [8]:
        if side * side > settings.max_batch_patches:
            break
        item, smaller = image(side), image(side - 2)
        if not cuda:
            enc.encode([item])
            continue
        # unequal segments whose longest is divisible by 16 (side - 4) or not (side - 2), beside the smallest image
        # (the load class of the longest alone) and in full packs
        even, least = image(side - 4), image(2)
        packs = [[item], [smaller], [item] * full(side * side), [smaller] * full((side - 2) ** 2), [item, smaller],
                 [item, smaller] * (full(side * side) // 2), [even, least], [smaller, least],
                 [smaller, even] * (full((side - 2) ** 2) // 2), [item] * 2, [item] * 3]
        if 2 * 2 * (side - 2) ** 2 + side * side <= settings.max_batch_patches:
            clip = video(side - 2)
            packs += [[clip], [clip, clip], [item, clip], [clip, item, clip]]
        for pack in packs:  # those the batcher can form: within the patch budget, or one item alone
            if pack and (len(pack) == 1 or sum(it.num_patches for it in pack) <= settings.max_batch_patches):
                enc.encode(pack)
