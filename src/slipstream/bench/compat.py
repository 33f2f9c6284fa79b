"""The compatibility sweep: is packed training exact, or refused, on every causal-LM architecture?

For one ``model_type`` of transformers' causal-LM registry, :func:`check_architecture` builds a
tiny random model with its special features on (:mod:`slipstream.models.tiny_any`) and runs:

* the **reference**: each document alone through the stock model (training mode, no
  dropout): its logits, its loss, and every parameter gradient of the token-weighted loss
  over all documents (what a padded batch trains);
* the **slipstream arm**: a copy of the same weights under ``slipstream.optimize`` with every
  speedup on (packed attention, sorted MoE routing where it applies, the chunked loss, the
  double-buffered offload engine driven synchronously on the CPU), on the documents packed in
  one row: logits (a forward without labels), loss and every gradient (a forward with labels);
* when slipstream refuses, the **advised fallback** the error names (``packed_attention=False``
  runs the documents as a right-padded batch; another option runs packed) must itself match;
* a packed arm that passes runs again with its documents grouped by length into batched SDPA
  calls (``attention_grouping="grouped"``), which must match too;
* a verdict that passed runs again with the compiled fused RMSNorm / SwiGLU kernels on every
  module class their probe passes (``fused_kernels="compiled"``; dynamo's eager backend unless
  ``compile=True``), which must match too;
* a packed verdict that passed runs a **prefix-shared pair check**: preference pairs
  (:data:`PAIR_LENGTHS`) packed ``prompt | chosen | rejected`` by ``collate_pairs`` (the rejected
  answer attends to its prompt, never the chosen answer), under the passing arm's options with
  the chunked loss off, must give every answer token the log-prob the stock model gives it with
  ``prompt + answer`` run alone (eval, no grad); with the chunked loss on, the summed log-probs
  it leaves on the batch (``answer_logprobs_of``) must match the stock sums (:func:`check_prefix_sharing`);
* a packed verdict that passed runs a **prefix-group check**: :data:`GROUP_SHAPES` (a prefix and
  N = 4 continuations, a prefix and 2) packed by ``collate_groups`` (each continuation attends to
  its group's prefix and itself, never a sibling), under the passing arm's options: every
  position's log-probs (chunked loss off, eval, no grad) within
  ``GROUP_TOLERANCE["token_logprob"]`` of each ``prefix + continuation`` run alone, and the SFT
  loss and every gradient (training mode, the chunked loss as set, labelled prefix tokens
  counted once per row) against the unshared rows run alone (:func:`check_prefix_groups`);
* opt-in (``compile=True``, the sweep's ``--compile``: a cold inductor compile costs 45-55 s per
  architecture on a 2-core CPU, hours for the registry), the passing arm runs again with its
  decoder layers compiled (``compile="on"``), which must match too;
* when the arm is wrong or crashes, ablations (one speedup at a time) name the culprit.

Outcomes: ``pass`` (within :data:`TOLERANCE`), ``refused`` (a slipstream error naming the
feature, with a verified fallback), ``WRONG`` (a silent difference), ``CRASH`` (any other
exception), ``unbuilt`` (the tiny model could not be made: a gap in the sweep, not a verdict).
``benchmarks/compat_sweep.py`` runs every architecture, each in a worker process, and writes
``docs/compatibility.md``. ``unchecked``: an entry :data:`NOT_CHECKABLE` names, with the reason.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch._dynamo
import transformers

from ..fused import compiled as compiled_kernels
from ..fused import compiled_plan
from ..loss.chunked_loss import UnsupportedLoss
from ..models.tiny_any import (
    DYNAMIC_ROPE_POSITIONS,
    POSITION_THRESHOLD,
    RESERVED_HIGH,
    RESERVED_LOW,
    causal_lm_class,
    tiny_model,
)
from ..moe.experts import UnsupportedExperts, is_moe_model
from ..offload import UnsupportedCheckpointing
from ..optimize import optimize, state_of
from ..packing.guards import UnsupportedArchitecture
from ..packing.rowpos import AUDIT
from .fingerprint import cpu_name

# Relative error bounds in fp32 (summation order differs between the arms; a cross-document
# leak shows as 1e-2 .. 1e0).
TOLERANCE = {"logits": 1e-4, "loss": 1e-5, "grad": 1e-3}
# Longer than the tiny sliding / chunk windows (8), so windows matter; on both sides of the tiny
# position thresholds (16), and all below the dynamic-RoPE model's max_position_embeddings (32),
# itself below the packed row (48).
LENGTHS = (11, 21, 16)
SEED = 0
# Preference pairs of the prefix-sharing column, (prompt, chosen, rejected) tokens: answers
# shorter and longer than the windows (8) so a rejected answer's window reaches into its prompt
# or past it; prompt + answer below, at and above the position thresholds (16); every prompt +
# answer below the dynamic-RoPE model's max_position_embeddings (32), the packed row (49) above.
PAIR_LENGTHS = ((11, 7, 5), (6, 8, 12))
# Bounds of the prefix-sharing check in fp32: each answer token's log-prob (absolute), each
# answer's summed log-prob through the chunked loss (relative).
PAIR_TOLERANCE = {"token_logprob": 1e-5, "summed_logprob": 1e-4}

# Prefix groups of the prefix-groups column, (prefix, [continuations]) tokens: N = 4 continuations
# after a prefix longer than the windows (8), prefix + continuation on both sides of the position
# thresholds (16) and below the dynamic-RoPE model's max_position_embeddings (32); a second group of
# two; the packed row (50) above it.
GROUP_SHAPES = ((11, (3, 7, 9, 5)), (5, (4, 6)))
GROUP_TOLERANCE = {"token_logprob": 1e-5}

# Registry entries a plain token-ids training step cannot exercise, and why: the sweep reports
# them as "not checked" rather than pretending a verdict.
NOT_CHECKABLE = {
    "gemma3n": "its vision tower is a timm model (timm is not a dependency); gemma3n_text is checked",
    "gemma4_assistant": "a speculative-decoding drafter: runs on the target model's embeddings and shared KV, no loss",
    "gemma4_unified_assistant": "a speculative-decoding drafter: runs on the target model's embeddings and "
    "shared KV, no loss",
    "musicgen": "audio codebooks: its ids and labels are [batch, length, codebooks], not text tokens",
    "musicgen_melody": "audio codebooks: its ids and labels are [batch, length, codebooks], not text tokens",
}

_ADVICE = re.compile(r"optimize\(model, (\w+)=([\w'\"]+)\)")


@dataclass
class ArmResult:
    """One configuration run against the reference."""

    status: str  # pass | refused | WRONG | CRASH
    detail: str = ""
    logits_error: float | None = None
    loss_error: float | None = None
    grad_error: float | None = None
    worst_param: str | None = None
    policies: list[str] = field(default_factory=list)
    offload: str = (
        "-"  # "on" when the arm ran with offloaded checkpointing, "-" if the model has no layers for it
    )


@dataclass
class Verdict:
    """Everything the sweep learned about one architecture."""

    model_type: str
    class_name: str = ""
    status: str = "unbuilt"  # pass | refused | WRONG | CRASH | unbuilt
    detail: str = ""
    moe: bool = False
    speedups: dict[str, str] = field(default_factory=dict)  # speedup -> "on" | "off: why" | "-"
    arm: ArmResult | None = None
    fallback: dict[str, Any] | None = None  # {"advice": ..., "result": ArmResult}
    ablations: dict[str, ArmResult] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------- inputs and reference


def _vocab_size(model: torch.nn.Module) -> int:
    embeddings = model.get_input_embeddings()
    size = getattr(embeddings, "num_embeddings", None)
    return int(size if size is not None else model.config.get_text_config().vocab_size)


def documents(model: torch.nn.Module, lengths=LENGTHS, seed: int = SEED) -> list[list[int]]:
    """Random documents over the ordinary ids of the tiny vocabulary (no special tokens)."""

    vocab = _vocab_size(model)
    low, high = RESERVED_LOW, max(RESERVED_LOW + 1, vocab - RESERVED_HIGH)
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(low, high, (n,), generator=generator).tolist() for n in lengths]


@dataclass
class Reference:
    logits: list[torch.Tensor]  # per document, [L, V]
    loss: float
    grads: dict[str, torch.Tensor | None]


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {
        name: (p.grad.detach().clone() if p.grad is not None else None)
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def reference(model: torch.nn.Module, docs: list[list[int]]) -> Reference:
    """Each document alone through the stock model; loss and gradients weigh every label token."""
    model.train()
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([doc])).logits[0].float() for doc in docs]
    model.zero_grad(set_to_none=True)
    return Reference(logits, _backward_per_document(model, docs), _grads(model))


def _backward_per_document(model: torch.nn.Module, docs: list[list[int]]) -> float:
    """Each document alone, its loss weighted by its label tokens (a padded batch's loss); back-propagated."""
    total_labels = sum(len(doc) - 1 for doc in docs)
    loss = 0.0
    for doc in docs:
        ids = torch.tensor([doc])
        part = model(input_ids=ids, labels=ids).loss * (len(doc) - 1) / total_labels
        part.backward()
        loss += part.item()
    return loss


# --------------------------------------------------------------------------- comparing


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)).item()


