"""``training.objective: grpo``: online RL with verifiable rewards (GRPO, DAPO's token-level loss, Dr. GRPO).

Every step, on every rank, for its share of the step's prompts (``grpo.prompts_per_batch`` per
micro-batch):

1. **Rollouts**: G = ``grpo.num_generations`` completions per prompt sampled from the current
   policy (the adapter on, eval mode, no grad) by a :class:`slipstream.rollouts.RolloutEngine`;
   ours prefills each prompt once and shares its KV cache among its G samples. Sampling is seeded
   by (seed, step, rank): a resumed run samples what the uninterrupted one did.
2. **Rewards**: every ``grpo.rewards`` function (TRL's convention, :mod:`slipstream.rewards`) on
   the decoded completions, the row's other columns as keyword arguments; the weighted sum is a
   completion's reward. A function that raises or returns what cannot be used stops the run with
   one line naming it, the step, and the checkpoint to resume from.
3. **Advantages**: reward minus its group's mean (a group: one prompt's G completions, always on
   one rank), divided by the group's std (``scale_rewards: group``, + 1e-4), the whole step's std
   over every rank (``batch``), or nothing (``none``).
4. **The update**: each micro-batch packs its groups as ``prompt | completion_1 | ... |
   completion_G`` (:mod:`slipstream.packing.completions`; the prompt once), and the chunked head
   gives every completion token's log-prob (of logits / temperature, the distribution sampled
   from) without ``[tokens, vocab]`` logits. Per token, with ratio ``r = exp(logp - logp_old)``::

       loss_t = -min(r * A, clip(r, 1 - epsilon, 1 + epsilon_high) * A) + beta * KL_t
       KL_t   = exp(ref_t - logp_t) - (ref_t - logp_t) - 1            (k3, the reference's)

   ``logp_old`` is the log-prob of the policy that sampled; with one update per rollout batch
   (``num_iterations: 1``) that is the policy being updated, so ``r`` is 1 in value and only its
   gradient acts. With ``num_iterations: k`` > 1 a batch of rollouts (a *round*: the bins of
   ``bins_for(round)``) is updated on in k steps; ``logp_old`` is read once, after sampling, by a
   ``no_grad`` forward in the same packed layout, and kept for the round. ``loss`` aggregates the tokens: ``dapo`` (sum over every completion token of the
   step / their count, TRL's default), ``grpo`` (each completion's token mean, then the mean over
   completions), ``dr_grpo`` (token sum / (completions x max_new_tokens)). The reference (``beta``
   > 0) is the base model: the same packed forward with the adapter off, no grad, before the step.
   ``mask_truncated_completions`` leaves completions cut at ``max_new_tokens`` out of the loss.

The step's metrics: the loss, the clipped share of tokens and the KL (read with the loss, in the
step's one read); the rewards (per function), the completion lengths, the share of groups whose
rewards are all equal, and generation vs update time, from the host.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from ..data import DataError, PackingReport
from ..data.prompts import load_prompts, split_prompts
from ..modes import eval_mode
from ..optimize import state_of
from ..packing.completions import collate_completions, completion_documents, completion_tokens
from ..preference.objective import answer_sums, reference_sums
from ..rewards import RewardError, RewardFunction, load_rewards, score, weighted
from ..rollouts import CachedSampler, Rollouts, Sampling, UnsupportedRollout, check_sampleable
from ..train.checkpoints import newest_checkpoint
from ..train.errors import TrainError
from ..train.evaluation import rank_share
from .base import Objective, ObjectiveData, StepPlan, register_objective, split_held_out

GROUP_STD_EPSILON = 1e-4  # added to a group's reward std before dividing (TRL's)


@dataclass
class PromptEvalSet:
    """The held-out prompts, in bins of ``prompts_per_batch``, and what ``run.json`` says of them."""

    bins: list[list[dict]]
    source: str
    rows: int

    def summary(self) -> dict:
        return {"source": self.source, "prompts": self.rows}


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


def stop_ids(tokenizer, model) -> tuple[int, ...]:
    """The tokens that end a completion: the tokenizer's EOS and the model's generation config's."""
    found: set[int] = set()
    if tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    generation = getattr(model, "generation_config", None)
    eos = getattr(generation, "eos_token_id", None)
    for token in eos if isinstance(eos, (list, tuple)) else [eos]:
        if token is not None:
            found.add(int(token))
    return tuple(sorted(found))


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


