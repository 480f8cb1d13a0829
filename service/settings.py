"""The one settings object of the service: CLI flags over `QWEN3VL_*` environment variables over
defaults, validated at start-up with messages that say what to change."""

from __future__ import annotations

import ctypes
import importlib.util
import os
import sys
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEFAULT_MODEL = "random:qwen3-vl-2b"
CPU_MAX_PIXELS = 1024 * 1024  # the default max_pixels_limit on the CPU
GPU_MAX_REQUEST_PATCHES, CPU_MAX_REQUEST_PATCHES = 262_144, 65_536  # the default max_request_patches
# token counts of the CUDA graph buckets, up to the default patch budget of a pack: each about 1.25x the last up to
# 4096, then every 512, where the padding's share of a forward's GPU time is what it costs (at most 3% above 16,384
# tokens); the batcher trims packs to the buckets whose forwards cost the least a patch, and start-up's timings route
# a bucket to a larger one whose forward is faster
DEFAULT_GRAPH_BUCKETS = (256, 320, 400, 512, 640, 800, 1024, 1280, 1600, 2048, 2560, 3200, *range(4096, 32769, 512))


def parse_buckets(spec: str) -> tuple[int, ...]:
    """'256,512,1024' -> (256, 512, 1024): ascending token counts, each a multiple of 4 (the merge unit)."""
    buckets = sorted({int(part) for part in spec.split(",") if part.strip()})
    if not buckets or buckets[0] < 4 or any(b % 4 for b in buckets):
        raise ValueError(f"graph buckets {spec!r}: positive multiples of 4 expected")
    return tuple(buckets)


