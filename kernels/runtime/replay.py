"""Launch replays: one launch bound once, relaunched with its tensors at new addresses (`Replay`; recorded by
`launcher.Launcher.record`)."""

from __future__ import annotations

import types
from typing import Callable

import torch

import kernels.runtime.triton_internals as internals


class NotReplayable(Exception):
    pass


class Replay:
    """One lean launch, with every argument bound, specialised and expanded once, relaunched straight through the
    kernel's C launcher with its tensors' current addresses.

    What a lean launch still does per call, and a replay does not: the binder (each argument specialised, each tensor
    descriptor's layout printed into its key), the launcher's Python wrapper (each descriptor encoded into a
    CUtensorMap, each tensor's address checked with a driver call). A replay reads one address per role, re-encodes
    a descriptor only where its base moved, and passes addresses as integers. The caller keys replays by everything
    else the launch depends on (shapes, strides, dtypes, scalars, the 16-byte alignment of every address: Triton's
    specialisation) and passes the same roles in the same order; a launch whose arguments hold a tensor outside
    `roles`, or that needs global scratch, is not replayable (NotReplayable).

    `stream(device)`: the current stream's handle; `encode(descriptor, metadata)`: a tensor descriptor's launcher
    arguments (Triton's, by default); `hooked()`: whether a launch hook is installed (then the caller takes the JIT's
    path, which calls it)."""

    def __init__(self, grid, kernel, bound, device, roles, *, stream: Callable = internals.current_stream,
                 encode: Callable | None = None, hooked: Callable[[], bool] = internals.launch_hooks_installed):
        if internals.needs_scratch(kernel):
            raise NotReplayable("needs scratch per launch")
        try:
            c_launch, meta = internals.c_launcher(kernel)
        except internals.Unknown as e:
            raise NotReplayable(str(e)) from None
        self.stream, self.hooked = stream, hooked
        self.encode = encode or internals.make_tensordesc_arg()
        signature = internals.signature(kernel)
        values = list(bound.values())
        if len(signature) != len(values):
            raise NotReplayable("signature and arguments differ in length")
        self.ptr_slots: list[tuple[int, int]] = []  # (position in the launch's arguments, role)
        # [position, role, descriptor, its metadata, (base address, its encoding)]: the pair replaced whole, so a
        # thread never reads one base's address with another's encoding
        self.desc_slots: list[list] = []
        expanded, descs = internals.launch_head(grid, kernel), 0
        for value, ty in zip(values, signature):
            if isinstance(ty, str) and ty.startswith("tensordesc"):
                if meta is None or meta[descs] is None:
                    raise NotReplayable("tensor descriptor without its metadata")
                role, address = _role(value.base, roles), value.base.data_ptr()
                encoded = self.encode(value, meta[descs])
                self.desc_slots.append([len(expanded), role, value, meta[descs], (address, encoded[0])])
                expanded.extend(encoded)
                descs += 1
            elif isinstance(ty, str) and ty.startswith("*"):
                if value is not None:
                    self.ptr_slots.append((len(expanded), _role(value, roles)))
                expanded.append(None if value is None else value.data_ptr())
            elif isinstance(value, torch.Tensor) or isinstance(ty, tuple):
                raise NotReplayable(f"argument of type {ty}")
            else:
                expanded.append(value)
        self.template, self.c_launch, self.device = expanded, c_launch, device

    def __call__(self, addresses) -> bool:
        """Launches on the current stream with the roles' `addresses` (ints, in `roles` order); False, launching
        nothing, where a launch hook is installed (a profiler's: the JIT's path calls it)."""
        if self.hooked():
            return False
        args = self.template.copy()
        args[3] = self.stream(self.device)
        for position, role in self.ptr_slots:
            args[position] = addresses[role]
        for slot in self.desc_slots:
            address, encoded = slot[4]
            if address != addresses[slot[1]]:
                address, desc = addresses[slot[1]], slot[2]
                moved = types.SimpleNamespace(base=_Address(address), shape=desc.shape, strides=desc.strides,
                                              padding=desc.padding)
                encoded = self.encode(moved, slot[3])[0]
                slot[4] = (address, encoded)
            args[slot[0]] = encoded
        self.c_launch(*args)
        return True


class _Address:
    """A tensor descriptor's base as Triton's encoder reads it: only its address."""

    def __init__(self, address: int):
        self.address = address

    def data_ptr(self) -> int:
        return self.address


def _role(tensor, roles) -> int:
    for i, role in enumerate(roles):
        if tensor is role:
            return i
    raise NotReplayable("a tensor outside the caller's roles")
