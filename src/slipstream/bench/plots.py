"""PNG plots of an A/B record and of a cross-hardware report (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

from ..atomic import atomic_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _save(fig, path: Path) -> Path:
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=90, bbox_inches="tight")
    finally:
        plt.close(fig)
    return path


def ab_plots(record: dict, out_dir: Path) -> list[Path]:
    """loss.png (curves overlaid), step_time.png (distribution per arm), memory.png (peak per arm),
    and mfu.png (MFU per arm) where the record has it."""
    config = record["config"]
    summary = {arm: s for arm, s in record["summary"].items() if "skipped" not in s}  # arms that trained
    runs = {arm: record["runs"][arm] for arm in summary}
    title = f"{config['model']} · max_seq_len {config['max_seq_len']} · {config['dtype']}"
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, arm_runs in runs.items():
        ax.plot(range(len(arm_runs[0]["loss"])), arm_runs[0]["loss"], label=arm, alpha=0.8)
    ax.set(title=f"Loss per step (curves must overlap)\n{title}", xlabel="step", ylabel="loss")
    ax.legend()
    paths.append(_save(fig, out_dir / "loss.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    warmup = config["warmup"]
    data = [[s for run in arm_runs for s in run["step_s"][warmup:]] for arm_runs in runs.values()]
    ax.boxplot(data, tick_labels=list(runs))
    ax.set(title=f"Step time per arm (timed steps, all repeats)\n{title}", ylabel="seconds per step")
    paths.append(_save(fig, out_dir / "step_time.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    arms = list(summary)
    ax.bar(arms, [summary[a]["peak_memory_mb"] for a in arms], color="tab:orange")
    kind = next(iter(summary.values()))["memory_kind"]
    ax.set(title=f"Peak memory per arm ({kind})\n{title}", ylabel="MB")
    paths.append(_save(fig, out_dir / "memory.png"))

    if any(s.get("mfu") is not None for s in summary.values()):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(arms, [100 * (summary[a].get("mfu") or 0) for a in arms], color="tab:green")
        peak = record.get("matmul_peak") or {}
        ax.set(
            title=f"MFU per arm (model FLOPs / step time / measured matmul peak {peak.get('tflops', 0):.3g} TFLOP/s)\n"
            f"{title}",
            ylabel="% of peak",
        )
        paths.append(_save(fig, out_dir / "mfu.png"))
    return paths


def report_plot(rows: list[dict], path: Path) -> Path:
    """Speedup with its interval for every (hardware, workload) row of a report."""
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * max(1, len(rows))))
    labels = [f"{r['hardware']} | {r['workload']} | {r['arm']}" for r in rows]
    ratios = [r["ratio"] for r in rows]
    # a row from too few timed steps has no interval (low / high None): its point alone
    errors = [
        [r["ratio"] - r["low"] if r["low"] is not None else 0.0 for r in rows],
        [r["high"] - r["ratio"] if r["high"] is not None else 0.0 for r in rows],
    ]
    ax.errorbar(ratios, range(len(rows)), xerr=errors, fmt="o", capsize=4)
    ax.axvline(1.0, color="grey", linestyle="--")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set(title="Speedup vs the stock arm (median step time, 95% bootstrap interval)", xlabel="speedup (x)")
    return _save(fig, path)
