"""The one interface the HTTP layer has to an engine, and the typed values that cross it.

Two engines implement `Engine`: `local.LocalEngine` loads the model in this process (`http_workers=0`), and
`remote.EnginePool` reaches the engine processes, one per device, from an HTTP front-end process.
`factory.open_engine` picks by the settings; nothing above the engine package asks which kind it has.
What of the model crosses to the HTTP layer is re-exported here: `Encoder` (a loaded model, which tests hand a
server; imported when first asked for, so that a front-end process never imports the tower, its kernels and
Triton), `EncodeResult` and `Preprocessed` (the values a request's items become), `result_tensors` (the tensors'
shared output layout), `pack_by_budget` (the server's packing, for the dataset job's Ray actors).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from ..errors import InvalidInput
from ..model.config import TowerConfig
from ..model.preprocess import Preprocessed, Preprocessor
from ..model.results import EncodeResult, pack_by_budget, result_tensors  # noqa: F401 (re-exported)
from ..model.video import is_video
from .sandbox import DecodeSandbox

if TYPE_CHECKING:
    from ..model.encoder import Encoder


def __getattr__(name: str):
    if name == "Encoder":  # the model itself: torch's tower, the kernels, Triton (a front-end needs none of them)
        from ..model import encoder

        return encoder.Encoder
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class ModelInfo:
    """What the API reads of the served model: its config, the preprocessor with the server's limits, device, dtype
    and attention backend. A front-end process gets it from the engine process and holds no weights."""

    config: TowerConfig
    preprocessor: Preprocessor
    device: torch.device
    dtype: torch.dtype
    backend: str
    quantization: str = "none"  # "fp8": the blocks' linear layers in e4m3

    def wire(self) -> dict[str, Any]:
        """The picklable description an engine process sends its front-ends (`from_wire` reads it back)."""
        return {"config": self.config, "preprocess": self.preprocessor.config, "device": str(self.device),
                "dtype": str(self.dtype).removeprefix("torch."), "backend": self.backend,
                "quantization": self.quantization}

    @classmethod
    def from_wire(cls, info: dict[str, Any]) -> "ModelInfo":
        return cls(info["config"], Preprocessor(info["preprocess"]), torch.device(info["device"]),
                   getattr(torch, info["dtype"]), info["backend"], info.get("quantization", "none"))


@dataclass(frozen=True)
class Timing:
    queue_s: float = 0.0  # the longest wait of the request's items for a forward
    inference_s: float = 0.0  # the longest forward that computed one of them
    pack_items: int = 1  # the most items in a pack that computed one of them (1: each went alone)


@dataclass(frozen=True)
class ItemDone:
    """What the batcher answers for one item."""

    result: EncodeResult
    queue_s: float
    inference_s: float
    pack_items: int = 1  # items in the pack that computed it


@dataclass(frozen=True)
class Encoded:
    """What `Engine.submit` returns: one result per submitted item, in order, and the request's timing."""

    results: list[EncodeResult]
    timing: Timing


@dataclass
class DeviceStats:
    """One engine's state, read where it runs (`down`: its process is restarting; the counters are then 0)."""

    device: str
    state: str = "up"
    pid: int | None = None
    restarts: int = 0  # engine processes on this device that died before this one
    queue_depth: int = 0
    queued_patches: int = 0
    in_flight: int = 0
    forwards: int = 0
    gpu_busy_s: float = 0.0
    launch_wait_s: float = 0.0  # of it, how long the GPU waited for launches dispatched while busy (`Batcher`)
    gpu_allocated_bytes: int = 0
    gpu_reserved_bytes: int = 0
    # whether kernel launches take the lean path (`kernels.runtime`; None: no Triton kernel launched, e.g. on the CPU)
    lean_launch: bool | None = None
    # kernels compiled after warm-up, each while every request waited (a specialisation the warm-up missed)
    compiles_while_serving: int = 0


TOTALS = ("queue_depth", "queued_patches", "in_flight", "forwards", "gpu_busy_s", "launch_wait_s", "restarts")


