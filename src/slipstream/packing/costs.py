"""The figures the per-document SDPA path's ``auto`` choices rest on, built in or measured here.

Two ``auto`` rules of the ``slipstream_docwise`` backend are cost models whose constants are timings:

- attention grouping (:mod:`.grouping`): a call's fixed cost, a score element's cost per head and
  head dimension, an element moved by the gather and scatter;
- the short-document kernel (:mod:`.short_attention`): the longest document (or group) it is faster
  than SDPA's CPU flash kernel for, per dtype (0: never).

:data:`BUILTIN` holds what one 2-core Xeon (AMX) VM measured; every CPU differs (an AVX2-only EPYC
runs fp32 and has no bf16 tile unit at all), so on a CPU ``optimize`` gives each model the figures
:mod:`.calibration` measured on this device, dtype and thread count (a few seconds, once, cached),
and :data:`BUILTIN` stays the rule where nothing was measured (CUDA, where neither rule applies,
and direct calls such as the tests').
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class AttentionCosts:
    """The cost model's constants and the short kernel's reach, and where they come from."""

    call_seconds: float  # one SDPA call, forward + backward, beyond its FLOPs
    score_seconds: float  # one score element, per head and head dimension, forward + backward
    gather_seconds: float  # one element of q, k, v or the output moved to / from the groups
    # the longest document the short kernel takes, by dtype name; a dtype not named: 0 (never)
    short_max_len: tuple[tuple[str, int], ...] = ()
    source: str = "built in"
    figures: dict = field(default_factory=dict, compare=False, hash=False)  # what was timed (doctor shows it)

    def short_limit(self, dtype: torch.dtype) -> int:
        """The longest document (or padded group) the short kernel takes in ``dtype`` (0: none)."""
        return dict(self.short_max_len).get(str(dtype).removeprefix("torch."), 0)


# One 2-core Xeon (AMX), fp32, 2 threads (grouping); its bf16 / fp16 crossover (short kernel).
BUILTIN = AttentionCosts(
    call_seconds=1.0e-4,
    score_seconds=1.5e-10,
    gather_seconds=6.0e-10,
    short_max_len=(("bfloat16", 160), ("float16", 160)),
    source="built in (measured on one 2-core Xeon with AMX)",
)

# Per attention-module costs (weak keys, beside GROUPING_CHOICE): set by optimize; a module without
# an entry uses BUILTIN.
ATTENTION_COSTS: weakref.WeakKeyDictionary[torch.nn.Module, AttentionCosts] = weakref.WeakKeyDictionary()
