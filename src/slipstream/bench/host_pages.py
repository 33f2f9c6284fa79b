"""An arm that waits keeps the memory its steps churn, so its next step starts as one straight after
another would: lockstep then measures what each arm alone measures.

Why (BENCHMARKS.md, "A verdict that does not depend on how it was measured (issue 33)"): a training
step allocates and frees the same GBs every step (activations, logits, gradients; TRL's DPO step on
SmolLM2 faults in ~2.4 million pages a step). Freed memory goes back to the kernel and the next
allocation takes it again, a page fault per 4 KiB page. On a VM whose balloon reports free pages to the
host, memory freed a few seconds earlier can be handed over meanwhile and fault in from the host when
touched again: a 1.5 GB touch took 0.32-0.42 s straight after a free and 0.75-1.05 s after a 4 s wait
in one probe on a Zen 4 VM (not in another an hour later: the host's reclaim comes and goes). Alone, an
arm's next step starts at once; in lockstep it waits while every other arm trains.

So after each step's clock stops, the arm touches and holds as much memory as its steps took beyond
what it holds at rest (its peak RSS less its RSS now): pages it just freed, still warm, now its own, so
the kernel has nothing of it to hand over while the arm waits. Just before the next step's clock
starts it lets them go, and the step's allocations take them back warm, as straight after a previous
step. Untimed, it costs wall time only (0.2-1.0 s a step for the TRL arms there, nothing for arms that
churn nothing), it never raises the arm's peak RSS (it holds at most what the peak held beyond now),
and it is done in every mode, alone and in lockstep, so both measure the same thing. Its effect on the
figures there was below the machine's drift between runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .ceiling import proc_status_kib

# At most this share of the memory still available is held (the rest stays for the other arms).
MAX_SHARE_OF_AVAILABLE = 0.5


@dataclass(frozen=True)
class Held:
    """One hold: the bytes touched and kept, and its wall time."""

    bytes: int = 0
    seconds: float = 0.0


def churn_bytes() -> int | None:
    """What this process held at its peak beyond what it holds now (VmHWM - VmRSS), capped at a share
    of the memory the machine still has; None where /proc cannot say (not Linux)."""
    try:
        peak = proc_status_kib("VmHWM") * 1024
        now = proc_status_kib("VmRSS") * 1024
        available = proc_status_kib("MemAvailable", path="/proc/meminfo") * 1024
    except OSError:
        return None
    return max(0, min(peak - now, int(available * MAX_SHARE_OF_AVAILABLE)))


class WarmPages:
    """Between two steps: :meth:`hold` after one (untimed), :meth:`release` before the next."""

    def __init__(self) -> None:
        self._block: torch.Tensor | None = None

    def hold(self, nbytes: int | None = None) -> Held:
        """Touch ``nbytes`` (default :func:`churn_bytes`) of memory and keep it until :meth:`release`."""
        self.release()
        if nbytes is None:
            nbytes = churn_bytes() or 0
        started = time.perf_counter()
        if nbytes > 0:
            self._block = torch.empty(nbytes, dtype=torch.uint8)
            self._block.fill_(1)  # a write to every page: each is this process's until released
        return Held(nbytes, time.perf_counter() - started)

    @property
    def held_bytes(self) -> int:
        return 0 if self._block is None else self._block.numel()

    def release(self) -> None:
        """Free what :meth:`hold` kept: the pages go back warm, for the step about to start."""
        self._block = None
