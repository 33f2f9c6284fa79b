"""``slipstream ab --objective grpo``: the rollouts every arm updates on, and one GRPO arm in its process.

A GRPO step has two halves that are compared apart and together:

- **Sampling**: every arm samples G completions of the step's prompts with its own engine (TRL's
  ``generate`` path; slipstream's :class:`~slipstream.rollouts.CachedSampler`, each prompt prefilled
  once) and scores them with the run's rewards. Sampling draws random tokens, so two arms' completions
  differ; their lengths follow the same distribution (the same weights at step 0, the same settings),
  and the table shows each arm's mean length next to its time.
- **The update**: every arm trains on the **same rollouts**, sampled once before any arm runs
  (:func:`prepare_rollouts`: slipstream's sampler on the starting weights, which every arm shares),
  so their loss and gradient norm must agree within the dtype's tolerance at step 0 and are judged
  like the DPO curves after.

An arm's step is its sampling, its scoring and its update, timed one after another in one process;
its ``step_s`` is their sum and ``generation_s`` / ``update_s`` are kept apart.
"""

from __future__ import annotations

import statistics
import time
from itertools import accumulate

from ..data import DataError
from ..data.prompts import load_prompts
from ..data.steps import step_order
from ..errors import TrainError
from ..objectives.base import StepPlan
from ..objectives.grpo import GRPO
from ..objectives.grpo_agents import AgentRollouts, agent_record
from ..objectives.grpo_rollouts import advantages_of, stop_ids
from ..optimize import base_model
from ..packing.completions import completion_documents
from ..rewards import RewardCall, RewardError, weighted
from ..rollouts import CachedSampler, UnsupportedRollout, check_sampleable
from ..utilisation import docs_micro_batch
from .ab_config import ABConfig, resolve_device
from .arm_session import ArmSession
from .arms import build_arm_model, train_config_of
from .inputs import ABInputError, ab_tokenizer, vocab_size
from .peers.trl_base import trainer_run

# what a GRPO arm keeps of each step beyond the curves every arm keeps
_PER_STEP = (
    "generation_s",
    "scoring_s",
    "update_s",
    "completions",
    "generated_tokens",
    "tool_calls",
    "update_tokens",
)


def _seed(config: ABConfig, step: int) -> int:
    """The sampling seed of ``step`` (as ``slipstream train`` draws it on rank 0)."""
    return (config.train.seed * 1_000_003 + step) * 1_009


def _objective(config: ABConfig, arm: str, tokenizer, model) -> GRPO:
    """Slipstream's GRPO objective for ``arm`` (its prefix sharing; its agents where there are tools),
    with our sampler."""
    objective = GRPO(train_config_of(config, arm))
    objective.tokenizer = tokenizer
    try:
        objective.plan_agents(tokenizer, base_model(model))
    except TrainError as error:
        raise ABInputError(str(error)) from None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    objective.engine = CachedSampler(stop_ids(tokenizer, base_model(model)), int(pad))
    return objective


