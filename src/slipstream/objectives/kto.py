"""``training.objective: kto``: Kahneman-Tversky optimisation on unpaired rows, as TRL 1.16's
``KTOTrainer`` computes it (:mod:`slipstream.loss.kto`: ``kto`` and ``apo_zero_unpaired``).

Rows are TRL's ``prompt`` / ``completion`` / ``label`` (:mod:`slipstream.data.kto`). A bin is a
micro-batch; when the bins are built each row is given its KL completion by TRL's rotation within
the batch (:mod:`slipstream.packing.kto`), and packed as a pair ``prompt | completion | kl_completion``:
the prompt runs once for both. The KL sequence's log-probs are read from the same forward and
detached (TRL runs a second, ``no_grad`` forward of ``prompt + kl_completion``). Both are exact; which
is faster depends on the prompt's share. Measured (``benchmarks/kto_kl_forward.py``: the qwen3 test preset with
LoRA r8, fp32, 2 busy CPU threads, 8 rows, best of 21, forward + backward), packed against the row
without its KL completion plus a separate ``no_grad`` forward of prompt + KL completion: prompt 128 /
completion 32 tokens 56.4 vs 76.3 ms (1.35x), 48 / 16: 32.0 vs 34.6 ms (1.08x), 32 / 32: 39.8 vs 38.1 ms
(0.96x), 16 / 48: 41.7 vs 35.5 ms (0.85x). The packed row is taken: it wins where the prompt is longer
than about one and a half completions (preference sets' prompts usually are), it runs the prompt once
as the issue asks, and the reference pass is then one forward per bin.

The reference (``preference.reference``: ``precomputed``, one cached pass before step 0, as for DPO,
over completions and KL completions alike; or ``per_step``) and ``preference.prefix_sharing`` are the
preference objectives' (:class:`.pairs.PairObjective`); ``beta`` is ``preference.beta`` (TRL's default
0.1); the ``kto:`` section holds the rest (:class:`KTOSettings`).

Where ours equals TRL's, and where not:

- The KL baseline is per micro-batch, as TRL's: the mean over the micro-batch's rows of the policy's
  minus the reference's summed KL log-probs, detached, averaged over the ranks (TRL's
  ``gather_for_metrics(kl).mean()``), clamped at 0. It equals TRL's where a micro-batch holds the same
  rows in the same order (TRL's batch of ``per_device_train_batch_size`` sequential rows); our bins are
  filled by tokens, so their row counts vary where TRL's batches hold a fixed count.
- The step's loss is the mean over the step's rows (every row weighs the same wherever it was packed);
  TRL takes each micro-batch's ``nanmean`` and averages the micro-batches: the same with one
  micro-batch per step, or micro-batches of equal row counts.
- A bin of a single row is refused (its KL completion would be its own; TRL refuses
  ``per_device_train_batch_size`` 1, though a short last batch slips through there).
- Logged: loss, the desirable and undesirable rows' mean rewards (``beta * (s - s^ref)``), their
  margin, the KL baseline (the row-weighted mean of the micro-batches'), the desirable share. TRL also
  logs mean log-probs, logits and entropy, which need the logits (the chunked loss never builds them).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from tqdm import tqdm

from ..data import PackingReport
from ..data.kto import load_kto_rows
from ..data.prompts import split_prompts
from ..errors import TrainError
from ..fields import Range
from ..loss.kto import KTO_METRICS, clamp_kl, kl_baseline, kto_means, kto_metric_sums, kto_terms
from ..modes import eval_mode
from ..optimize import state_of
from ..packing.kto import collate_kto, kto_counted_tokens, kto_documents, kto_tokens, labels_of, pack_kto
from . import answers as forward
from .base import ObjectiveData, register_objective, split_held_out, tokenizer_refusals
from .evaluation import HeldOut, rank_share
from .pairs import PairObjective

logger = logging.getLogger("slipstream")


@dataclass(frozen=True)
class KTOSettings:
    """The ``kto:`` section (``training.objective: kto``), TRL's ``KTOConfig`` fields of the same names."""

    desirable_weight: Annotated[float, Range(gt=0)] = 1.0  # a desirable row's loss is multiplied by it
    undesirable_weight: Annotated[float, Range(gt=0)] = 1.0
    # "kto": the KL baseline from mismatched completions; "apo_zero_unpaired": none (no KL sequence)
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"