@register_objective
class GRPO(Objective):
    name = "grpo"
    reads = "prompts"
    metrics = ("loss", "clip_fraction", "kl")

    def __init__(self, config: Any, settings: Any = None, engine: Any = None) -> None:
        super().__init__(config)
        self.settings = settings if settings is not None else config.grpo
        self.engine = engine  # a RolloutEngine; ours (CachedSampler) when None, made in before_training
        self.rewards: list[RewardFunction] = (
            load_rewards(self.settings.rewards) if self.settings.rewards else []
        )
        self.tokenizer = None
        self.chunked = True
        self.kept: tuple[int, StepPlan] | None = None  # (round, its plan): num_iterations > 1
        self.keeps_samples = self.settings.eval_samples
        self._eval_samples: list[dict] = []

    @property
    def sampling(self) -> Sampling:
        s = self.settings
        return Sampling(s.temperature, s.top_p, s.top_k, s.max_new_tokens)

    # ------------------------------------------------------------------ the config
    @classmethod
    def validate(cls, config, fail) -> None:
        grpo = config.grpo
        if config.data.path is None:
            fail(
                "data.path",
                "training.objective 'grpo' needs prompt rows: set data.path (a file of {\"prompt\": ...} rows)",
            )
        if not grpo.rewards:
            fail(
                "grpo.rewards",
                "training.objective 'grpo' needs at least one reward function in grpo.rewards "
                "('module:function', or a built-in: answer_tag, format_regex, length_penalty)",
            )
        try:
            load_rewards(grpo.rewards)
        except RewardError as error:
            fail("grpo.rewards", str(error))
        if config.data.max_seq_len <= grpo.max_new_tokens:
            fail(
                "data.max_seq_len",
                f"data.max_seq_len {config.data.max_seq_len} leaves no room for a prompt beside "
                f"grpo.max_new_tokens {grpo.max_new_tokens}",
            )
        if config.speedups.packed_attention is False:
            fail(
                "speedups.packed_attention",
                "training.objective 'grpo' trains packed completion groups: "
                "speedups.packed_attention false is not supported",
            )
        if grpo.num_iterations > 1 and config.training.epochs is not None:
            fail(
                "training.epochs",
                "training.epochs with grpo.num_iterations > 1: give training.steps instead (each batch of "
                "rollouts is trained num_iterations steps)",
            )
        if grpo.num_iterations > 1 and config.training.checkpoint_every % grpo.num_iterations:
            fail(
                "training.checkpoint_every",
                f"training.checkpoint_every must be a multiple of grpo.num_iterations "
                f"{grpo.num_iterations}: a checkpoint inside a round could not resume it exactly",
            )
        if grpo.beta > 0 and not config.lora.enabled:
            fail("grpo.beta", "grpo.beta > 0 compares with the base (the adapter off): it needs lora.enabled")
        if grpo.beta > 0 and config.lora.experts:
            fail("grpo.beta", "grpo.beta > 0 cannot switch lora.experts adapters off yet")
        if config.training.distributed == "fsdp2":
            fail(
                "training.distributed",
                "training.objective 'grpo' under fsdp2 (sharded weights while sampling) "
                "is not supported yet: use ddp",
            )

    # ------------------------------------------------------------------ rows and bins
    def read(self, tokenizer, info) -> ObjectiveData:
        config, settings = self.config, self.settings
        self.tokenizer = tokenizer
        room = config.data.max_seq_len - settings.max_new_tokens
        on_bad_row = "skip" if config.data.skip_bad_rows else "error"

        def load(path: str):
            try:
                return load_prompts(path, tokenizer, room=room, on_bad_row=on_bad_row)
            except ValueError as error:
                if isinstance(error, DataError):
                    raise
                raise TrainError(
                    f"{path}: {error} (the tokenizer of {config.model.path or config.model.preset})"
                ) from None

        rows, report = load(config.data.path)
        rows, evals = split_held_out(
            config,
            info,
            rows,
            load=load,
            split=split_prompts,
            eval_set=lambda held_out, source: PromptEvalSet(self._bins(held_out), source, len(held_out)),
            what="prompts",
            said=lambda eval_report: eval_report.skipped,
        )
        if info.is_main and report.skipped:
            tqdm.write(f"slipstream train: {report.summary()}")
        bins = self._bins(rows)
        tokens = sum(len(r["prompt_ids"]) for r in rows)
        packing = PackingReport(
            num_samples=len(rows), num_bins=len(bins), real_tokens=tokens, capacity=tokens, efficiency=1.0
        )
        return ObjectiveData(rows, bins, packing, report, evals)

    def _bins(self, rows: list[dict]) -> list[list[dict]]:
        """``prompts_per_batch`` prompts a bin, in a seeded order (the step plan shuffles bins per epoch)."""
        order = list(range(len(rows)))
        random.Random(f"slipstream grpo bins {self.config.seed}").shuffle(order)
        size = self.settings.prompts_per_batch
        return [[rows[i] for i in order[start : start + size]] for start in range(0, len(order), size)]

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        return [{"input_ids": r["prompt_ids"], "labels": [-100] * len(r["prompt_ids"])} for r in rows]

    def weight(self, rows: Sequence[dict]) -> int:
        return (
            len(rows) * self.settings.num_generations
        )  # completions; the step's real weight comes with its rollouts

    def tokens(self, rows: Sequence[dict]) -> int:
        return sum(len(r["prompt_ids"]) for r in rows) * self.settings.num_generations

    # ------------------------------------------------------------------ before step 0
    def before_training(self, context) -> str | None:
        state = state_of(context.base_model)
        self.chunked = state is not None and state.chunked_loss is not None
        if self.tokenizer is None:
            self.tokenizer = context.tokenizer
        if self.engine is None:
            try:
                check_sampleable(context.base_model, self.config.data.max_seq_len)
            except UnsupportedRollout as error:
                raise TrainError(f"{self.config.model.path or self.config.model.preset}: {error}") from None
            pad = self.tokenizer.pad_token_id
            if pad is None:
                pad = self.tokenizer.eos_token_id or 0
            self.engine = CachedSampler(stop_ids(self.tokenizer, context.base_model), int(pad))
        s = self.settings
        rewards = ", ".join(f"{fn.name} x {fn.weight:g}" for fn in self.rewards)
        return (
            f"grpo: {s.num_generations} completions per prompt ({type(self.engine).__name__}: each prompt "
            f"prefilled once, its KV cache shared by its samples), temperature {s.temperature:g}, top_p "
            f"{s.top_p:g}, top_k {s.top_k}, up to {s.max_new_tokens} new tokens; rewards {rewards}; loss "
            f"{s.loss}, advantages scaled by {s.scale_rewards}, epsilon {s.epsilon:g}/"
            f"{s.epsilon_high if s.epsilon_high is not None else s.epsilon:g}, beta {s.beta:g}; the update packs "
            + (
                "prompt | completions (the prompt once)"
                if s.prefix_sharing
                else "prompt + completion, G times"
            )
        )

    # ------------------------------------------------------------------ one step
    def sample(self, model, prompts: list[dict], seed: int) -> Rollouts:
        """G completions of each of ``prompts`` by the policy (eval mode, no grad), seeded."""
        self.engine.sync(model)
        with eval_mode(model), torch.no_grad():
            return self.engine.generate(
                model, [r["prompt_ids"] for r in prompts], self.settings.num_generations, self.sampling, seed
            )

    def score_rollouts(
        self, prompts: list[dict], rollouts: Rollouts, G: int
    ) -> tuple[list[list[float]], list[dict]]:
        """Every completion's per-function rewards; and each group's completion ids."""
        texts, ids, prompt_values, columns = [], [], [], {}
        for row, completions in zip(prompts, rollouts.completions, strict=True):
            for completion in completions:
                text = self.tokenizer.decode(completion.ids, skip_special_tokens=True)
                texts.append(
                    [{"role": "assistant", "content": text}] if isinstance(row["prompt"], list) else text
                )
                ids.append(list(completion.ids))
                prompt_values.append(row["prompt"])
        names = sorted({key for row in prompts for key in row["columns"]})
        for name in names:
            columns[name] = [row["columns"].get(name) for row in prompts for _ in range(G)]
        values = score(self.rewards, prompt_values, texts, ids, columns)
        groups = [
            {
                "prompt_ids": row["prompt_ids"],
                "completions": [c.ids for c in completions],
                "finished": [c.finished for c in completions],
            }
            for row, completions in zip(prompts, rollouts.completions, strict=True)
        ]
        return values, groups

    def _stopped(self, run, step: int, error: Exception) -> TrainError:
        newest = newest_checkpoint(run.out)
        where = f"--resume continues from {newest}" if newest is not None else "no checkpoint to resume from"
        return TrainError(f"step {step + 1}: {error}; nothing of this step was applied ({where})")

    def plan_step(self, run, step: int, step_bins: Sequence[int]) -> StepPlan:
        """Step ``step``: a new round of rollouts every ``num_iterations`` steps, the kept one between."""
        k = self.settings.num_iterations
        number, iteration = divmod(step, k)
        if iteration == 0:
            plan = self._round(run, step, step_bins if k == 1 else run.bins_for(number))
            if k > 1:
                plan.record["iteration"] = 1
            self.kept = (number, plan)
            return plan
        if self.kept is None or self.kept[0] != number:  # resumed inside a round (validate prevents it)
            raise TrainError(
                f"step {step + 1} is update {iteration + 1} of {k} on round {number + 1}'s rollouts, which this "
                "process did not sample: resume from a checkpoint at a multiple of grpo.num_iterations"
            )
        kept = self.kept[1]
        repeat = {
            **kept.record,
            "generation_s": 0.0,
            "reward_s": 0.0,
            "reference_s": 0.0,
            "iteration": iteration + 1,
        }
        return StepPlan(
            micro=kept.micro, total=kept.total, tokens=kept.tokens, documents=kept.documents, record=repeat
        )

    def _round(self, run, step: int, step_bins: Sequence[int]) -> StepPlan:
        """Sample, score and pack this rank's share of ``step_bins``; the old log-probs where kept."""
        config, settings, info = self.config, self.settings, run.info
        G = settings.num_generations
        mine = [run.bins[i] for i in step_bins[info.rank :: info.world_size]]
        prompts = [row for rows in mine for row in rows]
        started = time.perf_counter()
        rollouts = self.sample(
            run.base_model, prompts, seed=(config.seed * 1_000_003 + step) * 1_009 + info.rank
        )
        generated = time.perf_counter()
        try:
            per_function, groups = self.score_rollouts(prompts, rollouts, G)
        except RewardError as error:
            raise self._stopped(run, step, error) from None
        rewards = [weighted(values, self.rewards) for values in per_function]
        scored = time.perf_counter()
        # the step's counts over every rank: completions, counted tokens, and the rewards' sums (batch std)
        lengths = [len(c) for g in groups for c in g["completions"]]
        finished = [f for g in groups for f in g["finished"]]
        counted = self.counted_tokens(groups)
        local = torch.tensor(
            [len(rewards), sum(counted), sum(rewards), sum(r * r for r in rewards)], dtype=torch.float64
        )
        totals = info.sum_tensor(local.to(run.device)).tolist() if info.enabled else local.tolist()
        completions_all, tokens_all, reward_sum, reward_squares = totals
        batch_std = None
        if settings.scale_rewards == "batch":
            mean = reward_sum / completions_all
            batch_std = math.sqrt(
                max(0.0, (reward_squares - completions_all * mean * mean) / max(1.0, completions_all - 1))
            )
        advantages = advantages_of(rewards, G, settings.scale_rewards, batch_std)
        micro = self.pack_update(
            groups, [len(rows) for rows in mine], advantages, counted, tokens_all, run.device
        )
        if settings.beta > 0:  # the reference: the same packed forward with the adapter off, before the clock
            for item in micro:
                item.reference = reference_sums(run.model, item.completions.batch, self.chunked, adapter=True)
        if settings.num_iterations > 1:  # the sampling policy's log-probs, kept for the round's k updates
            with torch.no_grad():
                for item in micro:
                    item.old = answer_sums(run.model, item.completions.batch, self.chunked).detach()
        referenced = time.perf_counter()
        total = self.loss_divisor(completions_all, tokens_all)
        record = self._record(
            per_function,
            rewards,
            lengths,
            finished,
            G,
            rollouts,
            generated - started,
            scored - generated,
            referenced - scored,
        )
        return StepPlan(
            micro=micro,
            total=total,
            tokens=sum(completion_tokens(g, prefix_sharing=False) for g in groups) * info.world_size,
            documents=[completion_documents(groups, settings.prefix_sharing)],
            record=record,
        )

    def counted_tokens(self, groups: list[dict]) -> list[int]:
        """The tokens each completion of ``groups`` counts in the loss: its length, or 0 where it was
        cut at ``max_new_tokens`` and ``mask_truncated_completions`` leaves it out."""
        mask = self.settings.mask_truncated_completions
        return [
            0 if (mask and not finished) else len(ids)
            for g in groups
            for ids, finished in zip(g["completions"], g["finished"], strict=True)
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
        G times without prefix sharing), with every token's advantage and loss mask. ``counted``: the
        tokens each completion counts in the loss (0: masked out); ``tokens_all``: the step's counted
        tokens over every rank."""
        settings, G = self.settings, self.settings.num_generations
        micro, offset = [], 0
        for count in sizes:
            first = offset * G
            packed = collate_completions(
                groups[offset : offset + count],
                settings.prefix_sharing,
                device=None,
                temperature=settings.temperature,
            )
            owner = packed.completion_index
            adv = torch.tensor(advantages[first : first + count * G], dtype=torch.float32)
            keep = torch.tensor([1.0 if c else 0.0 for c in counted[first : first + count * G]])
            seq_tokens = torch.tensor(counted[first : first + count * G], dtype=torch.float32)
            micro.append(
                GRPOMicro(
                    completions=packed.to(device),
                    advantages=adv.index_select(0, owner).to(device),
                    mask=keep.index_select(0, owner).to(device),
                    seq_tokens=seq_tokens.to(device),
                    reference=None,
                    tokens_in_step=max(1.0, tokens_all),
                )
            )
            offset += count
        return micro

    def loss_divisor(self, completions: float, tokens: float) -> float:
        """What the step's summed loss is divided by: ``dapo`` its counted tokens, ``grpo`` its
        completions, ``dr_grpo`` completions x max_new_tokens (every rank's)."""
        if self.settings.loss == "dapo":
            return max(1.0, tokens)
        if self.settings.loss == "grpo":
            return completions
        return completions * self.settings.max_new_tokens

    def _record(
        self, per_function, rewards, lengths, finished, G, rollouts, generation_s, scoring_s, reference_s
    ):
        """This rank's host-side metrics of a step (rank 0's are logged)."""
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
        record["generation_s"] = generation_s
        record["generation_tokens_per_s"] = rollouts.stats.tokens_per_s
        record["reward_s"] = scoring_s
        record["reference_s"] = reference_s
        return record

    def micro_weight(self, micro) -> int:
        return micro.completions.num_completions

    def model_device(self, micro) -> torch.device:
        return micro.advantages.device

    def step_weight(self, total, device):
        return float(total)

    def micro_batch(self, model, micro: GRPOMicro, weight):
        settings = self.settings
        logp = answer_sums(model, micro.completions.batch, self.chunked)  # [tokens]: one "answer" a token
        # num_iterations 1: the policy that sampled is the one being updated (r = 1, its gradient acts)
        old = logp.detach() if micro.old is None else micro.old
        ratio = torch.exp(logp - old)
        low, high = (
            settings.epsilon,
            settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon,
        )
        clipped_ratio = ratio.clamp(1 - low, 1 + high)
        A = micro.advantages
        per_token = -torch.minimum(ratio * A, clipped_ratio * A)
        kl = torch.zeros_like(per_token)
        if micro.reference is not None:
            delta = micro.reference.to(logp.device) - logp
            kl = torch.exp(delta) - delta - 1
            per_token = per_token + settings.beta * kl
        mask = micro.mask
        if settings.loss == "grpo":
            owner = micro.completions.completion_index
            per_seq = torch.zeros_like(micro.seq_tokens).index_add(0, owner, per_token * mask)
            loss = (per_seq / micro.seq_tokens.clamp(min=1)).sum() / weight
        else:
            loss = (per_token * mask).sum() / weight
        clipped = (((ratio < 1 - low) & (A < 0)) | ((ratio > 1 + high) & (A > 0))).float()
        tokens = micro.tokens_in_step
        found = torch.stack(
            [loss.detach(), (clipped * mask).sum() / tokens, (kl.detach() * mask).sum() / tokens]
        )
        return loss, found

    def divisor(self, total) -> float:
        return 1.0  # micro_batch's sums are already shares of the step's means

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, model, evals, info, device) -> dict[str, float]:
        """The held-out prompts' mean reward (``eval_generations`` completions each, a fixed seed)."""
        model = getattr(model, "module", model)
        sums = torch.zeros(2 + len(self.rewards) * 2, dtype=torch.float64)
        # this rank's share of the held-out prompts, sampled in one batch (no collective while sampling)
        prompts = [
            row
            for index, counts in rank_share(len(evals.bins), info.rank, info.world_size)
            if counts
            for row in evals.bins[index]
        ]
        if prompts:
            seed = (self.config.seed * 1_000_003 + 7) * 1_009 + info.rank
            with eval_mode(model), torch.no_grad():
                rollouts = self.engine.generate(
                    model,
                    [r["prompt_ids"] for r in prompts],
                    self.settings.eval_generations,
                    self.sampling,
                    seed,
                )
            try:
                per_function, _ = self.score_rollouts(prompts, rollouts, self.settings.eval_generations)
            except RewardError as error:
                raise TrainError(f"evaluation: {error}") from None
            rewards = [weighted(values, self.rewards) for values in per_function]
            self._keep_samples(prompts, rollouts, per_function, rewards)
            sums[0] += sum(rewards)
            sums[1] += len(rewards)
            for k in range(len(self.rewards)):
                values = [v[k] for v in per_function if not math.isnan(v[k])]
                sums[2 + 2 * k] += sum(values)
                sums[3 + 2 * k] += len(values)
        if info.enabled:
            sums = info.sum_tensor(sums.to(device)).cpu()
        values = sums.tolist()
        found = {"reward": values[0] / max(1.0, values[1])}
        for k, fn in enumerate(self.rewards):
            found[f"reward_{fn.name}"] = values[2 + 2 * k] / values[3 + 2 * k] if values[3 + 2 * k] else None
        return found

    def _keep_samples(self, prompts, rollouts, per_function, rewards) -> None:
        """The first ``eval_samples`` held-out completions, decoded, with their rewards (samples.jsonl)."""
        kept, index = [], 0
        for row, completions in zip(prompts, rollouts.completions, strict=True):
            for completion in completions:
                if len(kept) < self.keeps_samples:
                    kept.append(
                        {
                            "prompt": row["prompt"],
                            "completion": self.tokenizer.decode(completion.ids, skip_special_tokens=True),
                            "new_tokens": len(completion.ids),
                            "finished": completion.finished,
                            "reward": rewards[index],
                            "rewards": {
                                fn.name: (None if math.isnan(v) else v)
                                for fn, v in zip(self.rewards, per_function[index], strict=True)
                            },
                        }
                    )
                index += 1
        self._eval_samples = kept

    def eval_samples(self) -> list[dict]:
        return self._eval_samples

    def summary(self, bins, last) -> dict:
        s = self.settings
        return {
            "grpo": {
                "num_generations": s.num_generations,
                "loss": s.loss,
                "scale_rewards": s.scale_rewards,
                "beta": s.beta,
                "prefix_sharing": s.prefix_sharing,
                "rewards": [
                    {"name": fn.name, "function": fn.source, "weight": fn.weight} for fn in self.rewards
                ],
                "prompts": sum(len(b) for b in bins),
                "last_step": None if last is None else {k: last[k] for k in self.metrics},
            }
        }
