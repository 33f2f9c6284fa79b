"""The compatibility sweep's per-speedup columns: what each speedup does on one architecture.

Everything a column of ``docs/compatibility.md`` needs is here, in table order:

* :data:`COLUMNS`: every column, its header in the table and its key in ``Verdict.speedups``;
* :data:`POLICY_COLUMNS` (+ offload): the columns read off the passing arm's own policy lines
  (:func:`base_columns`);
* :data:`EXTRA_COLUMNS` (+ :func:`_check_compile`, opt-in): the columns that run an arm of their own
  on top of the passing arm's options, each a function ``(verdict, subject)`` that records its
  column (and turns the verdict WRONG / CRASH, naming the column, where its arm differs);
  :func:`check_columns` runs them in order while the verdict holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch._dynamo

from ..fused import compiled as compiled_kernels
from ..fused import compiled_plan
from ..parity import SEED, Step
from .prefix_parity import (
    check_prefix_groups,
    check_prefix_sharing,
    pair_reference,
    preference_pairs,
    prefix_groups,
)
from .sweep_arm import ArmResult, Verdict, run_arm, short, where

# Every column of docs/compatibility.md after the verdict, in table order: (header, Verdict.speedups key).
COLUMNS = (
    ("packed", "packed attention"),
    ("MoE", "sorted MoE routing"),
    ("loss", "chunked loss"),
    ("offload", "offload"),
    ("grouped", "grouped attention"),
    ("short", "short kernel"),
    ("fused", "fused"),
    ("prefix", "prefix_sharing"),
    ("groups", "prefix_groups"),
    ("compiled", "compiled"),  # opt-in: the sweep's --compile
)

# The columns read off the passing arm's policy lines: column -> the line's start that means "on".
POLICY_COLUMNS = {
    "packed attention": "packed attention: slipstream",
    "sorted MoE routing": "moe routing: sorted",  # "-" for a model without experts
    "chunked loss": "chunked loss: on",
}


def base_columns(verdict: Verdict, result: ArmResult, offload_note: str = "") -> dict[str, str]:
    """The passing arm's columns: each of :data:`POLICY_COLUMNS` "on" or "off", and offload (its
    ``offload_note`` where offload refused the model and the arm ran without it)."""

    def said(prefix: str) -> bool:
        return any(p.startswith(prefix) for p in result.policies)

    table = {}
    for column, prefix in POLICY_COLUMNS.items():
        if column == "sorted MoE routing" and not verdict.moe:
            table[column] = "-"
        else:
            table[column] = "on" if said(prefix) else "off"
    table["offload"] = offload_note or result.offload
    return table


@dataclass
class Subject:
    """What every extra column runs on: the tiny stock model, its documents and reference step, and
    the options of the verdict's passing arm (the advised fallback's, if it was refused)."""

    stock: torch.nn.Module
    docs: list[list[int]]
    ref: Step
    options: dict[str, Any]
    seed: int = SEED
    inductor: bool = False  # the sweep's --compile: the fused kernels built by inductor


def _record_column(verdict: Verdict, column: str, result: ArmResult, shown: str, settings: str) -> None:
    """An extra arm's outcome: its column (``shown`` when it passed, else its status); a refusal
    leaves the verdict as it was, WRONG / CRASH becomes the verdict, naming the column."""
    verdict.ablations[column] = result
    verdict.speedups[column] = shown if result.status == "pass" else result.status
    if result.status in ("pass", "refused"):
        return
    verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
    verdict.detail = f"{column} ({settings}): {result.detail}"


def _packed(options: dict[str, Any]) -> bool:
    return options.get("packed_attention", True) is not False


# --------------------------------------------------------------------------- packed-attention variants

# The packed-attention variants every passing packed verdict is checked with: documents grouped by
# length into batched calls (whichever "auto" picked for the arm itself), and the short-document
# kernel forced on (fp32 here, where "auto" keeps SDPA) over right-padded groups.
PACKED_VARIANTS = {
    "grouped attention": {"attention_grouping": "grouped"},
    "short kernel": {"attention_grouping": "grouped", "short_document_kernel": "on"},
}


def _check_packed_variant(verdict: Verdict, subject: Subject, column: str, change: dict) -> None:
    """A packed verdict that passed, again with ``change`` on top of its options, without offload;
    the ``column``, and WRONG / CRASH if it differs."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups[column] = "-"
        return
    result = run_arm(subject.stock, subject.docs, subject.ref, {**subject.options, **change}, offload=False)
    verdict.ablations[column] = result
    if result.status == "pass":
        verdict.speedups[column] = "on"
        return
    verdict.speedups[column] = result.status
    verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
    settings = ", ".join(f"{key}={value!r}" for key, value in change.items())
    verdict.detail = f"{column} ({settings}): {result.detail}"


def _check_grouping(verdict: Verdict, subject: Subject) -> None:
    """Every packed variant (:data:`PACKED_VARIANTS`), each its own column."""
    for column, change in PACKED_VARIANTS.items():
        if verdict.status not in ("pass", "refused"):
            return
        _check_packed_variant(verdict, subject, column, change)


