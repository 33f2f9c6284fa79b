"""``slipstream ab`` without the CLI: its options, the configs they make, and the run of a sweep.

Here rather than in ``cli.py`` so the benchmark scripts take the same options and configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from pathlib import Path

import torch

from .. import speedups as speedups_module  # read at call time: a new field is a new option
from ..fields import choices, field_types, is_kind
from .ab_config import ABConfig, resolve_device
from .arms import ARM_PRESETS, ARM_SPECS, preset_arms
from .render import print_tables, write_record
from .runner import parity_failures, run_ab

_LISTS = ("arms", "lora_targets")  # comma-separated on the command line


def add_ab_arguments(p: argparse.ArgumentParser, defaults: ABConfig | None = None) -> None:
    """The A/B workload options (shared by ``slipstream ab`` and the benchmark scripts), generated
    from ABConfig's fields and Speedups' fields: a new field is a new option, no edit here.

    Every option parses to None when not given, so ``--config RUN.yaml`` can fill what the
    command line leaves out; ``ab_config_from_args`` then falls back to ``defaults``."""
    defaults = defaults or ABConfig()
    p.set_defaults(ab_defaults=defaults)
    types_ = field_types(ABConfig)
    for spec in dataclasses.fields(ABConfig):
        if not spec.metadata.get("cli", True):
            continue
        expected, value = types_[spec.name], getattr(defaults, spec.name)
        shown = ",".join(value) if spec.name in _LISTS else value
        if spec.name in defaults.defaults.get("fields", {}):
            shown = None  # the workload's default (a model directory's differs from a shape's): in the help
        help_text = spec.metadata.get("help")
        options: dict = {"default": None, "help": help_text}
        if help_text is not None and shown not in (None, False, ""):
            options["help"] = f"{help_text} (default: {shown})"
        if is_kind(expected, bool):
            options["action"] = argparse.BooleanOptionalAction
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
    add_speedup_arguments(p)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a key of --config RUN.yaml as slipstream train --set does (optimizer.lr=1e-4), or of "
        "its ab: section (ab.steps=20); repeatable",
    )


def _dest(spec: dataclasses.Field) -> str:
    return (spec.metadata.get("flag") or "--" + spec.name).lstrip("-").replace("-", "_")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "on", "1", "yes")


def add_speedup_arguments(p: argparse.ArgumentParser) -> None:
    """One option per ``Speedups`` field, generated: a new speedup is a new option, no edit here.

    ``checkpointing`` is ABConfig's own (it also sets the stock arms' recompute); every other
    field is collected into ``ABConfig.speedups`` for the slipstream arms.
    """
    for spec in dataclasses.fields(speedups_module.Speedups):
        flag = "--" + spec.name.replace("_", "-")
        expected = field_types(speedups_module.Speedups)[spec.name]
        allowed = choices(expected)
        kind = _bool if is_kind(expected, bool) else int if is_kind(expected, int) else str
        p.add_argument(
            flag,
            dest=f"speedup_{spec.name}",
            type=kind,
            choices=allowed,
            default=None,
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
    """An ABConfig from parsed ``add_ab_arguments`` options (raises ValueError on a bad one): the
    options given, then ``--config RUN.yaml``'s workload, then the defaults."""
    defaults: ABConfig = getattr(args, "ab_defaults", None) or ABConfig()
    given = {
        spec.name: getattr(args, _dest(spec))
        for spec in dataclasses.fields(ABConfig)
        if spec.metadata.get("cli", True) and getattr(args, _dest(spec), None) is not None
    }
    for name in _LISTS:
        if name in given:
            given[name] = tuple(item.strip() for item in given[name].split(",") if item.strip())
    if getattr(args, "preset", None):
        given["arms"] = ARM_PRESETS[args.preset]
    speedups = _speedup_options(args)
    if getattr(args, "speedup_checkpointing", None) is not None:
        given["checkpointing"] = args.speedup_checkpointing
    from_file: dict = {}
    sets = list(getattr(args, "set", None) or [])
    if sets and not given.get("train_config"):
        raise ValueError("--set changes the file --config RUN.yaml names: give --config too")
    if given.get("train_config"):
        from_file = workload_of_train_config(given["train_config"], sets)
        speedups = {**from_file.pop("speedups"), **speedups}
        preset = from_file.pop("preset", None)
        if preset and not getattr(args, "preset", None) and "arms" not in given:
            args.preset = preset  # the ab: section's preset, where the command line names no arms
    # the defaults as given: a field the defaults filled from their workload (workload_defaults) stays
    # open, so that a model directory named here gets its own workload's default
    filled = defaults.defaults.get("fields", {})
    values = {
        spec.name: None if spec.name in filled else getattr(defaults, spec.name)
        for spec in dataclasses.fields(ABConfig)
        if spec.name not in ("speedups", "defaults")
    }
    config = ABConfig(**{**values, **from_file, **given, "speedups": {**defaults.speedups, **speedups}})
    if getattr(args, "preset", None):
        config = dataclasses.replace(
            config, arms=preset_arms(args.preset, config, resolve_device(config.device))
        )
    return config


