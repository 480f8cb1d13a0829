"""`triton_varlen_attention`: checks, kernel and tile choice, launch, and launch plans.

Contract (flash-attention's varlen one): q, k, v are `(total_tokens, heads, head_dim)` views with any token and
head strides and a contiguous last dim, e.g. the three slices of a fused QKV projection, no copies. `cu_seqlens`
int32 `(segments + 1,)` on the device, `max_seqlen` a Python int: the longest segment's length (a larger one only
launches programs that exit at once; a smaller one leaves rows past it unwritten, and where total tokens =
segments * max_seqlen the Gluon kernel takes every segment to be max_seqlen long without reading cu_seqlens, unless
the call says `padded`: rows past the segments are padding, as in a CUDA graph captured for a bucket of tokens).
Every token attends to every token of its own segment (non-causal), never across segments.

Which kernel runs:
- on Hopper, at head dims 64, 72 and 80 with q, k and v parts of one buffer's rows (the tower's fused QKV
  projection): the Gluon kernel (`gluon.py`), its tile picked by the tuner per size class (`tiles.py`);
- everywhere else (older GPUs, other head dims and layouts, the interpreter): the pointer kernel (`pointer.py`).

Launch plans: the automatic path's one launch per call is recorded (`runtime.Replay`) under a key of everything its
checks and choices read, and replayed on later calls with the same key at the tensors' new addresses. A small
call's time is its host time, and the full path's checks, tuner lookup, descriptors and Triton's binder and
launcher wrapper are most of it (docs/PERFORMANCE.md). Keys hold no tensors; at most PLANS_MAX, then the table
starts over.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..runtime import cdiv, choose, interpreting, is_hopper, launch, record
from .gluon import REM_WIDTH as GLUON_REM_WIDTH
from .gluon import launch_gluon, qkv_columns
from .pointer import _varlen_attn_fwd
from .reference import check_inputs
from .remainder import hopper_layout_ok, kv_remainder_t
from .tiles import (GluonTile, PtrTile, Tile, gluon_candidates, head_dim_split, hopper_candidates, load_class,
                    ptr_candidates, remainder_rows, seq_bucket)


@dataclass(frozen=True)
class LaunchOptions:
    """Process-wide launch options (`configure`; the service sets them from its Settings).

    launch_plans: record each call layout's launch once and replay it (False: every call takes the full path)."""

    launch_plans: bool = True


_options = LaunchOptions()
_plans: dict[tuple, object] = {}
PLANS_MAX = 256


def configure(*, launch_plans: bool = True) -> None:
    """Set the launch options for this process (and forget recorded plans, which were made under the old ones)."""
    global _options
    _options = LaunchOptions(bool(launch_plans))
    _plans.clear()


def options() -> LaunchOptions:
    return _options


@dataclass
class _Call:
    """One call's tensors and the scalars every kernel's launch derives from them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    scale: float  # softmax scale times log2(e)
    columns: tuple[int, int] | None  # k's and v's heads in q's rows, for the Gluon kernel (`qkv_columns`)
    padded: bool = False  # rows past cu_seqlens[-1] are padding: the segments never fill q

    @property
    def roles(self) -> tuple:
        """The tensors a launch plan substitutes, in `_plan_key`'s address order."""
        return (self.q, self.k, self.v, self.out, self.cu_seqlens)


def triton_varlen_attention(q, k, v, cu_seqlens, max_seqlen, *, softmax_scale=None, seqlens=None, out=None,
                            block_m=None, block_n=None, config: Tile | None = None, padded: bool = False):
    """Triton forward. Returns `out` `(total_tokens, heads, head_dim)` in q's dtype.

    `seqlens` is accepted for signature parity with the fallback and ignored. `block_m`/`block_n` pin the pointer
    kernel's tiles, `config` pins everything (tests, the interpreter and the tile sweep use these).
    """
    plan = None
    if (_options.launch_plans and config is None and block_m is None and block_n is None
            and type(max_seqlen) is int):
        plan, addresses = _plan_key(q, k, v, cu_seqlens, max_seqlen, softmax_scale, out, padded)
        replay = _plans.get(plan)
        if replay:
            if out is None:
                out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
                addresses[3] = out.data_ptr()
            if replay(addresses):
                return out
    call = _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, out, config, padded)
    if config is not None:
        _check_pinned(call, config)
        hopper = isinstance(config, GluonTile)
    else:
        hopper = (block_m is None and call.columns is not None and _hopper_default(q)
                  and hopper_layout_ok(q, k, v, call.out) and bool(gluon_candidates(q.shape[2])))
    if hopper:
        run = functools.partial(_run_hopper, call)
        if config is None:
            config = _choose_hopper(call, run, plan)
    else:
        run = functools.partial(_run_pointer, call)
        if config is None and (block_m is not None or interpreting()):
            # pinned small tiles; stages: shared memory holds K and V tiles of both chunks, per stage
            config = PtrTile(block_m or 32, block_n or 16, 4, 2 if q.shape[2] > 64 else 3)
        if config is None:
            key = ("ptr", seq_bucket(max_seqlen), load_class(q.shape[0], q.shape[1]), q.shape[2], q.dtype, q.device)
            config = choose(key, lambda: ptr_candidates(q.shape[2]), _replaying(run, plan, call.roles))
    _run_and_plan(run, config, plan, call.roles)
    return call.out


