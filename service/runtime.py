"""Process-wide state, set once where each kind of process starts (`configure_process`) and once it is ready to serve
(`settle_process`), never by the layers' code.

- `engine`: an engine process (`service.engine.process`), the model and its batcher behind the front-ends;
- `frontend`: an HTTP front-end process (`service.http.app.frontend_app`);
- `local`: the model, its batcher and their callers in one process: the single-process server (`http_workers=0`)
  and `qwen3vl-encoder dataset`.
"""

from __future__ import annotations

import gc
import os
import sys

ROLES = ("engine", "frontend", "local")
# PyTorch's intra-op threads in an engine process: its host work is launches and copies, and PyTorch's default of
# one thread per core, in each of a node's engines and front-ends, would oversubscribe the cores with spinning
# OpenMP workers
ENGINE_TORCH_THREADS = 4
# the interpreter's switch interval where a batcher runs: its forward thread dispatches hundreds of CUDA ops per
# pack, and with the default 5 ms it and the event loop wait that long for the GIL at every hand-off between them
BATCHER_SWITCH_INTERVAL_S = 0.0005
# In the processes that decode (front-ends, the single-process server), blocks of at least this many bytes are mapped
# for themselves and unmapped when freed, and free memory at the heap's top past it goes back to the system: glibc's
# own thresholds grow with each large block freed (up to 32 MiB), and a request's decoded images (megabytes each) then
# stay in the decoding threads' heaps after it (16 MiB keeps them too). Below the threshold a block comes from the
# heap, its pages already faulted in: at 4 MiB a vLLM-layout reply's buffers were mapped and zeroed afresh at every
# reply, three times the CPU it costs at 8 MiB (`benchmarks/bench_reply_malloc.py`). An engine process decodes
# nothing and keeps glibc's thresholds: there a forward's blocks mapped and unmapped at every pack cost a CPU server
# an eighth to a quarter of its throughput (`benchmarks/results/cpu_engine_malloc.json`).
MALLOC_RETURN_BYTES = 8 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def proc_stat(pid: int | str = "self") -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (Linux; `proc(5)`'s field 3 at index 0), or None where
    there is no such file or process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except OSError:
        return None


def process_cpu_s(pid: int | str = "self") -> float | None:
    """The CPU seconds (user and system, every thread) process `pid` has used, where /proc gives them."""
    fields = proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if fields else None


def return_freed_memory(threshold: int = MALLOC_RETURN_BYTES) -> bool:
    """Fix glibc's mmap and trim thresholds at `threshold` (`MALLOC_RETURN_BYTES`), so that what a large request
    decoded goes back to the system when it is freed; whether it could (False: not glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


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
    if role in ("frontend", "local"):  # the processes that decode and reply (an engine does neither)
        return_freed_memory()  # MALLOC_RETURN_BYTES
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
