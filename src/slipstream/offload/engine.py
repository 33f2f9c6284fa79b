"""The stream / event / copy layer the offload schedule runs on, injectable for tests.

``CudaEngine`` is the real one: a side stream for copies, CUDA events as guards (streams wait
on events, the host never blocks). ``RecordingEngine`` runs the same schedule on the CPU,
copying at once, and writes an event log that tests read to prove the ordering.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


class CudaEngine:
    """Copies on a side stream; events guard buffers; nothing here blocks the host."""

    def __init__(self, device: torch.device):
        self.device = device
        with torch.inference_mode(False):  # created outside inference mode: eval can't poison them
            self.copy_stream = torch.cuda.Stream(device=device)

    def compute_stream(self):
        return torch.cuda.current_stream(self.device)

    def new_event(self, name: str):
        return torch.cuda.Event()

    def record(self, event, stream) -> None:
        event.record(stream)

    def wait(self, stream, event) -> None:
        stream.wait_event(event)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream, what: str) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        if src.is_cuda:  # the allocator keeps src until the copy on `stream` is done
            src.record_stream(stream)
        # A host source (a reload from the pinned pool) has no record_stream (aten's is CUDA-only);
        # pinned host memory is tracked by its own caching allocator, which records an event per
        # non-blocking copy, and the pool buffers live as long as the manager anyway.

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, pin_memory=pinned)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        with torch.inference_mode(False):
            return torch.empty(numel, dtype=dtype, device=self.device)

    def mark(self, what: str) -> None:
        """A point in the schedule (logged by the recording engine, free here)."""


@dataclass
class RecordingEngine:
    """CPU stand-in for CudaEngine: same calls, copies done at once, every call logged.

    Log entries are tuples: ("record", event, stream), ("wait", stream, event),
    ("copy", stream, what), ("mark", what).
    """

    log: list[tuple[Any, ...]] = field(default_factory=list)
    copy_stream: str = "copy"
    _events: int = 0

    def compute_stream(self):
        return "compute"

    def new_event(self, name: str):
        self._events += 1
        return f"{name}#{self._events}"

    def record(self, event, stream) -> None:
        self.log.append(("record", event, stream))

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream, event))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream, what: str) -> None:
        dst.copy_(src)
        self.log.append(("copy", stream, what))

    def host_empty(self, numel: int, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def device_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def mark(self, what: str) -> None:
        self.log.append(("mark", what))
