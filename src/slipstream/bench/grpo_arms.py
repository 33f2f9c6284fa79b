"""``slipstream ab --objective grpo``: the rollouts every arm updates on, and one GRPO arm in its process.

A GRPO step has two halves that are compared apart and together:

- **Sampling**: every arm samples G completions of the step's prompts with its own engine (TRL's
  ``generate`` path; slipstream's :class:`~slipstream.rollouts.CachedSampler`, each prompt prefilled
  once) and scores them with the run's rewards. Sampling draws random tokens, so two arms' completions
  differ; their lengths follow the same distribution (the same weights at step 0, the same settings),
  and the table shows each arm's mean length next to its time.
- **The update**: every arm trains on the **same rollouts**, recorded once before any arm runs
  (:func:`prepare_rollouts`: the run's own step driver samples and scores each step's round,
  ``sample_round``, on the starting weights every arm shares), so their loss and gradient norm must
  agree within the dtype's tolerance at step 0 and are judged like the DPO curves after; a slipstream
  arm packs a recorded round as ``train`` packs its own (``plan_round``).

An arm's step is its sampling, its scoring and its update, timed one after another in one process;
its ``step_s`` is their sum and ``generation_s`` / ``update_s`` are kept apart.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from ..data import DataError
from ..errors import TrainError
from ..objectives.grpo import GRPO
from ..objectives.grpo_rollouts import ScoredRound, advantages_of
from ..optimize import base_model
from ..packing.batch import cut
from ..packing.completions import completion_documents
from ..utilisation import docs_micro_batch
from .ab_config import ABConfig, resolve_device
from .arm_session import ArmSession
from .arms import train_config_of
from .inputs import ABInputError, ab_tokenizer, quiet_progress_bars, vocab_size
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


def prepare_rollouts(config: ABConfig) -> tuple[list[ScoredRound], int, dict]:
    """The rounds of the run's first ``ab.steps`` steps, one a step: each step's prompts as ``train``
    takes them, sampled and scored by the run's own step driver (``sample_round``) on the starting
    weights, with the sampler the slipstream arm runs."""
    from ..fields import ConfigError
    from ..train.distributed import Distributed
    from ..train.driver import driver_for
    from ..train.inputs import read_inputs

    tokenizer, steps = ab_tokenizer(config), config.ab.steps
    vocab = vocab_size(config, tokenizer)
    train = train_config_of(config, "slipstream-grpo")
    device = torch.device(resolve_device(config.ab.device))
    started, driver = time.perf_counter(), None
    try:
        with quiet_progress_bars():
            inputs = read_inputs(train, Distributed(), device, getattr(torch, train.model.dtype))
            driver = driver_for(train, inputs=dataclasses.replace(inputs, vocab_size=vocab))
        if driver.total < steps:
            raise ConfigError(
                f"the run trains {driver.total} optimizer steps; an A/B of {steps} steps would replay steps "
                "it never trains: lower ab.steps (--steps), or raise training.steps"
            )
        driver.prepare()  # the sampler, as train's before step 0
        context = driver.context()
        rounds = [
            driver.objective.sample_round(context, step, context.step_bins(step)) for step in range(steps)
        ]
    except ConfigError as error:
        raise ABInputError(f"{config.ab.train_config or 'the run'}: {error}") from None
    except (DataError, TrainError) as error:
        raise ABInputError(str(error)) from None
    finally:
        if driver is not None:
            driver.objective.after_training()
    return rounds, vocab, _rollout_report(config, rounds, time.perf_counter() - started)


def _rollout_report(config: ABConfig, rounds: list[ScoredRound], seconds: float) -> dict:
    """What the recorded rounds hold: prompts, completion lengths, rewards, tool use."""
    settings, G = config.train.grpo, config.train.grpo.num_generations
    used = [row for scored in rounds for row in scored.prompts]
    groups = [g for scored in rounds for g in scored.groups]
    rewards = [r for scored in rounds for r in scored.rewards]
    lengths = [_model_tokens(g, i) for g in groups for i in range(G)]
    finished = [f for g in groups for f in g["finished"]]
    spreads = [max(rewards[i : i + G]) - min(rewards[i : i + G]) for i in range(0, len(rewards), G)]
    every = sum(len(c) for g in groups for c in g["completions"])
    tools = {}
    if "tool_calls_per_trajectory" in rounds[0].record:
        keys = (
            "tool_calls_per_trajectory",
            "tool_calling_share",
            "tool_failure_rate",
            "malformed_call_share",
        )
        tools = {
            key: statistics.fmean(r.record[key] for r in rounds) for key in (*keys, "turns_per_trajectory")
        }
        tools["tool_token_share"] = 1 - sum(lengths) / every
    return {
        "prompts_trained": len(used),
        "completions_per_prompt": G,
        "mean_prompt_tokens": sum(len(r["prompt_ids"]) for r in used) / len(used),
        "min_prompt_tokens": min(len(r["prompt_ids"]) for r in used),
        "max_prompt_tokens": max(len(r["prompt_ids"]) for r in used),
        "mean_completion_tokens": sum(lengths) / len(lengths),
        "max_new_tokens": settings.max_new_tokens,
        "truncated_share": sum(1 for f in finished if not f) / len(finished),
        "mean_reward": sum(rewards) / len(rewards),
        "equal_rewards_share": sum(1 for s in spreads if s == 0) / len(spreads),
        "sampled_in_s": seconds,
        "sampled_by": "the run's step driver (slipstream's sampler) on the starting weights (the adapter at zero)",
        **tools,
    }


def _model_tokens(group: dict, index: int) -> int:
    """The tokens the model sampled of a group's ``index``-th completion (a trajectory's tool results left
    out: they are context)."""
    masks = group.get("model_masks")
    return sum(masks[index]) if masks else len(group["completions"][index])


class GrpoArmSession(ArmSession):
    """One GRPO arm in this process: its own sampling and scoring of each step's prompts, then the
    update on the recorded round (the step driver's for slipstream's arms, TRL's for its peer)."""

    def _open_peer(self):
        """slipstream's GRPO objective (the driver's; the TRL arm's its settings, rewards and agents);
        TRL's trainer."""
        if self.driver is not None:
            self.objective = self.driver.objective
            return None
        self.objective = GRPO(train_config_of(self.config, self.arm))
        tokenizer = ab_tokenizer(self.config)
        try:
            self.objective.plan_agents(tokenizer, base_model(self.model))
        except TrainError as error:
            raise ABInputError(str(error)) from None
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
            self.driver.prepare()  # the objective's sampler, as train's before step 0
        model_flops = [
            self.profile.step_flops(
                docs_micro_batch(completion_documents(groups)) for groups in cut(r.groups, r.sizes)
            )
            for r in self.plan
        ]
        return {"model_flops": model_flops, **{key: [] for key in _PER_STEP}}

    def _sample(self, step: int) -> dict:
        """Sampling and scoring of this step's prompts with this arm's engine (its own completions)."""
        if self.peer is not None:
            return self.peer.sample(self.plan[step].prompts, step)
        context, G = self.driver.context(), self.settings.num_generations
        own = self.objective.sample_round(context, step, context.step_bins(step))
        return {
            "generation_s": own.record["generation_s"],
            "scoring_s": own.record["reward_s"],
            "completions": len(own.prompts) * G,
            "generated_tokens": sum(_model_tokens(g, i) for g in own.groups for i in range(G)),
            "tool_calls": own.record.get("tool_calls_per_trajectory"),
        }

    def _update(self, scored: ScoredRound) -> dict:
        """One optimizer step on the recorded round of this step."""
        if self.peer is not None:
            G, micro_groups = self.settings.num_generations, cut(scored.groups, scored.sizes)
            advantages = advantages_of(scored.rewards, G, self.settings.scale_rewards)  # one process
            per_micro = cut(advantages, [len(micro) * G for micro in micro_groups])
            counted = self.objective.counted_tokens(scored.groups)
            return {**self.peer.update(micro_groups, per_micro, sum(counted)), "update_tokens": None}
        plan = self.objective.plan_round(self.driver.context(), scored)  # as train packs its own round
        done = self.driver.run(plan)
        # the tokens its packed rows ran (its layout: the prompt once, G times, or as trees)
        ran = sum(item.completions.batch.num_tokens for item in plan.micro)
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

    def _prepare(self, step: int) -> ScoredRound:
        return self.plan[step]

    def _timed_step(self, step: int, scored: ScoredRound) -> tuple[dict, float]:
        """Sample and score the step's prompts, then update on its recorded round (each on its clock);
        the update's metrics carry the sampling's times and counts to :meth:`_record`."""
        sampled = self._sample(step)
        self._sync()
        started = time.perf_counter()
        metrics = self._update(scored)
        self._sync()
        update_s = time.perf_counter() - started
        seconds = sampled["generation_s"] + sampled["scoring_s"] + update_s
        return {**metrics, **sampled, "update_s": update_s}, seconds

    def _record(self, step: int, metrics: dict) -> None:
        result = self.result
        for key in _PER_STEP:
            getattr(result, key).append(metrics[key])
        # the update's completion tokens (the same rollouts for every arm)
        result.tokens.append(sum(len(c) for g in self.plan[step].groups for c in g["completions"]))