def prepare_rollouts(config: ABConfig) -> tuple[list, int, dict]:
    """The rollouts of every step, ``[step][micro_batch] -> groups`` (a prompt's row, its G completions,
    whether each ended, their rewards), sampled once by slipstream's sampler on the starting weights."""
    settings = config.train.grpo
    if not settings.rewards:
        raise ABInputError(
            "objective grpo: the workload names no reward function (--config RUN.yaml with grpo.rewards)"
        )
    tokenizer = ab_tokenizer(config)
    vocab = vocab_size(config, tokenizer)
    room = config.train.data.max_seq_len - settings.max_new_tokens
    if room <= 0:
        raise ABInputError(
            f"max_seq_len {config.train.data.max_seq_len} leaves no room for a prompt beside max_new_tokens {settings.max_new_tokens}"
        )
    planned = GRPO(train_config_of(config, "slipstream-grpo"))
    try:
        schema = planned.plan_agents(tokenizer)  # with tools: rendered into every prompt, as train's
        rows, _ = load_prompts(config.train.data.path, tokenizer, room=room, tools=schema)
    except (DataError, TrainError) as error:
        raise ABInputError(str(error)) from None
    # the prompts of each step as slipstream train takes them: the objective's bins of prompts_per_batch
    # prompts, in data.steps' seeded order, grad_accum bins a step
    bins = planned.prompt_bins(rows)
    needed = config.ab.steps * config.train.training.grad_accum
    if len(bins) < needed:
        raise ABInputError(
            f"{config.train.data.path}: {len(rows)} prompts make {len(bins)} batches of prompts_per_batch, fewer than "
            f"steps x grad_accum = {needed}"
        )
    bins_for = step_order(len(bins), config.train.training.grad_accum, config.train.seed)
    device = resolve_device(config.ab.device)
    model = build_arm_model(config, "slipstream-grpo", vocab, device)
    try:
        check_sampleable(base_model(model), config.train.data.max_seq_len)
    except UnsupportedRollout as error:
        raise ABInputError(f"model {config.model}: {error}") from None
    objective = _objective(config, "slipstream-grpo", tokenizer, model)
    G = settings.num_generations
    plan, started = [], time.perf_counter()
    all_rewards, lengths, finished, tools = [], [], [], []
    for step in range(config.ab.steps):
        prompts = [row for index in bins_for(step) for row in bins[index]]
        rollouts = objective.sample(model, prompts, _seed(config, step))
        try:
            call = RewardCall(step=step, max_steps=config.ab.steps)  # the trainer_state a train step hands
            per_function, groups = objective.score_rollouts(prompts, rollouts, G, call)
        except RewardError as error:
            raise ABInputError(f"step {step + 1} of the shared rollouts: {error}") from None
        rewards = [weighted(values, objective.rewards) for values in per_function]
        if objective.agents is not None:
            tools.append(agent_record(rollouts))
        for index, (row, group) in enumerate(zip(prompts, groups, strict=True)):
            group["row"] = {key: row[key] for key in ("prompt", "prompt_ids", "columns", "location")}
            group["rewards"] = rewards[index * G : (index + 1) * G]
        # a micro-batch per bin, as train's step has them
        cuts = [0, *accumulate(len(bins[index]) for index in bins_for(step))]
        plan.append([groups[start:end] for start, end in zip(cuts, cuts[1:], strict=False)])
        all_rewards += rewards
        lengths += [_model_tokens(g, i) for g in groups for i in range(G)]
        finished += [f for g in groups for f in g["finished"]]
    spreads = [
        max(all_rewards[i : i + G]) - min(all_rewards[i : i + G]) for i in range(0, len(all_rewards), G)
    ]
    used = [g["row"] for step in plan for micro in step for g in micro]
    return (
        plan,
        vocab,
        {
            "prompts_trained": len(used),
            "completions_per_prompt": G,
            "mean_prompt_tokens": sum(len(r["prompt_ids"]) for r in used) / len(used),
            "min_prompt_tokens": min(len(r["prompt_ids"]) for r in used),
            "max_prompt_tokens": max(len(r["prompt_ids"]) for r in used),
            "mean_completion_tokens": sum(lengths) / len(lengths),
            "max_new_tokens": settings.max_new_tokens,
            "truncated_share": sum(1 for f in finished if not f) / len(finished),
            "mean_reward": sum(all_rewards) / len(all_rewards),
            "equal_rewards_share": sum(1 for s in spreads if s == 0) / len(spreads),
            "sampled_in_s": time.perf_counter() - started,
            "sampled_by": "slipstream's CachedSampler on the starting weights (the adapter at zero)",
            **(_tool_figures(tools, plan) if tools else {}),
        },
    )


def _model_tokens(group: dict, index: int) -> int:
    """The tokens the model sampled of a group's ``index``-th completion (a trajectory's tool results left
    out: they are context)."""
    masks = group.get("model_masks")
    return sum(masks[index]) if masks else len(group["completions"][index])


def _tool_figures(records: list[dict], plan: list) -> dict:
    """What the shared trajectories did with their tools (each step's agent record, averaged over steps;
    the tool-result tokens counted over all)."""
    groups = [g for step in plan for micro in step for g in micro]
    every = sum(len(c) for g in groups for c in g["completions"])
    model = sum(_model_tokens(g, i) for g in groups for i in range(len(g["completions"])))
    keys = ("tool_calls_per_trajectory", "tool_calling_share", "tool_failure_rate", "malformed_call_share")
    return {
        **{key: statistics.fmean(r[key] for r in records) for key in (*keys, "turns_per_trajectory")},
        "tool_token_share": 1 - model / every,
    }


