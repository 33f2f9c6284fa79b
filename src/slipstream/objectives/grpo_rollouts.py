"""GRPO's rollouts: a round sampled, scored and packed for the update (steps 1-4 of :mod:`.grpo`'s
docstring, up to the loss).

For this rank's share of the round's prompts (the bins the loop hands the round's steps):
completions sampled by the objective's :class:`slipstream.rollouts.RolloutEngine`, seeded by
(seed, step, rank); rewards (:mod:`slipstream.rewards`); group-relative advantages
(:func:`advantages_of`); the update's micro-batches (:mod:`slipstream.packing.completions`) with
each token's advantage and loss mask, and the reference's and the sampling policy's log-probs where
the settings need them, read by ``no_grad`` forwards before the step's clock. :class:`RolloutMaker`
is what :class:`.grpo.GRPO` inherits of it (the A/B's GRPO arms call the same methods).

How a rollout unfolds is a :class:`Turns`: one completion (:class:`SingleTurn`) or a trajectory of turns
and tool calls (:class:`.grpo_agents.AgentPlan`); what samples the tokens is the engine
(:mod:`.grpo_engines`). Nothing here asks which.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import TrainError
from ..loss.grpo import loss_divisor
from ..modes import eval_mode
from ..packing.batch import cut
from ..packing.completions import collate_completions, completion_documents, completion_tokens
from ..rewards import RewardCall, RewardError, RewardFunction, score, weighted
from ..rollouts import Rollouts, Sampling
from .answers import answer_sums, reference_sums
from .base import ObjectiveContext, StepPlan

GROUP_STD_EPSILON = 1e-4  # added to a group's reward std before dividing (TRL's)


@dataclass
class GRPOMicro:
    """One micro-batch of the update: the packed completions and, per token, what its loss reads."""

    completions: Any  # packing.completions.CompletionBatch
    advantages: torch.Tensor  # [tokens] fp32: the advantage of each token's completion
    mask: torch.Tensor  # [tokens] fp32: 1 where the token counts in the loss
    seq_tokens: torch.Tensor  # [completions] fp32: tokens each completion counts (grpo's mean)
    reference: torch.Tensor | None  # [tokens] fp32: the reference's log-probs (beta > 0)
    tokens_in_step: float  # every rank's counted completion tokens this step (metric divisor)
    old: torch.Tensor | None = None  # [tokens] fp32: the sampling policy's log-probs (num_iterations > 1)
    # [tokens] fp32: the log-probs the engine reported sampling each token (NaN: not reported), where
    # the update corrects for another engine's (vLLM's) numbers
    sampling: torch.Tensor | None = None
    record: dict | None = None  # the step's host record (rank 0's largest log-prob difference goes there)
    documents: list[dict] | None = None  # the documents its packed row runs (model FLOPs)


@dataclass
class ScoredRound:
    """A round's rollouts as sampled and scored, before anything is packed: what ``slipstream ab``
    records once and every GRPO arm updates on (:meth:`RolloutMaker.plan_round`)."""

    step: int
    sizes: list[int]  # prompts per micro-batch (this rank's bins of the round)
    prompts: list[dict]  # the prompt rows, in order
    groups: list[dict]  # per prompt: prompt_ids, completions, finished, logprobs (model_masks)
    per_function: list[list[float]]  # per completion, each reward function's value
    rewards: list[float]  # per completion, weighted (G a prompt)
    record: dict  # the host metrics so far: rewards, lengths, sampling and scoring times

    def bins(self) -> list[list[dict]]:
        """The round's prompt rows, a bin per micro-batch (what the step's ``step_bins`` held)."""
        return cut(self.prompts, self.sizes)


def advantages_of(
    rewards: Sequence[float], group: int, scale: str, batch_std: float | None = None
) -> list[float]:
    """Each reward minus its group's mean (groups of ``group`` in order), divided as ``scale`` says:
    ``group`` by the group's std (+ 1e-4), ``batch`` by ``batch_std`` (+ 1e-4; None: the std of
    ``rewards``, one process's whole step), ``none`` not at all. Stds are unbiased (n - 1), as
    torch's ``std`` (and TRL) computes them."""
    if scale == "batch" and batch_std is None:
        batch_std = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
    out = []
    for start in range(0, len(rewards), group):
        values = list(rewards[start : start + group])
        mean = sum(values) / len(values)
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        for value in values:
            centred = value - mean
            if scale == "group":
                centred /= std + GROUP_STD_EPSILON
            elif scale == "batch":
                centred /= (batch_std or 0.0) + GROUP_STD_EPSILON
            out.append(centred)
    return out


