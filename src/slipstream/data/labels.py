"""Labels: which tokens the loss learns, and how many.

The lowest layer owns the ignore index, so packing, the losses and the loop all count
the same way. The collator masks each document's first label (no document learns its
first token from the previous one), so a document contributes the labels after its first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

IGNORE_INDEX = -100  # the label cross-entropy ignores


def count_label_tokens(docs: Iterable[Mapping[str, Sequence[int]]]) -> int:
    """The label tokens ``docs`` contribute to the loss, packed or padded (each one's first is masked)."""
    return sum(sum(1 for label in doc["labels"][1:] if label != IGNORE_INDEX) for doc in docs)