@register_objective
class KTO(PairObjective):
    """KTO rows as pairs of (completion, KL completion); see the module docstring."""

    name = "kto"
    reads = "rows"  # unpaired rows (prompt, completion, label), binned with their KL completions
    prompt_shared_by = "a row's completion and its KL completion"
    metrics = KTO_METRICS

    def __init__(self, config=None, settings=None, kto: KTOSettings | None = None) -> None:
        super().__init__(config, settings)
        self.kto = kto if kto is not None else config.kto
        self.ranks = None  # the run's ranks (before_training): the KL baseline is averaged over them

    @property
    def with_kl(self) -> bool:
        return self.kto.loss_type == "kto"

    @classmethod
    def validate(cls, config, fail) -> None:
        super().validate(config, fail)
        if config.data.step_order != "shuffled":
            fail(
                "data.step_order",
                "training.objective kto: data.step_order histories is for pairs and SFT rows",
            )

    # ------------------------------------------------------------------ rows and bins
    def read(self, tokenizer, info):
        """The rows, binned with their KL completions (TRL's rotation per bin), and the held-out rows."""
        config, kl = self.config, self.with_kl
        max_seq_len, on_bad_row = config.data.max_seq_len, "skip" if config.data.skip_bad_rows else "error"
        load = tokenizer_refusals(
            config,
            lambda path: load_kto_rows(
                path, tokenizer, max_seq_len=max_seq_len, copies=2 if kl else 1, on_bad_row=on_bad_row
            ),
        )

        def pack(rows, what):
            bins = pack_kto(rows, max_seq_len, config.seed, kl=kl)
            alone = sum(len(rows) == 1 for rows in bins)
            if kl and alone:
                raise TrainError(
                    f"{what}: {alone} of {len(bins)} bins hold a single row, whose KL completion would be its own "
                    f"(TRL refuses a batch of 1): raise data.max_seq_len ({max_seq_len}) so every bin holds 2+ "
                    "rows, or set kto.loss_type apo_zero_unpaired (no KL baseline)"
                )
            return bins

        rows, report = load(config.data.path)
        rows, evals = split_held_out(
            config,
            info,
            rows,
            load=load,
            split=lambda rows, fraction, seed, source: split_prompts(
                rows, fraction, seed, source, noun="rows"
            ),
            eval_set=lambda held_out, source: HeldOut(pack(held_out, source), source, len(held_out), "rows"),
            what="KTO rows",
            said=lambda eval_report: eval_report.data.skipped or eval_report.truncated,
        )
        bins = pack(rows, config.data.path)
        if info.is_main:
            desirable = sum(row["label"] for row in rows)
            tqdm.write(
                f"slipstream train: {report.summary()}; {desirable} desirable, {len(rows) - desirable} undesirable"
            )
        # bins are filled by the shared length; unshared, a KL sequence runs its prompt again (and a row may
        # then pass max_seq_len: its slots are its length), as pack_pairs' rows
        unshared = kl and not self.settings.prefix_sharing

        def row_tokens(row):
            return kto_tokens(row, kl) + (len(row["prompt_ids"]) if unshared else 0)

        real = sum(row_tokens(row) for row in rows)
        capacity = sum(max(max_seq_len, sum(row_tokens(row) for row in rows)) for rows in bins)
        packing = PackingReport(len(rows), len(bins), real, capacity, real / capacity)
        logger.info("%s (KTO rows)", packing.summary())
        # the rows as binned (each with its KL completion), what documents() and the token checks read
        return ObjectiveData([row for rows in bins for row in rows], bins, packing, report, evals)

    def documents(self, rows):
        return kto_documents(rows)

    def tokens(self, rows) -> int:
        return kto_counted_tokens(rows)

    def pairs(self, rows) -> int:
        return 0  # rows, not pairs (no pairs/s)

    # ------------------------------------------------------------------ before step 0
    def before_training(self, context):
        """The reference log-probs of every bin's completions and KL completions (``precomputed``: once,
        cached, as DPO's), or per step."""
        self.ranks = context.ranks
        state = state_of(context.base_model)
        self.chunked = state is not None and state.chunked_loss is not None
        self.pair_trees = None  # prompts shared across rows: not yet (validate refuses tree / on)
        if self.settings.reference != "precomputed":
            self.per_step_reference = True
            line = "reference: per_step (a no_grad forward with the adapter off in every step)"
        else:
            line = self._precompute(context)
        kl = (
            "KL baseline per micro-batch from TRL's rotated completions" if self.with_kl else "no KL baseline"
        )
        return f"{line}; kto {self.kto.loss_type}: {kl}"

    def reference_log_probs(self, model, bins, device):
        return [
            forward.reference_sums(
                model, collate_kto(rows, self.settings.prefix_sharing, device), self.chunked, False
            )
            for rows in bins
        ]

    # ------------------------------------------------------------------ the step
    def collate(self, rows, device, prepared=None):
        return collate_kto(rows, self.settings.prefix_sharing, device), prepared, labels_of(rows, device)

    def micro_weight(self, micro) -> int:
        return int(micro[2].numel())

    def ready(self, model, micro):
        batch, reference, labels = micro
        if reference is None and self.per_step_reference:
            reference = forward.reference_sums(model, batch, self.chunked, adapter=True)
        return batch, reference, labels

    def _terms(self, model, micro):
        batch, reference, labels = micro
        policy = forward.answer_sums(model, batch, self.chunked)
        reference = reference.to(policy.device)
        if self.with_kl:
            kl = kl_baseline(policy[1::2].detach(), reference[1::2])
            ranks = self.ranks
            if ranks is not None and ranks.world_size > 1:  # TRL: gather_for_metrics(kl).mean()
                kl = ranks.sum_tensor(kl.reshape(1))[0] / ranks.world_size
            kl = clamp_kl(kl)
            policy, reference = policy[0::2], reference[0::2]
        else:
            kl = torch.zeros((), device=policy.device)
        found = kto_terms(
            policy,
            reference,
            labels,
            kl,
            beta=self.settings.beta,
            desirable_weight=self.kto.desirable_weight,
            undesirable_weight=self.kto.undesirable_weight,
            loss_type=self.kto.loss_type,
        )
        return found, kto_metric_sums(found, labels, kl)

    def micro_batch(self, model, micro, weight):
        found, sums = self._terms(model, micro)
        return found.losses.sum() / weight, sums

    def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return kto_means(metrics)

    def evaluate(self, model, evals, info, device) -> dict[str, float]:
        sums, rows = None, 0
        with eval_mode(model), torch.no_grad():
            for index, counts in rank_share(len(evals.bins), info.rank, info.world_size):
                micro = self.ready(
                    model, self.collate(evals.bins[index], device, self.prepared("eval", index))
                )
                _, found = self._terms(model, micro)
                found = found * (1.0 if counts else 0.0)
                sums = found if sums is None else sums + found
                rows += micro[2].numel() if counts else 0
        both = info.sum_tensor(torch.cat([sums.float(), torch.tensor([float(rows)], device=sums.device)]))
        values = both.tolist()
        metrics = {name: value / values[-1] for name, value in zip(self.metrics, values[:-1], strict=True)}
        return self.finish_metrics(metrics)

    def summary(self, bins, last) -> dict:
        settings = self.settings
        return {
            "kto": {
                "loss_type": self.kto.loss_type,
                "beta": settings.beta,
                "desirable_weight": self.kto.desirable_weight,
                "undesirable_weight": self.kto.undesirable_weight,
                "prefix_sharing": settings.prefix_sharing,
                "reference": settings.reference,
                "rows": sum(len(b) for b in bins),
                "last_step": None if last is None else {k: last[k] for k in self.metrics},
            },
        }