@dataclass
class EngineStats:
    engines: list[DeviceStats] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """Totals over the engines, each engine under `engines`, and `pid` where one engine serves (/info)."""
        body: dict[str, Any] = {k: sum(getattr(e, k) for e in self.engines) for k in TOTALS}
        body["engines"] = [asdict(e) for e in self.engines]
        if len(self.engines) == 1 and self.engines[0].pid is not None:
            body["pid"] = self.engines[0].pid
        return body


@dataclass(frozen=True)
class BatchStats:
    items: int
    patches: int
    forward_s: float
    ok: bool


# on_batch(device, stats): each forward's stats; on_change(device, up): an engine came up or went away
BatchListener = Callable[[str, BatchStats], None]
ChangeListener = Callable[[str, bool], None]


class Engine(Protocol):
    """An engine as the HTTP layer uses it.

    `state` is `starting` until the model is loaded and warm (or, for engine processes, until the first connects),
    `up` while one serves, `restarting` while every engine process is being replaced, and `failed` after a device
    fault in this process (nothing replaces it: the process must be restarted); `alive` is `state == "up"`.
    `model` is None until the model's description is known. `start` returns once the engine serves (local) or at
    once, following the engine processes in the background (pool); `on_change` hears of each device coming up or
    going away. `submit` raises the typed errors of `service.errors`; `stop` answers everything accepted first."""

    state: str
    model: ModelInfo | None

    @property
    def alive(self) -> bool: ...

    @property
    def started(self) -> bool:
        """Start-up is over: every configured engine has been up once (until then the server is not ready)."""

    @property
    def capacity(self) -> tuple[int, int]:
        """(engines serving, engines configured)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def preprocess(self, inputs: list[bytes], min_pixels: int | None = None, max_pixels: int | None = None,
                         fps: float | None = None, num_frames: int | None = None) -> list[Preprocessed]:
        """A request's inputs decoded and resized (an unusable one raises `InvalidInput` with its position)."""

    async def submit(self, items: list[Preprocessed], deadline: float, *, deepstack: bool = True,
                     tokens: bool = True, client: str = "", abandoned: asyncio.Event | None = None) -> Encoded:
        """Encode a request's `items` by `deadline` (`time.monotonic()`; else `DeadlineExceeded`), in whatever
        packs the engine forms. What the request asks for: `deepstack` and `tokens` (the pooled vectors always come
        back), `client` (who sent it: clients take turns in a pack and share the queue), `abandoned` (set when the
        client has gone: its items are dropped before compute). How fast a request alone is served is the engine's
        own policy (`latency.LatencyPolicy`)."""

    async def stats(self) -> EngineStats: ...


class Decoder:
    """Decoding and resizing off the event loop: images in threads, videos in the sandbox where there is one."""

    def __init__(self, workers: int, sandbox: DecodeSandbox | None = None):
        self.sandbox = sandbox
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="preprocess")

    async def __call__(self, pre: Preprocessor, data: bytes, *args) -> Preprocessed:
        if self.sandbox is not None and is_video(data):
            return await self.sandbox.preprocess(pre, data, *args)
        return await asyncio.get_running_loop().run_in_executor(self.pool, pre, data, *args)

    async def all(self, pre: Preprocessor, inputs: list[bytes], *args, inline: bool = False) -> list[Preprocessed]:
        """Every input of a request, decoded concurrently (`inline`: on the calling thread, the event loop, rather
        than the pool's); an unusable one raises with its position."""
        async def one(index: int, data: bytes) -> Preprocessed:
            try:
                return pre(data, *args) if inline else await self(pre, data, *args)
            except InvalidInput as e:
                raise e.at(index) from e.__cause__

        if len(inputs) == 1:
            return [await one(0, inputs[0])]
        return list(await asyncio.gather(*(one(i, data) for i, data in enumerate(inputs))))

    def prepare(self) -> None:
        """Once the server is ready: start what decoding videos needs (`DecodeSandbox.prepare`)."""
        if self.sandbox is not None:
            self.sandbox.prepare()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        if self.sandbox is not None:
            self.sandbox.close()