def gradient_errors(actual: dict, expected: dict) -> dict[str, float]:
    """Relative error of every parameter's gradient (inf where only one side has a nonzero one).

    A gradient far smaller than the model's largest is compared against that scale, so fp32 noise
    on a near-zero gradient is not called a difference."""
    scale = max((g.norm().item() for g in expected.values() if g is not None), default=1.0)
    errors: dict[str, float] = {}
    for name in sorted(set(actual) | set(expected)):
        a, e = actual.get(name), expected.get(name)
        if a is None and e is None:
            continue
        if a is None or e is None:
            if (a if e is None else e).abs().max().item() != 0:
                errors[name] = float("inf")
            continue
        errors[name] = (a - e).norm().item() / max(e.norm().item(), 1e-4 * scale, 1e-12)
    return errors


def _compare(ref: Reference, logits: list[torch.Tensor] | None, loss: float, grads) -> ArmResult:
    result = ArmResult("pass")
    problems = []
    if logits is not None:
        result.logits_error = max(_relative(a, e) for a, e in zip(logits, ref.logits, strict=True))
        if not result.logits_error <= TOLERANCE["logits"]:
            problems.append(f"logits off by {result.logits_error:.2g} (relative)")
    result.loss_error = abs(loss - ref.loss) / max(abs(ref.loss), 1e-12)
    if not result.loss_error <= TOLERANCE["loss"]:
        problems.append(f"loss off by {result.loss_error:.2g}")
    errors = gradient_errors(grads, ref.grads)
    worst_name = max(errors, key=errors.__getitem__, default=None)
    worst = errors.get(worst_name, 0.0)
    worst_name = worst_name if worst > 0 else None
    result.grad_error, result.worst_param = worst, worst_name
    if not worst <= TOLERANCE["grad"]:
        problems.append(f"gradient of {worst_name} off by {worst:.2g}")
    if problems:
        result.status, result.detail = "WRONG", "; ".join(problems)
    return result


# --------------------------------------------------------------------------- the slipstream arm


def _is_refusal(error: BaseException) -> bool:
    """A deliberate slipstream refusal (not a crash): one of its errors, raised by its own code."""

    if isinstance(
        error, UnsupportedArchitecture | UnsupportedExperts | UnsupportedLoss | UnsupportedCheckpointing
    ):
        return True
    if isinstance(error, NotImplementedError | ValueError):
        frames = traceback.extract_tb(error.__traceback__)
        return bool(frames) and "/slipstream/" in frames[-1].filename.replace("\\", "/")
    return False