# --------------------------------------------------------------------------- fused kernels, compiled layers

# The fused kernels' torch.compile backend in the sweep: dynamo's eager backend by default (the
# probe and the swap, checked in seconds), inductor under the sweep's --compile.
FUSED_BACKENDS = {False: "eager", True: "inductor"}


def _check_fused(verdict: Verdict, subject: Subject) -> None:
    """A verdict that passed (or whose fallback did), again with the compiled fused kernels
    (``fused_kernels="compiled"``) on every module class their probe passes, without offload; the
    ``fused`` column names the kernels switched ("-": no class matched), WRONG / CRASH if it
    differs. Without ``subject.inductor`` (the default sweep): dynamo runs the captured kernels with
    its eager backend, so the probe and the swap are checked on every architecture in seconds; the
    inductor build's numerics are checked by ``make compile-check`` and the sweep's ``--compile``."""
    plan = compiled_plan(subject.stock)
    kernels = "+".join(name for name, found in (("RMSNorm", plan.norms), ("SwiGLU", plan.mlps)) if found)
    if not kernels:
        verdict.speedups["fused"] = "-"
        return
    previous = compiled_kernels.BACKEND
    compiled_kernels.BACKEND = FUSED_BACKENDS[subject.inductor]
    torch._dynamo.reset()  # every architecture traced afresh, never past dynamo's recompile limit
    try:
        options = {**subject.options, "fused_kernels": "compiled"}
        fused = run_arm(
            subject.stock, subject.docs, subject.ref, options, packed=_packed(subject.options), offload=False
        )
    finally:
        compiled_kernels.BACKEND = previous
    _record_column(verdict, "fused", fused, kernels, "fused_kernels='compiled'")


def _check_compile(verdict: Verdict, subject: Subject) -> None:
    """A verdict that passed (or whose fallback did), again with its decoder layers compiled
    (``compile="on"``, inductor), without offload; the ``compiled`` column, and WRONG / CRASH if
    it differs."""
    options = {**subject.options, "compile": "on"}
    compiled = run_arm(
        subject.stock, subject.docs, subject.ref, options, packed=_packed(subject.options), offload=False
    )
    _record_column(verdict, "compiled", compiled, "on", "compile='on'")


# --------------------------------------------------------------------------- shared prefixes


def _check_prefix_sharing(verdict: Verdict, subject: Subject) -> None:
    """A packed verdict that passed (or whose packed fallback did), on prefix-shared preference
    pairs (:func:`check_prefix_sharing`); the ``prefix_sharing`` column ("-": not packed), a
    refusal kept as the column only, WRONG / CRASH the verdict."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups["prefix_sharing"] = "-"
        return
    try:
        pairs = preference_pairs(subject.stock, seed=subject.seed)
        expected = pair_reference(subject.stock, pairs)
    except Exception as error:  # noqa: BLE001 - the stock model itself failed on the pairs
        result = ArmResult(
            "CRASH", "the stock reference: " + short(error) + " @ " + where(error), error=error
        )
    else:
        result = check_prefix_sharing(subject.stock, pairs, expected, subject.options)
    _record_column(verdict, "prefix_sharing", result, "on", "collate_pairs(prefix_sharing=True)")


def _check_prefix_groups(verdict: Verdict, subject: Subject) -> None:
    """A packed verdict that passed (or whose packed fallback did), on prefix groups
    (:func:`check_prefix_groups`); the ``prefix_groups`` column ("-": not packed), a refusal kept as
    the column only, WRONG / CRASH the verdict."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups["prefix_groups"] = "-"
        return
    try:
        groups = prefix_groups(subject.stock, seed=subject.seed)
    except Exception as error:  # noqa: BLE001
        result = ArmResult("CRASH", "the groups: " + short(error) + " @ " + where(error), error=error)
    else:
        result = check_prefix_groups(subject.stock, groups, subject.options)
    _record_column(verdict, "prefix_groups", result, "on", "collate_groups (N=4)")


# --------------------------------------------------------------------------- in order

# The columns that run arms of their own, in the order the sweep runs them (the compiled column
# last, opt-in: check_columns' ``compile``).
EXTRA_COLUMNS = (_check_grouping, _check_fused, _check_prefix_sharing, _check_prefix_groups)


def check_columns(verdict: Verdict, subject: Subject, compile: bool = False) -> None:
    """Every extra column of a verdict that passed (or whose fallback did), in order, while it
    holds (a WRONG / CRASH column ends it); ``compile``: the compiled column too."""
    for check in (*EXTRA_COLUMNS, *((_check_compile,) if compile else ())):
        if verdict.status not in ("pass", "refused"):
            return
        check(verdict, subject)


__all__ = [
    "COLUMNS",
    "EXTRA_COLUMNS",
    "FUSED_BACKENDS",
    "PACKED_VARIANTS",
    "POLICY_COLUMNS",
    "Subject",
    "base_columns",
    "check_columns",
]
