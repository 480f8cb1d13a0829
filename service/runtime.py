"""Process-wide state, set once where each kind of process starts (`configure_process`) and once it is ready to serve
(`settle_process`), never by the layers' code.

- `engine`: an engine process (`service.engine.process`), the model and its batcher behind the front-ends;
- `frontend`: an HTTP front-end process (`service.http.app.frontend_app`);
- `local`: the model, its batcher and their callers in one process: the single-process server (`http_workers=0`)
  and `qwen3vl-encoder dataset`.
"""

from __future__ import annotations

import gc
import sys

ROLES = ("engine", "frontend", "local")
# PyTorch's intra-op threads in an engine process: its host work is launches and copies, and PyTorch's default of
# one thread per core, in each of a node's engines and front-ends, would oversubscribe the cores with spinning
# OpenMP workers
ENGINE_TORCH_THREADS = 4
# the interpreter's switch interval where a batcher runs: its forward thread dispatches hundreds of CUDA ops per
# pack, and with the default 5 ms it and the event loop wait that long for the GIL at every hand-off between them
BATCHER_SWITCH_INTERVAL_S = 0.0005


def configure_process(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown process role {role!r}: one of {ROLES}")
    import torch

    if role == "engine":
        torch.set_num_threads(ENGINE_TORCH_THREADS)
    elif role == "frontend":
        # a front-end's parallelism is its decoding threads and its sibling processes: PyTorch's ops on reply
        # tensors run on the calling thread, not on an OpenMP team per process (one per core, in up to 64 of them)
        torch.set_num_threads(1)
    if role in ("engine", "local"):
        sys.setswitchinterval(BATCHER_SWITCH_INTERVAL_S)
    if role in ("frontend", "local"):
        # `torch.save` of vLLM's features (`http.output.torch_saved`) without the zip records' CRC-32s, which
        # `torch.load` does not need and which take most of the time of saving; nothing else here saves with torch
        torch.serialization.set_crc32_options(False)


def settle_process() -> None:
    """Once a serving process has loaded what it serves with (the model, its kernels and graphs, the web stack):
    collect start-up's garbage, then move everything left out of the garbage collector's generations (`gc.freeze`).
    A full collection while serving then walks only what serving made. Otherwise each one walks the hundreds of
    thousands of objects start-up left (the model, torch, Triton), a pause of a tenth of a second or more of the
    engine's event loop and forward thread in the middle of traffic (docs/PERFORMANCE.md, "Soak")."""
    gc.collect()
    gc.freeze()
