"""Deliberate host reads, announced so counters can count them.

slipstream's own code reads a device value on the host in a few deliberate places (the
loop expert path's one read of the per-expert counts). On a CPU ``Tensor.tolist`` is not an
ATen op a dispatch-mode counter sees, so those reads go through :func:`read_to_host`, which
tells every subscriber (the benchmark harness's ``HostSyncCounter``). This module sits below
every other so the optimizations never import the harness.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_SUBSCRIBERS: list[Callable[[str], None]] = []


def subscribe(listener: Callable[[str], None]) -> Callable[[], None]:
    """Call ``listener(op_name)`` on every announced host read; returns the unsubscribe function."""
    _SUBSCRIBERS.append(listener)
    return lambda: _SUBSCRIBERS.remove(listener)


def read_to_host(tensor: torch.Tensor) -> list:
    """``tensor.tolist()``, announced to every subscriber as one host sync."""
    for listener in list(_SUBSCRIBERS):
        listener("tolist")
    return tensor.tolist()
