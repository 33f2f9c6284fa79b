"""``slipstream ab`` without the CLI: its options, the configs they make, and the run of a sweep.

Here rather than in ``cli.py`` so the benchmark scripts take the same options and configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
from pathlib import Path

from .. import speedups as speedups_module  # read at call time: a new field is a new option
from ..fields import choices, field_types, is_kind
from .ab_config import ABConfig
from .arms import ARM_PRESETS
from .render import print_tables, write_record
from .runner import parity_failures, run_ab


def add_ab_arguments(p: argparse.ArgumentParser, defaults: ABConfig | None = None) -> None:
    """The A/B workload options (shared by ``slipstream ab`` and the benchmark scripts), generated
    from ABConfig's fields and Speedups' fields: a new field is a new option, no edit here."""
    defaults = defaults or ABConfig()
    types_ = field_types(ABConfig)
    for spec in dataclasses.fields(ABConfig):
        if not spec.metadata.get("cli", True):
            continue
        expected, value = types_[spec.name], getattr(defaults, spec.name)
        options: dict = {"default": value, "help": spec.metadata.get("help")}
        if spec.name == "arms":  # a comma-separated list on the command line
            options["default"] = ",".join(value)
        elif choices(expected):
            options["choices"] = choices(expected)
        elif is_kind(expected, int) or is_kind(expected, float):
            options["type"] = int if is_kind(expected, int) else float
        if spec.metadata.get("metavar"):
            options["metavar"] = spec.metadata["metavar"]
        p.add_argument(spec.metadata.get("flag") or "--" + spec.name.replace("_", "-"), **options)
        if spec.name == "lora_rank":  # the arms preset sits beside the arms it picks
            p.add_argument(
                "--preset",
                choices=tuple(ARM_PRESETS),
                default=None,
                help="arms preset: default (stock-padded, stock-packed, slipstream), ablation (leave-one-out), "
                "ceiling (stock-packed, trl-fused-head, slipstream, slipstream-offload) or peers (trl, "
                "stock-packed, stock-offload, unsloth, unsloth-same-settings, liger, slipstream; a peer "
                "that cannot run here is skipped with the reason)",
            )
    add_speedup_arguments(p, defaults)


def _dest(spec: dataclasses.Field) -> str:
    return (spec.metadata.get("flag") or "--" + spec.name).lstrip("-").replace("-", "_")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "on", "1", "yes")


def add_speedup_arguments(p: argparse.ArgumentParser, defaults: ABConfig) -> None:
    """One option per ``Speedups`` field, generated: a new speedup is a new option, no edit here.

    ``checkpointing`` is ABConfig's own (it also sets the stock arms' recompute); every other
    field is collected into ``ABConfig.speedups`` for the slipstream arms.
    """
    for spec in dataclasses.fields(speedups_module.Speedups):
        flag = "--" + spec.name.replace("_", "-")
        expected = field_types(speedups_module.Speedups)[spec.name]
        allowed = choices(expected)
        kind = _bool if is_kind(expected, bool) else int if is_kind(expected, int) else str
        default = defaults.checkpointing if spec.name == "checkpointing" else None
        p.add_argument(
            flag,
            dest=f"speedup_{spec.name}",
            type=kind,
            choices=allowed,
            default=default,
            metavar=None if allowed else spec.name.upper(),
            help=spec.metadata.get("help", "") + " (slipstream arms)",
        )


def _speedup_options(args: argparse.Namespace) -> dict:
    return {
        spec.name: getattr(args, f"speedup_{spec.name}")
        for spec in dataclasses.fields(speedups_module.Speedups)
        if spec.name != "checkpointing" and getattr(args, f"speedup_{spec.name}", None) is not None
    }


def ab_config_from_args(args: argparse.Namespace) -> ABConfig:
    """An ABConfig from parsed ``add_ab_arguments`` options (raises ValueError on a bad one)."""
    values = {
        spec.name: getattr(args, _dest(spec))
        for spec in dataclasses.fields(ABConfig)
        if spec.metadata.get("cli", True)
    }
    values["arms"] = (
        ARM_PRESETS[args.preset]
        if args.preset
        else tuple(a.strip() for a in args.arms.split(",") if a.strip())
    )
    return ABConfig(**values, checkpointing=args.speedup_checkpointing, speedups=_speedup_options(args))


SWEEP_ALIASES = {"batch_tokens": "max_seq_len", "tokens": "max_seq_len"}


def sweep_grid(sweeps: list[str]) -> list[dict]:
    """[{field: value, ...}, ...] for every combination of the --sweep options."""
    fields = {f.name: f for f in dataclasses.fields(ABConfig)}
    axes = []
    for sweep in sweeps:
        key, _, values = sweep.partition("=")
        key = SWEEP_ALIASES.get(key.strip(), key.strip())
        if key not in fields or not values:
            raise ValueError(f"--sweep {sweep!r}: expected KEY=V1,V2 with KEY one of {', '.join(fields)}")
        kind = type(getattr(ABConfig(), key))
        cast = int if kind is int or key in ("layers", "threads") else float if kind is float else str
        axes.append([(key, cast(v.strip())) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def ab_grid(args: argparse.Namespace) -> list[tuple[dict, ABConfig]]:
    """Every (sweep point, config) the parsed options ask for (raises ValueError on a bad one)."""
    base = ab_config_from_args(args)
    points = sweep_grid(args.sweep)
    return [(point, dataclasses.replace(base, **point)) for point in points]


def run_grid(grid: list[tuple[dict, ABConfig]], out_root: Path) -> list[str]:
    """Run, print and write every point (a subdirectory each in a sweep); the arms whose loss diverged."""
    diverged = []
    for point, config in grid:
        out_dir = out_root / "-".join(f"{k}={v}" for k, v in point.items()) if point else out_root
        record = run_ab(config)
        print_tables(record)
        json_path, md_path = write_record(record, out_dir)
        print(f"wrote {json_path}, {md_path} and the plots in {out_dir}")
        diverged += [f"{out_dir}: {arm}" for arm in parity_failures(record)]
    return diverged
