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
   gradient acts. With ``num_iterations: k`` > 1 a batch of rollouts (a *round*: the loop hands
   its k steps the same bins, ``updates_per_round``) is updated on in k steps; ``logp_old`` is
   read once, after sampling, by a ``no_grad`` forward in the same packed layout, and kept for the
   round. ``loss`` aggregates the tokens: ``dapo`` (sum over every completion token of the
   step / their count, TRL's default), ``grpo`` (each completion's token mean, then the mean over
   completions), ``dr_grpo`` (token sum / (completions x max_new_tokens)). The reference (``beta``
   > 0) is the base model: the same packed forward with the adapter off, no grad, before the step.
   ``data.share_prefixes`` packs a micro-batch as prefix trees where its prompts and completions share
   more than one prompt per group (:mod:`.grpo_sharing`): the same log-probs, fewer tokens.
   ``mask_truncated_completions`` leaves completions cut at ``max_new_tokens`` out of the loss.

The step's metrics: the loss, the clipped share of tokens and the KL (read with the loss, in the
step's one read); the rewards (per function), the completion lengths, the share of groups whose
rewards are all equal, and generation vs update time, from the host.

Rooms: steps 1-3 and the packing of 4 are :mod:`.grpo_rollouts`, behind two small protocols: who
samples (a :class:`slipstream.rollouts.RolloutEngine`, started by :mod:`.grpo_engines`) and how a
rollout unfolds (a :class:`.grpo_rollouts.Turns`: one completion, or a tool-calling trajectory,
:mod:`.grpo_agents`); the loss of 4 is :func:`slipstream.loss.grpo.policy_loss`; here, the settings
(:class:`GRPOSettings`, the config's ``grpo:`` section), the prompts, the rounds, the update's step and
evaluation; the config's checks are :mod:`.grpo_checks`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
from tqdm import tqdm

from ..agents.tools import ToolError
from ..data import PackingReport
from ..data.prompts import load_prompts, split_prompts
from ..errors import TrainError
from ..fields import NonNegative, Positive, Range
from ..loss.grpo import policy_loss
from ..loss.importance import importance_weights
from ..modes import eval_mode
from ..optimize import state_of
from ..rewards import RewardCall, RewardError, RewardFunction, load_rewards, weighted
from ..rollouts import context_length
from .answers import answer_sums
from .base import (
    Objective,
    ObjectiveContext,
    ObjectiveData,
    StepPlan,
    register_objective,
    split_held_out,
    tokenizer_refusals,
)
from .evaluation import HeldOut, rank_share
from .grpo_agents import AgentPlan, environment_reward, load_toolset
from .grpo_checks import validate_grpo
from .grpo_engines import described, start_engine
from .grpo_rollouts import GRPOMicro, RolloutMaker
from .grpo_sharing import CompletionTrees
from .sharing import LayoutCost


@dataclass
class GRPOSettings:
    """Online RL's settings: the config's ``grpo:`` section (``training.objective: grpo``): rollouts,
    rewards and the clipped update. Each field's rule is declared here, where it is read."""

    num_generations: Annotated[int, Range(ge=2)] = 8  # completions sampled per prompt (G)
    prompts_per_batch: Positive = 2  # prompts per micro-batch, each with its G completions
    max_new_tokens: Positive = 128
    temperature: Annotated[float, Range(gt=0)] = 1.0
    top_p: Annotated[float, Range(gt=0, le=1)] = 1.0
    top_k: NonNegative = 0  # 0: no top-k cut
    # the reward functions: "module:function" (a .py file next to the config, or an importable
    # module) or a built-in's name (answer_tag, format_regex, length_penalty), or a mapping
    # {function, weight, args}; TRL's convention f(prompts, completions, completion_ids, **columns)
    rewards: list[Any] = field(default_factory=list)
    # dapo: every completion token weighs the same over the step (TRL's default); grpo: each
    # completion's token mean, then the mean over completions; dr_grpo: the token sum over
    # completions x max_new_tokens
    loss: Literal["dapo", "grpo", "dr_grpo"] = "dapo"
    # advantages: reward minus its group's mean, divided by the group's std, the batch's, or nothing
    scale_rewards: Literal["group", "batch", "none"] = "group"
    epsilon: Annotated[float, Range(gt=0, lt=1)] = 0.2  # the ratio's clip below 1
    epsilon_high: Annotated[float, Range(gt=0)] | None = None  # and above 1 (None: epsilon)
    beta: Annotated[float, Range(ge=0)] = 0.0  # the KL to the reference (the adapter off); 0: none
    num_iterations: Positive = 1  # updates per batch of rollouts
    mask_truncated_completions: bool = False  # leave completions cut at max_new_tokens out of the loss
    # the prompt run once for its G completions in the update (else prompt + completion, G times)
    prefix_sharing: bool = True
    # who samples: hf (slipstream's sampler: the model itself, each prompt prefilled once) or vllm
    # (vLLM in a process of its own, the policy synced to it each round: slipstream.engines.vllm_engine)
    engine: Literal["hf", "vllm"] = "hf"
    vllm_sync: Literal["merged", "lora"] = "merged"  # the policy reaches vLLM as merged weights or an adapter
    # the share of the device's memory vLLM reserves (TRL's key; host memory on vLLM's CPU backend)
    vllm_gpu_memory_utilization: Annotated[float, Range(gt=0, le=1)] = 0.3
    # vLLM's sampling log-probs are not the trainer's: each token's (or completion's) loss weighted by
    # their ratio, capped (TRL's keys and defaults; slipstream.loss.importance)
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = "sequence_mask"
    vllm_importance_sampling_clip_max: Annotated[float, Range(gt=0)] | None = 3.0
    vllm_importance_sampling_clip_min: Annotated[float, Range(ge=0)] | None = None
    # multi-turn tool calling in TRL's convention (slipstream.agents): functions ("file.py:name") the model
    # may call, and an environment class ("file.py:Class": one instance per rollout, reset(**row), its
    # methods the tools, get_reward() one more reward); tool rounds per trajectory (None: until the model
    # answers without a call) and each call's timeout (a hung tool is an error the model reads)
    tools: list[str] = field(default_factory=list)
    environment: str | None = None
    max_tool_calling_iterations: Positive | None = None
    tool_timeout_s: Annotated[float, Range(gt=0)] = 30.0
    eval_generations: Positive = 1  # completions per held-out prompt at an evaluation
    eval_samples: NonNegative = 4  # held-out completions kept per evaluation in samples.jsonl (with rewards)


@register_objective
class GRPO(RolloutMaker, Objective):
    name = "grpo"
    reads = "prompts"
    metrics = ("loss", "clip_fraction", "kl")
    # with rollouts from vLLM and the correction on: the mean |log-prob difference| between sampler and
    # trainer over the counted tokens, and the share of those tokens the cap changed
    corrected_metrics = ("sampling_logp_difference", "importance_sampling_clipped_share")

    def __init__(self, config: Any, settings: GRPOSettings | None = None, engine: Any = None) -> None:
        super().__init__(config)
        self.settings = settings if settings is not None else config.grpo
        self.engine = engine  # a RolloutEngine; ours (CachedSampler) when None, made in before_training
        self.engine_line = ""  # what the log says of the engine (set with it)
        self.rewards: list[RewardFunction] = (
            load_rewards(self.settings.rewards) if self.settings.rewards else []
        )
        self.toolset = load_toolset(self.settings)  # None: single-turn
        if self.toolset is not None and self.toolset.rewards_itself:
            self.rewards.append(environment_reward(self.toolset))
        self.agents: AgentPlan | None = None  # made with the tokenizer (read)
        self.tokenizer = None
        self.chunked = True
        self.kept: tuple[int, StepPlan] | None = None  # (round, its plan): num_iterations > 1
        self.keeps_samples = self.settings.eval_samples
        self._eval_samples: list[dict] = []
        self.evaluated_at = (0, 0)  # (steps done, max_steps): an evaluation's trainer_state for a reward
        if self.corrects:
            self.metrics = (*self.metrics, *self.corrected_metrics)

    @property
    def corrects(self) -> bool:
        """Whether the update weighs tokens by TRL's importance sampling (rollouts from vLLM)."""
        return self.settings.engine == "vllm" and self.settings.vllm_importance_sampling_correction

    @property
    def updates_per_round(self) -> int:
        """``grpo.num_iterations``: the steps that train on one round of rollouts."""
        return self.settings.num_iterations

    @property
    def prompt_room(self) -> int:
        """A prompt's tokens at most: the packed length less the completion's budget."""
        return self.config.data.max_seq_len - self.settings.max_new_tokens

    @classmethod
    def validate(cls, config, fail) -> None:
        validate_grpo(config, fail)  # the config's checks (.grpo_checks)

    # ------------------------------------------------------------------ rows and bins
    def read(self, tokenizer, info) -> ObjectiveData:
        config = self.config
        self.tokenizer = tokenizer
        room = self.prompt_room
        on_bad_row = "skip" if config.data.skip_bad_rows else "error"

        schema = self.plan_agents(tokenizer)
        load = tokenizer_refusals(
            config,
            lambda path: load_prompts(path, tokenizer, room=room, on_bad_row=on_bad_row, tools=schema),
        )

        rows, report = load(config.data.path)
        rows, evals = split_held_out(
            config,
            info,
            rows,
            load=load,
            split=split_prompts,
            eval_set=lambda held_out, source: HeldOut(
                self.prompt_bins(held_out), source, len(held_out), "prompts"
            ),
            what="prompts",
            said=lambda eval_report: eval_report.skipped,
        )
        if info.is_main and report.skipped:
            tqdm.write(f"slipstream train: {report.summary()}")
        bins = self.prompt_bins(rows)
        tokens = sum(len(r["prompt_ids"]) for r in rows)
        packing = PackingReport(
            num_samples=len(rows), num_bins=len(bins), real_tokens=tokens, capacity=tokens, efficiency=1.0
        )
        return ObjectiveData(rows, bins, packing, report, evals)

    def plan_agents(self, tokenizer, model=None) -> list | None:
        """With tools: the agent plan for ``tokenizer``'s chat template (its tool-call format, refused by
        name where there is none), ``model``'s context where given; the tool schema the prompts render
        (None: a single-turn run). Public: the A/B plans its arms' agents without reading the rows."""
        if self.toolset is None:
            return None
        if self.agents is None:
            try:
                self.agents = AgentPlan.make(
                    self.toolset,
                    tokenizer,
                    self.settings.max_tool_calling_iterations,
                    self.config.data.max_seq_len,
                    room=self.prompt_room,
                )
            except ToolError as error:
                raise TrainError(str(error)) from None
        if model is not None:
            self.agents.context = context_length(model, self.config.data.max_seq_len)
        return self.agents.schema

    def prompt_bins(self, rows: list[dict]) -> list[list[dict]]:
        """``prompts_per_batch`` prompts a bin, in a seeded order (the step plan shuffles bins per epoch);
        public: the A/B draws its shared rollouts from the bins train would."""
        order = list(range(len(rows)))
        random.Random(f"slipstream grpo bins {self.config.seed}").shuffle(order)
        size = self.settings.prompts_per_batch
        return [[rows[i] for i in order[start : start + size]] for start in range(0, len(order), size)]

    def documents(self, rows: Sequence[dict]) -> list[dict]:
        return [{"input_ids": r["prompt_ids"], "labels": [-100] * len(r["prompt_ids"])} for r in rows]

    def weight(self, rows: Sequence[dict]) -> int:
        # completions; the step's real weight comes with its rollouts
        return len(rows) * self.settings.num_generations

    def tokens(self, rows: Sequence[dict]) -> int:
        return sum(len(r["prompt_ids"]) for r in rows) * self.settings.num_generations

    # ------------------------------------------------------------------ before step 0
    def before_training(self, context: ObjectiveContext) -> str | None:
        state = state_of(context.base_model)
        self.chunked = state is not None and state.chunked_loss is not None
        self.evaluated_at = (0, context.steps)
        if self.tokenizer is None:
            self.tokenizer = context.tokenizer
        if self.engine is None:  # hf: our sampler; vllm: its own process (.grpo_engines)
            self.engine, self.engine_line = start_engine(self.config, self.settings, context, self.tokenizer)
        elif not self.engine_line:  # an engine handed in
            self.engine_line = described(self.engine)
        self.plan_agents(self.tokenizer, context.base_model)
        s = self.settings
        self.trees = None
        if s.prefix_sharing and self.chunked:
            model = context.base_model
            self.trees = CompletionTrees.make(
                self.config.data.share_prefixes,
                model,
                lambda: LayoutCost.of(model, context.device, context.dtype),
            )
        rewards = ", ".join(f"{fn.name} x {fn.weight:g}" for fn in self.rewards)
        tools = f"; {line}" if (line := self.turns.line()) else ""
        layout = (
            "prompt | completions (the prompt once)" if s.prefix_sharing else "prompt + completion, G times"
        )
        if self.trees is not None:
            layout += f"; {self.trees.policy()}"
        sampler = self.engine_line
        return (
            f"grpo: {s.num_generations} completions per prompt ({sampler}), temperature {s.temperature:g}, top_p "
            f"{s.top_p:g}, top_k {s.top_k}, up to {s.max_new_tokens} new tokens{tools}; rewards {rewards}; loss "
            f"{s.loss}, advantages scaled by {s.scale_rewards}, epsilon {s.epsilon:g}/"
            f"{s.epsilon_high if s.epsilon_high is not None else s.epsilon:g}, beta {s.beta:g}; the update packs "
            f"{layout}"
        )

    def after_training(self) -> None:
        """The engine's process stops with the run, however the run ends."""
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ one step
    def plan_step(self, context: ObjectiveContext, step: int, step_bins: Sequence[int]) -> StepPlan:
        """Step ``step``: a new round of rollouts every ``num_iterations`` steps (``step_bins``: the
        round's, as the loop hands them), the kept one between."""
        k = self.settings.num_iterations
        number, iteration = divmod(step, k)
        self.evaluated_at = (step + 1, context.steps)  # trainer_state of an evaluation after this step
        if iteration == 0:
            plan = self.plan_round(context, self.sample_round(context, step, step_bins))
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
        importance, corrected, difference = None, None, None
        if self.corrects and micro.sampling is not None:  # rollouts from vLLM: TRL's importance sampling
            importance, corrected, difference = importance_weights(
                old,
                micro.sampling,
                micro.mask,
                micro.completions.completion_index,
                micro.seq_tokens.numel(),
                settings.vllm_importance_sampling_mode,
                settings.vllm_importance_sampling_clip_min,
                settings.vllm_importance_sampling_clip_max,
            )
            if micro.record is not None:  # rank 0's largest difference, read after the step
                largest = difference.max()
                kept = micro.record.get("sampling_logp_difference_max")
                micro.record["sampling_logp_difference_max"] = (
                    largest if kept is None else torch.maximum(kept, largest)
                )
        loss, clipped, kl = policy_loss(
            logp,
            old,
            micro.advantages,
            micro.mask,
            weight,
            epsilon=settings.epsilon,
            epsilon_high=settings.epsilon_high,
            beta=settings.beta,
            reference=micro.reference,
            aggregate=settings.loss,
            owner=micro.completions.completion_index,
            seq_tokens=micro.seq_tokens,
            importance=importance,
        )
        mask, tokens = micro.mask, micro.tokens_in_step
        found = [loss.detach(), (clipped * mask).sum() / tokens, (kl.detach() * mask).sum() / tokens]
        if self.corrects:
            zero = torch.zeros((), device=mask.device)
            found += [
                difference.sum() / tokens if difference is not None else zero,
                corrected.sum() / tokens if corrected is not None else zero,
            ]
        found = torch.stack(found)
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
            G = self.settings.eval_generations
            self.sync_engine(model, self.evaluated_at[0])  # the weights of the step just done
            with eval_mode(model), torch.no_grad():
                rollouts = self.generate_rollouts(model, prompts, G, seed)
            call = RewardCall(*self.evaluated_at)
            try:
                per_function, _ = self.score_rollouts(prompts, rollouts, G, call)
            except RewardError as error:
                raise TrainError(f"evaluation: {error}") from None
            rewards = [weighted(values, self.rewards) for values in per_function]
            self._keep_samples(prompts, rollouts, per_function, rewards, call.extra)
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

    def _keep_samples(self, prompts, rollouts, per_function, rewards, extra=None) -> None:
        """The first ``eval_samples`` held-out completions, decoded, with their rewards (samples.jsonl)
        and the columns the reward functions logged for each (``log_extra``: one value a completion,
        as TRL's completions table shows them)."""
        count = len(rewards)
        columns = {name: values for name, values in (extra or {}).items() if len(values) == count}
        every = [
            (row, c)
            for row, completions in zip(prompts, rollouts.completions, strict=True)
            for c in completions
        ]
        self._eval_samples = [
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
                **({"extra": {name: values[index] for name, values in columns.items()}} if columns else {}),
            }
            for index, (row, completion) in enumerate(every[: self.keeps_samples])
        ]
        for sample, more in zip(self._eval_samples, self.turns.samples(rollouts), strict=False):
            sample.update(more)  # a trajectory's turns, calls and results

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
                "share_prefixes": "off" if self.trees is None else self.trees.policy(),
                "rewards": [
                    {"name": fn.name, "function": fn.source, "weight": fn.weight} for fn in self.rewards
                ],
                "prompts": sum(len(b) for b in bins),
                "last_step": None if last is None else {k: last[k] for k in self.metrics},
            }
        }
