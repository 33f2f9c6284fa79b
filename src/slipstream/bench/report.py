"""``slipstream report``: many A/B records (machines, runs) -> one hardware x workload table.

A workload is everything that decides what a step computes: every key of a record's ``config``
(``ab_config.record_config``) but the run options listed below (so model shape, layers, sequence
length, micro-batches per step, batching, dtype, checkpointing, LoRA rank, ...), the vocabulary and
the attention backends the arms ran. Records are only ever combined with records of the same workload
on the same hardware (their timed steps pooled into one interval); different workloads stay on
different rows and are never compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..atomic import write_text_atomically
from ..utilisation.step_profile import CATEGORIES
from .ab_config import SHAPE_DEFAULTS, ABConfig, record_config
from .arms import ARM_SPECS
from .inputs import short_name
from .render import CATEGORY_COLUMNS, step_profile_cells
from .stats import format_speedup, speedup

# Record keys that do not change what a timed step computes, so runs differing only in them
# are repeats of one workload and pool: how long and from where (steps, warmup, seed, lr and its
# schedule), which arms and how often (arms, repeats), the ceiling search (max_tokens_within), where
# results go (out_dir), and the machine (device, threads), which is the hardware column, not the
# workload. ``train_config`` is where the workload was read from, ``defaults`` which fields took their
# defaults; the values are the fields themselves.
RUN_OPTIONS = frozenset(
    (
        "steps",
        "warmup",
        "lr",
        "schedule",
        "lr_warmup_steps",
        "seed",
        "arms",
        "repeats",
        "interleave",
        "max_tokens_within",
        "out_dir",
        "profile_step",
        "device",
        "threads",
        "train_config",
        "defaults",
    )
)
# Every other field is workload: a field added to ABConfig separates records unless listed above.
# A record's workload keys and their defaults (a key an older record lacks ran its default); the ones a
# workload's defaults fill (the model's, SHAPE_DEFAULTS) were None before any was filled.
_DEFAULTS = {
    **{key: value for key, value in record_config(ABConfig()).items() if key != "train"},
    **dict.fromkeys((*SHAPE_DEFAULTS, "lora_alpha")),
    "defaults": {},
}
WORKLOAD_KEYS = tuple(name for name in _DEFAULTS if name not in RUN_OPTIONS)
# The workload keys its label spells out; any other one shows as "key value" when not its default.
_LABELLED = frozenset(
    ("model", "data", "layers", "max_seq_len", "grad_accum", "batching", "dtype", "checkpointing")
)


class ReportError(ValueError):
    """Unreadable records, or a request to compare what must not be compared."""


def _setting(record: dict, key: str):
    """A workload setting of a record; a record older than the field ran its default.

    A model directory or data file is its fingerprint, not its path: the same weights or rows
    at another path (another machine) are the same workload; other bytes at the same path are not."""
    if key in ("model", "data"):
        found = record.get("inputs", {}).get(key)
        if found and found["kind"] in ("model directory", "data file"):
            return short_name(found) + ":" + found["sha256"]
    value = record["config"].get(key, _DEFAULTS[key])
    if isinstance(value, dict):
        return tuple(sorted(value.items()))  # comparable and hashable
    return tuple(value) if isinstance(value, list) else value  # JSON gave back a tuple as a list


def _name(record: dict, key: str) -> str:
    """The model or data as a label: a preset's name, or a directory's or file's name and hash prefix."""
    if found := record.get("inputs", {}).get(key):
        return short_name(found)
    return record["config"].get(key) or "demo rows"


def workload(record: dict) -> str:
    config = record["config"]
    shape = _name(record, "model") + (f" x{config['layers']}L" if config.get("layers") else "")
    data = _name(record, "data")
    others = "".join(
        f"{key} {_setting(record, key)} · "
        for key in WORKLOAD_KEYS
        if key not in _LABELLED and _setting(record, key) not in (_DEFAULTS[key], ())
    )
    return (
        f"{shape} · {data} · seq {config['max_seq_len']} · accum {config['grad_accum']} · {config['batching']} · "
        f"{config['dtype']} · ckpt {config.get('checkpointing', 'off')} · {others}{'/'.join(_backends(record))} · "
        f"vocab {record.get('vocab_size', '?')}"
    )


def hardware(record: dict) -> str:
    info = record["fingerprint"]
    return (
        info["device"] if info["device"] != "cpu" else f"cpu {info['cpu']} ({info['torch_threads']} threads)"
    )