def _short(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"[:400]


def run_arm(
    stock: torch.nn.Module,
    docs: list[list[int]],
    ref: Reference,
    options: dict[str, Any],
    packed: bool = True,
    offload: bool = True,
) -> ArmResult:
    """A copy of ``stock`` under ``optimize(**options)`` (+ offload), compared with ``ref``."""
    from slipstream.offload import RecordingEngine, checkpointing_layers, enable_checkpointing
    from slipstream.packing import collate_packed

    offloaded = "-"
    model = stock
    try:
        model = _copy_model(stock)
        model.zero_grad(set_to_none=True)
        optimize(model, **options)
        if offload and checkpointing_layers(model):
            enable_checkpointing(model, "offload-double", engine=RecordingEngine(), min_offload_bytes=0)
            offloaded = "on"
        model.train()
        if packed:
            batch = collate_packed([{"input_ids": doc} for doc in docs])
            with torch.no_grad():
                out = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"})
            logits = [out.logits[0, start:end].float() for start, end in batch.doc_bounds()]
            out = model(**batch.model_inputs())
            out.loss.backward()
            loss = out.loss.item()
        else:  # unpacked: one document per row, the loss weighted by label tokens as in the reference
            with torch.no_grad():
                logits = [model(input_ids=torch.tensor([doc])).logits[0].float() for doc in docs]
            loss = _backward_per_document(model, docs)
        result = _compare(ref, logits, loss, _grads(model))
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        status = "refused" if _is_refusal(error) else "CRASH"
        detail = _short(error) if status == "refused" else _short(error) + " @ " + _where(error)
        result = ArmResult(status, detail)
    result.offload = offloaded
    state = state_of(model)
    result.policies = list(getattr(state, "policies", []) or [])
    return result


def _copy_model(stock: torch.nn.Module) -> torch.nn.Module:
    """A copy with the same weights (rebuilt from its config when a module holds a non-leaf tensor)."""
    try:
        return copy.deepcopy(stock)
    except RuntimeError:
        clone = type(stock)._from_config(
            stock.config, attn_implementation=stock.config._attn_implementation, dtype=torch.float32
        )
        clone.load_state_dict(stock.state_dict())
        return clone


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.rsplit('site-packages/', 1)[-1]}:{frame.lineno}"


def advice(detail: str) -> dict[str, Any] | None:
    """The ``optimize`` option a refusal names as the way out (``None`` if it names none)."""
    match = _ADVICE.search(detail)
    if not match:
        return None
    key, raw = match.groups()
    value: Any = {"False": False, "True": True, "None": None}.get(raw, raw.strip("'\""))
    return {key: value}


ABLATIONS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # name -> (optimize options, packed batch?, offload?)
    "packed attention only": ({"chunked_loss": False, "moe_routing": "stock"}, True, False),
    "chunked loss only (unpacked)": ({"packed_attention": False, "moe_routing": "stock"}, False, False),
    "sorted routing only (unpacked)": ({"packed_attention": False, "chunked_loss": False}, False, False),
    "offload only (unpacked)": (
        {"packed_attention": False, "chunked_loss": False, "moe_routing": "stock"},
        False,
        True,
    ),
}


def _speedups(verdict: Verdict, result: ArmResult, offload_note: str = "") -> dict[str, str]:
    def said(prefix: str) -> bool:
        return any(p.startswith(prefix) for p in result.policies)

    table = {}
    table["packed attention"] = "on" if said("packed attention: slipstream") else "off"
    if not verdict.moe:
        table["sorted MoE routing"] = "-"
    else:
        table["sorted MoE routing"] = "on" if said("moe routing: sorted") else "off"
    table["chunked loss"] = "on" if said("chunked loss: on") else "off"
    table["offload"] = offload_note or result.offload
    return table


def _run_with_offload_fallback(stock, docs, ref, options, packed=True) -> tuple[ArmResult, str]:
    """The arm with offload; if offload refuses the model, again without it (offload then 'off')."""
    result = run_arm(stock, docs, ref, options, packed=packed)
    if result.status == "refused" and "UnsupportedCheckpointing" in result.detail:
        note = "off (" + result.detail.split(": ", 1)[-1][:80] + ")"
        return run_arm(stock, docs, ref, options, packed=packed, offload=False), note
    return result, ""


