"""``training.objective: sft``: next-token loss on packed documents, every label token weighing the same.

Rows are SFT samples (``data.load_samples``, or the built-in demo rows), packed best-fit
decreasing into bins; a micro-batch is a ``PackedBatch``'s model inputs and its label-token
count. Each micro-batch's summed loss is divided by the label tokens of the whole step
(``num_items_in_batch``), so the step's loss is that of one big batch. Nothing runs before
step 0; the eval loss is the token-weighted loss of the held-out samples (``train.evaluation``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from ..data import DataError, demo_samples, load_samples, pack_samples
from ..data.labels import count_label_tokens
from ..data.prefix_groups import decide_sharing, group_rows, pack_shared, unshared_tokens
from ..packing import collate_packed
from ..packing.groups import collate_groups, group_documents
from ..train.errors import TrainError
from ..train.evaluation import EvalSet, eval_set, evaluate, split_rows
from ..train.preflight import check_labels_left
from .base import Objective, ObjectiveData, register_objective, split_held_out

logger = logging.getLogger("slipstream")


@register_objective
class SFT(Objective):
    name = "sft"
    reads = "samples"
    metrics = ("loss",)

    @classmethod
    def validate(cls, config, fail) -> None:
        if config.data.share_prefixes == "on":
            if config.speedups.packed_attention is False:
                fail(
                    "data.share_prefixes",
                    "data.share_prefixes on needs the packed attention (a row's own tokens attend to a start "
                    "another row holds): set speedups.packed_attention true, or data.share_prefixes off",
                )
            if config.speedups.chunked_loss is False:
                fail(
                    "data.share_prefixes",
                    "data.share_prefixes on needs the chunked loss (it reads a row's first target across the "
                    "shared start): set speedups.chunked_loss true (or leave it out), or data.share_prefixes off",
                )

    # ------------------------------------------------------------------ rows and bins
    def samples(self, tokenizer, path: str | None = None):
        """The samples of the training data (``path`` None), or of another file read the same way."""
        config = self.config
        if path is None and config.data.path is None:
            samples = demo_samples(
                tokenizer,
                num_rows=config.data.demo_rows,
                seed=config.seed,
                response_only=config.data.response_only,
            )
            return samples, None
        path = config.data.path if path is None else path
        try:
            samples, report = load_samples(
                path,
                tokenizer,
                response_only=config.data.response_only,
                on_bad_row="skip" if config.data.skip_bad_rows else "error",
                cache=config.data.cache,
            )
        except ValueError as error:  # the tokenizer cannot do what the data asks (no chat template, say)
            if isinstance(error, DataError):
                raise
            where = config.model.path or f"model.preset {config.model.preset}"
            raise TrainError(f"{path}: {error} (the tokenizer of {where})") from None
        if not samples:
            raise TrainError(f"{path}: no usable rows ({report.summary()})")
        return samples, report

    def _eval_set(self, samples: list[dict], source: str) -> EvalSet:
        config = self.config
        return eval_set(
            samples,
            source,
            max_seq_len=config.data.max_seq_len,
            seed=config.seed,
            overflow=config.data.overflow,
        )

    def read(self, tokenizer, info) -> ObjectiveData:
        """Samples and their bins, and the eval set; the rows skipped and the samples cut are always said."""
        config = self.config
        samples, data_report = self.samples(tokenizer)
        samples, evals = split_held_out(
            config,
            info,
            samples,
            load=lambda path: self.samples(tokenizer, path),
            split=split_rows,
            eval_set=self._eval_set,
            what="data",
            said=lambda eval_report: eval_report.skipped,
        )
        bins, packing = self._bins(samples, info)
        check_labels_left(packing.no_labels, config)
        if not bins:
            raise TrainError(
                f"{config.data.path or 'the demo data'}: no sample left to train on ({packing.summary()})"
            )
        if info.is_main and data_report is not None and (data_report.skipped or data_report.cached):
            tqdm.write(f"slipstream train: {data_report.summary()}")  # skipped rows are always said
        if info.is_main and (packing.no_labels or packing.truncated):
            tqdm.write(f"slipstream train: {packing.summary()}")
        logger.info("%s", packing.summary())
        if evals is not None:
            logger.info("eval set: %s", evals.summary())
        return ObjectiveData(samples, bins, packing, data_report, evals)

    def _bins(self, samples: list[dict], info) -> tuple[list[list[dict]], Any]:
        """Bins of samples, or, where ``data.share_prefixes`` decides so, bins of prefix groups
        (rows that start with the same tokens, the start once): the policy line says which and why."""
        config = self.config
        data = config.data
        mode = data.share_prefixes
        if mode != "off":
            groups, packing, sharing = pack_shared(
                samples, data.max_seq_len, seed=config.seed, overflow=data.overflow
            )
            unable = _cannot_share(config)
            share, policy = decide_sharing(mode, sharing)
            if share and unable:  # "on" was refused by validate(): only auto gets here
                share, policy = False, f"shared prefixes off (auto: {unable}): {sharing.summary()}"
            self.policy, self.sharing = policy, sharing if share else None
            if info.is_main and (share or sharing.groups):
                tqdm.write(f"slipstream train: {policy}")
            logger.info("%s", policy)
            if share:
                return groups, packing
        else:
            self.policy = decide_sharing("off", None)[1]
        return pack_samples(samples, data.max_seq_len, seed=config.seed, overflow=data.overflow)

    def summary(self, bins, last) -> dict:
        """``data.share_prefixes``' decision, and what the sharing saved where it shared."""
        found = {"shared_prefixes": {"policy": getattr(self, "policy", None)}}
        if getattr(self, "sharing", None) is not None:
            found["shared_prefixes"].update(self.sharing.as_dict())
        return found

    def weight(self, rows: Sequence[dict]) -> int:
        return count_label_tokens(_whole_rows(rows))

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        """A bin's documents as its packed row runs them (a group: its start once)."""
        return group_documents(rows) if _grouped(rows) else list(rows)

    def tokens(self, rows: Sequence[dict]) -> int:
        """The tokens of a bin's rows, every row whole: tokens/s with or without sharing counts the same."""
        return unshared_tokens(rows)

    # ------------------------------------------------------------------ the step
    def collate(self, rows, device, prepared: Any = None):
        batch = collate_groups(rows, device=device) if _grouped(rows) else collate_packed(rows, device=device)
        return batch.model_inputs(), batch.num_label_tokens

    def micro_weight(self, micro) -> int:
        return micro[1]

    def model_device(self, micro) -> torch.device:
        return micro[0]["input_ids"].device

    def step_weight(self, total: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(total, dtype=torch.float32).to(device)  # moved once per step

    def micro_batch(self, model, micro, weight):
        inputs, _ = micro
        if "num_items_in_batch" not in inputs:
            inputs = {**inputs, "num_items_in_batch": weight}
        loss = model(**inputs).loss
        return loss, loss.detach().float().reshape(1)

    def evaluate(self, model, evals, info, device) -> dict[str, float]:
        return {"loss": evaluate(model, evals, info, device)}


def _grouped(rows: Sequence[dict]) -> bool:
    return bool(rows) and "continuations" in rows[0]


def _whole_rows(rows: Sequence[dict]) -> list[dict]:
    return [row for group in rows for row in group_rows(group)] if _grouped(rows) else list(rows)


def _cannot_share(config) -> str | None:
    """Why this run's model path cannot honour prefix groups, or None."""
    if config.speedups.packed_attention is False:
        return "speedups.packed_attention is off"
    if config.speedups.chunked_loss is False:
        return "speedups.chunked_loss is off"
    return None
