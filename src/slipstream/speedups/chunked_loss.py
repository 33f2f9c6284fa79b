"""The chunked loss: the LM head and cross-entropy a chunk of labelled tokens at a time, so the
``[tokens, vocab]`` logits never exist; by default on wherever the model's head and loss allow it
exactly, else logged and off (``loss.ChunkedLoss``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from ..fields import Range
from ..loss import ChunkedLoss, UnsupportedLoss, choose_chunk_tokens
from .base import ApplyContext, DecisionContext, Option, ParityCase, Speedup


@dataclass
class ChunkedLossState:
    """The ``loss.ChunkedLoss`` installed on a model, or None (the stock loss)."""

    loss: ChunkedLoss | None = None


class ChunkedLossSpeedup(Speedup):
    name = "chunked loss"
    stage = 30
    options = (
        Option(
            "chunked_loss",
            bool | None,
            None,
            "LM head + cross-entropy a chunk of labelled tokens at a time (default: on where supported)",
            stock=False,
        ),
        Option(
            "loss_chunk_tokens",
            Annotated[int, Range(ge=1)] | None,
            None,
            "tokens per loss chunk (default: from a memory budget)",
        ),
    )
    ablation = {"chunked_loss": False}
    ablation_name = "chunked-loss"
    doctor_label = "chunked loss"
    sweep_column = "chunked loss"
    sweep_header = "loss"

    def apply(self, run: ApplyContext) -> None:
        base, state = run.base, run.state
        own = state.of(ChunkedLossState)
        wanted, chunk_tokens = run.speedups.chunked_loss, run.speedups.loss_chunk_tokens
        current = own.loss
        if wanted is False:
            if current is not None:
                current.remove()
                own.loss = None
                state.say("chunked loss: off (stock loss)")
            return
        if current is not None:
            if current.requested_chunk_tokens != chunk_tokens:
                current.requested_chunk_tokens, current.chunk_tokens = chunk_tokens, None
            return
        try:
            own.loss = ChunkedLoss.install(base, chunk_tokens=chunk_tokens)
        except UnsupportedLoss as error:
            if wanted:
                raise
            state.say(f"chunked loss: off ({error})")
            return
        own.loss.policies = state.policies  # its first-call decisions join the model's log
        state.say("chunked loss: on (LM head + cross-entropy over labelled tokens, a chunk at a time)")

    def decide(self, context: DecisionContext) -> tuple[str, str]:
        vocab = int(context.config.get_text_config().vocab_size)  # the real model's, not the tiny one's
        tokens, why = choose_chunk_tokens(vocab, context.dtype, context.device)
        return f"{tokens} tokens per chunk", why

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "chunked loss",
                fast={"chunked_loss": True},
                stock={"chunked_loss": False},
                arms="LM head + loss a chunk at a time vs transformers' loss",
                sweep=False,  # the sweep's main arm runs it wherever the model allows
            ),
        )
