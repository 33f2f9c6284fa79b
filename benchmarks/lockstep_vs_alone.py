"""Does lockstep measure what each arm alone measures? Compares ``slipstream ab`` runs of one workload
made in lockstep with runs that each trained one arm alone (``--arms X``).

A machine's speed drifts between runs (on this project's VMs the same arm alone, same batches, measured
2.27 s and 2.81 s a step in two runs five minutes apart), so one run of each mode says little: give
several of each, made alternately. For every arm: its median timed step in every run of each mode, the
mean of those medians per mode and their ratio (target: within 5%). For every pair of arms: the
speedup in each lockstep run and in the alone runs (``stats.speedup``: step times paired by step, the
same batch, with a bootstrap 95% interval; alone: the first alone run of each arm), and whether each
mode's ratio lies inside the other's interval.

    python benchmarks/lockstep_vs_alone.py --lockstep runs/lock-1 runs/lock-2 --alone runs/trl-1 runs/slip-1 runs/trl-2 runs/slip-2

Each path is an ``ab`` output directory (or its ``ab.json``).
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


def compare(
    locked_runs: list[dict], alone_runs: list[dict], tolerance: float = 0.05
) -> tuple[list[str], bool]:
    """Lines of the comparison, and whether every arm and ratio held."""
    locked = [_timed(record) for record in locked_runs]
    solo: dict[str, list[list[float]]] = {}
    for record in alone_runs:
        for arm, steps in _timed(record).items():
            solo.setdefault(arm, []).append(steps)
    arms = [arm for arm in locked[0] if arm in solo]
    lines, ok = [], True
    lines.append(
        "| arm | median step, lockstep runs (s) | median step, alone runs (s) | mean lockstep / mean alone |"
    )
    lines.append("|---|---|---|---:|")
    for arm in arms:
        in_lock = [statistics.median(run[arm]) for run in locked]
        in_solo = [statistics.median(steps) for steps in solo[arm]]
        ratio = statistics.mean(in_lock) / statistics.mean(in_solo)
        held = abs(ratio - 1) <= tolerance
        ok &= held
        lines.append(
            f"| {arm} | {', '.join(f'{m:.3f}' for m in in_lock)} | {', '.join(f'{m:.3f}' for m in in_solo)} | "
            f"{ratio:.3f}{'' if held else ' (over 5%)'} |"
        )
    lines.append("")
    lines.append(
        "| speedup | lockstep runs (95% interval) | alone (95% interval) | inside each other's interval |"
    )
    lines.append("|---|---|---|---|")
    for i, base in enumerate(arms):
        for other in arms[i + 1 :]:
            alone = speedup(solo[base][0], solo[other][0])
            cells, inside = [], True
            for run in locked:
                found = speedup(run[base], run[other])
                cells.append(f"{found.ratio:.2f}x [{found.low:.2f}, {found.high:.2f}]")
                inside &= alone.low <= found.ratio <= alone.high and found.low <= alone.ratio <= found.high
            ok &= inside
            lines.append(
                f"| {other} vs {base} | {'; '.join(cells)} | {alone.ratio:.2f}x [{alone.low:.2f}, {alone.high:.2f}] | "
                f"{'yes' if inside else 'no'} |"
            )
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--lockstep", nargs="+", required=True, help="lockstep runs (output directories or ab.json)"
    )
    parser.add_argument("--alone", nargs="+", required=True, help="runs of one arm each, the same workload")
    args = parser.parse_args(argv)
    lines, ok = compare([_record(path) for path in args.lockstep], [_record(path) for path in args.alone])
    print("\n".join(lines))
    print(
        "every arm within 5% and every ratio inside the other mode's interval"
        if ok
        else "NOT within the targets"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
