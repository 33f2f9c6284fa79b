"""``slipstream ab`` without the CLI: its options, the configs they make, and the run of a sweep.

Here rather than in ``cli.py`` so the benchmark scripts take the same options and configs.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from functools import reduce
from pathlib import Path

import yaml

from .. import speedups as speedups_module  # read at call time: a new field is a new option
from ..fields import choices, field_types, is_kind
from ..train.config import TrainConfig, load_config
from .ab_config import (
    TRAIN_FLAGS,
    ABConfig,
    ABSection,
    default_train,
    record_config,
    resolve_device,
    source_of,
)
from .arms import ARM_PRESETS, ARM_SPECS, ablation_arms, preset_arms
from .inputs import check_model, is_model_dir
from .render import print_tables, write_record
from .runner import parity_failures, run_ab

_LISTS = ("arms", "lora_targets")  # comma-separated on the command line


def _train_type(key: str):
    """The annotation of a dotted train key (its option's type and choices)."""
    cls, *sections, name = (TrainConfig, *key.split("."))
    for section in sections:
        cls = field_types(cls)[section]
    return field_types(cls)[name]


def _argument(p: argparse.ArgumentParser, flag: str, expected, help_text: str | None, shown=None, **extra):
    """An option that parses to None when not given, typed and choosing from its annotation."""
    options: dict = {"default": None, "help": help_text, **extra}
    if help_text is not None and shown is not None and shown != "":
        options["help"] = f"{help_text} (default: {shown})"
    if is_kind(expected, bool):
        options["action"] = argparse.BooleanOptionalAction
    elif choices(expected):
        options["choices"] = choices(expected)
    elif is_kind(expected, int) or is_kind(expected, float):
        options["type"] = int if is_kind(expected, int) else float
    p.add_argument(flag, **options)


def add_ab_arguments(p: argparse.ArgumentParser, defaults: dict | None = None) -> None:
    """The A/B options (shared by ``slipstream ab`` and the benchmark scripts): ABSection's fields,
    and the workload options, each a ``--set`` of its train key (``TRAIN_FLAGS``, Speedups' fields).

    Every option parses to None when not given, so ``--config RUN.yaml`` fills what the command line
    leaves out; ``defaults`` (options by name, e.g. a benchmark script's) sit under the given ones."""
    defaults = dict(defaults or {})
    p.set_defaults(ab_defaults=defaults)
    p.add_argument(
        "--model",
        default=None,
        metavar="SHAPE_OR_DIR",
        help="a built-in shape (tiny config or real-model preset, seeded random weights) or a local model "
        f"directory (real weights, with its tokenizer and chat template) (default: {defaults.get('model', 'demo')})",
    )
    built_in = default_train("demo", ABSection.steps)  # what `slipstream ab` alone trains
    for name, (key, help_text) in TRAIN_FLAGS.items():
        flag = "--rows" if name == "num_rows" else "--" + name.replace("_", "-")
        extra = {"dest": name, "metavar": "FILE" if name in ("data", "chat_template") else None}
        # (a help that says its default itself says how it depends on the model)
        shown = None if "default" in help_text else _shown(reduce(getattr, key.split("."), built_in))
        _argument(
            p, flag, _train_type(key), f"{help_text} (train's {key})", defaults.get(name, shown), **extra
        )
    _argument(
        p,
        "--lora-rank",
        int,
        "train a PEFT LoRA of this rank in every arm, 0: full fine-tune (default: 8 for a model directory, "
        "as slipstream train; 0 for a shape)",
        defaults.get("lora_rank"),
    )
    p.add_argument("--preset", choices=tuple(ARM_PRESETS), default=None, help=presets_help())
    types_ = field_types(ABSection)
    for spec in dataclasses.fields(ABSection):
        shown = _shown(defaults.get(spec.name, getattr(ABSection, spec.name, None)))
        flag = spec.metadata.get("flag") or "--" + spec.name.replace("_", "-")
        extra = {"dest": spec.name, "metavar": spec.metadata.get("metavar")}
        _argument(p, flag, types_[spec.name], spec.metadata["help"], shown, **extra)
    add_speedup_arguments(p)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a train key as slipstream train --set does (optimizer.lr=1e-4), of --config RUN.yaml or "
        "of the built-in defaults, or a key of its ab: section (ab.steps=20); repeatable",
    )


def _shown(value):
    """A default as its option is written: a list comma-separated."""
    return ",".join(value) if isinstance(value, (list, tuple)) else value


def presets_help() -> str:
    """Every preset of ``ARM_PRESETS`` and its arms (the leave-one-out arms said once): a new one shows."""
    leave_one_out = ablation_arms()
    said = []
    for name, arms in ARM_PRESETS.items():
        named = [arm for arm in arms if arm not in leave_one_out]
        named += ["slipstream-no-<speedup> for each speedup"] if len(named) < len(arms) else []
        said.append(f"{name} ({', '.join(named)})")
    return f"arms preset: {'; '.join(said)}. A peer that cannot run here is skipped with the reason"


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "on", "off", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return lowered in ("true", "on", "1", "yes")


