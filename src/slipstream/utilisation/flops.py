"""Model FLOPs of one training step, counted from the model's modules and the packed batch.

Model FLOPs are the useful matmul work of forward + backward (PaLM's "model FLOPs", not the
hardware's): what a perfect implementation must compute for the batch's real tokens. Recompute
(activation checkpointing), padding, elementwise ops (norms, activations, RoPE, softmax, the
loss) and the optimizer are not counted. A multiply-add is 2 FLOPs.

For a linear ``in -> out`` applied to one token (a row):

    forward                      2 * in * out
    input gradient  dL/dx        2 * in * out    (every linear: the gradient flows through frozen layers too)
    weight gradient dL/dW        2 * in * out    (trainable weights only)

so a frozen (or 4-bit) base linear costs 4 * in * out per token, a trainable one 6 * in * out.
A LoRA adapter is two trainable linears, A: in -> r and B: r -> out (6 * r * (in + out) per token).
A router (``nn.Linear``, or a ``...Router`` module holding its own [experts, hidden] weight) runs on
every token.
Routed experts (``@use_experts_implementation`` modules with 3D weights, or ``experts.<i>``
lists of linears) run on top-k (token, expert) pairs, not on every token: per token that is
``top_k`` experts' projections. The LM head runs on the rows it is given (``head_rows``): the
A/B harness and ``train`` give it the labelled rows, the ones the loss needs.

Attention, per layer, per (query, key) pair, per query head of size d:

    forward     2 * d (q . k)  +  2 * d (p * v)              =  4 * d
    backward    dq, dk (2 matmuls) + dp, dv (2 matmuls)      =  8 * d

so 12 * d * heads FLOPs per pair and layer. Pairs are counted per document (packing: a token
sees only its own document) and causally: a document of L tokens has L * (L + 1) / 2 pairs (the
unmasked half of the square, as FlashAttention counts), or min(i + 1, window) per query under a
sliding window. ``causal="full"`` counts the full L * L square instead (what a dense masked
matmul computes, and what ``torch.utils.flop_counter`` sees of eager attention).

The model is read by walking its modules, not by architecture: ``nn.Linear`` (bitsandbytes'
``Linear4bit`` and PEFT's ``lora_A`` / ``lora_B`` are ``nn.Linear``), the experts modules and
their expert LoRA, and the config's attention heads, head size and layer types.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from ..data.labels import count_label_tokens

Causal = Literal["half", "full"]
# Config keys naming how many experts each token is routed to (DBRX: ffn_config.moe_top_k).
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_top_k", "top_k", "moe_k")
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# A linear inside a list of experts (``mlp.experts.3.up_proj``): it sees a share of the tokens.
_EXPERT_LIST = re.compile(r"(^|\.)experts\.\d+\.")


def _linear_cost(in_features: int, out_features: int, trainable: bool) -> int:
    """FLOPs per row of forward + backward: 2 (forward) + 2 (input grad) [+ 2 (weight grad)] per weight."""
    return (6 if trainable else 4) * in_features * out_features


@dataclass
class FlopProfile:
    """Per-token, per-head-row and per-attention-pair FLOPs of one model (forward + backward).

    ``breakdown`` names where the per-token FLOPs come from (frozen / trainable linears, LoRA,
    experts), for a reader checking the count."""

    token_flops: int  # every linear but the LM head, per token (experts: top_k per token)
    head_row_flops: int  # the LM head, per row it projects
    # per attention-layer group: (layers, FLOPs per (query, key) pair in one layer, sliding window or None)
    attention: list[tuple[int, int, int | None]]
    breakdown: dict[str, int] = field(default_factory=dict)

    def attention_pairs(self, length: int, window: int | None, causal: Causal = "half") -> int:
        """(query, key) pairs one document of ``length`` tokens attends over."""
        if causal == "full":
            return length * length
        if window is None or length <= window:
            return length * (length + 1) // 2
        # the first `window` queries see 1..window keys, every later one exactly `window`
        return window * (window + 1) // 2 + (length - window) * window

    def micro_batch_flops(self, seq_lens: Sequence[int], head_rows: int, causal: Causal = "half") -> int:
        """Model FLOPs of forward + backward of one packed micro-batch (documents of ``seq_lens``)."""
        attention = sum(
            layers * per_pair * self.attention_pairs(length, window, causal)
            for layers, per_pair, window in self.attention
            for length in seq_lens
        )
        return self.linear_flops(seq_lens, head_rows) + attention

    def linear_flops(self, seq_lens: Sequence[int], head_rows: int) -> int:
        """The linear layers' share of ``micro_batch_flops`` (no attention): the matmuls' work."""
        return sum(seq_lens) * self.token_flops + head_rows * self.head_row_flops

    def step_flops(self, micro_batches: Iterable[tuple[Sequence[int], int]], causal: Causal = "half") -> int:
        """Model FLOPs of one optimizer step: ``(seq_lens, head_rows)`` per micro-batch."""
        return sum(self.micro_batch_flops(lens, rows, causal) for lens, rows in micro_batches)


def _first_int(configs, keys) -> int | None:
    for config in configs:
        for key in keys:
            value = getattr(config, key, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules transformers dispatches through its registry (decorated classes, by duck type)."""
    return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed")]


