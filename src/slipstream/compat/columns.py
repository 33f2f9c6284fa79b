"""The compatibility sweep's per-speedup columns, generated from the speedup registry.

Every column of ``docs/compatibility.md`` after the verdict, in table order (:func:`columns`):

* each registered speedup's ``sweep_column``, read off the passing arm's own policy log
  (``Speedup.sweep_cell``; :func:`base_columns`);
* each registered speedup's ``ParityCase`` with ``sweep=True``: an arm of its own on top of the
  passing arm's options, against the same stock reference (the parity kit), its column the case's
  label (:func:`check_columns`, in order while the verdict holds; a WRONG / CRASH names the column);
* the shared-prefix columns (data layouts, not speedups: ``prefix_parity``) and the reward head's
  (``reward_parity``);
* the cases only the sweep's ``--compile`` runs (inductor builds), last.

A speedup registered in a test alone has its columns here with no edit.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from ..parity import SEED, Step
from ..speedups import ParityCase, registry
from .arm import ArmResult, Verdict, run_arm, short, where
from .prefix_parity import (
    check_prefix_groups,
    check_prefix_sharing,
    check_prefix_tree,
    pair_reference,
    preference_pairs,
    prefix_groups,
    prefix_tree,
)
from .reward_parity import check_reward

# The shared-prefix columns: (header, Verdict.speedups key), after the speedups' parity cases.
PREFIX_COLUMNS = (
    ("prefix", "prefix_sharing"),
    ("groups", "prefix_groups"),
    ("tree", "prefix_tree"),
    ("reward", "reward_head"),  # the reward model's score head on packed pairs (compat.reward_parity)
)


def _sweep_cases(compile: bool) -> tuple[list[ParityCase], list[ParityCase]]:
    """The registered speedups' sweep cases: those every sweep runs, and those only ``--compile`` runs."""
    cases = [case for speedup in registry.registered() for case in speedup.parity_cases() if case.sweep]
    return [c for c in cases if not c.only_with_compile], [
        c for c in cases if c.only_with_compile and compile
    ]


def columns(compile: bool = True) -> list[tuple[str, str]]:
    """Every column after the verdict, in table order: (header, ``Verdict.speedups`` key)."""
    early, late = _sweep_cases(compile)
    return [
        *(
            (speedup.sweep_header or speedup.sweep_column, speedup.sweep_column)
            for speedup in registry.sweep_columns()
        ),
        *((case.header or case.label, case.label) for case in early),
        *PREFIX_COLUMNS,
        *((case.header or case.label, case.label) for case in late),
    ]


def base_columns(verdict: Verdict, result: ArmResult, offload_note: str = "") -> dict[str, str]:
    """The passing arm's columns, one per registered speedup with a ``sweep_column``, each from its
    policy log (``Speedup.sweep_cell``); offload: whether the harness ran the arm offloaded, or
    ``offload_note`` where offload refused the model and the arm ran without it."""
    offloaded = offload_note or result.offload
    return {
        speedup.sweep_column: speedup.sweep_cell(result.policies, verdict.moe, offloaded)
        for speedup in registry.sweep_columns()
    }


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


def _record_column(
    verdict: Verdict, column: str, result: ArmResult, shown: str, settings: str, refusal_fails: bool = False
) -> None:
    """An extra arm's outcome: its column (``shown`` when it passed, else its status); a refusal
    leaves the verdict as it was (``refusal_fails``: is a CRASH), WRONG / CRASH becomes the verdict,
    naming the column."""
    verdict.ablations[column] = result
    verdict.speedups[column] = shown if result.status == "pass" else result.status
    if result.status == "pass" or (result.status == "refused" and not refusal_fails):
        return
    verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
    verdict.detail = f"{column} ({settings}): {result.detail}"


def _packed(options: dict[str, Any]) -> bool:
    return options.get("packed_attention", True) is not False


# --------------------------------------------------------------------------- a speedup's parity case


def _settings(change: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in change.items())


