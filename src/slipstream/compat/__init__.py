"""The compatibility sweep's public face: is packed training exact, or refused, on every causal-LM
architecture? (What each piece does: :mod:`slipstream.compat.architectures`'s docstring.) A
correctness tool on the parity kit, so it sits beside it, below the A/B harness.

Its rooms, each one job:

* :mod:`slipstream.parity`: the documents, the stock reference step, an arm's step, the comparison
  and its tolerances (doctor's too);
* :mod:`.arm`: one arm's outcome (pass / refused / WRONG / CRASH), the refusal's advice;
* :mod:`.columns`: the per-speedup columns, in table order;
* :mod:`.prefix_parity`: the prefix-shared pairs, prefix groups and prefix tree checks;
* :mod:`.architectures`: one architecture's verdict, the registry in worker processes;
* :mod:`.render`: ``docs/compatibility.md``.
"""

from __future__ import annotations

from ..parity import LENGTHS, SEED, TOLERANCE, documents, reference
from ..speedups.fused_kernels import SWEEP_BACKENDS as FUSED_BACKENDS
from .architectures import causal_lm_model_types, check_architecture, sweep
from .arm import ArmResult, advice_of, run_arm
from .columns import columns
from .prefix_parity import (
    GROUP_SHAPES,
    GROUP_TOLERANCE,
    PAIR_LENGTHS,
    PAIR_TOLERANCE,
    TREE_ROWS,
    TREE_SPANS,
    check_prefix_groups,
    check_prefix_sharing,
    check_prefix_tree,
    pair_reference,
    preference_pairs,
    prefix_groups,
    prefix_tree,
)
from .render import _cell, render_markdown

__all__ = [
    "FUSED_BACKENDS",
    "GROUP_SHAPES",
    "GROUP_TOLERANCE",
    "LENGTHS",
    "PAIR_LENGTHS",
    "PAIR_TOLERANCE",
    "SEED",
    "TOLERANCE",
    "TREE_ROWS",
    "TREE_SPANS",
    "ArmResult",
    "_cell",
    "advice_of",
    "causal_lm_model_types",
    "columns",
    "check_architecture",
    "check_prefix_groups",
    "check_prefix_sharing",
    "check_prefix_tree",
    "documents",
    "pair_reference",
    "preference_pairs",
    "prefix_groups",
    "prefix_tree",
    "reference",
    "render_markdown",
    "run_arm",
    "sweep",
]
