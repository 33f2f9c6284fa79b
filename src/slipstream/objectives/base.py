"""The one interface every objective implements, and the registry the loop, the config and ``ab`` read.

An objective is a plug-in of the one training loop (``train/``): the loop, the optimizer step
(``train/step.py``), checkpoints, evaluation and ``slipstream ab`` call it and never branch on
its name. What an objective says, method by method:

- ``validate(config, fail)`` (classmethod): what it cannot do with a config, refused by key;
- ``read(tokenizer, info)``: its rows (SFT samples or preference pairs, with the readers'
  reports), its bins and its held-out set, as :class:`ObjectiveData`;
- ``documents(rows)``: the documents those rows pack, as the model sees them (token-id checks,
  model FLOPs); ``weight(rows)``: what weighs a bin in the step's loss (label tokens, pairs);
  ``tokens(rows)``: the tokens a bin trains (tokens/s); ``pairs(rows)``: pairs it holds (0: none);
- ``collate(rows, device, prepared)``: one micro-batch, with what ``before_training`` prepared
  for its bin (``prepared("train", index)``), e.g. the reference log-probs; ``micro_weight(micro)``:
  its weight, ``model_device(micro)``: its device;
- ``before_training(context)``: what runs before step 0 (DPO / IPO: the reference pass);
  returns the policy line it logs, or None;
- ``step_weight(total, device)``: the step's weight as the micro-batches' losses divide by it;
  ``ready(model, micro)``: what a micro-batch needs before its forward, outside the step's clock
  (a per-step reference forward); ``micro_batch(model, micro, weight)``: the loss one micro-batch
  backpropagates (its share of the step's mean) and its detached metric sums ``[len(metrics)]``
  (``metrics[0]`` is "loss");
  ``divisor(total)``: what the step's summed metrics are divided by (1 where they are means);
- ``evaluate(model, evals, info, device)``: the held-out metrics (``"loss"`` first);
- ``summary(bins, last)``: its keys of ``run.json`` ({}: none);
- ``plan_step(run, step, step_bins)``: what one optimizer step trains, as a :class:`StepPlan`
  (this rank's micro-batches, the step's weight, tokens and documents, extra record fields); by
  default the bins collated as they are. An online objective (GRPO) samples its rollouts here.

:func:`register_objective` adds a class under its ``name``; :func:`objective_for` returns it;
:func:`objective_names` lists them. A new objective is one module here (plus, where it needs
settings of its own, a small dataclass next to its code).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from tqdm import tqdm

from ..data import DataError
from ..train.errors import TrainError


@dataclass
class ObjectiveData:
    """What an objective read: its rows, their bins, the packing and data reports, the held-out set."""

    rows: list[dict]
    bins: list[list[dict]]
    packing: Any  # data.PackingReport
    report: Any  # data.DataReport, preference.PairReport, or None (the demo data)
    evals: Any  # an eval set with .bins and .summary(), or None


@dataclass
class StepPlan:
    """What one optimizer step trains: this rank's micro-batches and what the loop records of it."""

    micro: list  # this rank's collated micro-batches
    total: Any  # the step's weight over every rank (label tokens, pairs, completion tokens)
    tokens: int  # the step's tokens over every rank (tokens/s)
    documents: list[list[dict]]  # the step's documents, per bin (model FLOPs)
    pairs: int = 0  # preference pairs the step holds (pairs/s)
    # host values added to the step's metrics record (GRPO: rewards, lengths, generation time)
    record: dict = field(default_factory=dict)


