"""``training.sample_prompts``: the model's greedy answers to a few prompts, as training goes.

At every evaluation (every ``training.eval_every`` steps and at the end, with or without an
eval set) rank 0 answers each prompt with the model being trained and the run's tokenizer,
the way ``slipstream generate`` does (``models.answer.Generator``: one user turn of the chat
template when the tokenizer has one; greedy; at most ``training.sample_max_new_tokens`` new
tokens), under ``torch.no_grad()`` with the model in eval mode (each module's mode restored
after), and appends one JSON line per prompt to ``samples.jsonl``:
``{"step": N, "prompt": ..., "answer": ..., "new_tokens": K}``; each line is written whole and
flushed.

The training is not changed: greedy decoding draws no random number and seeds nothing, the
weights are only read, and no collective runs (the other ranks go on to the next step and wait
for rank 0 there). The model keeps slipstream's optimizations: without a packed batch its
packed attention runs each row as one causal sequence, as for an unpacked batch (the model's
``use_cache`` stays as ``optimize`` set it: off, each new token recomputes the prompt). A DDP
wrapper is taken off first; FSDP2 shards the weights across ranks, so ``TrainConfig.validate``
refuses ``sample_prompts`` with it. ``--resume`` keeps the lines up to the step resumed from
and appends.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..models.answer import Generator
from ..modes import eval_mode
from .distributed import unwrap
from .output_dir import SAMPLES


class Samples:
    """``samples.jsonl``, open for appending (rank 0); ``write`` answers every prompt at a step."""

    def __init__(
        self, out: Path, prompts: list[str], max_new_tokens: int, *, main: bool, evaluated: bool = False
    ) -> None:
        self.path = Path(out) / SAMPLES
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        # evaluated: the objective keeps what its evaluations produced (GRPO: sampled completions)
        opened = main and (self.prompts or evaluated)
        self.stream = self.path.open("a", encoding="utf-8") if opened else None

    @property
    def enabled(self) -> bool:
        """Whether there are prompts to answer (``training.sample_prompts``) on this rank."""
        return self.stream is not None and bool(self.prompts)

    def keep(self, step: int, records: list[dict]) -> None:
        """An evaluation's own samples after step ``step`` (rank 0); one whole, flushed line each."""
        if self.stream is None:
            return
        for record in records:  # a tool's list result may hold values JSON has no type for: their str()
            self.stream.write(json.dumps({"step": step, **record}, ensure_ascii=False, default=str) + "\n")
        self.stream.flush()

    def write(self, model: torch.nn.Module, tokenizer, step: int) -> None:
        """Answer every prompt with ``model`` after step ``step``; one whole, flushed line each."""
        if self.stream is None:
            return
        model = unwrap(model)
        generator = Generator(model, tokenizer, "the model being trained")
        with eval_mode(model), torch.no_grad():
            for prompt in self.prompts:
                answer = generator.answer(prompt, max_new_tokens=self.max_new_tokens)
                record = {
                    "step": step,
                    "prompt": prompt,
                    "answer": answer.text,
                    "new_tokens": answer.new_tokens,
                }
                self.stream.write(json.dumps(record, ensure_ascii=False) + "\n")
                self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None
