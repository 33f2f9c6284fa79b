"""GRPO with tools (``grpo.tools`` / ``grpo.environment``): the objective's side of :mod:`slipstream.agents`.

:class:`AgentPlan` holds the run's tools and the chat template's tool format; for a batch of prompt rows
it opens each rollout's toolbox (its own environment instance, ``reset`` with the row's fields, as TRL
does), samples the trajectories, and gives the scoring what TRL's reward functions get: each completion
as its list of assistant and tool messages, and ``environments`` (the rollouts' instances) where there is
an environment. The update trains every token the model sampled and none of the tool results'
(``model_masks``), and each step records what the tools did. It is one of GRPO's
:class:`~.grpo_rollouts.Turns`, beside one completion a rollout.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..agents.calls import ToolFormat
from ..agents.rollouts import AgentRollouts, agent_rollouts
from ..agents.tools import ToolError, ToolSet
from ..data.errors import DataError
from ..data.prompts import tokenize_prompt
from ..errors import TrainError
from ..rewards import RewardFunction
from .grpo_rollouts import sampled_groups


def load_toolset(settings, base: Path | None = None) -> ToolSet | None:
    """The configured tools and environment (None: a single-turn run); a ToolError names the key."""
    if not settings.tools and settings.environment is None:
        return None
    return ToolSet.load(settings.tools, settings.environment, base, settings.tool_timeout_s)


def environment_reward(toolset: ToolSet) -> RewardFunction:
    """The environment's ``get_reward`` as one more reward (weight 1, named after the class, as TRL adds it);
    async where ``get_reward`` is."""
    import inspect

    cls = toolset.environment
    if inspect.iscoroutinefunction(cls.get_reward):

        async def get_reward(environments, **kwargs):
            return [await e.get_reward() for e in environments]

    else:

        def get_reward(environments, **kwargs):
            return [e.get_reward() for e in environments]

    return RewardFunction(cls.__name__, get_reward, 1.0, "grpo.environment")


@dataclass
class AgentPlan:
    """Multi-turn tool-calling rollouts (a :class:`~.grpo_rollouts.Turns`)."""

    toolset: ToolSet
    format: ToolFormat
    schema: list  # what the chat template renders as the tools
    max_iterations: int | None
    context: int  # the model's context (TRL ends a trajectory whose next result would reach it)
    tokenizer: Any
    room: int  # a prompt's tokens at most (reset()'s text appended: tokenized again within it)

    @classmethod
    def make(
        cls, toolset: ToolSet, tokenizer, max_iterations: int | None, context: int, room: int
    ) -> AgentPlan:
        fmt = ToolFormat.of(tokenizer)
        schema = toolset.schema_tools()
        fmt.check(schema)
        return cls(toolset, fmt, schema, max_iterations, context, tokenizer, room)

    def line(self) -> str:
        cap = "no cap" if self.max_iterations is None else f"at most {self.max_iterations}"
        env = f", environment {self.toolset.environment.__name__}" if self.toolset.environment else ""
        return (
            f"tools {self.toolset.described}{env} ({self.format.name} calls; {cap} tool rounds a trajectory, "
            f"{self.toolset.timeout_s:g} s a call; tool results are context, never trained)"
        )

    def rollouts(self, engine, model, prompts: list[dict], G: int, sampling, seed: int) -> AgentRollouts:
        """G trajectories of each prompt row; each rollout's toolbox opened (``reset``) first."""
        boxes, ids = [], []
        for row in prompts:
            fields = {"prompt": row["prompt"], **row["columns"]}
            opened = []
            for _ in range(G):
                try:
                    opened.append(self.toolset.open(dict(fields)))
                except ToolError as error:
                    raise TrainError(f"{row['location']}: {error}") from None
                except Exception as error:  # the user's reset()
                    raise TrainError(
                        f"{row['location']}: {self.toolset.environment.__name__}.reset() raised "
                        f"{type(error).__name__}: {error}"
                    ) from None
            observations = {obs for _, obs in opened}
            if len(observations) > 1:
                raise TrainError(
                    f"{row['location']}: reset() returned different text for the {G} rollouts of this prompt; "
                    "slipstream samples a prompt's rollouts from one prompt (each prefilled once): make reset "
                    "depend on the row only"
                )
            (observation,) = observations
            boxes.append([box for box, _ in opened])
            ids.append(row["prompt_ids"] if observation is None else self._observed(row, observation))
        return agent_rollouts(
            engine, model, ids, boxes, self.format, G, sampling, seed, self.max_iterations, self.context
        )

    def _observed(self, row: dict, observation: str) -> list[int]:
        """The prompt with ``reset``'s text appended to its last message (TRL's rule), tokenized again."""
        messages = [dict(m) for m in row["prompt"]]
        messages[-1]["content"] = messages[-1]["content"] + observation
        try:
            found = tokenize_prompt(
                {"prompt": messages},
                self.tokenizer,
                room=self.room,
                location=row["location"],
                tools=self.schema,
            )
            return found["prompt_ids"]
        except DataError as error:
            raise TrainError(str(error)) from None

    def completions(self, prompts: list[dict], rollouts: AgentRollouts) -> tuple[list, dict]:
        """What TRL's reward functions get of trajectories: each completion's messages, and the rollouts'
        environment instances (``environments``) where there is an environment."""
        messages = [t.messages for row in rollouts.trajectories for t in row]
        extra = {}
        if self.toolset.environment is not None:
            extra["environments"] = [box.environment for row in rollouts.toolboxes for box in row]
        return messages, extra

    def groups(self, prompts: list[dict], rollouts: AgentRollouts) -> list[dict]:
        """The tokens the model sampled (1) and the tool results' (0: context only), and each prompt as
        sampled from (with reset()'s text, where the environment gave one)."""
        groups = sampled_groups(prompts, rollouts)
        for group, row, prompt_ids in zip(groups, rollouts.trajectories, rollouts.prompt_ids, strict=True):
            group["model_masks"] = [t.model_mask for t in row]
            group["prompt_ids"] = list(prompt_ids)
        return groups

    def record(self, rollouts: AgentRollouts) -> dict[str, Any]:
        """A step's tool metrics (hardware-independent counts beside the times)."""
        every = [t for row in rollouts.trajectories for t in row]
        calls = sum(t.calls for t in every)
        tokens = sum(len(t.ids) for t in every)
        return {
            "tool_calls_per_trajectory": calls / len(every),
            "tool_failure_rate": sum(t.failures for t in every) / calls if calls else 0.0,
            "tool_calling_share": sum(1 for t in every if t.calls) / len(every),
            "malformed_call_share": sum(1 for t in every if t.malformed) / len(every),
            "turns_per_trajectory": statistics.fmean(t.turns for t in every),
            "tool_token_share": sum(t.tool_tokens for t in every) / tokens if tokens else 0.0,
            "tool_s": sum(t.tool_s for t in every),
            "turn_generation_s": list(rollouts.turn_s),
        }

    def samples(self, rollouts: AgentRollouts) -> list[dict]:
        """Whole trajectories for samples.jsonl: every turn, call and result."""
        return [
            {"messages": t.messages, "tool_calls": t.calls, "tool_failures": t.failures, "turns": t.turns}
            for row in rollouts.trajectories
            for t in row
        ]
