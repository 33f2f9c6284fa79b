"""Bin packing: samples into rows of at most ``max_seq_len`` tokens, with little room left over.

Best-fit-decreasing: longest samples first, each into the open bin it fills most tightly,
found by bisecting a sorted list of ``(room left, bin index)``. Ties in length are broken by
a seeded shuffle before a stable sort, and the bins are shuffled at the end, so one seed
always gives the same bins and another seed a different order. A sample longer than a bin
is truncated or split into chunks, as asked, and counted: nothing is dropped silently.

``strategy="sequential"`` is the other common way to fill a token budget: the samples in a
seeded random order, each bin closed when the next sample does not fit. It packs less
tightly, and unlike best-fit-decreasing it does not gather samples of similar length into
the same bin, which is how padded training sees its batches (the A/B harness uses it to give
the padded arm realistic batches).
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .labels import count_label_tokens

Overflow = Literal["truncate", "split"]
OVERFLOW_POLICIES: tuple[str, ...] = ("truncate", "split")
STRATEGIES: tuple[str, ...] = ("bfd", "sequential")

Sample = dict[str, Any]  # at least "input_ids" and "labels", lists of the same length


@dataclass
class PackingReport:
    """How full the bins are, and what was cut to make the samples fit."""

    num_samples: int  # samples given, before any split
    num_bins: int
    real_tokens: int  # tokens placed in bins
    capacity: int  # num_bins * max_seq_len
    efficiency: float  # real_tokens / capacity
    truncated: int = 0  # samples cut to max_seq_len
    tokens_truncated: int = 0  # tokens those cuts removed
    split: int = 0  # samples cut into chunks
    chunks_from_splits: int = 0  # chunks those samples became
    no_labels: int = 0  # pieces left out: after the cut, no label is left to train on

    def summary(self) -> str:
        line = (
            f"packed {self.num_samples} samples into {self.num_bins} bins: {self.real_tokens} of "
            f"{self.capacity} token slots used ({self.efficiency:.1%})"
        )
        if self.truncated:
            line += f"; {self.truncated} truncated ({self.tokens_truncated} tokens dropped)"
        if self.split:
            line += f"; {self.split} split into {self.chunks_from_splits} chunks"
        if self.no_labels:
            line += f"; {self.no_labels} left out with no label to train on (all prompt after the cut)"
        return line


def pack_samples(
    samples: Sequence[Sample],
    max_seq_len: int,
    seed: int = 0,
    overflow: Overflow = "truncate",
    strategy: str = "bfd",
) -> tuple[list[list[Sample]], PackingReport]:
    """Group ``samples`` into bins of at most ``max_seq_len`` tokens; see the module docstring."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    if overflow not in OVERFLOW_POLICIES:
        raise ValueError(f"overflow={overflow!r}: expected one of {', '.join(OVERFLOW_POLICIES)}")
    if max_seq_len < 1:
        raise ValueError(f"max_seq_len={max_seq_len}: must be at least 1")
    report = PackingReport(num_samples=len(samples), num_bins=0, real_tokens=0, capacity=0, efficiency=0.0)
    pieces = _fit_to_length(samples, max_seq_len, overflow, report)

    rng = random.Random(seed)
    rng.shuffle(pieces)  # a seeded order among equal lengths, kept by the stable sort
    if strategy == "sequential":
        bins = _fill_in_order(pieces, max_seq_len)
    else:
        bins = best_fit_decreasing(pieces, max_seq_len)
        rng.shuffle(bins)

    report.num_bins = len(bins)
    report.real_tokens = sum(len(piece["input_ids"]) for piece in pieces)
    report.capacity = len(bins) * max_seq_len
    report.efficiency = report.real_tokens / report.capacity if report.capacity else 0.0
    return bins, report


def _fill_in_order(pieces: list[Sample], max_seq_len: int) -> list[list[Sample]]:
    bins: list[list[Sample]] = [[]]
    room = max_seq_len
    for piece in pieces:
        length = len(piece["input_ids"])
        if length > room:
            bins.append([])
            room = max_seq_len
        bins[-1].append(piece)
        room -= length
    return [b for b in bins if b]


def _tokens(piece: Sample) -> int:
    return len(piece["input_ids"])


def best_fit_decreasing(pieces: Sequence[Any], capacity: int, size=_tokens) -> list[list[Any]]:
    """``pieces`` (of ``size(piece)`` tokens each, none over ``capacity``) into bins of ``capacity``:
    largest first, each into the open bin it fills most tightly (a stable sort: equal sizes keep
    the order given)."""
    pieces = sorted(pieces, key=size, reverse=True)
    bins: list[list[Any]] = []
    rooms: list[tuple[int, int]] = []  # (room left, bin index) of bins with room, ascending
    for piece in pieces:
        length = size(piece)
        slot = bisect.bisect_left(rooms, (length, -1))  # the tightest bin the piece fits in
        if slot < len(rooms):
            room, index = rooms.pop(slot)
        else:
            room, index = capacity, len(bins)
            bins.append([])
        bins[index].append(piece)
        if room > length:
            bisect.insort(rooms, (room - length, index))
    return bins


def _fit_to_length(
    samples: Sequence[Sample], max_seq_len: int, overflow: str, report: PackingReport
) -> list[Sample]:
    """Samples no longer than ``max_seq_len``: longer ones truncated or split, and counted.

    A piece with no label left after its first token (which the collator masks: no document
    learns its first token from the previous one) would add nothing but a zero to the loss,
    and a step of only such pieces none at all: it is left out and counted.
    """
    pieces = []
    for index, sample in enumerate(samples):
        input_ids, labels = sample["input_ids"], sample["labels"]
        length = len(input_ids)
        if length != len(labels) or length == 0:
            raise ValueError(f"sample {index}: needs as many labels as input_ids, and at least one token")
        if length <= max_seq_len:
            pieces.append(sample)
        elif overflow == "truncate":
            pieces.append({**sample, "input_ids": input_ids[:max_seq_len], "labels": labels[:max_seq_len]})
            report.truncated += 1
            report.tokens_truncated += length - max_seq_len
        else:
            starts = range(0, length, max_seq_len)
            pieces += [
                {**sample, "input_ids": input_ids[s : s + max_seq_len], "labels": labels[s : s + max_seq_len]}
                for s in starts
            ]
            report.split += 1
            report.chunks_from_splits += len(starts)
    trainable = [piece for piece in pieces if count_label_tokens([piece])]
    report.no_labels = len(pieces) - len(trainable)
    return trainable