def check_case(verdict: Verdict, subject: Subject, case: ParityCase) -> None:
    """One speedup's parity case as a column: the passing arm's options with ``case.fast`` on top,
    without offload, against the stock reference. A ``packed_only`` case is ``-`` where the packed
    attention is off, and anything but a pass (a refusal too) is the verdict's WRONG / CRASH; another
    case shows ``case.shown(stock model)`` when it passes (``-`` and not run where that is None), a
    refusal kept as its column only."""
    column = case.label
    if case.packed_only:
        if verdict.speedups.get("packed attention") != "on":
            verdict.speedups[column] = "-"
            return
        result = run_arm(
            subject.stock, subject.docs, subject.ref, {**subject.options, **case.fast}, offload=False
        )
        _record_column(verdict, column, result, "on", _settings(case.fast), refusal_fails=True)
        return
    shown = case.shown(subject.stock) if case.shown is not None else "on"
    if shown is None:
        verdict.speedups[column] = "-"
        return
    running = case.runs_in(subject.inductor) if case.runs_in is not None else contextlib.nullcontext()
    with running:
        options = {**subject.options, **case.fast}
        result = run_arm(
            subject.stock, subject.docs, subject.ref, options, packed=_packed(subject.options), offload=False
        )
    _record_column(verdict, column, result, shown, _settings(case.fast))


# --------------------------------------------------------------------------- shared prefixes


def _check_shared_prefix(verdict: Verdict, subject: Subject, column: str) -> None:
    """A packed verdict that passed (or whose packed fallback did), on prefix-shared preference
    pairs (:func:`check_prefix_sharing`), prefix groups (:func:`check_prefix_groups`) or a prefix
    tree (:func:`check_prefix_tree`): the
    ``column`` ("-": not packed), a refusal kept as the column only, WRONG / CRASH the verdict."""
    if verdict.speedups.get("packed attention") != "on":
        verdict.speedups[column] = "-"
        return
    stock = subject.stock
    what, settings = {  # what a CRASH of the inputs names; the column's settings
        "prefix_sharing": ("the stock reference: ", "collate_pairs(prefix_sharing=True)"),
        "prefix_groups": ("the groups: ", "collate_groups (N=4)"),
        "prefix_tree": ("the tree: ", "collate_trees (depth 4)"),
        "reward_head": ("the pairs: ", "reward head, collate_pairs(prefix_sharing=True)"),
    }[column]
    try:  # the inputs, and the stock model itself on the pairs
        if column == "prefix_sharing":
            pairs = preference_pairs(stock, seed=subject.seed)
            check, inputs = check_prefix_sharing, (pairs, pair_reference(stock, pairs))
        elif column == "reward_head":
            check, inputs = check_reward, (preference_pairs(stock, seed=subject.seed),)
        elif column == "prefix_groups":
            check, inputs = check_prefix_groups, (prefix_groups(stock, seed=subject.seed),)
        else:
            check, inputs = check_prefix_tree, (prefix_tree(stock, seed=subject.seed),)
    except Exception as error:  # noqa: BLE001
        result = ArmResult("CRASH", what + short(error) + " @ " + where(error), error=error)
    else:
        result = check(stock, *inputs, subject.options)
    _record_column(verdict, column, result, "on", settings)


# --------------------------------------------------------------------------- in order


def check_columns(verdict: Verdict, subject: Subject, compile: bool = False) -> None:
    """Every extra column of a verdict that passed (or whose fallback did), in table order, while it
    holds (a WRONG / CRASH column ends it): the speedups' parity cases, the shared-prefix columns,
    then (``compile``: the sweep's --compile) the cases that build with inductor."""
    early, late = _sweep_cases(compile)
    checks = [
        *(lambda v, s, case=case: check_case(v, s, case) for case in early),
        *(lambda v, s, column=column: _check_shared_prefix(v, s, column) for _, column in PREFIX_COLUMNS),
        *(lambda v, s, case=case: check_case(v, s, case) for case in late),
    ]
    for check in checks:
        if verdict.status not in ("pass", "refused"):
            return
        check(verdict, subject)


__all__ = ["PREFIX_COLUMNS", "Subject", "base_columns", "check_case", "check_columns", "columns"]
