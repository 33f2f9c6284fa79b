"""``slipstream doctor``: the device, the versions, each fast path's choice and why, and its check.

:func:`run_doctor` gathers the report (a plain dict, what ``--json`` writes), prints it as rich
tables and returns it with the exit status: 1 if any path is WRONG, else 0 (and the marker that
silences the first-use hint is written).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from ..atomic import write_text_atomically
from ..bench.fingerprint import fingerprint
from ..packing.calibration import attention_costs
from ..train.precision import resolve_dtype
from ..utilisation import matmul_peak
from .checks import VERDICTS, check_paths
from .decisions import decisions
from .machine import describe_device, device_rows, training_device, versions
from .marker import marker_key, write_marker
from .models import resolve_model, shape_of

VERDICT_STYLE = {"ok": "green", "WRONG": "bold red", "refused": "yellow", "skipped": "dim"}


def run_doctor(
    model: str | None = None,
    json_path: str | Path | None = None,
    dtype: str = "auto",
    console: Console | None = None,
    probe_pinned_memory: bool = True,
    remeasure_peak: bool = False,
    recalibrate: bool = False,
) -> tuple[dict[str, Any], int]:
    """Check this machine; returns (the report, the exit status). Raises DoctorError on a bad ``model``.

    ``remeasure_peak``: measure the matmul peak again and replace the cached figure (one taken
    while the machine was busy would otherwise stay); ``recalibrate``: the same for the packed
    attention's cost figures (``packing.calibration``)."""
    started = time.perf_counter()
    console = console or Console(width=None if Console().is_terminal else 160)
    checked = resolve_model(model)  # first: a bad --model fails before any work
    device = training_device()
    torch_dtype, dtype_why = resolve_dtype(dtype, device)

    info = fingerprint()
    device_facts = describe_device(device, info, probe_pinned_memory=probe_pinned_memory)
    # cached: measured once per machine, unless asked to measure again
    device_facts["matmul_peak"] = matmul_peak(device, torch_dtype, remeasure=remeasure_peak)
    # the packed attention's figures training weighs here (measured once per device, dtype, threads)
    costs = attention_costs(device, torch_dtype, remeasure=recalibrate)
    found_versions = versions(info)
    console.print(_table("Device", ("", ""), device_rows(device_facts)))
    shown = [(k, v if v is not None else "not installed") for k, v in found_versions.items()]
    console.print(_table("Versions", ("", ""), shown))
    console.print(
        f"model: {checked.describe()}; checked as a tiny random model: {shape_of(checked.tiny)}, "
        f"{str(torch_dtype).removeprefix('torch.')} on {device}"
    )

    with console.status("checking the fast paths") as status:
        checks, subjects = check_paths(
            checked, device, torch_dtype, progress=lambda path: status.update(f"checking {path}")
        )
        chosen = decisions(
            checked, subjects["main"].base, subjects["moe"].base, device, torch_dtype, dtype_why, costs
        )
    if subjects["moe"] is not subjects["main"]:
        console.print(
            f"MoE check on a tiny {subjects['moe'].label} ({checked.family} has no experts): "
            f"{shape_of(subjects['moe'].base.config)}"
        )
    decided = [(row["path"], row["choice"], row["why"]) for row in chosen]
    console.print(_table("Fast paths on this device: what runs, and why", ("path", "choice", "why"), decided))
    console.print(_checks_table(checks, checked.asked))

    counts = {verdict: sum(c.verdict == verdict for c in checks) for verdict in VERDICTS}
    status = 1 if counts["WRONG"] else 0
    key = marker_key(device)
    report: dict[str, Any] = {
        "device": device_facts,
        "versions": found_versions,
        "model": {
            "asked": checked.asked,
            "source": checked.source,
            "family": checked.family,
            "checked_shape": shape_of(checked.tiny),
            "note": checked.note,
            "dtype": str(torch_dtype).removeprefix("torch."),
            "dtype_why": dtype_why,
        },
        "decisions": chosen,
        "attention_costs": dataclasses.asdict(costs),
        "checks": [c.to_dict() for c in checks],
        "verdicts": counts,
        "exit_status": status,
        "marker": None,
    }
    if status == 0:
        path, problem = write_marker(key, {"model": checked.asked, "verdicts": counts})
        report["marker"] = str(path) if path else f"not written ({problem})"
    report["seconds"] = round(time.perf_counter() - started, 1)
    summary = ", ".join(f"{n} {v}" for v, n in counts.items() if n)
    wrong = "; a fast path is WRONG on this device: train with it off (see the reason) and report it"
    console.print(f"doctor: {summary} ({report['seconds']:.1f} s)" + (wrong if status else ""))
    if json_path is not None:
        write_text_atomically(json_path, json.dumps(report, indent=2, default=str) + "\n")
        console.print(f"wrote {json_path}")
    return report, status


def _table(title: str, headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> Table:
    """A table titled on the left, its first column bold; no header row where the headers are all ""."""
    table = Table(title=title, show_header=any(headers), title_justify="left")
    for index, header in enumerate(headers):
        table.add_column(header, style="bold" if index == 0 else None)
    for row in rows:
        table.add_row(*map(str, row))
    return table


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.1e}"


def _syncs(check) -> str:
    if check.syncs is None:
        return "-"
    allowed = "not promised unpacked" if check.syncs_allowed is None else f"promised <= {check.syncs_allowed}"
    text = f"{check.syncs} ({allowed}; stock {check.stock_syncs})"
    if check.cuda_sync_warnings is not None:
        text += f"; sync-debug warnings {check.cuda_sync_warnings}"
    return text


def _checks_table(checks, main_model: str) -> Table:
    rows = []
    for check in checks:
        compares = check.arms + (f"; on the {check.model}" if check.model != main_model else "")
        if check.layout == "alone" and check.path != "packed attention":
            compares += "; unpacked (packed attention is not ok here)"
        reason = check.reason or check.bound
        copies = check.details.get("offload_copies")
        if copies and check.verdict == "ok":
            reason += f"; {copies.get('offloads', 0)} offloads, {copies.get('reloads', 0)} reloads"
        rows.append(
            (
                check.path,
                compares,
                _number(check.loss_error),
                _number(check.grad_error),
                _syncs(check),
                f"[{VERDICT_STYLE[check.verdict]}]{check.verdict}[/]",
                reason,
            )
        )
    headers = ("path", "compares", "loss Δ", "grad Δ", "host syncs", "verdict", "reason / how judged")
    return _table("Checks: each fast path vs its stock arm, one training step", headers, rows)
