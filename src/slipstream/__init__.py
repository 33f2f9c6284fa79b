"""slipstream: faster LoRA / QLoRA fine-tuning of Hugging Face causal LMs, proven by A/B.

The public API::

    import slipstream
    batch = slipstream.collate_packed(samples)       # list of {"input_ids": [...], "labels": [...]}
    model = slipstream.optimize(model, packed_attention=True)   # the same model, changed in place
    out = model(**batch.model_inputs())              # out.loss: token-weighted mean over all docs

- ``collate_packed``: documents into one row, metadata (position_ids, cu_seqlens,
  max_seqlen) built once on the host; returns a ``PackedBatch``.
- ``optimize``: each speedup a toggle whose other arm is the stock path.
- ``Speedups``: every toggle as one typed, validated dataclass (what ``optimize`` takes).
- ``state_of(model)``: what slipstream attached to a model (``model.slipstream``), with ``undo()``.
- ``PackedBatch``: the batch and its metadata; ``model_inputs()`` gives the model kwargs.
- ``PackedCollator``: the same packing as a data collator for the HF Trainer and TRL's
  SFTTrainer (the loss stays token-weighted under their gradient accumulation).
- ``load_for_qlora``: a local model with NF4 linear layers and, for MoE models, NF4 experts.
- ``export_merged(run_dir, out, dtype=None, checkpoint=None)``: a run's adapter merged into its
  base, written as a plain transformers directory and checked against base + adapter first.
- ``generate(run_dir, prompts)``: the answers of a trained run's model (base + adapter), greedy
  by default (``slipstream generate`` on the command line).
"""

from ._version import __version__
from .export import export_merged
from .generation import generate
from .models.qlora import load_for_qlora
from .optimize import optimize, state_of
from .packing import PackedBatch, PackedCollator, collate_packed
from .speedups import Speedups

__all__ = [
    "PackedBatch",
    "PackedCollator",
    "Speedups",
    "__version__",
    "collate_packed",
    "export_merged",
    "generate",
    "load_for_qlora",
    "optimize",
    "state_of",
]