def _check_packed_variant(
    verdict: Verdict, stock, docs, ref, options: dict[str, Any], column: str, change: dict
) -> None:
    """A packed verdict that passed, again with ``change`` on top of its options, without offload;
    the ``column``, and WRONG / CRASH if it differs."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups[column] = "-"
        return
    result = run_arm(stock, docs, ref, {**options, **change}, offload=False)
    verdict.ablations[column] = result
    if result.status == "pass":
        verdict.speedups[column] = "on"
        return
    verdict.speedups[column] = result.status
    verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
    settings = ", ".join(f"{key}={value!r}" for key, value in change.items())
    verdict.detail = f"{column} ({settings}): {result.detail}"


# The packed-attention variants every passing packed verdict is checked with: documents grouped by
# length into batched calls (whichever "auto" picked for the arm itself), and the short-document
# kernel forced on (fp32 here, where "auto" keeps SDPA) over right-padded groups.
PACKED_VARIANTS = {
    "grouped attention": {"attention_grouping": "grouped"},
    "short kernel": {"attention_grouping": "grouped", "short_document_kernel": "on"},
}


def _check_grouping(verdict: Verdict, stock, docs, ref, options: dict[str, Any]) -> None:
    """Every packed variant (:data:`PACKED_VARIANTS`), each its own column."""
    for column, change in PACKED_VARIANTS.items():
        if verdict.status not in ("pass", "refused"):
            return
        _check_packed_variant(verdict, stock, docs, ref, options, column, change)


def _check_compile(verdict: Verdict, stock, docs, ref, options: dict[str, Any]) -> None:
    """A verdict that passed (or whose fallback did), again with its decoder layers compiled
    (``compile="on"``, inductor), without offload; the ``compiled`` column, and WRONG / CRASH if
    it differs."""
    packed = options.get("packed_attention", True) is not False
    compiled = run_arm(stock, docs, ref, {**options, "compile": "on"}, packed=packed, offload=False)
    _record_column(verdict, "compiled", compiled, "on", "compile='on'")


def _record_column(verdict: Verdict, column: str, result: ArmResult, shown: str, settings: str) -> None:
    """An extra arm's outcome: its column (``shown`` when it passed, else its status); a refusal
    leaves the verdict as it was, WRONG / CRASH becomes the verdict, naming the column."""
    verdict.ablations[column] = result
    verdict.speedups[column] = shown if result.status == "pass" else result.status
    if result.status in ("pass", "refused"):
        return
    verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
    verdict.detail = f"{column} ({settings}): {result.detail}"


# The fused kernels' torch.compile backend in the sweep: dynamo's eager backend by default (the
# probe and the swap, checked in seconds), inductor under the sweep's --compile.
FUSED_BACKENDS = {False: "eager", True: "inductor"}


def _check_fused(verdict: Verdict, stock, docs, ref, options: dict[str, Any], inductor: bool) -> None:
    """A verdict that passed (or whose fallback did), again with the compiled fused kernels
    (``fused_kernels="compiled"``) on every module class their probe passes, without offload; the
    ``fused`` column names the kernels switched ("-": no class matched), WRONG / CRASH if it
    differs. ``inductor`` False (the default sweep): dynamo runs the captured kernels with its eager
    backend, so the probe and the swap are checked on every architecture in seconds; the inductor
    build's numerics are checked by ``make compile-check`` and the sweep's ``--compile``."""
    plan = compiled_plan(stock)
    kernels = "+".join(name for name, found in (("RMSNorm", plan.norms), ("SwiGLU", plan.mlps)) if found)
    if not kernels:
        verdict.speedups["fused"] = "-"
        return
    packed = options.get("packed_attention", True) is not False
    previous = compiled_kernels.BACKEND
    compiled_kernels.BACKEND = FUSED_BACKENDS[inductor]
    torch._dynamo.reset()  # every architecture traced afresh, never past dynamo's recompile limit
    try:
        fused = run_arm(
            stock, docs, ref, {**options, "fused_kernels": "compiled"}, packed=packed, offload=False
        )
    finally:
        compiled_kernels.BACKEND = previous
    _record_column(verdict, "fused", fused, kernels, "fused_kernels='compiled'")


# --------------------------------------------------------------------------- prefix-shared preference pairs

ANSWER_KEYS = ("chosen_ids", "rejected_ids")


def preference_pairs(
    model: torch.nn.Module, lengths=PAIR_LENGTHS, seed: int = SEED
) -> list[dict[str, list[int]]]:
    """Random preference pairs (``{"prompt_ids", "chosen_ids", "rejected_ids"}``) of ``lengths``,
    from the same random documents as the sweep's (:func:`documents`)."""
    flat = documents(model, lengths=[n for pair in lengths for n in pair], seed=seed)
    return [
        {"prompt_ids": flat[3 * i], "chosen_ids": flat[3 * i + 1], "rejected_ids": flat[3 * i + 2]}
        for i in range(len(lengths))
    ]


def pair_reference(stock: torch.nn.Module, pairs: list[dict[str, list[int]]]) -> list[torch.Tensor]:
    """Per answer (pair i: chosen 2i, rejected 2i + 1), the stock log-prob [A] (fp32) of each of
    its tokens, ``prompt + answer`` run alone through the stock model (eval, no grad)."""
    was_training = stock.training
    stock.eval()
    expected = []
    try:
        with torch.no_grad():
            for pair in pairs:
                prompt = pair["prompt_ids"]
                for key in ANSWER_KEYS:
                    answer = pair[key]
                    logits = stock(input_ids=torch.tensor([prompt + answer])).logits[0].float()
                    rows = logits[len(prompt) - 1 : len(prompt) + len(answer) - 1]
                    targets = torch.tensor(answer).unsqueeze(1)
                    expected.append(rows.log_softmax(-1).gather(1, targets).squeeze(1))
    finally:
        stock.train(was_training)
    return expected


def _token_logprobs(logits_1TV: torch.Tensor, answers) -> torch.Tensor:
    """[N] fp32: the log-prob of every answer token, read from full logits at ``answers.positions``."""
    rows = logits_1TV[0].index_select(0, answers.positions).float()
    return rows.log_softmax(-1).gather(1, answers.targets.unsqueeze(1)).squeeze(1)


def check_prefix_sharing(
    stock: torch.nn.Module,
    pairs: list[dict[str, list[int]]],
    expected: list[torch.Tensor],
    options: dict[str, Any],
) -> ArmResult:
    """``pairs`` packed with their prompts shared (``collate_pairs(prefix_sharing=True)``) through a
    copy of ``stock`` under ``optimize(**options)``, against ``expected`` (:func:`pair_reference`):

    * with the chunked loss off, a forward without labels: every answer token's log-prob from
      the logits, within ``PAIR_TOLERANCE["token_logprob"]`` (absolute) of the stock one;
    * with the chunked loss as ``options`` set it, a forward with labels: the summed log-prob of
      every answer it leaves on the batch (``answer_logprobs_of``), within
      ``PAIR_TOLERANCE["summed_logprob"]`` (relative) of the stock sum. Where the chunked loss is
      off (advised off, or refused for this model), the sums are read from the logits
      (``answer_logprobs_from_logits``) instead, and the detail says so.

    Eval mode (no dropout, no training-only routing) on both sides. A slipstream refusal is
    ``refused``, any other exception ``CRASH``, a difference ``WRONG``."""
    from slipstream.loss import answer_logprobs_from_logits, answer_logprobs_of
    from slipstream.packing.pairs import collate_pairs

    model = stock
    try:
        want_tokens = torch.cat(expected)
        want_sums = torch.stack([e.double().sum() for e in expected])
        model = _copy_model(stock)
        optimize(model, **{**options, "chunked_loss": False})
        model.eval()
        batch = collate_pairs(pairs, prefix_sharing=True)
        answers = batch.answers
        with torch.no_grad():
            out = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"})
        got_tokens = _token_logprobs(out.logits, answers)
        result = ArmResult("pass")
        result.logits_error = (got_tokens - want_tokens).abs().max().item()
        problems = []
        if not result.logits_error <= PAIR_TOLERANCE["token_logprob"]:
            worst = int((got_tokens - want_tokens).abs().argmax())
            answer = int(answers.index[worst])
            first = sum(answers.lengths[:answer])
            problems.append(
                f"answer token log-probs off by {result.logits_error:.2g} (worst: token {worst - first} of "
                f"pair {answer // 2}'s {'chosen' if answer % 2 == 0 else 'rejected'} answer; per answer: "
                + ", ".join(
                    f"{(got_tokens[a:b] - want_tokens[a:b]).abs().max().item():.1g}"
                    for a, b in _spans(answers.lengths)
                )
                + ")"
            )
        from_logits = answer_logprobs_from_logits(
            out.logits, answers.positions, answers.targets, answers.index, answers.num_answers
        )
        del out

        chunked = _copy_model(stock)
        optimize(chunked, **options)
        chunked.eval()
        model = chunked
        batch = collate_pairs(pairs, prefix_sharing=True)
        with torch.no_grad():
            chunked(**batch.model_inputs())
        sums = answer_logprobs_of(batch)
        if sums is None:
            sums = from_logits
            result.detail = "summed log-probs from the logits: the chunked loss is off"
        result.loss_error = (
            ((sums.double() - want_sums).abs() / want_sums.abs().clamp_min(1e-12)).max().item()
        )
        if not result.loss_error <= PAIR_TOLERANCE["summed_logprob"]:
            problems.append(
                f"summed answer log-probs off by {result.loss_error:.2g} (relative; "
                f"got {[round(v, 4) for v in sums.tolist()]}, stock {[round(v, 4) for v in want_sums.tolist()]})"
            )
        if problems:
            result.status, result.detail = "WRONG", "; ".join(problems)
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        status = "refused" if _is_refusal(error) else "CRASH"
        detail = _short(error) if status == "refused" else _short(error) + " @ " + _where(error)
        result = ArmResult(status, detail)
    state = state_of(model)
    result.policies = list(getattr(state, "policies", []) or [])
    return result


