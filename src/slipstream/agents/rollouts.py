"""Multi-turn rollouts: a turn, the tools it called, the next turn, until the model answers.

TRL 1.16's tool loop, kept exactly (``GRPOTrainer._tool_call_loop``):

1. Each prompt's G first turns are sampled together (the engine prefills the prompt once).
2. A turn that ended with the end-of-turn token and called tools gets each call run (its rollout's own
   :class:`~.tools.Toolbox`), and the results' tokens (:meth:`~.calls.ToolFormat.result_ids`) are appended
   to the trajectory, marked as context: the update never trains on them. A result that would take the
   trajectory past ``max_new_tokens`` (the whole trajectory's budget, tool results included, as TRL's
   ``max_completion_length``) or the model's context is dropped and the trajectory ends at its call.
3. Every trajectory with results goes on: one more turn each, sampled from the trajectory so far, cut to
   what is left of its budget; until no turn calls a tool or ``max_tool_calling_iterations`` is reached (a
   trajectory that still calls a tool then ends at its call, unanswered).

A trajectory's tokens are its turns and results in order; ``model_mask`` says which the model sampled;
``messages`` is what a reward function gets as the completion (TRL's list of assistant and tool messages).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..rollouts import Completion, RolloutStats, Sampling, text_config, windows_in_use
from .calls import ToolFormat
from .tools import Toolbox


@dataclass
class Trajectory:
    """One rollout: every turn the model sampled and every tool result, in order."""

    ids: list[int]
    model_mask: list[int]  # 1: a token the model sampled (trained); 0: a tool result's (context only)
    logprobs: list[float] | None  # the engine's, NaN at the tool results' tokens; None: not reported
    finished: bool  # the last turn ended with the end-of-turn token (else: cut at the budget)
    messages: list[dict]  # TRL's completion: assistant and tool messages
    turns: int = 1
    calls: int = 0
    failures: int = 0
    malformed: int = 0
    tool_s: float = 0.0

    @property
    def tool_tokens(self) -> int:
        return len(self.ids) - sum(self.model_mask)


@dataclass
class AgentRollouts:
    """What :func:`agent_rollouts` returns: each prompt's G trajectories and what the sampling did."""

    trajectories: list[list[Trajectory]]
    stats: RolloutStats
    turn_s: list[float] = field(default_factory=list)  # each round of turns' sampling seconds
    iterations: int = 0  # rounds of tool calls run
    toolboxes: list[list[Toolbox]] = field(default_factory=list)  # each rollout's (its environment)
    prompt_ids: list[list[int]] = field(default_factory=list)  # each prompt as sampled from

    @property
    def completions(self) -> list[list[Completion]]:
        """The trajectories as :class:`~slipstream.rollouts.Completion` (what single-turn code reads)."""
        return [[Completion(t.ids, t.finished, t.logprobs) for t in row] for row in self.trajectories]


@dataclass
class _Loop:
    """What deciding a trajectory's next step needs: the format, the budgets and the cap."""

    fmt: ToolFormat
    budget: int  # max_new_tokens: the whole trajectory's, tool results included
    context: int
    cap: float  # tool rounds a trajectory may run

    def answer(self, t: Trajectory, box: Toolbox, prompt_length: int) -> list[int] | None:
        """Run the calls of ``t``'s last turn; the results' tokens to append (and the tool messages added),
        or None where the trajectory ends at its call (the cap reached, or the results do not fit: TRL
        drops them)."""
        calls = t.messages[-1].get("tool_calls")
        if not calls or t.turns - 1 >= self.cap:
            return None
        results = []
        for result in box.call_turn([(c["function"]["name"], c["function"]["arguments"]) for c in calls]):
            t.calls += 1
            t.failures += int(result.failed)
            t.tool_s += result.seconds
            results.append((result.name, result.content))
        suffix = self.fmt.result_ids(calls, results)
        grown = len(t.ids) + len(suffix)
        if grown > self.budget or prompt_length + grown >= self.context:
            return None
        t.ids += suffix
        t.model_mask += [0] * len(suffix)
        if t.logprobs is not None:
            t.logprobs += [math.nan] * len(suffix)
        t.messages += [{"role": "tool", "name": name, "content": content} for name, content in results]
        return suffix

    def add_turn(self, t: Trajectory, ids: list[int], finished: bool, logprobs: list[float] | None) -> None:
        """A turn the model sampled, appended, counted and parsed."""
        t.ids += ids
        t.model_mask += [1] * len(ids)
        if t.logprobs is not None:
            t.logprobs = t.logprobs + list(logprobs) if logprobs is not None else None
        t.finished = finished
        t.turns += 1
        if ids:
            parsed = self.fmt.parse(ids)
            t.malformed += int(parsed.malformed)
            t.messages.append(parsed.message())


def _empty(logprobs: bool) -> Trajectory:
    return Trajectory(
        ids=[], model_mask=[], logprobs=[] if logprobs else None, finished=False, messages=[], turns=0
    )


