"""`LocalEngine`: the model in this process. `start` loads and warms it, then its `Batcher` packs the requests into
forwards; decoding runs in threads (videos in the sandbox). It serves the single-process server (`http_workers=0`)
and, behind `process.EngineServer`, each engine process."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

from ..model.encoder import Encoder, bind_thread
from ..model.kernel_runtime import launch_status
from ..model.preprocess import Preprocessed
from ..settings import Settings
from .api import BatchListener, BatchStats, ChangeListener, Decoder, DeviceStats, Encoded, EngineStats, ModelInfo
from .batching import Batcher
from .build import apply_limits, load_encoder, warmup
from .sandbox import video_sandbox

log = logging.getLogger(__name__)


class LocalEngine:
    """The `api.Engine` of a model loaded here. `encoder`: an already loaded model (tests), else loaded by `start`."""

    def __init__(self, settings: Settings, encoder: Encoder | None = None, *, on_batch: BatchListener | None = None,
                 on_change: ChangeListener | None = None, on_fault: Callable[[BaseException], None] | None = None,
                 decodes_videos: bool = True):
        """`decodes_videos`: whether this process decodes videos (in the sandbox, `Settings.video_sandbox`): not an
        engine process behind front-ends, which decode for it."""
        self.settings = settings
        self.encoder = encoder
        self.on_batch, self.on_change, self.on_fault = on_batch, on_change, on_fault
        self.state = "starting"
        self.model: ModelInfo | None = None
        self.batcher: Batcher | None = None
        self._decode = Decoder(settings.preprocess_workers, video_sandbox(settings) if decodes_videos else None)

    @property
    def alive(self) -> bool:
        return self.state == "up"

    @property
    def started(self) -> bool:
        return self.state != "starting"

    @property
    def capacity(self) -> tuple[int, int]:
        return int(self.alive), 1

    async def start(self) -> None:
        """Load the model (unless given), warm it up (`Settings.warmup`), then serve."""
        settings, start = self.settings, time.perf_counter()
        enc = self.encoder if self.encoder is not None else await asyncio.to_thread(load_encoder, settings)
        self.encoder = enc
        apply_limits(enc, settings)
        bind_thread(enc.device)  # the loop's thread launches lone packs (`Batcher.inline_launch`)
        loaded = time.perf_counter()
        if settings.warmup:
            await asyncio.to_thread(warmup, enc, settings)
        log.info("model loaded in %.1f s, warmed up in %.1f s", loaded - start, time.perf_counter() - loaded)
        self._decode.prepare()
        if enc.device.type == "cuda":
            status = launch_status()
            if status["lean"]:
                log.info("kernel launches: the lean path (Triton %s)", status["triton"])
            else:
                log.warning("kernel launches: Triton's own path, slower per launch (Triton %s): %s", status["triton"],
                            status["reason"] or "no Triton kernel launched during warm-up")
        device = str(enc.device)
        on_batch = self.on_batch

        def batch_done(stats: BatchStats) -> None:
            if on_batch is not None:
                on_batch(device, stats)

        def faulted(e: BaseException) -> None:
            # the CUDA context is unusable: this engine serves no more (an engine process exits in `on_fault` and is
            # replaced; a single-process server answers 503 and /ready 503 until it is restarted)
            self.state = "failed"
            if self.on_change is not None:
                self.on_change(device, False)
            if self.on_fault is not None:
                self.on_fault(e)

        self.batcher = Batcher(enc, max_batch_patches=settings.max_batch_patches,
                               max_batch_items=settings.max_batch_items, max_wait_ms=settings.max_wait_ms,
                               max_queue_items=settings.max_queue_items, on_batch=batch_done, on_fault=faulted,
                               trace=settings.forward_trace)
        await self.batcher.start()
        self.model = ModelInfo(enc.config, enc.preprocessor, enc.device, enc.dtype, enc.backend,
                               enc.tower.options.quantization)
        self.state = "up"
        if self.on_change is not None:
            self.on_change(device, True)

    async def stop(self) -> None:
        """Refuse new work and answer everything already accepted."""
        if self.batcher is not None:
            await self.batcher.stop()
        self._decode.close()

    async def preprocess(self, inputs: list[bytes], min_pixels: int | None = None, max_pixels: int | None = None,
                         fps: float | None = None, num_frames: int | None = None) -> list[Preprocessed]:
        """Decode and resize in the pool (videos in the sandbox): this process's loop dispatches the GPU too, so a
        lone request's decoding stays off it."""
        return await self._decode.all(self.encoder.preprocessor, inputs, min_pixels, max_pixels, fps, num_frames)

    async def submit(self, items: list[Preprocessed], deadline: float, **kwargs) -> Encoded:
        return await self.batcher.submit(items, timeout_s=deadline - time.monotonic(), **kwargs)

    async def stats(self) -> EngineStats:
        if self.batcher is None:  # loading
            return EngineStats([DeviceStats(self.settings.resolved_device(), state="down", pid=os.getpid())])
        return EngineStats([self.batcher.stats()])
