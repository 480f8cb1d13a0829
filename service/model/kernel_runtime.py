"""The kernels' process-wide runtime, as the engine sets it up: the attention's launch switches, the launcher's lean
path, the tuner's choices (saved with the kernels' source digest and restored at the next start)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import kernels
from kernels.attention import configure as configure_attention
from kernels.runtime import allow_lean_launch, launch_status, restore_choices, tuned_choices
from kernels.runtime import serving as kernels_serving

__all__ = ["allow_lean_launch", "configure_attention", "kernels_serving", "kernels_source_digest", "launch_status",
           "restore_choices", "tuned_choices"]


def kernels_source_digest() -> str:
    """SHA-256 of every kernel source file: tuned choices are kept per digest, so a changed kernel is tuned again."""
    digest = hashlib.sha256()
    for path in sorted(Path(kernels.__file__).parent.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()