def _objective_of_train_config(path: str, config) -> dict:
    """The objective a train config trains and its settings, as ABConfig fields: a preference
    objective's ``beta`` and its arms (the preset of its name: its slipstream arms, with and
    without the prompt shared, and the peers where they exist; ``--arms`` / ``--preset`` win)."""
    from ..objectives import objective_for

    name = config.training.objective
    reads = objective_for(name).reads
    if reads == "samples":
        return {"objective": name}
    if name not in ARM_PRESETS:
        with_arms = sorted({spec.objective for spec in ARM_SPECS.values() if spec.objective})
        raise ValueError(
            f"{path}: 'training.objective' {name!r}: slipstream ab has no arms for it yet "
            f"(it A/Bs {', '.join(with_arms)})"
        )
    if reads == "prompts":  # online RL: its settings section (rewards, G, sampling, loss)
        return {
            "objective": name,
            "grpo": dataclasses.asdict(getattr(config, name)),
            "arms": ARM_PRESETS[name],
        }
    return {"objective": name, "beta": config.preference.beta, "arms": ARM_PRESETS[name]}


# The ABConfig fields a train config sets, by its key: an ``ab:`` section may not set them again.
TRAIN_KEYS = {
    "model": "model.path / model.preset",
    "layers": "model.layers",
    "data": "data.path",
    "num_rows": "data.demo_rows",
    "response_only": "data.response_only",
    "chat_template": "data.chat_template",
    "max_seq_len": "data.max_seq_len",
    "overflow": "data.overflow",
    "share_prefixes": "data.share_prefixes",
    "dtype": "model.dtype",
    "grad_accum": "training.grad_accum",
    "lr": "optimizer.lr",
    "schedule": "optimizer.schedule",
    "lr_warmup_steps": "optimizer.warmup_steps",
    "seed": "seed",
    "lora_rank": "lora.rank",
    "lora_alpha": "lora.alpha",
    "lora_targets": "lora.target_modules",
    "checkpointing": "speedups.checkpointing",
    "objective": "training.objective",
    "beta": "preference.beta",
}
_AB_ALIASES = {"out": "out_dir"}  # the ab: section's key for a field whose flag differs