class GrpoArmSession(ArmSession):
    """One GRPO arm in this process: its own sampling and scoring of each step's prompts, then the
    update on the shared rollouts (the step driver's for slipstream's arms, TRL's for its peer)."""

    def _open_peer(self):
        """slipstream's GRPO objective (the driver's, or one for the TRL arm's scoring); TRL's trainer."""
        if self.driver is not None:
            self.objective = self.driver.objective
            return None
        tokenizer = ab_tokenizer(self.config)
        self.objective = _objective(self.config, self.arm, tokenizer, self.model)
        self.objective.chunked = self.state is not None and self.state.chunked_loss is not None
        if self.spec.peer != "trl":
            return None
        from .peers.trl_grpo_step import TrlGrpoStep

        return TrlGrpoStep(
            self.model,
            tokenizer,
            self.objective.settings,
            self.objective.rewards,
            agents=self.objective.agents,
            device=self.device,
            **trainer_run(self.config),
        )

    def _set_up(self) -> dict:
        self.settings = self.objective.settings
        if self.driver is not None:
            self.driver.prepare()  # the objective's sampler (CachedSampler), as train's before step 0
        model_flops = [
            self.profile.step_flops(docs_micro_batch(completion_documents(groups)) for groups in step)
            for step in self.plan
        ]
        return {"model_flops": model_flops, **{key: [] for key in _PER_STEP}}

    def _sample(self, rows: list[dict], step: int) -> dict:
        """Sampling and scoring of this step's prompts with this arm's engine (its own completions)."""
        if self.peer is not None:
            return self.peer.sample(rows, step)
        objective, G = self.objective, self.settings.num_generations
        started = time.perf_counter()
        rollouts = objective.sample(self.model, rows, _seed(self.config, step))
        generated = time.perf_counter()
        call = RewardCall(step=step, max_steps=self.config.ab.steps)
        per_function, groups = objective.score_rollouts(rows, rollouts, G, call)
        # as a real step (and TRL's scoring) does; the update uses the shared rollouts' own
        rewards = [weighted(values, objective.rewards) for values in per_function]
        advantages_of(rewards, G, self.settings.scale_rewards)
        trajectories = isinstance(rollouts, AgentRollouts)
        return {
            "generation_s": generated - started,
            "scoring_s": time.perf_counter() - generated,
            "completions": len(rows) * G,
            "generated_tokens": sum(_model_tokens(g, i) for g in groups for i in range(G)),
            "tool_calls": agent_record(rollouts)["tool_calls_per_trajectory"] if trajectories else None,
        }

    def _update(self, micro_groups: list[list[dict]]) -> dict:
        """One optimizer step on the shared rollouts of this step."""
        objective, settings, G = self.objective, self.settings, self.settings.num_generations
        groups = [g for micro in micro_groups for g in micro]
        rewards = [r for g in groups for r in g["rewards"]]
        advantages = advantages_of(rewards, G, settings.scale_rewards)  # one process: the step's own std
        counted = objective.counted_tokens(groups)
        if self.peer is not None:
            cuts = [0, *accumulate(len(micro) * G for micro in micro_groups)]
            per_micro = [advantages[start:end] for start, end in zip(cuts, cuts[1:], strict=False)]
            return {**self.peer.update(micro_groups, per_micro, sum(counted)), "update_tokens": None}
        micro = objective.pack_update(
            groups, [len(m) for m in micro_groups], advantages, counted, float(sum(counted)), self.device
        )
        plan = StepPlan(
            micro=micro,
            total=objective.loss_divisor(len(rewards), float(sum(counted))),
            tokens=sum(counted),
            documents=[],
        )
        done = self.driver.run(plan)  # the driver's step on the shared rollouts
        # the tokens its packed rows ran (its layout: the prompt once, G times, or as trees)
        ran = sum(item.completions.batch.num_tokens for item in micro)
        return {**done.metrics, "lr": done.lr, "update_tokens": ran}

    def _after_figures(self) -> None:
        """An engine in a process of its own (vLLM): its peak memory joins the arm's; it stops."""
        engine = getattr(self.objective, "engine", None)
        if hasattr(engine, "peak_memory_mb"):
            engine_mb = engine.peak_memory_mb()
            self.result.peak_memory_mb += engine_mb
            self.result.memory_kind += f" + the vLLM engine's process ({engine_mb:.0f} MB)"
            if engine.sync_s:  # inside each step's generation time
                self.result.policies.append(
                    f"vLLM sync ({engine.sync_mode}): {statistics.median(engine.sync_s):.2f} s a round (median of "
                    f"{len(engine.sync_s)}), {engine.sync_bytes / 2**20:.0f} MiB of weights"
                )
            self.objective.after_training()

    def _prepare(self, step: int) -> list[list[dict]]:
        return self.plan[step]

    def _timed_step(self, step: int, micro_groups) -> tuple[dict, float]:
        """Sample and score the step's prompts, then update on its shared rollouts (each on its clock);
        the update's metrics carry the sampling's times and counts to :meth:`_record`."""
        rows = [g["row"] for micro in micro_groups for g in micro]
        sampled = self._sample(rows, step)
        self._sync()
        started = time.perf_counter()
        metrics = self._update(micro_groups)
        self._sync()
        update_s = time.perf_counter() - started
        seconds = sampled["generation_s"] + sampled["scoring_s"] + update_s
        return {**metrics, **sampled, "update_s": update_s}, seconds

    def _record(self, step: int, metrics: dict) -> None:
        result = self.result
        for key in _PER_STEP:
            getattr(result, key).append(metrics[key])
        # the update's completion tokens (the same rollouts for every arm)
        result.tokens.append(
            sum(len(c) for micro in self.plan[step] for g in micro for c in g["completions"])
        )