def _spans(lengths) -> list[tuple[int, int]]:
    spans, start = [], 0
    for length in lengths:
        spans.append((start, start + length))
        start += length
    return spans


def _check_prefix_sharing(verdict: Verdict, stock, options: dict[str, Any], seed: int = SEED) -> None:
    """A packed verdict that passed (or whose packed fallback did), on prefix-shared preference
    pairs (:func:`check_prefix_sharing`); the ``prefix_sharing`` column ("-": not packed), a
    refusal kept as the column only, WRONG / CRASH the verdict."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups["prefix_sharing"] = "-"
        return
    try:
        pairs = preference_pairs(stock, seed=seed)
        expected = pair_reference(stock, pairs)
    except Exception as error:  # noqa: BLE001 - the stock model itself failed on the pairs
        result = ArmResult("CRASH", "the stock reference: " + _short(error) + " @ " + _where(error))
    else:
        result = check_prefix_sharing(stock, pairs, expected, options)
    _record_column(verdict, "prefix_sharing", result, "on", "collate_pairs(prefix_sharing=True)")


# --------------------------------------------------------------------------- prefix groups


def prefix_groups(model: torch.nn.Module, shapes=GROUP_SHAPES, seed: int = SEED) -> list[dict[str, Any]]:
    """Random prefix groups (``collate_groups``' input) of ``shapes``, from the sweep's random
    documents; the second half of every prefix labelled, so shared labels are counted."""
    lengths = [n for prefix, continuations in shapes for n in (prefix, *continuations)]
    flat = iter(documents(model, lengths=lengths, seed=seed + 1))
    groups = []
    for prefix_len, continuations in shapes:
        prefix = next(flat)
        labels = [-100 if i < prefix_len // 2 else t for i, t in enumerate(prefix)]
        groups.append(
            {
                "prefix_ids": prefix,
                "prefix_labels": labels,
                "continuations": [{"input_ids": next(flat)} for _ in continuations],
            }
        )
    return groups


def _rows_loss(model: torch.nn.Module, rows: list[dict[str, list[int]]]) -> torch.Tensor:
    """The unshared rows, each alone: summed cross-entropy over their labels / the label count."""
    total, count = 0.0, 0
    for row in rows:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1].float()
        targets = torch.tensor(row["labels"][1:])
        keep = targets != -100
        total = total + torch.nn.functional.cross_entropy(logits[keep], targets[keep], reduction="sum")
        count += int(keep.sum())
    return total / count


def check_prefix_groups(
    stock: torch.nn.Module, groups: list[dict[str, Any]], options: dict[str, Any]
) -> ArmResult:
    """``groups`` packed with their prefixes shared (``collate_groups``) through copies of ``stock``
    under ``optimize(**options)``, against every ``prefix + continuation`` run alone through the stock
    model: log-probs at every position (chunked loss off, eval, no grad, absolute
    ``GROUP_TOLERANCE["token_logprob"]``), then the SFT loss and every gradient (training mode, the
    chunked loss as ``options`` set it; where it is off, the loss from the logits with
    ``packed_loss_from_logits``) within the sweep's :data:`TOLERANCE`."""
    from slipstream.loss import packed_loss_from_logits
    from slipstream.packing.groups import collate_groups, unshared_documents

    model = stock
    try:
        rows = unshared_documents(groups)
        was_training = stock.training
        stock.eval()
        try:
            with torch.no_grad():
                expected = [
                    stock(input_ids=torch.tensor([row["input_ids"]])).logits[0].float().log_softmax(-1)
                    for row in rows
                ]
        finally:
            stock.train(was_training)
        model = _copy_model(stock)
        optimize(model, **{**options, "chunked_loss": False})
        model.eval()
        batch = collate_groups(groups)
        with torch.no_grad():
            logprobs = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"}).logits[0]
        logprobs = logprobs.float().log_softmax(-1)
        errors = [
            (logprobs[positions] - want).abs().max().item()
            for positions, want in zip(_shared_rows(groups), expected, strict=True)
        ]
        result = ArmResult("pass")
        result.logits_error = max(errors)
        problems = []
        if not result.logits_error <= GROUP_TOLERANCE["token_logprob"]:
            problems.append(
                f"log-probs off by {result.logits_error:.2g} (per prefix + continuation: "
                + ", ".join(f"{e:.1g}" for e in errors)
                + ")"
            )

        reference_model = _copy_model(stock).train()
        reference_model.zero_grad(set_to_none=True)
        want_loss = _rows_loss(reference_model, rows)
        want_loss.backward()
        want_grads = _grads(reference_model)
        del reference_model
        model = _copy_model(stock)
        model.zero_grad(set_to_none=True)
        optimize(model, **options)
        model.train()
        batch = collate_groups(groups)
        if getattr(state_of(model), "chunked_loss", None) is not None:
            loss = model(**batch.model_inputs()).loss
        else:
            out = model(**{k: v for k, v in batch.model_inputs().items() if k != "labels"})
            loss = packed_loss_from_logits(out.logits, batch)
            result.detail = "the loss from the logits (packed_loss_from_logits): the chunked loss is off"
        loss.backward()
        result.loss_error = abs(loss.item() - want_loss.item()) / max(abs(want_loss.item()), 1e-12)
        if not result.loss_error <= TOLERANCE["loss"]:
            problems.append(f"loss off by {result.loss_error:.2g}")
        grad_errors = gradient_errors(_grads(model), want_grads)
        worst = max(grad_errors, key=grad_errors.__getitem__, default=None)
        result.grad_error = grad_errors.get(worst, 0.0)
        result.worst_param = worst if result.grad_error > 0 else None
        if not result.grad_error <= TOLERANCE["grad"]:
            problems.append(f"gradient of {worst} off by {result.grad_error:.2g}")
        if problems:
            result.status, result.detail = "WRONG", "; ".join(problems)
    except Exception as error:  # noqa: BLE001 - every failure is an outcome here
        status = "refused" if _is_refusal(error) else "CRASH"
        detail = _short(error) if status == "refused" else _short(error) + " @ " + _where(error)
        result = ArmResult(status, detail)
    state = state_of(model)
    result.policies = list(getattr(state, "policies", []) or [])
    return result


def _shared_rows(groups: list[dict[str, Any]]) -> list[list[int]]:
    """Per ``prefix + continuation``, the positions of its tokens in the shared row, from the groups
    alone (not from the batch's metadata, which is what is checked): a group's first document holds
    the prefix and continuation 0, each further continuation follows in its own document."""
    rows, start = [], 0
    for group in groups:
        P = len(group["prefix_ids"])
        prefix = list(range(start, start + P))
        start += P
        for continuation in group["continuations"]:
            C = len(continuation["input_ids"])
            rows.append(prefix + list(range(start, start + C)))
            start += C
    return rows


def _check_prefix_groups(verdict: Verdict, stock, options: dict[str, Any], seed: int = SEED) -> None:
    """A packed verdict that passed (or whose packed fallback did), on prefix groups
    (:func:`check_prefix_groups`); the ``prefix_groups`` column ("-": not packed), a refusal kept as
    the column only, WRONG / CRASH the verdict."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups["prefix_groups"] = "-"
        return
    try:
        groups = prefix_groups(stock, seed=seed)
    except Exception as error:  # noqa: BLE001
        result = ArmResult("CRASH", "the groups: " + _short(error) + " @ " + _where(error))
    else:
        result = check_prefix_groups(stock, groups, options)
    _record_column(verdict, "prefix_groups", result, "on", "collate_groups (N=4)")


def check_architecture(model_type: str, seed: int = SEED, compile: bool = False) -> Verdict:
    """The verdict for one registry ``model_type`` (never raises); ``compile``: also the compiled
    arm (see the module docstring)."""

    started = time.perf_counter()
    verdict = Verdict(model_type)
    if model_type in NOT_CHECKABLE:
        verdict.status, verdict.detail = "unchecked", NOT_CHECKABLE[model_type]
        return verdict
    try:
        verdict.class_name = causal_lm_class(model_type).__name__
        stock = tiny_model(model_type, seed=seed)
        docs = documents(stock, seed=seed)
        ref = reference(stock, docs)
        again = reference(stock, docs)
        if abs(again.loss - ref.loss) > 1e-6 * max(1.0, abs(ref.loss)):
            raise RuntimeError("the stock model is not deterministic in training mode")
    except Exception as error:  # noqa: BLE001
        verdict.status, verdict.detail = "unbuilt", _short(error) + " @ " + _where(error)
        verdict.seconds = time.perf_counter() - started
        return verdict

    verdict.moe = is_moe_model(stock)
    arm, offload_note = _run_with_offload_fallback(stock, docs, ref, {})
    verdict.arm = arm
    verdict.status, verdict.detail = arm.status, arm.detail
    if arm.status == "pass":
        verdict.speedups = _speedups(verdict, arm, offload_note)
    elif arm.status == "refused":
        # Follow the advice, and the advice of a refusal on the way, as a user would.
        options: dict[str, Any] = {}
        result, detail = arm, arm.detail
        while result.status == "refused" and len(options) < 4:
            option = advice(result.detail)
            if option is None or option.items() <= options.items():
                break
            options.update(option)
            packed = options.get("packed_attention", True) is not False
            result, offload_note = _run_with_offload_fallback(stock, docs, ref, dict(options), packed=packed)
        verdict.fallback = {"advice": options or None, "result": result}
        if not options:
            verdict.status = "CRASH"
            verdict.detail = f"refused without naming a way out: {detail}"
        elif result.status == "pass":
            verdict.speedups = _speedups(verdict, result, offload_note)
        else:
            verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
            verdict.detail = (
                f"refused ({detail}); the advised fallback {options} is {result.status}: {result.detail}"
            )
    if verdict.status in ("pass", "refused") and verdict.speedups:
        advised = (verdict.fallback or {}).get("advice") or {}
        _check_grouping(verdict, stock, docs, ref, dict(advised))
        if verdict.status in ("pass", "refused"):
            _check_fused(verdict, stock, docs, ref, dict(advised), inductor=compile)
        if verdict.status in ("pass", "refused"):
            _check_prefix_sharing(verdict, stock, dict(advised), seed=seed)
        if verdict.status in ("pass", "refused"):
            _check_prefix_groups(verdict, stock, dict(advised), seed=seed)
        if compile and verdict.status in ("pass", "refused"):
            _check_compile(verdict, stock, docs, ref, dict(advised))
    if verdict.status in ("WRONG", "CRASH"):
        for name, (options, packed, offload) in ABLATIONS.items():
            verdict.ablations[name] = run_arm(stock, docs, ref, options, packed=packed, offload=offload)
    verdict.seconds = time.perf_counter() - started
    return verdict


def causal_lm_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


__all__ = [
    "TOLERANCE",
    "ArmResult",
    "Verdict",
    "advice",
    "causal_lm_model_types",
    "check_architecture",
    "check_prefix_groups",
    "check_prefix_sharing",
    "pair_reference",
    "preference_pairs",
    "prefix_groups",
    "run_arm",
]


# --------------------------------------------------------------------------- the sweep, in worker processes


def _worker(model_types: list[str], compile: bool = False) -> None:
    """Worker process: one ``START`` line, then one ``RESULT`` JSON line, per model type."""

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    for model_type in model_types:
        print("START " + model_type, flush=True)
        verdict = check_architecture(model_type, compile=compile)
        print("RESULT " + json.dumps(verdict.to_dict(), default=str), flush=True)


def sweep(
    model_types: list[str], workers: int = 2, timeout_s: float = 300.0, progress=None, compile: bool = False
) -> list[dict[str, Any]]:
    """Check every model type, ``workers`` processes at a time; a worker that dies (an abort in
    a native kernel) or hangs costs only the model type it was on, which is recorded as CRASH.
    ``compile``: also the compiled arm of each (slow: see the module docstring)."""

    pending = list(model_types)
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def take(n: int) -> list[str]:
        with lock:
            batch, pending[:] = pending[:n], pending[n:]
            return batch

    def run_worker() -> None:
        while True:
            batch = take(max(1, min(12, len(pending) // max(1, workers) or 1)))
            if not batch:
                return
            command = [
                sys.executable,
                "-c",
                f"from slipstream.bench.compat import _worker; _worker({batch!r}, compile={compile!r})",
            ]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            lines: queue.Queue[str | None] = queue.Queue()

            def pump(stream=process.stdout, lines=lines) -> None:
                for line in stream:
                    lines.put(line)
                lines.put(None)

            threading.Thread(target=pump, daemon=True).start()
            current, done = None, []
            while True:
                try:
                    line = lines.get(timeout=timeout_s)
                except queue.Empty:
                    process.kill()
                    line = None
                    reason = f"no result within {timeout_s:.0f} s"
                else:
                    reason = "the worker process died"
                if line is None:
                    break
                if line.startswith("START "):
                    current = line[6:].strip()
                elif line.startswith("RESULT "):
                    verdict = json.loads(line[7:])
                    with lock:
                        results[verdict["model_type"]] = verdict
                    done.append(verdict["model_type"])
                    if progress:
                        progress(verdict)
                    current = None
            process.wait()
            if current is not None:  # died or hung on `current`: record it, requeue the rest
                verdict = Verdict(
                    current, status="CRASH", detail=f"{reason} (exit {process.returncode})"
                ).to_dict()
                with lock:
                    results[current] = verdict
                if progress:
                    progress(verdict)
                rest = [t for t in batch if t not in done and t != current]
                with lock:
                    pending[:0] = rest

    threads = [threading.Thread(target=run_worker) for _ in range(max(1, workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[t] for t in model_types if t in results]


# --------------------------------------------------------------------------- the table

_STATUS_TEXT = {
    "pass": "packed, exact",
    "refused": "refused",
    "WRONG": "**WRONG**",
    "CRASH": "**CRASH**",
    "unbuilt": "not built",
    "unchecked": "not checked",
}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _note(verdict: dict[str, Any]) -> str:
    # a refused extra column (shared prompts) names its refusal after the verdict's own note
    refusals = [
        f"{column.replace('_', ' ')} refused: {result.get('detail', '')}"
        for column, result in (verdict.get("ablations") or {}).items()
        if (verdict.get("speedups") or {}).get(column) == "refused" and isinstance(result, dict)
    ]
    if verdict["status"] == "refused":
        fallback = verdict.get("fallback") or {}
        option = fallback.get("advice")
        advised = ", ".join(f"{k}={v!r}" for k, v in option.items()) if option else "none named"
        return "; ".join([f"{verdict['detail']} (advised fallback {advised}: verified)", *refusals])
    notes = [p for p in (verdict.get("arm") or {}).get("policies", []) if "adapted:" in p or "guarded:" in p]
    return "; ".join(notes + refusals) if verdict["status"] == "pass" else verdict["detail"]


def render_markdown(verdicts: list[dict[str, Any]], seconds: float | None = None, workers: int = 2) -> str:
    """``docs/compatibility.md``: the per-architecture table and how it was made (``seconds``: the
    sweep's wall time, with ``workers`` worker processes)."""

    counts = Counter(v["status"] for v in verdicts)
    compiled = any("compiled" in (v.get("speedups") or {}) for v in verdicts)  # the sweep's --compile
    lines = [
        "# Compatibility: which transformers causal LMs slipstream trains, and how",
        "",
        "Generated by `python benchmarks/compat_sweep.py` (do not edit by hand). For every model type in",
        f"transformers {transformers.__version__}'s causal-LM registry, a tiny random model with its special",
        "features on (sliding / chunked windows of 8 tokens, 8 experts top-2, small SSM chunks, position",
        f"thresholds at {POSITION_THRESHOLD} tokens: see the end) trains three",
        f"documents of {', '.join(map(str, LENGTHS))} tokens packed in one row under `slipstream.optimize` with",
        "every speedup on (packed attention, sorted MoE routing, the chunked loss, double-buffered offload),",
        "and is compared with each document run alone through the stock model: logits, loss and every",
        f"parameter gradient in fp32 (relative tolerances {TOLERANCE}). A refusal is a clear error naming the",
        "feature; the fallback it advises is run and compared too.",
        "",
        f"Machine: {cpu_name()} ({os.cpu_count()} cores), torch {torch.__version__}"
        + (
            f"; the sweep took {seconds:.0f} s with {workers} worker process{'es' if workers != 1 else ''}."
            if seconds
            else "."
        ),
        "",
        "| outcome | architectures |",
        "|---|---:|",
    ]
    for status in ("pass", "refused", "WRONG", "CRASH", "unbuilt", "unchecked"):
        lines.append(f"| {_STATUS_TEXT[status]} | {counts.get(status, 0)} |")
    lines += [
        f"| total | {len(verdicts)} |",
        "",
        "Columns: *packed* = packed attention (documents never see each other; no host syncs, no T×T mask);",
        "*MoE* = sorted expert routing (`-`: not an MoE model); *loss* = the chunked LM head + loss;",
        "*offload* = offloaded checkpointing of decoder-layer inputs; *grouped* = the packed row's documents",
        "grouped by length into batched SDPA calls (`attention_grouping='grouped'`), checked the same way;",
        "*short* = the same groups attended by the short-document kernel (`short_document_kernel='on'`: fp32",
        "GEMMs and softmax recomputed in backward; on by default only for bf16 / fp16 on a CPU).",
        *(
            [
                "*compiled* = the decoder layers compiled (`compile='on'`, inductor, dynamic shapes), checked the",
                "same way (the sweep's `--compile`).",
            ]
            if compiled
            else [
                "Compiled layers (`compile='on'`) are checked by `benchmarks/compat_sweep.py --compile` (a cold",
                "compile costs 45-55 s per architecture here), not in this table.",
            ]
        ),
        "For a refused architecture the",
        "columns show what its verified fallback runs.",
        "*fused* = the compiled RMSNorm / SwiGLU kernels (`fused_kernels='compiled'`) on each module class",
        "whose forward their probe finds bit-identical to the stock formula (`-`: no class matched; the",
        "rest keep their own forward), checked the same way"
        + (" with inductor's build." if compiled else "; dynamo runs the captured kernels with its eager")
        + ("" if compiled else " backend here (the inductor build's numerics: `make compile-check`)."),
        "*prefix* = preference pairs packed with their prompt shared (`collate_pairs(prefix_sharing=True)`:",
        "`prompt | chosen | rejected`, the rejected answer attending to the prompt and itself, never the",
        "chosen answer) under the same options, checked against each `prompt + answer` run alone through the",
        "stock model (eval, no grad): two pairs of "
        + " and ".join("+".join(map(str, lengths)) for lengths in PAIR_LENGTHS)
        + " prompt+chosen+rejected tokens, every answer token's log-prob",
        f"from the logits within {PAIR_TOLERANCE['token_logprob']:g} (absolute, the chunked loss off) and every"
        " answer's summed log-prob through",
        f"the chunked loss (`answer_logprobs_of`) within {PAIR_TOLERANCE['summed_logprob']:g} (relative);"
        " *refused*: slipstream refuses shared",
        "prompts for this model (train its pairs with `preference.prefix_sharing: false`); `-`: not packed.",
        "*groups* = prefix groups packed with their prefix shared (`collate_groups`: a prefix and N = 4",
        "continuations, a prefix and 2; each continuation attends to its prefix and itself, never a sibling):",
        "every position's log-probs within "
        f"{GROUP_TOLERANCE['token_logprob']:g} (absolute, fp32) of each `prefix + continuation` run alone, and the",
        "SFT loss and every gradient (labelled prefix tokens counted once per continuation) as the unshared",
        "rows give them, within the tolerances above; *refused*: slipstream refuses shared prefixes for this",
        "model (pack its groups with `collate_groups(..., prefix_sharing=False)`); `-`: not packed.",
        "No column for Liger-Kernel's fused RMSNorm / SwiGLU / RoPE (`fused_kernels='liger'`): this sweep runs",
        "on a CPU, where they never run (Triton, CUDA only); `tests/fused/test_gpu.py` checks them on a GPU.",
        "",
        "| model type | class | verdict | packed | MoE | loss | offload | grouped | short | fused | prefix | "
        + "groups | "
        + ("compiled | " if compiled else "")
        + "note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if compiled else "") + "---|",
    ]
    for verdict in sorted(verdicts, key=lambda v: v["model_type"]):
        speedups = verdict.get("speedups") or {}
        cells = [
            f"`{verdict['model_type']}`",
            verdict.get("class_name", ""),
            _STATUS_TEXT.get(verdict["status"], verdict["status"]),
            speedups.get("packed attention", ""),
            speedups.get("sorted MoE routing", ""),
            (speedups.get("chunked loss", "") or "").split(" (")[0],
            speedups.get("offload", ""),
            speedups.get("grouped attention", ""),
            speedups.get("short kernel", ""),
            speedups.get("fused", ""),
            speedups.get("prefix_sharing", ""),
            speedups.get("prefix_groups", ""),
            *([speedups.get("compiled", "")] if compiled else []),
            _note(verdict),
        ]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines + render_audit()) + "\n"


_OUTCOME_TEXT = {
    "exact": "exact",
    "adapted": "adapted",
    "guarded": "exact below a threshold, refused above",
    "refused": "refused",
}


def render_audit() -> list[str]:
    """The row-position audit (:data:`slipstream.packing.rowpos.AUDIT`) as markdown lines."""
    lines = [
        "",
        "## Values computed from the packed row",
        "",
        "Packed, a document's position_ids restart at 0 but its tokens sit further along the row. What",
        "a model computes from position_ids is exact packed; what it computes from the row (an arange",
        "over the tokens, the row's length or its largest position) is not. A read of every causal LM",
        f"in transformers {transformers.__version__}'s registry for such values in the training forward found:",
        "",
        "| feature | model types | packed | why |",
        "|---|---|---|---|",
    ]
    for finding in AUDIT:
        cells = [finding.feature, finding.model_types, _OUTCOME_TEXT[finding.outcome], finding.why]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    lines += [
        "",
        "The tiny configs above put each such threshold inside the test documents' lengths (Llama 4's",
        f"`floor_scale`, longrope's and Ministral 3's `original_max_position_embeddings` at {POSITION_THRESHOLD}"
        " tokens; the",
        f"dynamic-RoPE model's `max_position_embeddings` at {DYNAMIC_ROPE_POSITIONS}, above every document and "
        f"below the {sum(LENGTHS)}-token",
        "row), so a value taken from the row instead of the document shows as **WRONG**.",
    ]
    return lines
