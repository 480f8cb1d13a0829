"""`triton_varlen_attention`: checks, kernel and tile choice, launch, and launch plans.

Contract (flash-attention's varlen one): q, k, v are `(total_tokens, heads, head_dim)` views with any token and
head strides and a contiguous last dim, e.g. the three slices of a fused QKV projection, no copies. `cu_seqlens`
int32 `(segments + 1,)` on the device, `max_seqlen` a Python int: the longest segment's length (a larger one only
launches programs that exit at once; a smaller one leaves rows past it unwritten, and where total tokens =
segments * max_seqlen the Gluon kernel takes every segment to be max_seqlen long without reading cu_seqlens, unless
the call says `padded`: rows past the segments are padding, as in a CUDA graph captured for a bucket of tokens).
Every token attends to every token of its own segment (non-causal), never across segments.

Which kernel runs:
- on Hopper, with K and V in the fused QKV layout: the tuner picks among the TMA kernel's tiles (`tma.py`) and, at
  head dims 64, 72 and 80 with q, k and v parts of one buffer's rows, the Gluon kernel's (`gluon.py`), per size
  class (`tiles.py`);
- everywhere else (older GPUs, other layouts, the interpreter): the pointer kernel (`pointer.py`).

Launch plans: the automatic path's one launch per call is recorded (`runtime.Replay`) under a key of everything its
checks and choices read, and replayed on later calls with the same key at the tensors' new addresses. A small
call's time is its host time, and the full path's checks, tuner lookup, descriptors and Triton's binder and
launcher wrapper are most of it (docs/PERFORMANCE.md). Keys hold no tensors; at most PLANS_MAX, then the table
starts over.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton

from ..runtime import cdiv, choose, interpreting, is_hopper, launch, record
from .gluon import REM_WIDTH as GLUON_REM_WIDTH
from .gluon import launch_gluon, qkv_columns
from .pointer import _varlen_attn_fwd
from .reference import check_inputs
from .tiles import (GluonTile, PtrTile, Tile, TmaTile, head_dim_split, hopper_candidates, load_class, ptr_candidates,
                    remainder_rows, seq_bucket)
from .tma import TensorDescriptor, _varlen_attn_fwd_tma, kv_remainder_t, tma_layout_ok

TMA_DESCRIPTORS = ("auto", "host", "device")


@dataclass(frozen=True)
class LaunchOptions:
    """Process-wide launch options (`configure`; the service sets them from its Settings).

    tma_descriptors: where the TMA kernel's K/V descriptors are encoded. Host: TensorDescriptor arguments, which
    Triton's launcher encodes at every call (host time). Device: every program builds its own (GPU time, growing with
    the number of programs); docs/PERFORMANCE.md has both costs. Auto: device descriptors for small calls launched
    eagerly that no plan replays, host ones otherwise (and always under CUDA-graph capture, where host time is paid
    once).
    launch_plans: record each call layout's launch once and replay it (False: every call takes the full path)."""

    tma_descriptors: str = "auto"
    launch_plans: bool = True


_options = LaunchOptions()
# total_tokens * max_seqlen * heads * head_dim up to which `auto` encodes descriptors on the device: 1x1024 d64 is
# 2**30, where host encoding costs more than the kernel's GPU time
DEVICE_DESC_MAX_WORK = 2 * 2**30
_plans: dict[tuple, object] = {}
PLANS_MAX = 256


def configure(*, tma_descriptors: str = "auto", launch_plans: bool = True) -> None:
    """Set the launch options for this process (and forget recorded plans, which were made under the old ones)."""
    global _options
    if tma_descriptors not in TMA_DESCRIPTORS:
        raise ValueError(f"tma_descriptors={tma_descriptors!r}: use one of {TMA_DESCRIPTORS}")
    _options = LaunchOptions(tma_descriptors, bool(launch_plans))
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
        hopper = not isinstance(config, PtrTile)
    else:
        hopper = block_m is None and _tma_default(q) and tma_layout_ok(q, k, v, call.out)
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
    if not isinstance(config, PtrTile) and not tma_layout_ok(call.q, call.k, call.v, call.out):
        raise ValueError("the TMA kernel needs K/V in the fused QKV layout and 16-byte aligned rows and heads in q "
                         "and out")
    head_dim = call.q.shape[2]
    past_power = head_dim - head_dim_split(head_dim)[0]
    if isinstance(config, GluonTile) and (past_power > GLUON_REM_WIDTH or call.columns is None):
        raise ValueError(f"the Gluon kernel needs at most {GLUON_REM_WIDTH} head-dim columns past a power of two, "
                         "and q, k, v as parts of one buffer's rows (the fused QKV layout)")


def _choose_hopper(call: _Call, run, plan: tuple | None) -> TmaTile | GluonTile:
    """The tuner's pick among the TMA and Gluon candidates, timed with the descriptors this call uses: a small call
    with host descriptors spends more host time than GPU time, and the timings would rank launch overhead, not
    tiles."""
    total, heads, head_dim = call.q.shape
    device_desc = _device_descriptors(total * call.max_seqlen * heads * head_dim, plan is not None)
    gluon = call.columns is not None
    key = ("tma", seq_bucket(call.max_seqlen), load_class(total, heads), head_dim, gluon, call.q.dtype, call.q.device)

    def candidates():
        return [_with_descriptors(c, device_desc) for c in hopper_candidates(head_dim, gluon, call.max_seqlen)]
    return _with_descriptors(choose(key, candidates, _replaying(run, plan, call.roles)), device_desc)


