"""Rollouts for online RL: G sampled completions of each prompt, each prompt prefilled once.

GRPO samples G completions of every prompt from the current policy. ``generate(...,
num_return_sequences=G)`` (what TRL's GRPOTrainer does without vLLM) copies each prompt G times
before the prefill, so every layer runs the prompt G times; here the prompts are prefilled once
(left-padded into one batch), their KV cache is repeated G times along the batch
(``Cache.batch_repeat_interleave``: a copy, no compute), and the G x prompts sequences decode
together. A row leaves the batch as soon as it has sampled a stop token
(``Cache.batch_select_indices``), so the rows still decoding do not carry the finished ones.

The engine is one small interface (:class:`RolloutEngine`): ``sync(model)`` before a step's
rollouts (an engine that holds its own copy of the weights, such as a vLLM server, takes the
adapter's weights there; :class:`CachedSampler` samples from the model itself and has nothing
to copy) and ``generate(model, prompts, num_generations, sampling, seed)``.

Sampling is seeded: a ``torch.Generator`` seeded from ``seed`` alone draws every token of a call,
so the same policy, prompts and seed give the same completions (a resumed run samples what the
uninterrupted one did). Temperature, top-k and top-p act on fp32 logits in that order (as
transformers' processors do). The model is run as given (the caller puts it in eval mode); the
masks are 4D, built here (slipstream's packed attention and stock attention both honour a 4D
mask a caller prepared), so padded prompts never attend to their padding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from .refusal import Refusal


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (``grpo.temperature`` / ``top_p`` / ``top_k`` / ``max_new_tokens``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    max_new_tokens: int = 128


@dataclass
class Completion:
    """One sampled completion: its tokens (the stop token included when one ended it)."""

    ids: list[int]
    finished: bool  # ended by a stop token; False: cut at max_new_tokens
    # each token's log-prob under the distribution it was drawn from (an engine that reports them:
    # vLLM's differ from the trainer's, which the update corrects for); None: not reported
    logprobs: list[float] | None = None


@dataclass
class RolloutStats:
    """What a call did, in counts that do not depend on the machine, and its time."""

    prompts: int = 0
    completions: int = 0
    prefill_tokens: int = 0  # prompt tokens run through the model (each prompt once)
    generated_tokens: int = 0  # sampled tokens, stop tokens included
    decode_steps: int = 0  # forwards after the prefill
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class Rollouts:
    """``completions[p][g]``: completion g of prompt p; what producing them took."""

    completions: list[list[Completion]]
    stats: RolloutStats = field(default_factory=RolloutStats)


class RolloutEngine(Protocol):
    """What the GRPO objective asks of a generation engine (ours, or a vLLM / SGLang server later)."""

    def sync(self, model: torch.nn.Module) -> None:
        """Make the engine sample from ``model``'s current weights (before each step's rollouts)."""

    def generate(
        self,
        model: torch.nn.Module,
        prompts: Sequence[Sequence[int]],
        num_generations: int,
        sampling: Sampling,
        seed: int,
    ) -> Rollouts:
        """``num_generations`` completions of every prompt (token ids), seeded by ``seed``."""


class UnsupportedRollout(Refusal, NotImplementedError):
    """A model :class:`CachedSampler` cannot sample from exactly; the message names what and why.

    No speedup avoids it (``avoid`` None): the sampler is not one of the optimizations; the data
    (a shorter ``max_seq_len``) or the model must change."""

    avoid = None


def text_config(model):
    """The model's text config (a multimodal model's language part), or None."""
    config = getattr(model, "config", None)
    return getattr(config, "get_text_config", lambda: config)() if config is not None else None


def context_length(model, default: int) -> int:
    """The model's context in tokens (its text config's ``max_position_embeddings``), else ``default``."""
    return int(getattr(text_config(model), "max_position_embeddings", None) or default)


def windows_in_use(config) -> dict[str, int]:
    """The sliding window and the attention chunk the model's layers use, by config key (a sliding window
    the named layer kinds do not use is left out)."""
    kinds = set(getattr(config, "layer_types", None) or [])
    found = {}
    for key in ("sliding_window", "attention_chunk_size"):
        window = getattr(config, key, None)
        uses = key != "sliding_window" or not kinds or "sliding_attention" in kinds
        if isinstance(window, int) and not isinstance(window, bool) and uses:
            found[key] = window
    return found


def _last_column(takes: bool, width: int, device) -> dict:
    """``logits_to_keep`` for the last of ``width`` columns, where the model ``takes`` it: as an index, not
    ``1``. The slice ``1`` makes is a strided view of the hidden states, which the LM head's matmul cannot
    fold into one GEMM (it broadcast the head's weight to [rows, width, vocab] and copied it); an index
    gathers a contiguous [rows, 1, hidden]."""
    return {"logits_to_keep": torch.tensor([width - 1], device=device)} if takes else {}


def check_sampleable(model: torch.nn.Module, longest: int) -> None:
    """Refuse a model whose attention the sampler's masks do not describe: a sliding window or
    chunked attention shorter than ``longest`` (prompt + completion), or layers that are not
    attention (recurrent / linear-attention states would carry the prompts' left padding)."""
    config = text_config(model)
    if config is None:
        return
    name = getattr(config, "model_type", type(model).__name__)
    kinds = set(getattr(config, "layer_types", None) or [])
    other = sorted(kinds - {"full_attention", "sliding_attention"})
    if other:
        raise UnsupportedRollout(
            f"{name}: layers of kind {', '.join(other)}: rollouts by slipstream's sampler cover attention "
            "layers only (a recurrent state would take in the prompts' padding)",
            refused=f"sampling {name}'s {', '.join(other)} layers",
        )
    for key, window in windows_in_use(config).items():
        if window < longest:
            raise UnsupportedRollout(
                f"{name}: {key} {window} is shorter than a prompt and its completion ({longest} tokens): "
                "slipstream's sampler would attend past it; lower data.max_seq_len to at most "
                f"{window}, or use a model without it",
                refused=f"sampling past {name}'s {key}",
            )


def sample_next(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """[N] token ids drawn from [N, V] logits after temperature, top-k and top-p."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.top_p < 1.0:
        ordered, order = scores.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass (the first stays)
        drop = probs.cumsum(-1) - probs >= sampling.top_p
        scores = scores.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    # inverse-CDF sampling: one uniform a row, found in the cumulative probabilities. The same
    # distribution as torch.multinomial, whose exponential draw over the whole vocabulary took 14%
    # of a SmolLM2 decode step here; a token cut above (probability 0) has an empty interval
    cdf = scores.softmax(-1).cumsum(-1)
    u = torch.rand((cdf.shape[0], 1), generator=generator, device=cdf.device, dtype=cdf.dtype) * cdf[:, -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(1)


def _prefill_mask(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, L, L] additive mask: causal, padding keys hidden; a padding query sees itself (so no
    row is fully masked and nothing it computes is NaN; nothing reads it)."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    allowed = causal & valid[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=valid.device)
    return _additive(allowed[:, None], dtype)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(dtype).min
    )


@dataclass
class CachedSampler:
    """Our engine: the model itself, with a KV cache; each prompt prefilled once for its G samples.

    ``stop_ids``: the token ids that end a completion (the tokenizer's EOS and the chat
    template's end-of-turn); ``pad_id`` fills the padding of the prompts' batch."""

    stop_ids: tuple[int, ...]
    pad_id: int = 0
    continues_turns = True  # generate(turn_end=...): a multi-turn rollout keeps its KV cache across turns

    def sync(self, model: torch.nn.Module) -> None:
        """Nothing to copy: it samples from the model it is given."""

    @staticmethod
    def _forward_params(model) -> frozenset[str]:
        """The keyword arguments the causal LM's own forward names (under a PEFT wrapper, which
        passes ``**kwargs`` on, the model it wraps)."""
        import inspect

        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        return frozenset(inspect.signature(inner.forward).parameters)

    @torch.no_grad()
    def generate(self, model, prompts, num_generations, sampling, seed, turn_end=None) -> Rollouts:
        """G completions of each prompt. ``turn_end(completion, tokens)`` (multi-turn rollouts,
        :mod:`slipstream.agents`): called when completion number ``completion`` samples a stop token,
        with its tokens so far; it returns the tokens to feed it next (a tool's result, which become
        part of the completion: the row keeps its KV cache and only they are prefilled) or None (done).
        Every completion is cut at ``max_new_tokens`` tokens, results included."""
        from transformers import DynamicCache

        started = time.perf_counter()
        if not prompts:
            raise ValueError("generate needs at least one prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt is empty: it needs at least one token")
        device = next(model.parameters()).device
        dtype = model.get_input_embeddings().weight.dtype  # the activations' (a 4-bit base's too)
        generator = torch.Generator(device=device)
        generator.manual_seed(int(seed))
        count, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((count, width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(count, width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            valid[row, width - len(prompt) :] = True
        ids, valid = ids.to(device), valid.to(device)
        positions = (valid.long().cumsum(1) - 1).clamp(min=0)
        config = getattr(model, "config", None)
        cache = DynamicCache(config=config) if config is not None else DynamicCache()
        params = self._forward_params(model)
        # the cache under the name this transformers takes (``cache``, or ``past_key_values`` before it)
        cached = {"cache" if "cache" in params else "past_key_values": cache, "use_cache": True}
        # logits_to_keep: the prefill's [B, L, V] logits are never built, the last position's only
        last_only = "logits_to_keep" in params
        out = model(
            input_ids=ids,
            attention_mask=_prefill_mask(valid, dtype),
            position_ids=positions,
            **cached,
            **_last_column(last_only, width, device),
        )
        logits = out.logits[:, -1]  # the cache was filled in place
        # the G samples of a prompt share its cache: repeated along the batch, not recomputed
        cache.batch_repeat_interleave(num_generations)
        logits = logits.repeat_interleave(num_generations, 0)
        valid = valid.repeat_interleave(num_generations, 0)
        next_position = positions[:, -1].repeat_interleave(num_generations, 0) + 1
        total = count * num_generations
        tokens: list[list[int]] = [[] for _ in range(total)]
        finished = [False] * total
        stops = torch.tensor(sorted(set(self.stop_ids)), dtype=torch.long, device=device)
        stats = RolloutStats(prompts=count, completions=total, prefill_tokens=sum(len(p) for p in prompts))
        rows = list(range(total))  # which completion each batch row is
        budget = sampling.max_new_tokens
        while True:
            drawn = sample_next(logits, sampling, generator)
            ended = torch.isin(drawn, stops) if stops.numel() else torch.zeros_like(drawn, dtype=torch.bool)
            # the step's one host read: the drawn tokens and which of them stop
            drawn_now, ended_now = torch.stack([drawn, ended.long()]).tolist()
            feed: dict[int, list[int]] = {}  # batch row -> the tool result it takes in next
            leaving = []
            for index, (row, token, stop) in enumerate(zip(rows, drawn_now, ended_now, strict=True)):
                tokens[row].append(token)
                finished[row] = bool(stop)
                more = turn_end(row, tokens[row]) if stop and turn_end is not None else None
                if more:
                    if len(tokens[row]) + len(more) > budget:
                        raise ValueError(f"turn_end fed {len(more)} tokens past completion {row}'s budget")
                    tokens[row].extend(more)
                    finished[row] = False
                    feed[index] = list(more)
                if (stop and index not in feed) or len(tokens[row]) >= budget:
                    leaving.append(index)  # a result that fills the budget ends it too: nothing is fed
                    feed.pop(index, None)
            stats.generated_tokens += len(rows)
            if len(leaving) == len(rows):
                break
            if leaving:  # rows that are done leave the batch (and the cache)
                kept = [i for i in range(len(rows)) if i not in set(leaving)]
                keep = torch.tensor(kept, dtype=torch.long, device=device)
                cache.batch_select_indices(keep)
                feed = {kept.index(i): more for i, more in feed.items()}
                rows = [rows[i] for i in kept]
                drawn_now = [drawn_now[i] for i in kept]
                drawn, valid, next_position = drawn[keep], valid[keep], next_position[keep]
            if not feed:  # a decode step: each row takes in the token it drew
                valid = torch.cat([valid, torch.ones(valid.shape[0], 1, dtype=torch.bool, device=device)], 1)
                out = model(
                    input_ids=drawn[:, None],
                    attention_mask=_additive(valid[:, None, None, :], dtype),
                    position_ids=next_position[:, None],
                    **cached,
                )
                next_position = next_position + 1
            else:  # some rows take in a tool's result (after the token they drew), the others their token
                out, valid, next_position = self._feed(
                    model, cached, last_only, drawn_now, feed, valid, next_position, dtype
                )
                stats.prefill_tokens += sum(len(more) for more in feed.values())
            logits = out.logits[:, -1]
            stats.decode_steps += 1
        done = [Completion(ids, stop) for ids, stop in zip(tokens, finished, strict=True)]
        stats.seconds = time.perf_counter() - started
        return Rollouts([done[p * num_generations : (p + 1) * num_generations] for p in range(count)], stats)

    @staticmethod
    def _feed(model, cached, last_only: bool, drawn: list[int], feed, valid, next_position, dtype):
        """One forward in which row i takes in its drawn token and, where ``feed[i]`` holds one, a tool's
        result after it: the rows' inputs right-aligned (left padding marked invalid, so every later query
        skips it), each token at its own position, causal within the chunk. ``drawn``: the step's tokens as
        the host already read them (no second read). ``last_only``: the model takes ``logits_to_keep``; the
        last column's logits only are built."""
        device = valid.device
        inputs = [[token] + feed.get(i, []) for i, token in enumerate(drawn)]
        chunk = max(len(x) for x in inputs)
        rows = len(inputs)
        ids = torch.zeros(rows, chunk, dtype=torch.long)
        real = torch.zeros(rows, chunk, dtype=torch.bool)
        offsets = torch.zeros(rows, chunk, dtype=torch.long)
        for i, x in enumerate(inputs):
            ids[i, chunk - len(x) :] = torch.tensor(x)
            real[i, chunk - len(x) :] = True
            offsets[i, chunk - len(x) :] = torch.arange(len(x))
        ids, real, offsets = ids.to(device), real.to(device), offsets.to(device)
        keys = torch.cat([valid, real], 1)  # [rows, K + chunk]
        past = valid.shape[1]
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=device).tril()
        allowed = torch.cat(
            [keys[:, None, :past].expand(rows, chunk, past), causal[None] & real[:, None, :]], 2
        )
        allowed[:, torch.arange(chunk), past + torch.arange(chunk)] = True  # a padding query sees itself
        out = model(
            input_ids=ids,
            attention_mask=_additive(allowed[:, None], dtype),
            position_ids=next_position[:, None] + offsets,
            **cached,
            **_last_column(last_only, chunk, device),
        )
        lengths = torch.tensor([len(x) for x in inputs], dtype=torch.long, device=device)
        return out, keys, next_position + lengths
