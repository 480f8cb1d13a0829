"""Launch configurations of the attention kernels, and the size classes the tuner keys them by.

Each kernel has its own launch configuration type (`PtrTile`, `GluonTile`: only the fields that kernel reads). Its
candidates are a short named list: the tuner (`kernels.runtime.choose`) times them once per key (kernel, length
class, load class, head dim, dtype, device) and every later call launches the choice. The lists hold the tiles that
won somewhere in the sweeps (docs/PERFORMANCE.md); a tile that never wins is not listed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from .gluon import gluon_available


@functools.lru_cache(maxsize=None)  # called several times per launch, on the host path of small calls
def head_dim_split(head_dim: int) -> tuple[int, int, int]:
    """(D0, D1, DV1): a power-of-two chunk D0 plus, for other head dims, a remainder D1 columns wide
    (the smallest power of two >= 16 covering it) and the pointer kernel's PV remainder DV1 (0, 0, 0
    when head_dim is a power of two).

    The pointer kernel reads the last D1 / DV1 columns of each row; DV1 is at least 64 because Triton 3.6
    on sm90 miscompiles a PV dot whose V operand has rows narrower than 64 columns (out-of-range
    shared-memory accesses, for N = 16 and 32). The Hopper (Gluon) kernel reads a 16-column remainder, in
    place or from K's and V's transposed copy (`remainder.kv_remainder_t`), so 72 costs 64 + 16 lanes in both
    QK^T and PV.
    """
    if head_dim < 16 or head_dim > 256 or head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 in [16, 256]; got {head_dim}")
    d0 = 1 << (head_dim.bit_length() - 1)
    rest = head_dim - d0
    if rest == 0:
        return d0, 0, 0
    if d0 < 64:
        raise ValueError(f"head_dim {head_dim}: non-power-of-two head dims must be > 64")
    d1 = max(16, 1 << (rest - 1).bit_length())
    return d0, d1, max(d1, 64)


def seq_bucket(max_seqlen: int) -> int:
    """Coarse length class for the tuning key: a new image size never re-tunes, a new class may."""
    return 0 if max_seqlen <= 256 else 1 if max_seqlen <= 1024 else 2 if max_seqlen <= 4096 else 3


def load_class(total_tokens: int, heads: int) -> int:
    """Whether a call fills the GPU (1) or not (0), for the tuning key: the best tiles for one 1024-token
    image (128 programs of 128 rows: a fraction of a wave) are slower on 32 images of 784 tokens than
    the best there, and full packs are what the
    service encodes most. 4096 tokens of 16 heads is 512 programs of 128 rows."""
    return int(total_tokens * heads > 4096 * 16)


@functools.lru_cache(maxsize=None)
def remainder_rows(head_dim: int) -> int:
    """R's rows per head (`kv_remainder_t`): K's remainder columns, V's, and a row of ones where the
    remainder leaves a spare accumulator column (72: 8 + 8 + 1; 80: 16 + 16; 0 for powers of two)."""
    d0, w1, _ = head_dim_split(head_dim)
    rem = head_dim - d0
    return 0 if rem == 0 else 2 * rem + int(rem < w1)


@dataclass(frozen=True)
class PtrTile:
    """A launch of the pointer kernel (`pointer.py`): query rows and keys per tile, warps, software-pipeline stages."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class GluonTile:
    """A launch of the Hopper Gluon kernel (`gluon.py`)."""

    block_m: int
    block_n: int
    num_warps: int = 4
    ring: int = 2  # depth of the K/V ring in shared memory
    persistent: int = 0  # programs per SM of the persistent kernel, each with a one-warp loader (0: the plain kernel)
    maxnreg: int = 0  # registers per thread, capped (0: ptxas's choice)
    rem_copy: bool = True  # past a power of two: K's and V's remainder from kv_remainder_t, or read in place
    sum_mma: bool = True  # with the copy: P's row sums from its row of ones, where it has one (72), by the tensor cores


Tile = PtrTile | GluonTile  # what the tuner chooses among and a launch runs


def _ptr(block_m: int, block_n: int, warps: int, stages: int) -> PtrTile:
    return PtrTile(block_m, block_n, warps, stages)


def _gluon(block_m: int, block_n: int, warps: int, ring: int, *, maxnreg: int = 0, rem_copy: bool = False,
           persistent: int = 0) -> GluonTile:
    return GluonTile(block_m, block_n, warps, ring, persistent=persistent, maxnreg=maxnreg, rem_copy=rem_copy)


# The pointer kernel's candidates: they compile correctly on sm90 with Triton 3.6 for every head dim we serve (see
# head_dim_split).
PTR_TILES = (_ptr(128, 64, 4, 3), _ptr(128, 64, 8, 3), _ptr(128, 128, 8, 2), _ptr(64, 64, 4, 3))


def ptr_candidates(head_dim: int) -> list[PtrTile]:
    """The pointer kernel's candidates for `head_dim`; above 128 only 64-wide K tiles (registers: the fp32
    P tile plus a 256-wide accumulator)."""
    return [c for c in PTR_TILES if head_dim <= 128 or c.block_n <= 64]


# The Gluon kernel's candidates per head dim (`ring`: the K/V ring's depth; `persistent`: programs per SM of the
# persistent kernel with a loader warp, whose 8-warp tiles run as two 4-warp partitions; `rem_copy`: past 64, K's
# and V's remainder read from `kv_remainder_t`'s transposed copy rather than in place). Each won a size class:
# at 64 the 128-row tile capped at 128 registers from 1x4096 up and 64/64 three per SM on packs of short
# segments; at 72 128/128 persistent (the copy from 1x4096 up, in place below), 128/64 and 64/64 on short
# segments; at 80 128/64 on 8 warps, and for Qwen2.5-VL's windows (64 tokens and less) 64/64 persistent, two per
# SM (three do not fit at 80).
GLUON_TILES = {
    64: (_gluon(128, 128, 8, 2, maxnreg=128), _gluon(64, 128, 4, 2), _gluon(64, 64, 4, 3, persistent=3),
         _gluon(64, 64, 4, 2)),
    72: (_gluon(128, 128, 8, 2, rem_copy=True, persistent=1), _gluon(128, 128, 8, 2, persistent=1),
         _gluon(128, 64, 8, 2, rem_copy=True), _gluon(128, 64, 8, 2), _gluon(64, 64, 4, 2)),
    80: (_gluon(128, 64, 8, 2), _gluon(64, 128, 4, 2), _gluon(64, 64, 4, 2, persistent=2), _gluon(64, 64, 4, 2)),
}
GLUON_HEAD_DIMS = tuple(GLUON_TILES)


def gluon_candidates(head_dim: int) -> list[GluonTile]:
    """The Gluon kernel's candidates for `head_dim` (none where Gluon's Hopper API is missing)."""
    if head_dim not in GLUON_HEAD_DIMS or not gluon_available():
        return []
    return list(GLUON_TILES[head_dim])


def hopper_candidates(head_dim: int, max_seqlen: int | None = None) -> list[GluonTile]:
    """Every configuration the automatic Hopper path may pick (q, k and v parts of one buffer's rows:
    `gluon.qkv_columns`). With `max_seqlen` up to 1024, none copies the remainder: the copy pays only from 1x4096
    up, and its second launch and descriptor cost host time, which small calls are bound by."""
    own = gluon_candidates(head_dim)
    if max_seqlen is not None and seq_bucket(max_seqlen) < 2:
        own = [c for c in own if not (c.rem_copy and head_dim_split(head_dim)[1])]
    return own