def cuda_device_count() -> int:
    """The CUDA devices this process can use, as `torch.cuda.device_count()` counts them where torch is built with
    CUDA (0 where it is not, or there is no driver or device; CUDA_VISIBLE_DEVICES applies), without importing
    torch where it is not imported yet: the server's main process decides how many engine processes to start, and
    importing torch first (3-5 s) would delay every one of them. It asks the driver, which creates no context."""
    if "torch" in sys.modules:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return 0
    version = importlib.util.spec_from_file_location(  # torch/version.py: no imports but typing
        "_torch_version", os.path.join(spec.submodule_search_locations[0], "version.py"))
    build = importlib.util.module_from_spec(version)
    try:
        version.loader.exec_module(build)
    except OSError:
        return 0
    if not getattr(build, "cuda", None):
        return 0
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def default_cache_dir() -> str:
    """The user's cache directory (XDG_CACHE_HOME, else ~/.cache), then qwen3vl-encoder."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "qwen3vl-encoder")


def default_http_workers(gpus: int, cores: int) -> int:
    """HTTP front-end processes for `gpus` engines on `cores` cores.

    A front-end carries a few hundred 448-px JPEG requests a second (decoding, the reply), a fifth to a quarter of
    what one GPU encodes in FP8, so 6 per GPU; up to three eighths of the cores, the rest for the engines, the
    decoding threads and the kernel's network stack (measured on a node of 4 GPUs and 64 cores: docs/PERFORMANCE.md,
    "A whole node"); at least 8 (or half the cores), which one GPU needs.
    """
    return max(1, min(64, max(min(8, cores // 2), min(6 * gpus, cores * 3 // 8))))


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="QWEN3VL_", extra="ignore")

    # model
    model: str = Field(DEFAULT_MODEL, description="checkpoint directory or random:<preset>")
    device: str = Field("auto", description="auto (cuda when available), cpu, cuda, cuda:N")
    devices: str | None = Field(None, description="with HTTP front-end processes: one engine process per device. "
                                "'all' (every visible GPU), GPU indices such as '0,1,3', or device names such as "
                                "'cuda:0,cuda:2' or 'cpu,cpu'. Default: every visible GPU, else one engine on `device`")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    warmup: bool = Field(True, description="compile and tune kernels before /ready turns true")

    cache_dir: str = Field(default_factory=lambda: default_cache_dir(), description=(
        "compiled Triton kernels, the kernel tuner's choices and the graph buckets' timed forwards, kept across "
        "restarts (a volume in the container): a second start skips compiling and timing; empty: no cache"))

    # kernels
    attention_backend: Literal["auto", "triton", "sdpa"] = Field(
        "auto", description="attention backend for eager forwards and CUDA graphs alike; auto: the Triton kernels "
                            "where they run (sm80+), SDPA elsewhere")
    quantization: Literal["none", "fp8"] = Field("none", description="fp8: the blocks' linear layers in e4m3 "
                                                 "(weights per output channel at load, activations per token); "
                                                 "check a checkpoint's error first with `qwen3vl-encoder quant-check`")
    fused_qkv_rope: bool = Field(True, description="Triton backend on Hopper: the QKV projection adds its bias and "
                                 "rotates Q and K in its own epilogue, instead of cuBLAS and a RoPE pass")
    residual_in_gemm: bool | None = Field(None, description="the output projections add the residual in their GEMM's "
                                          "epilogue and the norm after them only normalises; None: on for Qwen3-VL, "
                                          "off for Qwen2.5-VL (whose bf16 error it raises)")
    launch_plans: bool = Field(True, description="record each attention call layout's launch once and replay it "
                                                 "(a fraction of the full path's host time per call)")
    lean_launch: bool = Field(True, description="launch compiled Triton kernels through this project's launcher (the "
                              "JIT's binder and a cache of compiled kernels, a fraction of Triton's host time per "
                              "launch); it turns itself off, with a warning and the reason, where this Triton's "
                              "internals are not the ones it reads. false: every launch through Triton's own path")
    cublaslt_workspace_kib: int | None = Field(
        0, ge=0, description="cuBLASLt workspace of the model's process in KiB (PyTorch's CUBLASLT_WORKSPACE_SIZE; "
                             "None: PyTorch's default). 0: the GEMMs need no memset before each call")

    # HTTP
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    api_key: SecretStr | None = Field(None, description="if set, every route but /health, /ready and /metrics needs "
                                      "'Authorization: Bearer <key>'. Prefer QWEN3VL_API_KEY or api_key_file to the "
                                      "flag, which other users of the host see in ps")
    api_key_file: str | None = Field(None, description="a file holding the API key (a mounted secret); read at "
                                     "start-up, surrounding whitespace ignored")
    max_body_bytes: int = Field(64 * 2**20, ge=1024)
    max_inputs_per_request: int = Field(64, ge=1)
    max_request_patches: int | None = Field(None, ge=1, description="the most patches one request's inputs may come "
                                            "to after resizing (the work it buys; 413 beyond); default 262,144 on "
                                            "a GPU (8 full forwards), 65,536 on the CPU")
    request_timeout_s: float = Field(60.0, gt=0, description="deadline from arrival to response")
    max_connections: int = Field(1000, ge=1, description="open connections per HTTP process; the next is answered "
                                 "503 with Retry-After and closed (a process's descriptors are bounded)")
    max_header_bytes: int = Field(32768, ge=1024, description="request line and headers, in bytes (431 beyond)")
    max_headers: int = Field(100, ge=8, description="headers per request (431 beyond)")
    header_timeout_s: float = Field(10.0, gt=0, description="from a connection's opening, or a request's first "
                                    "byte, to its last header (then 408 and closed: a client sending a byte a second, "
                                    "or nothing, holds no connection longer)")
    body_timeout_s: float = Field(60.0, gt=0, description="from a request's headers to its body's last byte (then "
                                  "408 and closed: a stalled upload frees its memory)")
    keep_alive_s: float = Field(120.0, gt=0, description="how long an idle keep-alive connection stays open: longer "
                                "than clients' and load balancers' own idle timeouts (Go 90 s, AWS ALB 60 s, aiohttp "
                                "15 s), so that the client closes an idle connection, not the server (a server that "
                                "closes one just as its client reuses it resets a request already sent, and clients "
                                "do not retry a POST)")
    drain_s: float = Field(5.0, ge=0, description="on SIGTERM: seconds the server keeps serving with /ready 503 and "
                           "'Connection: close' on every response, so that clients leave their keep-alive connections "
                           "before it stops accepting (a second SIGTERM skips the rest)")
    graceful_shutdown_s: float = Field(30.0, ge=0, description="after the drain: how long requests in flight may "
                                       "take to finish")

    # images
    max_image_pixels: int = Field(40_000_000, ge=1, description="decoded width*height limit (bombs)")
    max_pixels_limit: int | None = Field(None, ge=1, description="the most pixels any image is resized to (a "
                                         "request's max_pixels may only lower it); default: the checkpoint's "
                                         "max_pixels on a GPU, at most 1,048,576 (1024 x 1024) on the CPU, where the "
                                         "checkpoint's 16.7 Mpx cost one request tens of seconds")
    min_pixels_limit: int = Field(256, ge=1, description="lower bound of a request's min_pixels")

    # videos
    max_video_frames: int = Field(9000, ge=2, description="frames in one video file beyond which it is refused "
                                  "(413) before decoding; decoding is sequential, so this bounds its CPU time")

    video_sandbox: bool = Field(True, description="decode each video in a child process with the CPU and memory "
                                "limits below, so a decoder crash costs that input a 422 and nothing else")
    video_decode_cpu_s: float = Field(60.0, gt=0, description="CPU seconds one video's decoding may use")
    video_decode_memory_mib: int = Field(4096, ge=256, description="memory one video's decoding may allocate")

    # batching
    max_batch_patches: int = Field(32768, ge=64, description="patch budget of one forward")
    max_batch_items: int = Field(64, ge=1)
    max_wait_ms: float = Field(0.0, ge=0, description="how long a pack waits to fill up when the GPU is idle (0: it "
                               "goes at once; while the GPU is busy a pack fills until just before it frees up)")
    forward_trace: str | None = Field(None, description="append a CSV line per forward to this file (unix time, "
                                      "device, items, patches, GPU ms, launch-to-outputs ms, launch ms, the GPU's "
                                      "idle ms before it, ms its end was predicted late (these two from CUDA "
                                      "events, nan without), 1 where it ran eagerly, not through graphs, the "
                                      "batcher's estimate of an idle GPU's wait for a launch's host work, then "
                                      "the launch ms in parts: the inputs' upload, the forward, the outputs' "
                                      "copies, then how many ms the launch returned after the GPU finished the "
                                      "forward before, nan where it returned before): the packs the batcher "
                                      "forms and what each costs, for tuning and diagnosis")
    cuda_graphs: bool | None = Field(None, description="run packs of up to the largest graph bucket as CUDA graphs, "
                                     "captured at start-up for every bucket (nothing is captured once traffic "
                                     "flows). Default: on with CUDA and HTTP front-end processes")
    cuda_graph_buckets: str = Field(
        ",".join(map(str, DEFAULT_GRAPH_BUCKETS)), description="token counts (patches) of the graph buckets: a pack is "
        "padded to the smallest that holds it (each about 1.25x the last up to 4096, then every 512: at most 20% of "
        "a padded forward is padding below 4096 tokens, 11% above, 3% above 16384); on CUDA, start-up moves each up to "
        "4096 by at most 64 patches to where the blocks' GEMMs time at least 2% faster (cuBLAS's kernel changes in "
        "steps with the row count), then times each bucket's "
        "forward, a pack above 4096 patches runs in a larger bucket where that one's forward timed at least 2% "
        "faster, and a busy GPU's pack is trimmed to the cheapest a patch. Buckets above the first that holds "
        "max_batch_patches are not captured; a larger pack (one item over the budget) runs eagerly")
    cuda_graph_eager_above: bool = Field(True, description="run eagerly, without the bucket's padding, the packs whose "
                                         "forward keeps the GPU busier than an eager forward's launches take the host "
                                         "to issue, with a margin (timed at start-up, then on the eager forwards as "
                                         "served). false: every pack within a bucket runs its graphs")
    cuda_graph_eager_margin: float = Field(3.0, gt=0, le=100, description="with cuda_graph_eager_above, a "
                                           "pack runs eagerly when its forward takes the GPU at least this multiple "
                                           "of the host time an eager forward takes to issue")
    max_queue_items: int = Field(512, ge=1, description="queued images beyond which requests get 429")
    http_workers: int | None = Field(None, ge=0, le=64, description="HTTP front-end processes (parse, decode, "
                                     "respond) feeding the engine processes that own the model; 0: one process does "
                                     "everything (service.engine.process). Default on CUDA: 6 per GPU within three "
                                     "eighths of the cores, at least 8 (within half the cores); 0 on CPU")
    engine_restart_backoff_s: float = Field(0.5, ge=0, description="wait before restarting a dead engine process; "
                                            "doubles with each death inside the crash window")
    engine_max_restarts: int = Field(5, ge=0, description="engine deaths within engine_restart_window_s beyond "
                                     "which the server gives up and exits with code 3 (a crash loop)")
    engine_restart_window_s: float = Field(600.0, gt=0)
    engine_standby: bool = Field(True, description="keep the next engine process spawned, its modules imported and "
                                 "the GPU untouched, so a restart only loads and warms the model (one idle process's "
                                 "host memory)")
    preprocess_workers: int = Field(4, ge=1, description="image and video decoding workers")
    embedding_cache_mib: int = Field(512, ge=0, description="results of identical inputs (same bytes and options) kept "
                                     "in shared memory, for every HTTP process, and answered without the engine; 0: "
                                     "none kept (identical inputs in flight in one process still share one encoding)")
    embedding_cache_write_mib_s: int = Field(64, ge=0, description="per HTTP process, the results of 256 KiB or more "
                                             "written to the embedding cache a second (a second's worth at once; the "
                                             "rest go unwritten): writing fresh shared memory costs ~1.3 ms of CPU a "
                                             "MB, which distinct images in vLLM's layout (3.2 MB each) never get back; "
                                             "0: every result written")
    shared_memory_mib: int = Field(256, ge=0, description="per front-end process, split evenly between its "
                                   "connections to the engines: shared memory in /dev/shm (page-locked by the engines) "
                                   "through which decoded frames reach an engine and its results come back; a request "
                                   "holds its frames' and its results' room from its submission to its reply (a 448 "
                                   "px image asking for vLLM's layout: 3.8 MB), so this bounds the requests of a "
                                   "front-end in flight before the rest go over the socket, as all do with 0. "
                                   "Containers need room for it: 16 front-ends take 4 GiB (compose: shm_size)")

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if v != "auto" and not (v == "cpu" or v == "cuda" or v.startswith("cuda:")):
            raise ValueError(f"device {v!r}: use auto, cpu, cuda or cuda:N")
        return v

    @field_validator("cuda_graph_buckets")
    @classmethod
    def _buckets(cls, v: str) -> str:
        parse_buckets(v)
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: str | None) -> str | None:
        if v is None or v.strip() == "all":
            return v
        for d in (part.strip() for part in v.split(",")):
            if not (d.isdigit() or d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit())):
                raise ValueError(f"devices {v!r}: {d!r} is not a GPU index, cuda:N or cpu")
        return v

    @model_validator(mode="after")
    def _key_file(self):
        if self.api_key_file:
            try:
                key = open(self.api_key_file).read().strip()
            except OSError as e:
                raise ValueError(f"api_key_file: {e}") from None
            if not key:
                raise ValueError(f"api_key_file {self.api_key_file} is empty")
            self.api_key = SecretStr(key)
        return self

    @model_validator(mode="after")
    def _limits(self):
        if self.max_pixels_limit is not None and self.max_pixels_limit < self.min_pixels_limit:
            raise ValueError("max_pixels_limit must be >= min_pixels_limit")
        return self

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        return "cuda" if cuda_device_count() else "cpu"

    def resolved_devices(self) -> list[str]:
        """The engine processes' devices, one engine each."""
        spec = (self.devices or "").strip()
        if spec and spec != "all":
            return [f"cuda:{d}" if d.isdigit() else d for d in (part.strip() for part in spec.split(",")) if d]
        count = cuda_device_count()
        if (spec == "all" or self.device in ("auto", "cuda")) and count:
            return [f"cuda:{i}" for i in range(count)]
        return [self.resolved_device()]

    def as_env(self) -> dict[str, str]:
        """The settings as QWEN3VL_* environment variables, for processes that rebuild them with Settings()."""
        env: dict[str, str] = {}
        for name, value in self.model_dump().items():
            if value is None:
                continue
            if hasattr(value, "get_secret_value"):
                value = value.get_secret_value()
            env[f"QWEN3VL_{name.upper()}"] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    def resolved_http_workers(self) -> int:
        if self.http_workers is not None:
            return self.http_workers
        if not self.resolved_device().startswith("cuda"):
            return 1 if self.devices and len(self.resolved_devices()) > 1 else 0
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 4)
        return default_http_workers(len(self.resolved_devices()), cores)

    def for_processes(self, devices: list[str]) -> "Settings":
        """These settings with what each process would otherwise resolve for itself fixed once (the devices, the
        front-end count, graphs on or off), as `serve` and the dataset job hand them to their processes."""
        return self.model_copy(update={"devices": ",".join(devices), "http_workers": self.resolved_http_workers(),
                                       "cuda_graphs": self.resolved_cuda_graphs()})

    def resolved_cuda_graphs(self) -> bool:
        """Graphs pay off once the engine's host work is not shared with HTTP handling (in one process they
        measured slower: docs/PERFORMANCE.md)."""
        if self.cuda_graphs is not None:
            return self.cuda_graphs
        return self.resolved_device().startswith("cuda") and bool(self.resolved_http_workers())

    def graph_eager_margin(self) -> float | None:
        """`BucketedTower`'s `eager_margin`: None where every pack within a bucket runs its graphs."""
        return self.cuda_graph_eager_margin if self.cuda_graph_eager_above else None

    def graph_buckets(self) -> tuple[int, ...]:
        """The buckets to capture: none without graphs; else those up to the first that holds a full pack."""
        if not self.resolved_cuda_graphs():
            return ()
        buckets = parse_buckets(self.cuda_graph_buckets)
        full = next((i for i, b in enumerate(buckets) if b >= self.max_batch_patches), len(buckets) - 1)
        return buckets[:full + 1]

    def resolved_max_pixels_limit(self, device_type: str) -> int | None:
        """The operator's bound on an image's resized pixels on `device_type` (None: the checkpoint's)."""
        if self.max_pixels_limit is not None:
            return self.max_pixels_limit
        return CPU_MAX_PIXELS if device_type == "cpu" else None

    def resolved_max_request_patches(self, device_type: str) -> int:
        if self.max_request_patches is not None:
            return self.max_request_patches
        return CPU_MAX_REQUEST_PATCHES if device_type == "cpu" else GPU_MAX_REQUEST_PATCHES

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if self.resolved_device().startswith("cuda") else "float32"
