"""A rollout engine that answers from a script instead of a model: the agent loop's tests drive it."""

from __future__ import annotations

import json
from collections.abc import Callable

from slipstream.rollouts import Completion, Rollouts, RolloutStats


class ScriptedEngine:
    """``script(text_so_far, g) -> str``: the turn to sample for a request (the prompt and trajectory so far,
    decoded) of trajectory g of its prompt (a continuation keeps the g of the turn it extends); the
    end-of-turn token is appended unless the turn ends with ``...`` (then it is cut at max_new_tokens, as a
    turn that ran out). ``in_place``: turns continue inside one call, through ``turn_end``, as slipstream's
    sampler continues them from each row's kept cache. Records every request."""

    def __init__(
        self,
        tokenizer,
        script: Callable[[str, int], str],
        in_place: bool = False,
        logprob: float | None = None,
    ):
        self.tokenizer = tokenizer
        self.script = script
        self.continues_turns = in_place
        self.logprob = logprob  # reported for every sampled token, as vLLM reports its own (None: none)
        self.requests: list[tuple[list[list[int]], int, int]] = []  # (prompts, n, max_new_tokens)
        self.lineage: list[tuple[list[int], int]] = []  # every sequence sampled so far, with its g
        self.synced = 0

    def sync(self, model) -> None:
        self.synced += 1

    def _turn(self, text: str, g: int, room: int) -> tuple[list[int], bool]:
        turn = self.script(text, g)
        cut = turn.endswith("...")
        ids = self.tokenizer(turn.removesuffix("..."), add_special_tokens=False)["input_ids"]
        ids = ids if cut else ids + [self.tokenizer.eos_token_id]
        return ids[:room], not cut and len(ids) <= room

    def generate(self, model, prompts, num_generations, sampling, seed, turn_end=None) -> Rollouts:
        self.requests.append(([list(p) for p in prompts], num_generations, sampling.max_new_tokens))
        out, generated = [], 0
        for p, prompt in enumerate(prompts):
            group = []
            lineage = sorted(self.lineage, key=lambda item: len(item[0]))
            extends = [g for seq, g in lineage if list(prompt[: len(seq)]) == seq]
            for g in range(num_generations):
                g = extends[-1] if extends and num_generations == 1 else g
                tokens: list[int] = []
                while True:
                    text = self.tokenizer.decode(list(prompt) + tokens)
                    ids, finished = self._turn(text, g, sampling.max_new_tokens - len(tokens))
                    tokens += ids
                    generated += len(ids)
                    more = turn_end(p * num_generations + g, tokens) if finished and turn_end else None
                    if not more:
                        break
                    tokens += more
                self.lineage.append((list(prompt) + tokens, g))
                reported = None if self.logprob is None else [self.logprob] * len(tokens)
                group.append(Completion(tokens, finished, reported))
            out.append(group)
        stats = RolloutStats(
            prompts=len(prompts),
            completions=len(prompts) * num_generations,
            prefill_tokens=sum(map(len, prompts)),
            generated_tokens=generated,
            seconds=0.0,
        )
        return Rollouts(out, stats)


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
