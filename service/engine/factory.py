"""The engine the settings name (`open_engine`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..settings import Settings
from .api import BatchListener, ChangeListener, Decoder, Engine
from .remote import EnginePool
from .sandbox import video_sandbox
from .supervisor import started_marker
from .wiring import Wiring

if TYPE_CHECKING:
    from ..model.encoder import Encoder


def open_engine(settings: Settings, wiring: Wiring = Wiring(), encoder: Encoder | None = None, *,
                on_batch: BatchListener | None = None, on_change: ChangeListener | None = None) -> Engine:
    """In a front-end process (`wiring.frontend`), the pool of engine processes; else the model in this process
    (`encoder`: already loaded, else loaded by `start`)."""
    if wiring.frontend:
        decoder = Decoder(settings.preprocess_workers, video_sandbox(settings))
        sockets = list(wiring.engine_sockets)
        return EnginePool.of(sockets, settings.resolved_devices(), decoder,
                             shared_memory_bytes=(settings.shared_memory_mib << 20) // len(sockets),
                             on_batch=on_batch,
                             on_change=on_change, started_marker=started_marker(sockets[0]))
    from .local import LocalEngine  # the model in this process: a front-end never imports it

    return LocalEngine(settings, encoder, on_batch=on_batch, on_change=on_change)