def add_speedup_arguments(p: argparse.ArgumentParser) -> None:
    """One option per ``Speedups`` field, generated: a new speedup is a new option, no edit here.
    Each is a ``--set speedups.NAME`` (checkpointing also makes the stock arms recompute)."""
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
            help=spec.metadata.get("help", "")
            + (
                " (slipstream arms)"
                if spec.default is None
                else f" (slipstream arms; default: {spec.default})"
            ),
        )


def ab_config_from_args(args: argparse.Namespace, **point) -> ABConfig:
    """An ABConfig from parsed ``add_ab_arguments`` options (raises ValueError on a bad one); ``point``:
    options over them (a sweep's)."""
    names = (*(f.name for f in dataclasses.fields(ABSection)), *TRAIN_FLAGS, "model", "lora_rank", "preset")
    given = {name: value for name in names if (value := getattr(args, name, None)) is not None}
    speedups = {
        spec.name: value
        for spec in dataclasses.fields(speedups_module.Speedups)
        if (value := getattr(args, f"speedup_{spec.name}", None)) is not None
    }
    options = {**(getattr(args, "ab_defaults", None) or {}), **given, **point}
    if speedups:
        options["speedups"] = {**options.get("speedups", {}), **speedups}
    config = ab_config(getattr(args, "set", None) or (), **options)
    if (flags := [name for name in given if name in TRAIN_FLAGS]) and not point:  # one name per train key
        keys = ", ".join(f"--{name.replace('_', '-')} sets {TRAIN_FLAGS[name][0]}" for name in flags)
        print(f"slipstream ab: {keys} (--set KEY=VALUE, or the key in --config RUN.yaml)")
    return config


def _sets(options: dict, shape: bool) -> list[str]:
    """The ``--set KEY=VALUE`` of each workload option (``TRAIN_FLAGS``, a Speedups field; a dict names a
    section)."""
    sets = []
    for name, value in options.items():
        if name in _LISTS and isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        if name == "model":
            directory = is_model_dir(value)
            sets += [f"model.path={json.dumps(value if directory else None)}"]
            sets += [f"model.preset={json.dumps(None if directory else value)}"]
        elif name == "lora_rank":
            sets += [f"lora.enabled={json.dumps(bool(value))}"] + ([f"lora.rank={value}"] if value else [])
            if value and shape and "lora_alpha" not in options:
                sets.append(f"lora.alpha={2.0 * value}")  # a shape's LoRA: alpha twice the rank
        elif name in TRAIN_FLAGS:
            sets.append(f"{TRAIN_FLAGS[name][0]}={json.dumps(list(value) if name in _LISTS else value)}")
        elif name in {f.name for f in dataclasses.fields(speedups_module.Speedups)}:
            sets.append(f"speedups.{name}={json.dumps(value)}")
        elif isinstance(value, dict):  # a train config section: speedups, grpo, preference, ...
            sets += [f"{name}.{key}={json.dumps(item)}" for key, item in value.items()]
        else:
            raise ValueError(f"unknown option {name!r}")
    return sets


def ab_config(sets: list[str] | tuple[str, ...] = (), **options) -> ABConfig:
    """An ABConfig from options by name (``--NAME``'s: ABSection's fields, ``TRAIN_FLAGS``, model,
    lora_rank, preset, a train section as a dict) and ``--set KEY=VALUE``s: the train config read from
    ``train_config`` (RUN.yaml, its ``ab:`` section under the options) or built from ``model``'s
    defaults, each workload option a ``--set`` of its train key (None: not given); ValueError naming
    what is wrong."""
    options = {name: value for name, value in options.items() if value is not None}
    ab = {f.name: options.pop(f.name) for f in dataclasses.fields(ABSection) if f.name in options}
    if isinstance(ab.get("arms"), str):
        ab["arms"] = tuple(item.strip() for item in ab["arms"].split(",") if item.strip())
    preset, path = options.pop("preset", None), ab.get("train_config")
    train_sets = [s for s in sets if not s.startswith("ab.")]
    if path:
        from_file = ab_section(path, [s for s in sets if s.startswith("ab.")])
        preset = preset or (from_file.pop("preset", None) if "arms" not in ab else None)
        ab = {**{k: v for k, v in from_file.items() if k != "preset"}, **ab}
        train = load_config(path, train_sets + _sets(options, shape=False))
        objective = train.training.objective
        with_arms = sorted({spec.objective for spec in ARM_SPECS.values()})
        if objective not in with_arms:
            raise ValueError(
                f"{path}: 'training.objective' {objective!r}: slipstream ab has no arms for it yet "
                f"(it A/Bs {', '.join(with_arms)})"
            )
        preset = preset or (objective if "arms" not in ab and objective in ARM_PRESETS else None)
        if "steps" not in ab and train.training.steps and train.training.steps < ABSection.steps:
            ab["steps"] = train.training.steps  # a run shorter than the A/B's default: all of it
            ab.setdefault("warmup", min(ABSection.warmup, ab["steps"] - 1))
        if train.lora.enabled and train.lora.dropout:
            print(
                f"slipstream ab: {path}: lora.dropout {train.lora.dropout:g} runs as 0 here: each arm would "
                "draw its own dropout masks, and the loss curves could not be compared",
                file=sys.stderr,
            )
    else:
        ab = {**ab_section_sets([s for s in sets if s.startswith("ab.")]), **ab}
        model = options.pop("model", "demo")
        check_model(model)  # the model's own error before its defaults are looked for
        shape = not is_model_dir(model)
        train = default_train(model, ab.get("steps", ABSection.steps), train_sets + _sets(options, shape))
    config = ABConfig(train, ABSection(**{**ab, **({"arms": ARM_PRESETS[preset]} if preset else {})}))
    if not path:  # what the built-in defaults filled, said in the record
        view, keys = record_config(config), {"lora_rank": "lora.", "lora_alpha": "lora.alpha"}
        keys |= {name: TRAIN_FLAGS[name][0] for name in ("lr", "schedule", "dtype")}
        said = {
            name: view[name]
            for name, key in keys.items()
            if name not in options and view[name] is not None and not (shape and name == "lora_alpha")
            if not any(s.startswith(key) for s in train_sets)
        }
        if said:
            config.defaults = {
                "source": source_of(config),
                "fields": {**said, **config.defaults.get("fields", {})},
            }
    if preset:
        arms = preset_arms(preset, config, resolve_device(config.ab.device))
        config = dataclasses.replace(config, ab=dataclasses.replace(config.ab, arms=arms))
    return config


