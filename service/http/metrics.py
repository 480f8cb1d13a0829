"""Prometheus metrics, one prefix (`qwen3vl_`), kept by the HTTP processes. With an engine process, its forwards'
stats reach them on replies and its gauges through `stats` (service.engine.process).

Buckets span this service's range: a tiny image on a warm GPU answers in a few milliseconds, a
16-frame video or an overloaded queue takes tens of seconds.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess

PREFIX = "qwen3vl"
TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITEM_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PATCH_BUCKETS = (256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_batch_patches: int = 32768):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=r)
        self.request_latency = Histogram(f"{PREFIX}_request_duration_seconds", "HTTP request latency",
                                         ["route", "status"], buckets=TIME_BUCKETS, registry=r)
        self.queue_time = Histogram(f"{PREFIX}_queue_seconds", "time an image waited for a forward",
                                    buckets=TIME_BUCKETS, registry=r)
        self.preprocess_time = Histogram(f"{PREFIX}_preprocess_seconds", "decode+resize time of a request's inputs "
                                         "(decoded concurrently), observed once per input",
                                         buckets=TIME_BUCKETS, registry=r)
        # per engine: `device` is its device (cuda:0, ..., or cpu)
        self.forward_time = Histogram(f"{PREFIX}_forward_seconds", "time of one packed forward pass", ["device"],
                                      buckets=TIME_BUCKETS, registry=r)
        self.batch_items = Histogram(f"{PREFIX}_batch_items", "images (or videos) per forward", ["device"],
                                     buckets=ITEM_BUCKETS, registry=r)
        self.batch_patches = Histogram(f"{PREFIX}_batch_patches", "patches per forward", ["device"],
                                       buckets=PATCH_BUCKETS, registry=r)
        self.batch_fill = Histogram(f"{PREFIX}_batch_fill_ratio", "patches per forward / max_batch_patches",
                                    ["device"], buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0), registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "images waiting for a forward", ["device"], registry=r,
                                 multiprocess_mode="livemostrecent")
        self.queued_patches = Gauge(f"{PREFIX}_queued_patches", "patches waiting for a forward (what requests are "
                                    "balanced on across engines)", ["device"], registry=r,
                                    multiprocess_mode="livemostrecent")
        self.engine_up = Gauge(f"{PREFIX}_engine_up", "1 while the engine is connected and serving", ["device"],
                               registry=r, multiprocess_mode="livemax")
        self.engines = Gauge(f"{PREFIX}_engines", "engine processes configured (one per device): the capacity "
                             "serving is sum(qwen3vl_engine_up) / this", registry=r, multiprocess_mode="livemax")
        self.in_flight = Gauge(f"{PREFIX}_in_flight_requests", "HTTP requests being served", registry=r,
                               multiprocess_mode="livesum")
        self.images = Counter(f"{PREFIX}_images", "images encoded", registry=r)
        self.video_frames = Counter(f"{PREFIX}_video_frames", "video frames encoded", registry=r)
        self.output_tokens = Counter(f"{PREFIX}_output_tokens", "merged visual tokens returned", registry=r)
        self.cache_items = Counter(f"{PREFIX}_embedding_cache_items", "inputs by how they were served: hit (from "
                                   "the cache), shared (an identical input's encoding in flight), miss (encoded)",
                                   ["result"], registry=r)
        self.cache_bytes = Gauge(f"{PREFIX}_embedding_cache_bytes", "bytes held by the embedding cache (shared by "
                                 "the HTTP processes), at the last eviction pass", registry=r,
                                 multiprocess_mode="livemostrecent")
        self.cache_skipped = Counter(f"{PREFIX}_embedding_cache_unwritten", "large results left out of the "
                                     "embedding cache by its write rate (embedding_cache_write_mib_s)", registry=r)
        self.errors = Counter(f"{PREFIX}_errors", "errors by reason", ["reason"], registry=r)
        # a gauge fixed at 1 rather than an Info metric: multiprocess mode has no Info (same series name)
        self.model_info = Gauge(f"{PREFIX}_model_info", "model, dtype, device and attention backend",
                                ["model", "dtype", "device", "attention_backend", "random_weights"], registry=r,
                                multiprocess_mode="max")
        self.gpu_allocated = Gauge(f"{PREFIX}_gpu_memory_allocated_bytes", "torch.cuda.memory_allocated",
                                   ["device"], registry=r, multiprocess_mode="livemostrecent")
        self.gpu_reserved = Gauge(f"{PREFIX}_gpu_memory_reserved_bytes", "torch.cuda.memory_reserved",
                                  ["device"], registry=r, multiprocess_mode="livemostrecent")
        self.compiles_while_serving = Gauge(f"{PREFIX}_kernel_compiles_while_serving", "kernels the engine compiled "
                                            "after its warm-up, each while every request waited", ["device"],
                                            registry=r, multiprocess_mode="livemostrecent")
        # cumulative per engine since it started (a restart starts again from 0; rate() takes that as a reset)
        self.gpu_busy = Gauge(f"{PREFIX}_gpu_busy_seconds", "the GPU's time in forwards since the engine started "
                              "(CUDA events): rate() is the busy fraction", ["device"], registry=r,
                              multiprocess_mode="livemostrecent")
        self.launch_wait = Gauge(f"{PREFIX}_gpu_launch_wait_seconds", "of the GPU's time since the engine started, "
                                 "how long it waited for launches dispatched while it was busy to return: rate() "
                                 "over a few percent means the engine's host side holds the GPU back (CPU-starved)",
                                 ["device"], registry=r, multiprocess_mode="livemostrecent")
        self.loop_lag = Histogram(f"{PREFIX}_event_loop_lag_seconds", "how late an HTTP process's event loop runs "
                                  "what it scheduled (sampled 4 times a second): a saturated front-end shows here first "
                                  "(more HTTP_WORKERS, or fewer requests per front-end)", registry=r,
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5))
        self._max_batch_patches = max_batch_patches

    def sample_engine(self, stats) -> None:
        """Queue depth, device memory and GPU time from an engine's `DeviceStats` (read where the engine runs)."""
        self.queue_depth.labels(stats.device).set(stats.queue_depth)
        self.queued_patches.labels(stats.device).set(stats.queued_patches)
        self.gpu_allocated.labels(stats.device).set(stats.gpu_allocated_bytes)
        self.gpu_reserved.labels(stats.device).set(stats.gpu_reserved_bytes)
        self.compiles_while_serving.labels(stats.device).set(stats.compiles_while_serving)
        self.gpu_busy.labels(stats.device).set(stats.gpu_busy_s)
        self.launch_wait.labels(stats.device).set(stats.launch_wait_s)

    def observe_batch(self, device: str, stats) -> None:
        """One forward's `BatchStats`, on the engine of `device`."""
        self.forward_time.labels(device).observe(stats.forward_s)
        self.batch_items.labels(device).observe(stats.items)
        self.batch_patches.labels(device).observe(stats.patches)
        self.batch_fill.labels(device).observe(min(1.0, stats.patches / self._max_batch_patches))

    def observe_request(self, items, results, queue_s: float) -> None:
        """One served request: its queue time, and the images, video frames and tokens it returned."""
        self.queue_time.observe(queue_s)
        for it, r in zip(items, results):
            if it.kind == "video":
                self.video_frames.inc(len(it.meta["frame_indices"]))
            else:
                self.images.inc()
            self.output_tokens.inc(r.num_tokens)

    def exposition(self) -> bytes:
        """The text for /metrics: this registry, or, with several processes (PROMETHEUS_MULTIPROC_DIR set),
        every process's metrics merged."""
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
