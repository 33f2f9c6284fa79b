"""Token ids against a model's vocabulary: the one check ``slipstream train`` (train/preflight.py)
and the A/B (bench/inputs.py) both run before a step, so a tokenizer that is not the model's
fails in one line, the same line, rather than as an index error on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence


def check_ids_in_vocab(
    samples: Iterable[Mapping[str, Sequence[int]]],
    vocab: int,
    source: str,
    error: Callable[[str], Exception] = ValueError,
    advice: str = "",
) -> None:
    """Raise ``error`` naming ``source``, the first sample with an id beyond the model's ``vocab``
    embedding rows and its highest id; ``advice`` (a caller's way out) ends the message."""
    for index, sample in enumerate(samples):
        highest = max(sample["input_ids"], default=0)
        if highest >= vocab:
            raise error(
                f"{source}: sample {index} has token id {highest}, beyond the model's {vocab} embeddings: "
                f"the tokenizer does not belong to this model{advice}"
            )
