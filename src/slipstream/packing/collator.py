"""PackedCollator: slipstream's packed batches inside the HF Trainer and TRL's SFTTrainer.

The Trainer asks a data collator for a dict of model kwargs; ``PackedCollator`` packs the
features it is given into one row with :func:`collate_packed` and returns that batch's
``model_inputs()``. Everything else stays the Trainer's: its sampler decides which features
share a row, and it counts the label tokens of each optimizer step itself.

How the loss stays token-weighted. For gradient accumulation the Trainer (transformers 5.x)
counts ``num_items_in_batch`` as ``labels[..., 1:] != -100`` summed over every micro-batch of
the step, and the model (or TRL's fused LM head) divides each micro-batch's summed loss by
it. ``collate_packed`` sets the label of each document's first token to -100, so:

- no document learns its first token from the end of the previous one (after the one-token
  shift, the last position of a document targets that -100);
- ``labels[..., 1:]`` drops only a -100 (the row starts a document), so the Trainer's count
  equals ``PackedBatch.num_label_tokens``, the count slipstream's own loop divides by.

Every label token of the step therefore weighs the same, whichever row it was packed into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from .batch import PACKED_BATCH_KWARG, TENSOR_FIELDS, PackedBatch, collate_packed, cut


class PackedInputs(dict):
    """The model kwargs of one :class:`PackedBatch`, as a dict the Trainer can move.

    accelerate's dataloader calls ``.to(device)`` on the batch it yields, and torch's
    ``pin_memory`` calls ``.pin_memory()``. Both act on the PackedBatch once and rebuild the
    kwargs from it, so ``input_ids`` and the metadata the packed attention reads (cu_seqlens)
    are the same tensors, on the same device, copied once.
    """

    @property
    def batch(self) -> PackedBatch:
        return self[PACKED_BATCH_KWARG]

    def to(self, device: torch.device | str, non_blocking: bool | None = None) -> PackedInputs:
        return self._rebuilt(self.batch.to(device, non_blocking=non_blocking), device)

    def pin_memory(self) -> PackedInputs:
        tensors = {name: getattr(self.batch, name) for name in TENSOR_FIELDS}
        pinned = {name: None if t is None else t.pin_memory() for name, t in tensors.items()}
        return self._rebuilt(dataclasses.replace(self.batch, **pinned, _memo={}), None)

    def _rebuilt(self, batch: PackedBatch, device: torch.device | str | None) -> PackedInputs:
        own = batch.model_inputs()
        # Keys a caller added (say num_items_in_batch) travel along, moved if they are tensors.
        extra = {
            key: value.to(device) if device is not None and isinstance(value, torch.Tensor) else value
            for key, value in self.items()
            if key not in own
        }
        return PackedInputs({**extra, **own})


class PackedCollator:
    """Data collator for the HF Trainer / TRL's SFTTrainer: the features of a batch -> one packed row.

    A feature is one of:

    - a document: ``{"input_ids": [...], "labels": [...]}`` (labels optional: every token);
    - a pre-packed bin: ``{"input_ids": [[...], [...]], "labels": [[...], [...]]}``, one list
      per document, as ``slipstream.data.pack_samples`` makes them. With
      ``per_device_train_batch_size=1`` the Trainer then trains on exactly those bins (and a
      ``datasets.Dataset`` stores them as list-of-lists columns the Trainer keeps);
    - a TRL-packed row: flat ``input_ids`` / ``labels`` plus ``seq_lengths``, split back into
      its documents (so packed documents never attend to each other).

    Other keys are ignored, except an ``attention_mask`` with zeros: padding cannot be packed,
    so it is refused rather than trained on. The documents of all features go into one row, in
    order; ``pad_to_multiple_of`` is passed to :func:`collate_packed`.
    """

    def __init__(self, pad_to_multiple_of: int | None = None):
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, features: Sequence[dict[str, Any]]) -> PackedInputs:
        documents = [doc for index, feature in enumerate(features) for doc in _documents(feature, index)]
        batch = collate_packed(documents, pad_to_multiple_of=self.pad_to_multiple_of)
        return PackedInputs(batch.model_inputs())


def _as_list(values: Any) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


def _documents(feature: dict[str, Any], index: int) -> list[dict[str, list[int]]]:
    """The documents one feature holds, each ``{"input_ids", "labels"}``."""
    if "input_ids" not in feature:
        raise KeyError(f"feature {index} has no 'input_ids'")
    mask = feature.get("attention_mask")
    if mask is not None and _has_padding(mask):
        raise ValueError(
            f"feature {index} has padding (zeros in attention_mask); PackedCollator packs documents "
            "without padding: give it the unpadded input_ids"
        )
    input_ids = _as_list(feature["input_ids"])
    labels = _as_list(feature["labels"]) if feature.get("labels") is not None else input_ids
    if input_ids and isinstance(input_ids[0], list | tuple | torch.Tensor):  # a pre-packed bin
        if len(labels) != len(input_ids):
            raise ValueError(f"feature {index}: {len(labels)} label lists for {len(input_ids)} documents")
        return [
            {"input_ids": _as_list(ids), "labels": _as_list(lab)}
            for ids, lab in zip(input_ids, labels, strict=True)
        ]
    seq_lengths = feature.get("seq_lengths")
    if seq_lengths is None:
        return [{"input_ids": input_ids, "labels": labels}]
    seq_lengths = _as_list(seq_lengths)
    if sum(seq_lengths) != len(input_ids) or len(labels) != len(input_ids):
        raise ValueError(
            f"feature {index}: seq_lengths sum to {sum(seq_lengths)}, but it has {len(input_ids)} input_ids "
            f"and {len(labels)} labels"
        )
    return [
        {"input_ids": ids, "labels": doc_labels}
        for ids, doc_labels in zip(cut(input_ids, seq_lengths), cut(labels, seq_lengths), strict=True)
    ]


def _has_padding(mask: Any) -> bool:
    if isinstance(mask, torch.Tensor):
        return not bool(mask.all())
    return any(_has_padding(m) if isinstance(m, list | tuple | torch.Tensor) else m == 0 for m in mask)
