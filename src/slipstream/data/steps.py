"""Which bins form each optimizer step: one order for every layout, every arm and ``train``.

A run's rows are packed whole into bins (:func:`.binpack.pack_samples`); each epoch is a seeded
permutation of those bins, and a step takes ``per_step`` of them (``grad_accum x world_size``, so
N ranks at grad_accum G see the batches one process sees at G x N). What a step trains is fixed
here, by the rows' own tokens; a layout (rows sharing a start run once, grouped documents) only
changes how a step's rows run, never which rows a step holds, so the optimisation is the same
whatever the layout (``slipstream train`` and every arm of ``slipstream ab``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable


def steps_per_epoch(num_bins: int, per_step: int) -> int:
    return math.ceil(num_bins / per_step)


def step_order(num_bins: int, per_step: int, seed: int) -> Callable[[int], list[int]]:
    """step -> the indices of the bins it trains (every rank's), epoch after epoch."""
    if num_bins < 1 or per_step < 1:
        raise ValueError(f"step_order: {num_bins} bins, {per_step} a step: both must be at least 1")
    orders: dict[int, list[int]] = {}

    def bins_for(step: int) -> list[int]:
        out = []
        for j in range(per_step):
            epoch, position = divmod(step * per_step + j, num_bins)
            if epoch not in orders:
                order = list(range(num_bins))
                random.Random(seed * 1_000_003 + epoch).shuffle(order)
                orders[epoch] = order
            out.append(orders[epoch][position])
        return out

    return bins_for