class Objective:
    """The base of every objective (see the module docstring for what each method does)."""

    name: ClassVar[str] = ""
    # what the objective trains on: "samples" (documents) or "pairs" (preference pairs)
    reads: ClassVar[str] = "samples"
    # the metrics of one step and of an evaluation, in the order micro_batch's sums stack them
    metrics: ClassVar[tuple[str, ...]] = ("loss",)

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    def validate(cls, config: Any, fail) -> None:
        """Refuse, by ``fail(key, message)``, what this objective cannot do with ``config``."""

    def read(self, tokenizer: Any, info: Any) -> ObjectiveData:
        raise NotImplementedError

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        return list(rows)

    def weight(self, rows: Sequence[dict]) -> int:
        raise NotImplementedError

    def tokens(self, rows: Sequence[dict]) -> int:
        return sum(len(row["input_ids"]) for row in rows)

    def pairs(self, rows: Sequence[dict]) -> int:
        return 0

    def collate(self, rows: Sequence[dict], device: torch.device | str, prepared: Any = None) -> Any:
        raise NotImplementedError

    def before_training(self, context: Any) -> str | None:
        return None

    def prepared(self, part: str, index: int) -> Any:
        """What ``before_training`` kept for bin ``index`` of ``part`` ("train" or "eval"); None: nothing."""
        return None

    def micro_weight(self, micro: Any) -> int:
        """A collated micro-batch's weight (where the caller gives no step weight)."""
        raise NotImplementedError

    def step_weight(self, total: int, device: torch.device) -> Any:
        return total

    def ready(self, model: torch.nn.Module, micro: Any) -> Any:
        """The micro-batch as its forward needs it, before the step's clock starts (e.g. a per-step reference)."""
        return micro

    def micro_batch(
        self, model: torch.nn.Module, micro: Any, weight: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def divisor(self, total: int) -> float:
        return 1.0

    def evaluate(
        self, model: torch.nn.Module, evals: Any, info: Any, device: torch.device
    ) -> dict[str, float]:
        raise NotImplementedError

    # how many of what its evaluation produced it keeps in samples.jsonl (``eval_samples``); 0: none
    keeps_samples: int = 0

    def eval_samples(self) -> list[dict]:
        """What the last ``evaluate`` produced worth reading (e.g. a few sampled completions with their
        rewards), for ``samples.jsonl``; none by default."""
        return []

    def summary(self, bins: Sequence[Sequence[dict]], last: dict | None) -> dict:
        """Its keys of ``run.json`` (the preference objectives: ``preference``); {}: none."""
        return {}

    def plan_step(self, run: Any, step: int, step_bins: Sequence[int]) -> StepPlan:
        """Step ``step``'s bins (``step_bins``, every rank's): this rank's share collated, with
        whatever ``before_training`` prepared for each bin."""
        info = run.info
        micro = [
            self.collate(run.bins[index], run.device, self.prepared("train", index))
            for index in step_bins[info.rank :: info.world_size]
        ]
        return StepPlan(
            micro=micro,
            total=sum(run.label_tokens[index] for index in step_bins),
            tokens=sum(self.tokens(run.bins[index]) for index in step_bins),
            documents=[self.documents(run.bins[index]) for index in step_bins],
            pairs=sum(self.pairs(run.bins[index]) for index in step_bins),
        )

    def model_device(self, micro: Any) -> torch.device:
        """The device a micro-batch lives on (the step's clock and its weight tensor)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Objective]] = {}


def split_held_out(
    config: Any, info: Any, rows: list, *, load, split, eval_set, what: str, said
) -> tuple[list, Any]:
    """The rows left to train on and the held-out set every objective's ``read`` builds alike:
    ``data.eval_fraction`` of the rows (``split``: a seeded by-row split, the same on every rank), or
    ``data.eval_path`` read as the training file is (``load``; a DataError there names
    data.eval_path, and what its reader skipped is said where ``said(report)``); ``eval_set(rows,
    source)`` makes the objective's set; None without either."""
    data = config.data
    if data.eval_fraction is not None:
        source = data.path or "the demo data"
        rows, held_out = split(rows, data.eval_fraction, config.seed, source)
        return rows, eval_set(held_out, f"data.eval_fraction {data.eval_fraction:g} of {source}")
    if data.eval_path is None:
        return rows, None
    try:
        held_out, report = load(data.eval_path)
    except DataError as error:
        raise TrainError(f"{error} (data.eval_path)") from None
    if info.is_main and said(report):
        tqdm.write(f"slipstream train: eval {what}: {report.summary()}")  # skipped rows are always said
    return rows, eval_set(held_out, data.eval_path)


def register_objective(cls: type[Objective]) -> type[Objective]:
    """Add ``cls`` under ``cls.name`` (a class decorator); a second class of the same name replaces it."""
    if not cls.name:
        raise ValueError(f"{cls.__name__}: an objective needs a name")
    _REGISTRY[cls.name] = cls
    return cls


def objective_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def objective_for(name: str) -> type[Objective]:
    """The objective registered as ``name``; KeyError naming the registered ones otherwise."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown objective {name!r} (registered: {', '.join(objective_names())})") from None