def agent_rollouts(
    engine,
    model,
    prompts: Sequence[Sequence[int]],
    toolboxes: Sequence[Sequence[Toolbox]],
    fmt: ToolFormat,
    num_generations: int,
    sampling: Sampling,
    seed: int,
    max_iterations: int | None,
    context: int,
) -> AgentRollouts:
    """G trajectories of each prompt; ``toolboxes[p][g]``: rollout (p, g)'s tools; ``context``: the
    longest sequence the model takes (prompt and trajectory). An engine that can continue a sequence in
    place (slipstream's sampler: ``continues_turns``) keeps each trajectory's KV cache across its turns
    (only the tool results are prefilled); any other is asked turn by turn with the whole trajectory
    so far (vLLM's prefix cache holds what it has seen)."""
    loop = _Loop(
        fmt, sampling.max_new_tokens, context, math.inf if max_iterations is None else max_iterations
    )
    # not under a sliding window or chunked attention: the in-place cache's padding columns would count in it
    if getattr(engine, "continues_turns", False) and not windows_in_use(text_config(model)):
        found = _in_place(engine, model, prompts, toolboxes, loop, num_generations, sampling, seed)
    else:
        found = _turn_by_turn(engine, model, prompts, toolboxes, loop, num_generations, sampling, seed)
    found.toolboxes = [list(row) for row in toolboxes]
    found.prompt_ids = [list(p) for p in prompts]
    return found


def _in_place(engine, model, prompts, toolboxes, loop: _Loop, G, sampling, seed) -> AgentRollouts:
    every = [_empty(False) for _ in range(len(prompts) * G)]

    def turn_end(row: int, tokens: list[int]) -> list[int] | None:
        t = every[row]
        loop.add_turn(t, tokens[len(t.ids) :], True, None)
        return loop.answer(t, toolboxes[row // G][row % G], len(prompts[row // G]))

    out = engine.generate(model, prompts, G, sampling, seed, turn_end=turn_end)
    for row, completion in enumerate(c for group in out.completions for c in group):
        t = every[row]
        rest = completion.ids[len(t.ids) :]
        if rest or not t.messages:  # a turn cut at the budget (or a first turn that never stopped)
            loop.add_turn(t, rest, completion.finished, None)
        t.finished = completion.finished
        if t.ids != list(completion.ids):
            raise RuntimeError("the sampler's completion and the trajectory it was fed differ")
    rounds = max((t.turns - 1 for t in every), default=0)
    rows = [every[p * G : (p + 1) * G] for p in range(len(prompts))]
    return AgentRollouts(rows, out.stats, [out.stats.seconds], rounds)


def _turn_by_turn(engine, model, prompts, toolboxes, loop: _Loop, G, sampling, seed) -> AgentRollouts:
    began = time.perf_counter()
    first = engine.generate(model, prompts, G, sampling, seed)
    stats = replace(first.stats)  # its seconds are this whole call's, set at the end
    turn_s = [first.stats.seconds]
    trajectories: list[list[Trajectory]] = []
    for group in first.completions:
        row = []
        for c in group:
            t = _empty(c.logprobs is not None)
            loop.add_turn(t, list(c.ids), c.finished, c.logprobs)
            row.append(t)
        trajectories.append(row)
    pending = [(p, g) for p, row in enumerate(trajectories) for g, t in enumerate(row) if t.finished]
    iterations = 0
    while pending:
        requests, budgets, going = [], [], []
        for p, g in pending:
            t = trajectories[p][g]
            if loop.answer(t, toolboxes[p][g], len(prompts[p])) is None:
                continue  # no call, the cap, or results that do not fit: the trajectory ends here
            left = min(loop.budget - len(t.ids), loop.context - len(prompts[p]) - len(t.ids))
            if left <= 0:  # the results filled the budget: the trajectory ends with them, cut
                t.finished = False
                continue
            requests.append(list(prompts[p]) + t.ids)
            budgets.append(left)
            going.append((p, g))
        if not going:
            break
        iterations += 1
        turn = Sampling(sampling.temperature, sampling.top_p, sampling.top_k, max(budgets))
        out = engine.generate(model, requests, 1, turn, seed + 1_000_003 * iterations)
        stats.prefill_tokens += out.stats.prefill_tokens
        stats.generated_tokens += out.stats.generated_tokens
        stats.decode_steps += out.stats.decode_steps
        turn_s.append(out.stats.seconds)
        pending = []
        for (p, g), (completion,), budget in zip(going, out.completions, budgets, strict=True):
            t = trajectories[p][g]
            ids = list(completion.ids)[:budget]
            finished = completion.finished and len(ids) == len(completion.ids)
            logprobs = completion.logprobs[: len(ids)] if completion.logprobs is not None else None
            loop.add_turn(t, ids, finished, logprobs)
            if finished:
                pending.append((p, g))
    stats.seconds = time.perf_counter() - began
    return AgentRollouts(trajectories, stats, turn_s, iterations)