_AB_ALIASES = {"out": "out_dir"}  # the ab: section's key for a field whose flag differs
_TRAIN_KEY_OF = {
    **{name: key for name, (key, _) in TRAIN_FLAGS.items()},
    "model": "model.path / model.preset",
    "lora_rank": "lora.rank",
    "checkpointing": "speedups.checkpointing",
}


def ab_section_sets(sets: list[str], section: dict | None = None, path: str = "--set") -> dict:
    """``section`` (an ``ab:`` mapping) with ``--set ab.KEY=VALUE`` applied, as ABSection fields;
    ValueError naming ``ab.KEY`` for a key it does not know, or one the train config sets (naming it)."""
    section = dict(section or {})
    for override in sets:
        key, _, raw = override.partition("=")
        section[key.removeprefix("ab.")] = yaml.safe_load(raw) if raw else None
    own = {f.name for f in dataclasses.fields(ABSection)} - {"train_config"}
    found = {}
    for key, value in section.items():
        name = _AB_ALIASES.get(key, key)
        if name in _TRAIN_KEY_OF:
            raise ValueError(f"{path}: 'ab.{key}': the train config's '{_TRAIN_KEY_OF[name]}' sets it")
        if name not in own and name != "preset":
            raise ValueError(f"{path}: unknown key 'ab.{key}' (valid: {', '.join(sorted(own | {'preset'}))})")
        if name in _LISTS and isinstance(value, str):
            value = [item.strip() for item in value.split(",") if item.strip()]
        found[name] = tuple(value) if isinstance(value, list) else value
    return found


def ab_section(path: str, sets: list[str]) -> dict:
    """The ``ab:`` section of a train config (arms or preset, steps, warmup, repeats, threads,
    interleave, out, ...) with ``--set ab.KEY=VALUE`` applied, as ABSection fields."""
    try:
        section = (yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}).get("ab") or {}
    except (OSError, yaml.YAMLError, AttributeError):
        section = {}  # the train config's reader says what is wrong with the file
    if not isinstance(section, dict):
        raise ValueError(f"{path}: 'ab' must be a mapping of slipstream ab's keys")
    return ab_section_sets(sets, section, path)


SWEEP_ALIASES = {"batch_tokens": "max_seq_len", "tokens": "max_seq_len"}


def sweep_grid(sweeps: list[str]) -> list[dict]:
    """[{option: value, ...}, ...] for every combination of the --sweep options."""
    kinds = {**{name: _train_type(key) for name, (key, _) in TRAIN_FLAGS.items()}, **field_types(ABSection)}
    kinds |= {"model": str, "lora_rank": int}
    axes = []
    for sweep in sweeps:
        key, _, values = sweep.partition("=")
        key = SWEEP_ALIASES.get(key.strip(), key.strip())
        if key not in kinds or not values:
            raise ValueError(f"--sweep {sweep!r}: expected KEY=V1,V2 with KEY one of {', '.join(kinds)}")
        kind = kinds[key]
        cast = int if is_kind(kind, int) else float if is_kind(kind, float) else str
        axes.append([(key, cast(v.strip())) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def ab_grid(args: argparse.Namespace) -> list[tuple[dict, ABConfig]]:
    """Every (sweep point, config) the parsed options ask for (raises ValueError on a bad one)."""
    return [(point, ab_config_from_args(args, **point)) for point in sweep_grid(args.sweep)]


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