def sampled_groups(prompts: list[dict], rollouts: Rollouts) -> list[dict]:
    """Per prompt, what the update packs: its ids and its completions' ids, ends and engine log-probs."""
    return [
        {
            "prompt_ids": row["prompt_ids"],
            "completions": [c.ids for c in completions],
            "finished": [c.finished for c in completions],
            "logprobs": [c.logprobs for c in completions],
        }
        for row, completions in zip(prompts, rollouts.completions, strict=True)
    ]


class Turns(Protocol):
    """How a prompt's rollouts unfold, and what the rewards, the update and the log read of them."""

    def rollouts(self, engine, model, prompts: list[dict], G: int, sampling: Sampling, seed: int) -> Rollouts:
        """G rollouts of each prompt row, sampled by ``engine`` (seeded)."""

    def completions(self, prompts: list[dict], rollouts) -> tuple[list, dict]:
        """Each rollout as TRL's reward functions get it, and the columns it adds (``environments``)."""

    def groups(self, prompts: list[dict], rollouts) -> list[dict]:
        """:func:`sampled_groups`, with what the update must leave out of the loss (``model_masks``)."""

    def record(self, rollouts) -> dict:
        """The round's metrics beyond the completions' own (tool calls)."""

    def samples(self, rollouts) -> list[dict]:
        """What ``samples.jsonl`` keeps of each rollout beyond its text (its turns and calls)."""

    def line(self) -> str:
        """What the run's log says of them ("" where nothing more than the engine's line)."""