def _prepare(q, k, v, cu_seqlens, max_seqlen, softmax_scale, out, config, padded) -> _Call:
    check_inputs(q, k, v, cu_seqlens, max_seqlen)
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {q.dtype}; expected float16, bfloat16 or float32")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim; strides {t.stride()}")
    head_dim_split(q.shape[2])  # raises for head dims no kernel takes
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    elif out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a contiguous last dim; got "
                         f"{out.dtype} {tuple(out.shape)} on {out.device}, strides {out.stride()}")
    scale = (softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5) * math.log2(math.e)
    # found once per call, only where a Gluon configuration may run
    columns = qkv_columns(q, k, v) if config is None or isinstance(config, GluonTile) else None
    return _Call(q, k, v, out, cu_seqlens, max_seqlen, scale, columns, padded)


def _check_pinned(call: _Call, config: Tile):
    if isinstance(config, PtrTile):
        return
    if not hopper_layout_ok(call.q, call.k, call.v, call.out):
        raise ValueError("the Gluon kernel needs half-precision K/V in the fused QKV layout and 16-byte aligned rows "
                         "and heads in q and out")
    head_dim = call.q.shape[2]
    past_power = head_dim - head_dim_split(head_dim)[0]
    if past_power > GLUON_REM_WIDTH or call.columns is None:
        raise ValueError(f"the Gluon kernel needs at most {GLUON_REM_WIDTH} head-dim columns past a power of two, "
                         "and q, k, v as parts of one buffer's rows (the fused QKV layout)")


def _choose_hopper(call: _Call, run, plan: tuple | None) -> GluonTile:
    """The tuner's pick among the Gluon candidates for this call's size class."""
    total, heads, head_dim = call.q.shape
    key = ("gluon", seq_bucket(call.max_seqlen), load_class(total, heads), head_dim, call.q.dtype, call.q.device)
    return choose(key, lambda: hopper_candidates(head_dim, call.max_seqlen), _replaying(run, plan, call.roles))


def _run_pointer(call: _Call, c: PtrTile):
    q, k, v, out = call.q, call.k, call.v, call.out
    total, heads, head_dim = q.shape
    d0, d1, dv1 = head_dim_split(head_dim)
    launch(
        _varlen_attn_fwd, (cdiv(call.max_seqlen, c.block_m), heads, call.cu_seqlens.numel() - 1), q, k, v, out,
        call.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), call.scale, HEAD_DIM=head_dim, D0=d0, REM=d1 > 0, D1=max(d1, 16),
        DV1=max(dv1, 16), BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)


def _run_hopper(call: _Call, c: GluonTile):
    """One launch of the Gluon kernel, after the remainder's copy where it reads one: the tuner then times a
    candidate that reads the copy with the copy, against one that reads the remainder in place."""
    head_dim = call.q.shape[2]
    rem = None
    if head_dim_split(head_dim)[1] and c.rem_copy:
        rem = kv_remainder_t(call.k, call.v, call.cu_seqlens, call.max_seqlen)
    launch_gluon(call.q, call.out, call.cu_seqlens, call.max_seqlen, call.scale, call.columns, c.block_m, c.block_n,
                 c.num_warps, c.ring, c.maxnreg, rem, remainder_rows(head_dim), c.sum_mma, ws=c.persistent,
                 padded=call.padded)


def _hopper_default(q) -> bool:
    if interpreting() or not q.is_cuda:
        return False
    return is_hopper(q.device)


def _plan_key(q, k, v, cu_seqlens, max_seqlen: int, softmax_scale, out, padded: bool = False
              ) -> tuple[tuple, list[int]]:
    """A call's plan key and its roles' addresses (q, k, v, out or 0, cu_seqlens): shapes, strides, dtypes, devices,
    k's and v's offsets from q, scalars and every address modulo 16 (Triton specialises pointers on 16-byte
    alignment, and the Gluon kernel's descriptors need it)."""
    q_ptr, k_ptr, v_ptr, cu_ptr = q.data_ptr(), k.data_ptr(), v.data_ptr(), cu_seqlens.data_ptr()
    out_ptr = 0 if out is None else out.data_ptr()
    key = (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype, v.dtype, q.device,
           k_ptr - q_ptr, v_ptr - q_ptr, q_ptr % 16, cu_seqlens.shape, cu_seqlens.dtype, cu_seqlens.device,
           cu_ptr % 16, max_seqlen, softmax_scale, padded,
           None if out is None else (out.shape, out.stride(), out.dtype, out.device, out_ptr % 16))
    return key, [q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr]


def _replaying(run, plan: tuple | None, roles: tuple):
    """`run` as the tuner times it: where this call will be planned, each candidate through its own replay, so that
    small calls are ranked by what later calls cost (their host time a replay's, not the full path's)."""
    if plan is None:
        return run
    replays: dict[Tile, object] = {}
    addresses = [t.data_ptr() for t in roles]

    def timed(c: Tile):
        replay = replays.get(c)
        if replay is None:  # not recorded yet, or its first launch compiled through the JIT
            replays[c] = record(lambda: run(c), roles)
        elif replay is False or not replay(addresses):
            run(c)
    return timed


def _run_and_plan(run, config: Tile, plan: tuple | None, roles: tuple):
    """`run(config)`, recorded for `plan` (a key from `_plan_key`) the first time the key launches lean: the
    recorded launch, or False where it cannot be replayed (e.g. two launches: the remainder's copy and its reader)."""
    if plan is None or plan in _plans:
        run(config)
        return
    replay = record(lambda: run(config), roles)
    if replay is not None:
        if len(_plans) >= PLANS_MAX:
            _plans.clear()
        _plans[plan] = replay