def _backends(record: dict) -> tuple[str, ...]:
    """The attention backends the arms that trained ran, sorted."""
    return tuple(sorted({s["attn_implementation"] for s in record["summary"].values() if "skipped" not in s}))


def _key(record: dict) -> tuple:
    return (*(_setting(record, k) for k in WORKLOAD_KEYS), record.get("vocab_size"), _backends(record))


def pair_records(a: dict, b: dict) -> None:
    """Raise unless ``a`` and ``b`` ran the same workload (so their steps may be pooled)."""
    if _key(a) != _key(b):
        diffs = [k for k in WORKLOAD_KEYS if _setting(a, k) != _setting(b, k)]
        diffs += ["vocab_size"] if a.get("vocab_size") != b.get("vocab_size") else []
        raise ReportError(
            f"refusing to compare different workloads ({', '.join(diffs) or 'attention backend'} differ): "
            f"{workload(a)} vs {workload(b)}"
        )


def load_records(paths: list[str | Path]) -> list[tuple[Path, dict]]:
    """Every ab.json under the given files or directories."""
    found = []
    for path in map(Path, paths):
        if not path.exists():
            raise ReportError(f"{path}: no such file or directory")
        files = [path] if path.is_file() else sorted(path.rglob("ab.json"))
        for file in files:
            try:
                record = json.loads(file.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ReportError(f"{file}: not a JSON A/B record ({error})") from None
            if record.get("kind") != "slipstream-ab":
                raise ReportError(f"{file}: not a slipstream A/B record (kind {record.get('kind')!r})")
            found.append((file, record))
    if not found:
        raise ReportError(f"no ab.json records under {', '.join(map(str, paths))}")
    return found


def _timed(record: dict, arm: str) -> list[float]:
    warmup = record["config"]["warmup"]
    return [s for run in record["runs"][arm] for s in run["step_s"][warmup:]]


def pooled_mfu(group: list[dict], arm: str) -> float | None:
    """An arm's MFU over a group of records (their mean); None if any record predates MFU."""
    found = [r["summary"].get(arm, {}).get("mfu") for r in group]
    return sum(found) / len(found) if found and None not in found else None


def report_rows(records: list[tuple[Path, dict]]) -> list[dict]:
    """One row per (workload, hardware, arm vs stock arm), repeated runs pooled; each side's MFU
    where every pooled record has one (older records load without it)."""
    groups: dict[tuple, list[dict]] = {}
    for _, record in records:
        groups.setdefault((_key(record), hardware(record)), []).append(record)
    rows = []
    for (_, machine), group in groups.items():
        for other in group[1:]:
            pair_records(group[0], other)
        arms = [
            a
            for a in group[0]["runs"]
            if all(a in r["runs"] and "skipped" not in r["summary"].get(a, {}) for r in group)
        ]
        for arm in (a for a in arms if not ARM_SPECS[a].stock):
            for base in (a for a in arms if ARM_SPECS[a].stock):
                base_s = [s for r in group for s in _timed(r, base)]
                arm_s = [s for r in group for s in _timed(r, arm)]
                interval = speedup(base_s, arm_s)
                rows.append(
                    {
                        "workload": workload(group[0]),
                        "hardware": machine,
                        "arm": f"{arm} vs {base}",
                        **dataclasses.asdict(interval),  # ratio, low, high, verdict
                        "records": len(group),
                        "mfu": pooled_mfu(group, arm),
                        "base_mfu": pooled_mfu(group, base),
                    }
                )
    return sorted(rows, key=lambda r: (r["workload"], r["arm"], r["hardware"]))


def cross_table(rows: list[dict]) -> str:
    """Markdown: a row per workload and comparison, a column per hardware."""
    machines = sorted({r["hardware"] for r in rows})
    cells: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows:
        cells.setdefault((r["workload"], r["arm"]), {})[r["hardware"]] = (
            format_speedup(r["ratio"], r)
            + (f" ({r['records']} runs)" if r["records"] > 1 else "")
            + (
                f"; MFU {r['mfu']:.1%} vs {r['base_mfu']:.1%}"
                if r.get("mfu") is not None and r.get("base_mfu") is not None
                else ""
            )
        )
    return _by_machine(("workload", "comparison"), cells, machines)


def _by_machine(labels: tuple[str, ...], cells: dict[tuple, dict[str, str]], machines: list[str]) -> str:
    """Markdown: a row per key of ``cells`` (its ``labels`` columns), a column per machine ("—": no record)."""

    def row(key: tuple[str, ...], values) -> str:
        return "| " + " | ".join(key) + " | " + " | ".join(values) + " |"

    lines = [row(labels, machines), "|---" * len(labels) + "|" + "---|" * len(machines)]
    lines += [row(key, (by_machine.get(m, "—") for m in machines)) for key, by_machine in cells.items()]
    return "\n".join(lines) + "\n"


def ceiling_table(records: list[tuple[Path, dict]]) -> str:
    """Markdown: the memory ceilings found (``ab --max-tokens-within``), a row per workload, budget and arm."""
    cells: dict[tuple[str, str, str], dict[str, str]] = {}
    machines: set[str] = set()
    for _, record in records:
        ceiling = record.get("ceiling")
        if not ceiling:
            continue
        machine = hardware(record)
        machines.add(machine)
        stock = [a for a in ceiling if ARM_SPECS[a].stock and ceiling[a]["max_tokens"]]
        for arm, found in ceiling.items():
            budget = f"{found['budget_bytes'] / 1e9:.1f} GB"
            ratios = [f"{found['max_tokens'] / ceiling[b]['max_tokens']:.1f}x {b}" for b in stock if b != arm]
            cells.setdefault((workload(record), budget, arm), {})[machine] = (
                f"{'>= ' if found['capped'] else ''}{found['max_tokens']:,}"
                + (f" ({', '.join(ratios)})" if ratios else "")
            )
    if not cells:
        return ""
    return _by_machine(("workload", "budget", "arm"), cells, sorted(machines))


def step_profile_table(records: list[tuple[Path, dict]]) -> str:
    """Markdown: every profiled step (``ab --profile-step``), a row per record and arm: its time by
    category and its GEMM rate, with the machine and workload it ran."""
    lines = []
    for path, record in records:
        for arm, s in record["summary"].items():
            found = s.get("step_profile")
            if not found:
                continue
            shares, rate = step_profile_cells(found)
            mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "-"
            lines.append(
                f"| {hardware(record)} | {workload(record)} | {arm} | {mfu} | {shares} | {rate} | {path.parent.name} |"
            )
    if not lines:
        return ""
    header = [
        f"| machine | workload | arm | MFU | {CATEGORY_COLUMNS} | GEMM rate | record |",
        "|---|---|---|---:|" + "---:|" * (len(CATEGORIES) + 1) + "---|",
    ]
    return "\n".join(header + lines) + "\n"


def skipped_lines(records: list[tuple[Path, dict]]) -> list[str]:
    """'- arm on machine, workload: reason' for every arm a record skipped (a peer that could not run)."""
    seen = {}
    for _, record in records:
        for arm, s in record["summary"].items():
            if "skipped" in s:
                seen.setdefault((arm, hardware(record), s["skipped"]), workload(record))
    return [f"- {arm} on {machine} ({load}): {reason}" for (arm, machine, reason), load in seen.items()]


def report_markdown(records: list[tuple[Path, dict]], rows: list[dict]) -> str:
    """What ``slipstream report`` shows: the speedup table (slipstream against every stock and peer
    arm, with both sides' MFU where the records have it), any memory ceilings, any profiled steps
    (where each step's time went), then the arms that were skipped and why."""
    table = cross_table(rows)
    if ceilings := ceiling_table(records):
        table += f"\nMemory ceiling (max packed tokens per step within the budget):\n\n{ceilings}"
    if profiles := step_profile_table(records):
        table += f"\nWhere a step goes (`ab --profile-step`; self time by category, an op inside attention or a compiled graph counted there):\n\n{profiles}"
    if skipped := skipped_lines(records):
        table += "\nArms skipped (not run on that machine):\n\n" + "\n".join(skipped) + "\n"
    return table


def write_report(
    out: Path, records: list[tuple[Path, dict]], rows: list[dict], table: str
) -> tuple[Path, Path]:
    """report.md (the table) and report.png (the speedups), each written atomically."""
    from .plots import report_plot  # matplotlib is slow to import: only when a plot is drawn

    md_path, png_path = out / "report.md", out / "report.png"
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomically(
        md_path, f"# slipstream report\n\n{len(records)} records.\n\n{table}\n![speedups](report.png)\n"
    )
    report_plot(rows, png_path)
    return md_path, png_path
