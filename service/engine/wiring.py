"""How `serve`'s processes find each other (`Wiring`): made by the main process, handed to the front-ends and the
engine processes it starts, kept apart from the operator's `Settings`."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Wiring:
    """`engine_sockets`: where each engine process listens, one per device (a front-end connects to all of them, an
    engine process listens on its own, the only one it is given); `cache_dir`: the embedding cache's directory, shared
    by the front-ends. Empty (`Wiring()`): one process does everything, and makes its own cache directory."""

    engine_sockets: tuple[str, ...] = ()
    cache_dir: str | None = None

    ENV = "QWEN3VL_INTERNAL_WIRING"  # how it reaches the processes uvicorn or multiprocessing spawn

    @property
    def frontend(self) -> bool:
        """Whether this process is a front-end of engine processes (else the model is here)."""
        return bool(self.engine_sockets)

    @property
    def workdir(self) -> str | None:
        """The main process's directory of sockets and markers."""
        return os.path.dirname(self.engine_sockets[0]) if self.engine_sockets else None

    def to_env(self) -> dict[str, str]:
        return {self.ENV: json.dumps(asdict(self))}

    @classmethod
    def from_env(cls, environ=None) -> "Wiring":
        raw = (os.environ if environ is None else environ).get(cls.ENV)
        if not raw:
            return cls()
        data = json.loads(raw)
        return cls(engine_sockets=tuple(data.get("engine_sockets", ())), cache_dir=data.get("cache_dir"))