def _expert_projection_flops(module: torch.nn.Module) -> dict[str, int]:
    """Per routed (token, expert) pair: the experts' base projections and their expert LoRA."""
    nf4 = getattr(module, "slipstream_nf4", None)
    lora = getattr(module, "slipstream_lora", None)
    flops = {"experts": 0, "expert_lora": 0}
    for name in ("gate_up_proj" if module.has_gate else "up_proj", "down_proj"):
        weight = getattr(module, name, None)
        if isinstance(weight, torch.Tensor):
            shape, trainable = tuple(weight.shape), weight.requires_grad
        elif nf4 is not None and name in nf4.shapes:
            shape, trainable = nf4.shapes[name], False  # 4-bit: frozen
        else:
            continue
        _, a, b = shape  # [E, out, in], or [E, in, out] when transposed (GPT-OSS)
        in_features, out_features = (a, b) if module.is_transposed else (b, a)
        flops["experts"] += _linear_cost(in_features, out_features, trainable)
        if lora is not None and name in lora.adapters:
            rank = lora.config.r
            flops["expert_lora"] += _linear_cost(in_features, rank, True) + _linear_cost(
                rank, out_features, True
            )
    return flops


def _attention_groups(config) -> list[tuple[int, int, int | None]]:
    """(layers, FLOPs per pair and layer, window) for the model's softmax-attention layers."""
    heads = getattr(config, "num_attention_heads", None)
    hidden = getattr(config, "hidden_size", None)
    if not heads or not hidden:
        return []
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_pair = 12 * head_dim * heads  # forward 4 * d, backward 8 * d, per query head
    layers = getattr(config, "num_hidden_layers", 0)
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(config, "sliding_window", None)
    full = sum(1 for t in types if t == "full_attention")
    sliding = sum(1 for t in types if t in ("sliding_attention", "chunked_attention"))
    if window is None:
        full, sliding = full + sliding, 0
    groups = [(full, per_pair, None)] if full else []
    if sliding:
        groups.append((sliding, per_pair, window))
    return groups


def flop_profile(model: torch.nn.Module) -> FlopProfile:
    """Count ``model``'s per-token, per-head-row and per-pair FLOPs (see the module docstring).

    ``model`` may be a PEFT wrapper, carry 4-bit linears or experts, and expert LoRA."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    # (experts, top_k) from the config or its ffn / moe sub-config; (None, None) for a dense model
    configs = [config] + [
        getattr(config, key) for key in ("ffn_config", "moe_config") if hasattr(config, key)
    ]
    experts, top_k = _first_int(configs, EXPERT_COUNT_KEYS), _first_int(configs, TOP_K_KEYS)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    head_ids = {id(m) for m in head.modules()} if head is not None else set()
    breakdown = dict.fromkeys(
        ("frozen_linear", "trainable_linear", "lora", "router", "experts", "expert_lora"), 0
    )
    head_row = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".original_module" in name:
            continue  # (PEFT's modules_to_save keeps an inactive copy of the module it trains)
        weight = module.weight
        cost = _linear_cost(
            module.in_features, module.out_features, weight is not None and weight.requires_grad
        )
        if id(module) in head_ids:
            head_row += cost
        elif _EXPERT_LIST.search(name) and experts and top_k:
            breakdown["experts"] += cost * top_k // experts  # each token visits top_k of the experts
        elif ".lora_A." in name or ".lora_B." in name:
            breakdown["lora"] += cost
        else:
            breakdown["trainable_linear" if weight.requires_grad else "frozen_linear"] += cost
    for module in base.modules():  # routers that hold their weight themselves (Qwen3-MoE's, GPT-OSS's)
        weight = getattr(module, "weight", None)
        if "Router" in type(module).__name__ and isinstance(weight, torch.Tensor) and weight.dim() == 2:
            breakdown["router"] += _linear_cost(weight.shape[1], weight.shape[0], weight.requires_grad)
    for module in experts_modules(base):
        for key, per_pair in _expert_projection_flops(module).items():
            breakdown[key] += per_pair * (top_k or 1)
    return FlopProfile(
        token_flops=sum(breakdown.values()),
        head_row_flops=head_row,
        attention=_attention_groups(config),
        breakdown=breakdown,
    )


def docs_micro_batch(docs: Sequence[dict]) -> tuple[list[int], int]:
    """``(seq_lens, labelled rows)`` of a micro-batch's documents (``input_ids`` / ``labels`` lists):
    the rows the loss needs are those whose next token is labelled (``data.labels.count_label_tokens``)."""
    return [len(d["input_ids"]) for d in docs], count_label_tokens(list(docs))


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the measured peak (None without a peak or time)."""
    if not peak_flops_per_s or seconds <= 0:
        return None
    return flops / seconds / peak_flops_per_s
