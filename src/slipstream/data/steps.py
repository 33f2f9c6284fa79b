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
from collections.abc import Callable, Sequence
from typing import Any

from .binpack import _tokens, best_fit_decreasing


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


# ``data.step_order``: how a run's rows become steps. "shuffled": the rows packed best-fit into bins,
# each epoch a seeded permutation of the bins (above). "histories": rows that share a history (the same
# first tokens: a conversation's rows, one per turn; a prompt's answers) go into the same step, so the
# step can run what they share once (``data.share_prefixes``); each epoch a seeded permutation of those
# steps. Either order is the one plan of a run: every layout, every arm of ``slipstream ab`` takes it.


def _row_key(row: dict) -> tuple[list[int], list[int]]:
    return list(row["input_ids"]), list(row["labels"])


def history_steps(
    pieces: Sequence[dict],
    max_seq_len: int,
    per_step: int,
    size: Callable[[dict], int] = _tokens,
    key: Callable[[dict], Any] = _row_key,
) -> tuple[list[list[dict]], list[list[int]]]:
    """Rows (each at most ``max_seq_len`` tokens) in the order of their tokens (rows that share a
    history are neighbours there), cut into steps of at most ``per_step`` bins: a step takes the next
    row while its rows still pack best-fit into ``per_step`` bins. Returns the bins (each step's
    together) and, per step, its bins' indices. Only the last step may hold fewer bins. Preference
    pairs: ``size`` their packed tokens, ``key`` their prompt then answers."""
    if per_step < 1:
        raise ValueError(f"history_steps: {per_step} bins a step: must be at least 1")
    capacity = per_step * max_seq_len
    steps: list[list[dict]] = []
    current: list[dict] = []
    tokens = 0

    def fits(rows: list[dict], total: int) -> bool:
        if total > capacity:
            return False
        # best-fit can need more bins than the tokens do: checked once the step is nearly full
        return (
            total <= capacity - max_seq_len or len(best_fit_decreasing(rows, max_seq_len, size)) <= per_step
        )

    for row in sorted(pieces, key=key):  # a stable sort: rows with equal keys keep their order
        length = size(row)
        if current and not fits([*current, row], tokens + length):
            steps.append(current)
            current, tokens = [], 0
        current.append(row)
        tokens += length
    if current:
        steps.append(current)
    bins: list[list[dict]] = []
    blocks: list[list[int]] = []
    for rows in steps:
        packed = best_fit_decreasing(rows, max_seq_len, size)
        blocks.append(list(range(len(bins), len(bins) + len(packed))))
        bins += packed
    return bins, blocks


def block_order(blocks: Sequence[Sequence[int]], seed: int) -> Callable[[int], list[int]]:
    """step -> the bin indices it trains, when the steps are fixed blocks of bins (``histories``): each
    epoch a seeded permutation of the blocks."""
    if not blocks:
        raise ValueError("block_order: no steps")
    block_for = step_order(len(blocks), 1, seed)  # each step one block, in step_order's permutations
    return lambda step: list(blocks[block_for(step)[0]])