def ab_section(path: str, sets: list[str]) -> dict:
    """The ``ab:`` section of a train config (arms or preset, steps, warmup, repeats, threads,
    interleave, out, ...) with ``--set ab.KEY=VALUE`` applied, as ABConfig fields; ValueError naming
    ``ab.KEY`` for a key it does not know, or one the train config itself sets (naming that key)."""
    import yaml

    try:
        section = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}).get("ab") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        section = {}  # the train config's reader says what is wrong with the file
    if not isinstance(section, dict):
        raise ValueError(f"{path}: 'ab' must be a mapping of slipstream ab's keys")
    section = dict(section)
    for override in sets:
        key, _, raw = override.partition("=")
        section[key.removeprefix("ab.")] = yaml.safe_load(raw) if raw else None
    own = {f.name for f in dataclasses.fields(ABConfig) if f.metadata.get("cli", True)} - set(TRAIN_KEYS)
    own -= {"train_config"}
    found = {}
    for key, value in section.items():
        name = _AB_ALIASES.get(key, key)
        if name in TRAIN_KEYS:
            raise ValueError(f"{path}: 'ab.{key}': the train config's '{TRAIN_KEYS[name]}' sets it")
        if name not in own and name != "preset":
            raise ValueError(f"{path}: unknown key 'ab.{key}' (valid: {', '.join(sorted(own | {'preset'}))})")
        if name in _LISTS and isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        found[name] = tuple(value) if isinstance(value, list) else value
    return found


def workload_of_train_config(path: str, sets: list[str] | tuple[str, ...] = ()) -> dict:
    """The ABConfig fields a ``slipstream train`` config sets (its model, data, LoRA, dtype, lr,
    seed, grad_accum, speedups, and its objective with its settings), then its ``ab:`` section's;
    ``sets``: ``--set`` overrides, a train key's or an ``ab.`` key's. ValueError naming the file's
    key for what an A/B cannot run."""
    from ..train.config import load_config  # the train config's reader, errors naming file:line
    from ..train.precision import resolve_dtype

    config = load_config(path, [s for s in sets if not s.startswith("ab.")])
    unsupported = {
        "quantization.four_bit": config.quantization.four_bit,
        "lora.experts": config.lora.experts,
        "model.trust_remote_code": config.model.trust_remote_code,
    }
    for key, value in unsupported.items():
        if value:
            raise ValueError(
                f"{path}: '{key}' is not supported by slipstream ab yet (A/B the run without it)"
            )
    if config.data.skip_bad_rows:
        raise ValueError(
            f"{path}: 'data.skip_bad_rows': slipstream ab reads every row or stops; fix or drop the bad rows"
        )
    device = resolve_device("auto")
    dtype, _ = resolve_dtype(config.model.dtype, torch.device(device))
    if config.lora.enabled and config.lora.dropout:
        print(
            f"slipstream ab: {path}: lora.dropout {config.lora.dropout:g} runs as 0 here: each arm would "
            "draw its own dropout masks, and the loss curves could not be compared",
            file=sys.stderr,
        )
    speedups = dataclasses.asdict(config.speedups)
    checkpointing = speedups.pop("checkpointing") or "off"  # None: the model as it is, not checkpointed
    return {
        **_objective_of_train_config(path, config),
        "model": config.model.path or config.model.preset,
        "layers": config.model.layers,
        "data": config.data.path,
        "num_rows": config.data.demo_rows,
        "response_only": config.data.response_only,
        "chat_template": config.data.chat_template,
        "max_seq_len": config.data.max_seq_len,
        "overflow": config.data.overflow,
        "share_prefixes": config.data.share_prefixes,
        "dtype": str(dtype).removeprefix("torch."),
        "grad_accum": config.training.grad_accum,
        "lr": config.optimizer.lr,
        "schedule": config.optimizer.schedule,
        "lr_warmup_steps": config.optimizer.warmup_steps,
        "seed": config.seed,
        "lora_rank": config.lora.rank if config.lora.enabled else 0,
        "lora_alpha": config.lora.alpha,
        "lora_targets": tuple(config.lora.target_modules),
        "lora_modules_to_save": tuple(config.lora.modules_to_save),
        "checkpointing": checkpointing,
        "speedups": speedups,
        **ab_section(path, [s for s in sets if s.startswith("ab.")]),
    }


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