def _run_pointer(call: _Call, c: PtrTile):
    q, k, v, out = call.q, call.k, call.v, call.out
    total, heads, head_dim = q.shape
    d0, d1, dv1 = head_dim_split(head_dim)
    launch(
        _varlen_attn_fwd, (cdiv(call.max_seqlen, c.block_m), heads, call.cu_seqlens.numel() - 1), q, k, v, out,
        call.cu_seqlens, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), call.scale, HEAD_DIM=head_dim, D0=d0, REM=d1 > 0, D1=max(d1, 16),
        DV1=max(dv1, 16), BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages)


def _run_hopper(call: _Call, c: TmaTile | GluonTile):
    """One Hopper launch of configuration `c`, after the remainder's copy where it reads one: the tuner then times a
    candidate that reads the copy with the copy, against one that reads the remainder in place."""
    q, k, v, out = call.q, call.k, call.v, call.out
    total, heads, head_dim = q.shape
    d0, d1, _ = head_dim_split(head_dim)
    r_rows = remainder_rows(head_dim)
    gluon = isinstance(c, GluonTile)
    rem = kv_remainder_t(k, v, call.cu_seqlens, call.max_seqlen) if d1 and (not gluon or c.rem_copy) else None
    if gluon:
        launch_gluon(q, out, call.cu_seqlens, call.max_seqlen, call.scale, call.columns, c.block_m, c.block_n,
                     c.num_warps, c.ring, c.maxnreg, rem, r_rows, c.sum_mma, ws=c.persistent, padded=call.padded)
        return
    rem = q if rem is None else rem  # q: a placeholder without a remainder
    if c.device_desc:
        _set_scratch_allocator()
        descs = [None] * 3
    else:
        # R's descriptor only exists where the kernel reads it (None is a constexpr there): each descriptor costs
        # host time at every launch
        descs = [TensorDescriptor(t, [total, heads * head_dim], [t.stride(0), 1], [c.block_n, d0]) for t in (k, v)]
        descs.append(TensorDescriptor(rem, list(rem.shape), [rem.stride(0), 1], [d1, c.block_n]) if d1 else None)
    launch(
        _varlen_attn_fwd_tma, (cdiv(call.max_seqlen, c.block_m), heads, call.cu_seqlens.numel() - 1), q, *descs, out,
        call.cu_seqlens, q.stride(0), q.stride(1), out.stride(0), out.stride(1), call.scale, k, v, rem, k.stride(0),
        v.stride(0), rem.stride(0), total, HEAD_DIM=head_dim, D0=d0, W1=max(d1, 16), HEADS=heads, BLOCK_M=c.block_m,
        BLOCK_N=c.block_n, WS=bool(c.ws), TAIL_IN_LOOP=c.tail_in_loop, DEVICE_DESC=c.device_desc, TAIL_N=c.tail_n,
        Q_TAIL=c.q_tail, SUM_MMA=c.sum_mma, R_ROWS=r_rows, num_warps=c.num_warps, num_stages=c.num_stages)


@functools.lru_cache(maxsize=None)
def _with_descriptors(config: TmaTile | GluonTile, device_desc: bool) -> TmaTile | GluonTile:
    """`config` encoding its descriptors where `device_desc` says; a Gluon configuration as it is (that kernel
    encodes them on the host either way, and a field it ignores would mislead the logged choice)."""
    if isinstance(config, GluonTile) or config.device_desc == device_desc:
        return config
    return dataclasses.replace(config, device_desc=device_desc)


def _device_descriptors(work: int, replayable: bool = False) -> bool:
    """Where `tma_descriptors` is auto: device descriptors for a small eager call that no launch plan will replay
    (a replay encodes host descriptors once, not per call; and device ones need scratch, which replays refuse)."""
    mode = _options.tma_descriptors
    if mode != "auto":
        return mode == "device"
    return not replayable and work <= DEVICE_DESC_MAX_WORK and not torch.cuda.is_current_stream_capturing()


def _scratch(size: int, alignment: int, stream):
    """Global scratch for device-side tensor descriptors, from PyTorch's caching allocator (stream-ordered,
    and taken from the graph pool under CUDA-graph capture)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _set_scratch_allocator():
    """Triton keeps its allocator in a ContextVar, so each thread that launches (the service's engine
    thread, warm-up threads, ...) must set it itself; setting it is a ContextVar write, done per launch."""
    triton.set_allocator(_scratch)


def _tma_default(q) -> bool:
    if interpreting() or not q.is_cuda:
        return False
    return is_hopper(q.device)


def _plan_key(q, k, v, cu_seqlens, max_seqlen: int, softmax_scale, out, padded: bool = False
              ) -> tuple[tuple, list[int]]:
    """A call's plan key and its roles' addresses (q, k, v, out or 0, cu_seqlens): shapes, strides, dtypes, devices,
    k's and v's offsets from q, scalars and every address modulo 16 (Triton specialises pointers on 16-byte
    alignment, and the TMA kernels need it)."""
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