@dataclass
class SingleTurn:
    """One completion a rollout: the engine's sample of the prompt, decoded for the rewards (a
    conversational prompt's as one assistant message, as TRL hands it)."""

    tokenizer: Any

    def rollouts(self, engine, model, prompts, G, sampling, seed) -> Rollouts:
        return engine.generate(model, [r["prompt_ids"] for r in prompts], G, sampling, seed)

    def completions(self, prompts, rollouts) -> tuple[list, dict]:
        texts = []
        for row, completions in zip(prompts, rollouts.completions, strict=True):
            for completion in completions:
                text = self.tokenizer.decode(completion.ids, skip_special_tokens=True)
                texts.append(
                    [{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
                )
        return texts, {}

    def groups(self, prompts, rollouts) -> list[dict]:
        return sampled_groups(prompts, rollouts)

    def record(self, rollouts) -> dict:
        return {}

    def samples(self, rollouts) -> list[dict]:
        return []

    def line(self) -> str:
        return ""


class RolloutMaker:
    """Sampling, scoring and packing a round of rollouts (see the module docstring); a mixin of the
    GRPO objective, whose ``settings``, ``engine``, ``tokenizer``, ``rewards`` and ``chunked`` it reads."""

    config: Any  # the run's config (its seed)
    settings: Any  # objectives.grpo.GRPOSettings
    engine: Any  # a RolloutEngine
    tokenizer: Any
    rewards: list[RewardFunction]
    chunked: bool
    corrects: bool  # the update weighs tokens by TRL's importance sampling (GRPO.corrects)
    synced_at: int | None = None  # the optimizer steps done when the engine last took the policy
    agents: Any = None  # .grpo_agents.AgentPlan: tool-calling rollouts (grpo.tools); None: single-turn
    trees: Any = None  # .grpo_sharing.CompletionTrees: data.share_prefixes on the update (None: off)

    @property
    def sampling(self) -> Sampling:
        s = self.settings
        return Sampling(s.temperature, s.top_p, s.top_k, s.max_new_tokens)

    def sync_engine(self, model, steps_done: int | None) -> None:
        """The engine takes the policy after ``steps_done`` optimizer steps, unless it already holds it
        (an evaluation after step N and round N+1's sampling share one sync); None: always."""
        if steps_done is None or steps_done != self.synced_at:
            self.engine.sync(model)
            self.synced_at = steps_done

    def sample(self, model, prompts: list[dict], seed: int, steps_done: int | None = None) -> Rollouts:
        """G completions of each of ``prompts`` by the policy (eval mode, no grad), seeded."""
        self.sync_engine(model, steps_done)
        with eval_mode(model), torch.no_grad():
            return self.generate_rollouts(model, prompts, self.settings.num_generations, seed)

    @property
    def turns(self) -> Turns:
        """The run's tool-calling trajectories (``grpo.tools``), else one completion a rollout."""
        return self.agents if self.agents is not None else SingleTurn(self.tokenizer)

    def generate_rollouts(self, model, prompts: list[dict], G: int, seed: int):
        """G rollouts of each prompt row, as the run's :class:`Turns` unfold them on its engine."""
        return self.turns.rollouts(self.engine, model, prompts, G, self.sampling, seed)

    def score_rollouts(
        self, prompts: list[dict], rollouts: Rollouts, G: int, call: RewardCall | None = None
    ) -> tuple[list[list[float]], list[dict]]:
        """Every completion's per-function rewards; and each group's completion ids. ``call``: the
        step's ``trainer_state`` and what the functions log (default: step 0, kept nowhere)."""
        turns = self.turns
        texts, extra = turns.completions(prompts, rollouts)
        names = sorted({key for row in prompts for key in row["columns"]})
        columns = {name: [row["columns"].get(name) for row in prompts for _ in range(G)] for name in names}
        columns.update(extra)
        rows = zip(prompts, rollouts.completions, strict=True)
        prompt_values = [row["prompt"] for row, completions in rows for _ in completions]
        ids = [list(c.ids) for completions in rollouts.completions for c in completions]
        values = score(self.rewards, prompt_values, texts, ids, columns, call)
        return values, turns.groups(prompts, rollouts)

    def replayed_bins(self, recorded: ScoredRound) -> list[list[dict]]:
        """A recorded round's bins (``slipstream ab``'s arms replay the run's rounds: ``plan_round``)."""
        return recorded.bins()

    def sample_round(self, context: ObjectiveContext, step: int, step_bins: Sequence[int]) -> ScoredRound:
        """This rank's share of ``step_bins`` sampled (seeded by the run's seed, the step and the rank) and
        scored: the round before anything is packed (what ``slipstream ab`` records and replays)."""
        settings, info = self.settings, context.ranks
        G = settings.num_generations
        mine = [context.bins[i] for i in step_bins[info.rank :: info.world_size]]
        prompts = [row for rows in mine for row in rows]
        started = time.perf_counter()
        rollouts = self.sample(
            context.base_model,
            prompts,
            seed=(self.config.seed * 1_000_003 + step) * 1_009 + info.rank,
            steps_done=step,
        )
        generated = time.perf_counter()
        call = RewardCall(step=step, max_steps=context.steps)
        try:
            per_function, groups = self.score_rollouts(prompts, rollouts, G, call)
        except RewardError as error:
            raise TrainError(
                f"step {step + 1}: {error}; nothing of this step was applied ({context.resume_hint()})"
            ) from None
        rewards = [weighted(values, self.rewards) for values in per_function]
        record = self._record(
            per_function, rewards, groups, rollouts, (started, generated, time.perf_counter())
        )
        record.update(call.metric_means())  # what the reward functions logged (log_metric), as TRL logs it
        return ScoredRound(step, [len(rows) for rows in mine], prompts, groups, per_function, rewards, record)

    def plan_round(self, context: ObjectiveContext, scored: ScoredRound) -> StepPlan:
        """The update of a scored round: advantages (the step's counts over every rank), the packed
        micro-batches, and the reference's and the sampling policy's log-probs where kept."""
        settings, info, groups, rewards = self.settings, context.ranks, scored.groups, scored.rewards
        G = settings.num_generations
        started = time.perf_counter()
        # the step's counts over every rank: completions, counted tokens, and the rewards' sums (batch std)
        counted = self.counted_tokens(groups)
        local = torch.tensor(
            [len(rewards), sum(counted), sum(rewards), sum(r * r for r in rewards)], dtype=torch.float64
        )
        totals = info.sum_tensor(local.to(context.device)).tolist() if info.enabled else local.tolist()
        completions_all, tokens_all, reward_sum, reward_squares = totals
        batch_std = None
        if settings.scale_rewards == "batch":
            mean = reward_sum / completions_all
            batch_std = math.sqrt(
                max(0.0, (reward_squares - completions_all * mean * mean) / max(1.0, completions_all - 1))
            )
        advantages = advantages_of(rewards, G, settings.scale_rewards, batch_std)
        micro = self.pack_update(groups, scored.sizes, advantages, counted, tokens_all, context.device)
        if settings.beta > 0:  # the reference: the same packed forward with the adapter off, before the clock
            for item in micro:
                item.reference = reference_sums(
                    context.model, item.completions.batch, self.chunked, adapter=True
                )
        if settings.num_iterations > 1:  # the sampling policy's log-probs, kept for the round's k updates
            with torch.no_grad():
                for item in micro:
                    item.old = answer_sums(context.model, item.completions.batch, self.chunked).detach()
        record = {**scored.record, "reference_s": time.perf_counter() - started}
        if self.corrects and info.is_main:
            for item in micro:
                item.record = record
        if self.trees is not None and settings.prefix_sharing:
            record.update(self.trees.step.record())
        sync_s = getattr(self.engine, "sync_s", None)
        if sync_s:
            record["engine_sync_s"] = sync_s[-1]
        return StepPlan(
            micro=micro,
            total=self.loss_divisor(completions_all, tokens_all),
            tokens=sum(completion_tokens(g, prefix_sharing=False) for g in groups) * info.world_size,
            documents=[item.documents for item in micro],
            record=record,
        )

    def counted_tokens(self, groups: list[dict]) -> list[int]:
        """The tokens each completion of ``groups`` counts in the loss: its length, or 0 where it was
        cut at ``max_new_tokens`` and ``mask_truncated_completions`` leaves it out."""
        mask = self.settings.mask_truncated_completions
        return [
            0 if (mask and not finished) else (len(ids) if kept is None else sum(kept))
            for g in groups
            for ids, finished, kept in zip(
                g["completions"],
                g["finished"],
                g.get("model_masks") or [None] * len(g["completions"]),
                strict=True,
            )
        ]

    def pack_update(
        self,
        groups: list[dict],
        sizes: Sequence[int],
        advantages: Sequence[float],
        counted: Sequence[int],
        tokens_all: float,
        device,
    ) -> list[GRPOMicro]:
        """The update's micro-batches: ``groups`` (one prompt's completions each, in order) cut into
        micro-batches of ``sizes`` groups, each packed ``prompt | completions`` (or prompt + completion
        G times without prefix sharing; or as prefix trees, ``data.share_prefixes``), with every token's advantage and loss mask. ``counted``: the
        tokens each completion counts in the loss (0: masked out); ``tokens_all``: the step's counted
        tokens over every rank."""
        settings, G = self.settings, self.settings.num_generations
        micro = []
        trees = self.trees if settings.prefix_sharing else None
        if trees is not None:
            trees.take_step()  # this call's counts start at zero
        completion_sizes = [count * G for count in sizes]
        for mine, mine_advantages, mine_counted in zip(
            cut(groups, sizes), cut(advantages, completion_sizes), cut(counted, completion_sizes), strict=True
        ):
            if trees is not None:  # data.share_prefixes: trees where they share more than their prompts
                packed, documents = trees.pack(mine, settings.temperature)
            else:
                packed = collate_completions(
                    mine, settings.prefix_sharing, device=None, temperature=settings.temperature
                )
                documents = completion_documents(mine, settings.prefix_sharing)
            owner = packed.completion_index
            sampling = None
            if self.corrects:  # the engine's log-prob of each token, in the packed order
                reported = []
                for g in mine:
                    for logprobs, ids in zip(g.get("logprobs") or [None] * G, g["completions"], strict=True):
                        known = logprobs is not None and len(logprobs) == len(ids)
                        reported += logprobs if known else [math.nan] * len(ids)
                sampling = torch.tensor(reported, dtype=torch.float32)
                if sampling.numel() != owner.numel():
                    raise ValueError(
                        f"{sampling.numel()} sampled log-probs for {owner.numel()} completion tokens"
                    )
            adv = torch.tensor(mine_advantages, dtype=torch.float32)
            keep = torch.tensor([1.0 if c else 0.0 for c in mine_counted])
            token_keep = keep.index_select(0, owner)
            if any("model_masks" in g for g in mine):  # tool results: context
                sampled = [m for g in mine for mask in g["model_masks"] for m in mask]
                token_keep = token_keep * torch.tensor(sampled, dtype=torch.float32)
            seq_tokens = torch.tensor(mine_counted, dtype=torch.float32)
            micro.append(
                GRPOMicro(
                    completions=packed.to(device),
                    advantages=adv.index_select(0, owner).to(device),
                    mask=token_keep.to(device),
                    seq_tokens=seq_tokens.to(device),
                    reference=None,
                    tokens_in_step=max(1.0, tokens_all),
                    sampling=None if sampling is None else sampling.to(device),
                    documents=documents,
                )
            )
        return micro

    def loss_divisor(self, completions: float, tokens: float) -> float:
        """What the step's summed loss is divided by (:func:`slipstream.loss.grpo.loss_divisor`)."""
        settings = self.settings
        return loss_divisor(settings.loss, completions, tokens, settings.max_new_tokens)

    def _record(self, per_function, rewards, groups, rollouts, times):
        """This rank's host-side metrics of a step (rank 0's are logged); ``times``: when the sampling
        started and when it and the scoring were done."""
        G = self.settings.num_generations
        lengths = [len(c) for g in groups for c in g["completions"]]
        finished = [f for g in groups for f in g["finished"]]
        started, generated, scored = times
        record: dict[str, Any] = {"reward": statistics.fmean(rewards)}
        stds = [statistics.stdev(rewards[i : i + G]) for i in range(0, len(rewards), G)]
        record["reward_std"] = statistics.fmean(stds)
        record["equal_rewards_share"] = sum(1 for s in stds if s == 0.0) / len(stds)
        for index, fn in enumerate(self.rewards):
            values = [v[index] for v in per_function if not math.isnan(v[index])]
            record[f"reward_{fn.name}"] = statistics.fmean(values) if values else None
        record["completion_mean_tokens"] = statistics.fmean(lengths)
        record["completion_max_tokens"] = max(lengths)
        record["truncated_share"] = sum(1 for f in finished if not f) / len(finished)
        record["generation_s"] = generated - started
        record["generation_tokens_per_s"] = rollouts.stats.tokens_per_s
        record["reward_s"] = scored - generated
        record["reference_s"] = 0.0  # the update's reference forwards (plan_round)
        record.update(self.turns.record(rollouts))
        return record
