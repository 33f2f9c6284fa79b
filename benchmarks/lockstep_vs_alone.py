"""Does lockstep measure what each arm alone measures? Compares one lockstep ``slipstream ab`` run with
runs of the same workload that each trained one arm alone (``--arms X``).

For every arm: its median timed step in lockstep and alone, and their ratio (target: within 5%). For
every pair of arms: the speedup (``stats.speedup``: the step times paired by step, the same batch, with
a bootstrap 95% interval) in each mode, and whether each mode's ratio lies inside the other's interval.

    python benchmarks/lockstep_vs_alone.py runs/ab-lock runs/ab-alone-trl runs/ab-alone-slipstream

Each argument is an ``ab`` output directory (or its ``ab.json``); the first is the lockstep run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from slipstream.bench.stats import speedup


def _record(path: str) -> dict:
    found = Path(path)
    return json.loads((found / "ab.json" if found.is_dir() else found).read_text())


def _timed(record: dict) -> dict[str, list[float]]:
    warmup = record["config"]["warmup"]
    return {
        arm: [s for run in runs for s in run["step_s"][warmup:]]
        for arm, runs in record["runs"].items()
        if not any("skipped" in run for run in runs)
    }


def compare(lockstep: dict, alone: list[dict], tolerance: float = 0.05) -> tuple[list[str], bool]:
    """Lines of the comparison, and whether every arm and ratio held."""
    locked = _timed(lockstep)
    solo: dict[str, list[float]] = {}
    for record in alone:
        solo.update(_timed(record))
    lines, ok = [], True
    mode = lockstep.get("interleaving", [{}])[0].get("mode")
    lines.append(f"lockstep run: arms interleaved by {mode}")
    lines.append("| arm | median step, lockstep (s) | median step, alone (s) | lockstep / alone |")
    lines.append("|---|---:|---:|---:|")
    for arm in locked:
        if arm not in solo:
            continue
        a, b = statistics.median(locked[arm]), statistics.median(solo[arm])
        held = abs(a / b - 1) <= tolerance
        ok &= held
        lines.append(f"| {arm} | {a:.3f} | {b:.3f} | {a / b:.3f}{'' if held else ' (over 5%)'} |")
    arms = [arm for arm in locked if arm in solo]
    lines.append("")
    lines.append(
        "| speedup | lockstep (95% interval) | alone (95% interval) | each inside the other's interval |"
    )
    lines.append("|---|---|---|---|")
    for i, base in enumerate(arms):
        for other in arms[i + 1 :]:
            in_lock = speedup(locked[base], locked[other])
            in_solo = speedup(solo[base], solo[other])
            inside = (
                in_solo.low <= in_lock.ratio <= in_solo.high and in_lock.low <= in_solo.ratio <= in_lock.high
            )
            ok &= inside
            lines.append(
                f"| {other} vs {base} | {in_lock.ratio:.2f}x [{in_lock.low:.2f}, {in_lock.high:.2f}] | "
                f"{in_solo.ratio:.2f}x [{in_solo.low:.2f}, {in_solo.high:.2f}] | {'yes' if inside else 'no'} |"
            )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("lockstep", help="the lockstep run's output directory or ab.json")
    parser.add_argument("alone", nargs="+", help="runs of one arm each, same workload")
    args = parser.parse_args(argv)
    lines, ok = compare(_record(args.lockstep), [_record(path) for path in args.alone])
    print("\n".join(lines))
    print(
        "every arm within 5% and every ratio inside the other mode's interval"
        if ok
        else "NOT within the targets"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
