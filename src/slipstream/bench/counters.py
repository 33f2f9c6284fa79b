"""Counters the clock can't see: host syncs and large allocations, counted at the ATen level.

A device-to-host sync stalls the CPU until the GPU catches up. On a CPU nothing stalls, but
the ops that would sync on a GPU run all the same, so counting them here tells what a GPU run
would pay. Counted through a ``TorchDispatchMode``, which sees every ATen op of forward and
backward (the CPU autograd engine runs backward on the calling thread).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .. import host_reads

# ATen ops that read a device value back to the host (or need its value to size an output).
HOST_SYNC_OPS = frozenset({"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"})


def _op_name(func) -> str:
    # "aten::nonzero" / overload packet name, without the overload suffix.
    return func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else str(func)


class HostSyncCounter(TorchDispatchMode):
    """Count host-syncing ATen calls while active: ``with HostSyncCounter() as syncs: ...``.

    ``syncs.total`` is the number of calls; ``syncs.by_op`` breaks it down.
    """

    def __init__(self, ops: Iterable[str] = HOST_SYNC_OPS):
        super().__init__()
        self.ops = frozenset(ops)
        self.by_op: Counter[str] = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_op.values())

    def __enter__(self):
        # slipstream's deliberate host reads (a CPU tolist is no ATen op) are announced, not seen
        self._unsubscribe = host_reads.subscribe(self._announced)
        return super().__enter__()

    def __exit__(self, *exc):
        self._unsubscribe()
        return super().__exit__(*exc)

    def _announced(self, op: str) -> None:
        self.by_op[op] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = _op_name(func)
        if name in self.ops:
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


class LargeTensorWatch(TorchDispatchMode):
    """Record every ATen output with at least ``min_numel`` elements (to prove no [T, T] tensor exists)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel = min_numel
        self.seen: list[tuple[str, tuple[int, ...]]] = []
        self.largest_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (leaf for leaf in tree_leaves(out) if isinstance(leaf, torch.Tensor)):
            numel = tensor.numel()
            self.largest_numel = max(self.largest_numel, numel)
            if numel >= self.min_numel:
                self.seen.append((_op_name(func), tuple(tensor.shape)))
        return out
