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
- ``before_training(context)``: what runs before step 0 (DPO / IPO: the reference pass), with
  what it may read of the run (:class:`ObjectiveContext`); returns the policy line it logs, or None;
- ``step_weight(total, device)``: the step's weight as the micro-batches' losses divide by it;
  ``ready(model, micro)``: what a micro-batch needs before its forward, outside the step's clock
  (a per-step reference forward); ``micro_batch(model, micro, weight)``: the loss one micro-batch
  backpropagates (its share of the step's mean) and its detached metric sums ``[len(metrics)]``
  (``metrics[0]`` is "loss");
  ``divisor(total)``: what the step's summed metrics are divided by (1 where they are means);
  ``finish_metrics(metrics)``: those means as the objective reports them (KTO: per-label rewards);
- ``evaluate(model, evals, info, device)``: the held-out metrics (``"loss"`` first);
- ``summary(bins, last)``: its keys of ``run.json`` ({}: none);
- ``plan_step(context, step, step_bins)``: what one optimizer step trains, as a :class:`StepPlan`
  (this rank's micro-batches, the step's weight, tokens and documents, extra record fields); by
  default the bins collated as they are. An online objective (GRPO) samples its rollouts here;
  ``updates_per_round``: how many steps train on one round (the loop hands each the round's bins);
- ``replayed_bins(recorded)``: the bins of one step ``slipstream ab`` recorded of the run, which every
  arm replays (the step's bins; GRPO records the round it sampled and scored).

:func:`register_objective` adds a class under its ``name``; :func:`objective_for` returns it;
:func:`objective_names` lists them. A new objective is one module here (plus, where it needs
settings of its own, a small dataclass next to its code).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
from tqdm import tqdm

from ..data import DataError
from ..errors import TrainError


class Ranks(Protocol):
    """What an objective reads of the processes a run spans (``train.distributed.Distributed`` is one)."""

    rank: int
    world_size: int
    strategy: str  # "none", "ddp" or "fsdp2"

    @property
    def is_main(self) -> bool: ...

    @property
    def enabled(self) -> bool: ...

    def barrier(self) -> None: ...

    def sum(self, value: float) -> float: ...

    def sum_tensor(self, tensor: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ObjectiveContext:
    """What an objective may read of the run it is plugged into (``before_training``, ``plan_step``):
    the loop builds it once. Which bins a step trains, the ranks' collectives and where a run resumes
    are the loop's; an objective reads them here and changes none of them."""

    ranks: Ranks  # this rank, the world size and the collectives
    tokenizer: Any
    bins: list[list[dict]]  # the training bins, every rank's
    weights: list[int]  # per bin, what weighs it in the step's loss (label tokens, pairs), every rank's
    evals: Any  # the objective's eval set (with .bins), or None
    device: torch.device
    dtype: torch.dtype
    model: torch.nn.Module  # as the step trains it (wrapped for the ranks)
    base_model: torch.nn.Module  # under the ranks' wrapper (what a reference pass or a sampler runs)
    steps: int  # the run's optimizer steps
    # step -> the bin indices it trains, every rank's (a round's, for steps of one round)
    step_bins: Callable[[int], list[int]]
    # optimizer steps in one epoch of the bins (a step of several rounds counted once)
    epoch_steps: int | None = None
    # the line that says where a stopped run resumes ("--resume continues from <checkpoint>")
    resume_hint: Callable[[], str] = lambda: "no checkpoint to resume from"


@dataclass
class ObjectiveData:
    """What an objective read: its rows, their bins, the packing and data reports, the held-out set."""

    rows: list[dict]
    bins: list[list[dict]]
    packing: Any  # data.PackingReport
    report: Any  # data.DataReport, preference.PairReport, or None (the demo data)
    evals: Any  # an eval set with .bins and .summary(), or None
    # per step of an epoch, its bins' indices, where the steps are fixed blocks of bins
    # (data.step_order: histories); None: a seeded permutation of the bins (data.steps)
    blocks: list[list[int]] | None = None


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
    # the head the model is loaded with (models.heads): "causal-lm", or "reward" (a scalar score head)
    model_head: ClassVar[str] = "causal-lm"

    # optimizer steps trained on one round (GRPO's num_iterations): the loop hands each step of a
    # round that round's bins (``step_bins``); 1: every step its own bins
    updates_per_round: int = 1

    def __init__(self, config: Any) -> None:
        self.config = config

    @classmethod
    def validate(cls, config: Any, fail) -> None:
        """Refuse, by ``fail(key, message)``, what this objective cannot do with ``config``."""

    def read(self, tokenizer: Any, info: Ranks) -> ObjectiveData:
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

    def before_training(self, context: ObjectiveContext) -> str | None:
        return None

    def after_training(self) -> None:
        """Whatever the objective started for the run is stopped (the run ended, however it ended)."""

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

    def finish_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The step's metrics once divided by ``divisor`` (KTO: its rewards as means over the desirable and
        the undesirable rows, not over every row); as they are by default."""
        return metrics

    def evaluate(
        self, model: torch.nn.Module, evals: Any, info: Ranks, device: torch.device
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

    def plan_step(self, context: ObjectiveContext, step: int, step_bins: Sequence[int]) -> StepPlan:
        """Step ``step``'s bins (``step_bins``, every rank's): this rank's share collated, with
        whatever ``before_training`` prepared for each bin."""
        ranks, bins = context.ranks, context.bins
        micro = [
            self.collate(bins[index], context.device, self.prepared("train", index))
            for index in step_bins[ranks.rank :: ranks.world_size]
        ]
        return StepPlan(
            micro=micro,
            total=sum(context.weights[index] for index in step_bins),
            tokens=sum(self.tokens(bins[index]) for index in step_bins),
            documents=[self.documents(bins[index]) for index in step_bins],
            pairs=sum(self.pairs(bins[index]) for index in step_bins),
            record={"micro_batches": len(micro)},  # this rank's
        )

    def replayed_bins(self, recorded: Any) -> list[list[dict]]:
        """The bins of one step ``slipstream ab`` recorded of the run (``train.record``): the step's bins
        themselves; an objective that records more (GRPO: the round it sampled and scored) says which."""
        return recorded

    def model_device(self, micro: Any) -> torch.device:
        """The device a micro-batch lives on (the step's clock and its weight tensor)."""
        raise NotImplementedError


_REGISTRY: dict[str, type[Objective]] = {}


def tokenizer_refusals(config: Any, reader: Callable[[str], Any]) -> Callable[[str], Any]:
    """``reader`` (a data file's path -> its rows) with a ValueError its tokenizer raised (no chat
    template, say) as a TrainError naming the file and the tokenizer; a DataError (naming the file's
    line) passes as it is."""

    def read(path: str):
        try:
            return reader(path)
        except ValueError as error:
            if isinstance(error, DataError):
                raise
            where = config.model.path or f"model.preset {config.model.preset}"
            raise TrainError(f"{path}: {error} (the tokenizer of {where})") from None

    return read


def split_held_out(
    config: Any, info: Ranks, rows: list, *, load, split, eval_set, what: str, said
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
