"""One A/B, ``ABConfig``: the ``slipstream train`` config every arm trains, and the A/B's own keys.

Kept apart from the runner so that the runner and the memory-ceiling search (``ceiling.py``),
which both read it, import it from below instead of from each other.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from functools import reduce
from pathlib import Path
from typing import Any, Literal

import torch

from .. import speedups as speedups_module
from ..fields import check_fields
from ..objectives import objective_for
from ..train.config import TrainConfig, config_from_data
from .arms import ARM_PRESETS, ARM_SPECS, ARMS
from .inputs import check_model, is_model_dir, read_chat_template_option

# How the arms' processes share the machine (bench/lockstep.py)
Interleave = Literal["auto", "steps", "arms"]
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'8GB' -> 8e9, '8GiB' -> 8 * 2**30, '512MB', '1.5GB'; ValueError naming the text otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMG]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"max_tokens_within: {text!r} is not a memory size (e.g. 8GB, 512MiB)")
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if value <= 0:
        raise ValueError(f"max_tokens_within: {text!r} must be positive")
    return int(value)


def _option(default: Any, help: str | None, flag: str | None = None, metavar: str | None = None):
    """An ABSection field and its ``slipstream ab`` option (generated in bench/command.py)."""
    return field(default=default, metadata={"help": help, "flag": flag, "metavar": metavar})


@dataclass
class ABSection:
    """The A/B's own keys (a train config's ``ab:`` section): which arms, and how they are timed."""

    arms: tuple[str, ...] = _option(ARM_PRESETS["default"], f"comma-separated, from {','.join(ARMS)}")
    steps: int = _option(40, "optimizer steps per arm (warm-up included)")
    warmup: int = _option(2, "untimed warm-up steps")
    device: str = _option("auto", "auto, cpu or cuda")
    repeats: int = _option(1, "run every arm this many times, interleaved")
    interleave: Interleave = _option(
        "auto",
        "steps: every arm's process alive at once, each arm's step k timed next to the others' (a slow "
        "phase of the machine then slows every arm alike); arms: one arm after another; auto: steps where "
        "the arms' memory fits side by side",
    )
    threads: int | None = _option(None, "torch CPU threads per arm")
    # why: on a VM the host takes a waiting process's freed pages back; they fault in cold (host_pages.py)
    keep_pages_warm: bool = _option(
        True,
        "CPU: between two steps, hold the memory the arm's steps churn (untimed) and free it just before the "
        "next, so an arm that waited (lockstep) pays no colder page faults than one stepping alone",
    )
    out_dir: str | None = _option(None, "output directory (default: runs/ab-<time>)", flag="--out")
    # the memory ceiling (bench/ceiling.py); None: not searched
    max_tokens_within: str | None = _option(
        None,
        "also find each arm's memory ceiling: the most packed tokens one step trains within SIZE "
        "(e.g. 8GB; peak RSS on a CPU, max_memory_allocated on CUDA)",
        metavar="SIZE",
    )
    profile_step: bool = _option(
        False,
        "after the timed steps, profile one more step per arm: its time in matmuls, attention, dtype "
        "copies, compiled kernels, the optimizer and the rest, and the linear layers' GEMM rate",
    )
    # The `slipstream train` config the A/B was read from (--config RUN.yaml), for the record.
    train_config: str | None = _option(
        None,
        "A/B the run a slipstream train config describes (its model, data, LoRA, optimizer, objective, "
        "speedups and seed) with its ab: section; options given here win",
        flag="--config",
        metavar="RUN.yaml",
    )


# What a built-in shape (seeded random weights) trains when nothing says otherwise: a full fine-tune
# at a constant, high learning rate, in fp32 (every earlier A/B record ran so); a model directory
# gets slipstream train's own defaults. Keyed by the record's names, valued as train keys.
SHAPE_DEFAULTS = {
    "lora_rank": ("lora.enabled", False),
    "lr": ("optimizer.lr", 2e-3),
    "schedule": ("optimizer.schedule", "constant"),
    "dtype": ("model.dtype", "float32"),
}
DEMO_ROWS = 1500  # the demo rows an A/B draws from (train's data.demo_rows otherwise)


def default_train(model: str, steps: int, sets: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """The train config of ``model`` without a file: train's defaults, a shape's own (``SHAPE_DEFAULTS``)."""
    data: dict[str, Any] = {
        "model": {"path": model} if is_model_dir(model) else {"preset": model},
        "data": {"demo_rows": DEMO_ROWS},
        "training": {"steps": steps},
    }
    if not is_model_dir(model):
        for key, value in SHAPE_DEFAULTS.values():
            section, name = key.split(".")
            data.setdefault(section, {})[name] = value
    return config_from_data(data, sets, "slipstream ab")


@dataclass
class ABConfig:
    """One A/B: ``train`` is what every arm trains, ``ab`` how they are run and timed."""

    train: TrainConfig = field(default_factory=lambda: default_train("demo", ABSection.steps))
    ab: ABSection = field(default_factory=ABSection)
    # What the train config took from the defaults: {"source": ..., "fields": {...}}, kept in the record.
    defaults: dict[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> str:
        return self.train.model.path or self.train.model.preset

    @property
    def lora_rank(self) -> int:
        return self.train.lora.rank if self.train.lora.enabled else 0

    def __post_init__(self):
        train, ab = self.train, self.ab
        check_model(self.model)  # raises ValueError naming a model that is neither shape nor directory
        self._resolve_dtype()
        if unknown := [arm for arm in ab.arms if arm not in ARMS]:
            raise ValueError(f"unknown arm(s) {unknown}; choose from {ARMS}")
        if ab.steps <= ab.warmup:
            raise ValueError(f"steps ({ab.steps}) must exceed warmup ({ab.warmup})")
        check_fields(ab)  # the typed fields' rules (choices, ranges), as everywhere
        if (rounds := objective_for(train.training.objective)(train).updates_per_round) > 1:
            raise ValueError(  # GRPO's grpo.num_iterations: the one objective that updates a round k times
                f"{ab.train_config or 'the train config'}: 'grpo.num_iterations' {rounds} is not supported by "
                "slipstream ab yet: its arms replay one update a round (A/B the run with 1)"
            )
        if train.model.trust_remote_code:  # an arm's process would run the directory's own code
            raise ValueError(
                f"{ab.train_config or 'the train config'}: 'model.trust_remote_code' is not supported by "
                "slipstream ab yet (A/B the run without it)"
            )
        if train.model.layers is not None and is_model_dir(self.model):
            raise ValueError(
                f"layers: a model directory ({self.model}) runs as saved; --layers shortens a built-in shape"
            )
        if train.data.path is not None and not Path(train.data.path).exists():
            raise ValueError(f"data {train.data.path}: no such file or directory")
        if train.data.chat_template is not None:
            read_chat_template_option(train.data.chat_template)  # raises ValueError naming chat_template
        self._check_objective()
        if ab.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but this torch sees no CUDA device")
        if ab.max_tokens_within is not None:
            parse_bytes(ab.max_tokens_within)  # raises ValueError naming the value

    def _check_objective(self) -> None:
        """Its arms train the run's objective (each arm names the one it trains); its data file and a
        grpo run's rewards are train's validation's."""
        objective, arms = self.train.training.objective, self.ab.arms
        own = [arm for arm in ARMS if ARM_SPECS[arm].objective == objective]
        if not own:
            raise ValueError(f"objective {objective}: no A/B arm trains it yet")
        if other := [arm for arm in arms if ARM_SPECS[arm].objective != objective]:
            theirs = sorted({ARM_SPECS[arm].objective for arm in other})
            raise ValueError(
                f"objective {objective}: arm(s) {other} train another objective, {'/'.join(theirs)} "
                f"(add --objective {theirs[0]}, or run {objective}'s own: {', '.join(own)})"
            )

    def _resolve_dtype(self) -> None:
        """``dtype: auto`` becomes the dtype it resolves to on the run's device, said in ``defaults``."""
        if self.train.model.dtype != "auto":
            return
        from ..train.precision import resolve_dtype  # the rule slipstream train applies

        chosen, why = resolve_dtype("auto", torch.device(resolve_device(self.ab.device)))
        self.train.model.dtype = str(chosen).removeprefix("torch.")
        said = f"auto: {self.train.model.dtype} ({why.split('(auto: ', 1)[-1].rstrip(')')})"
        fields = {**self.defaults.get("fields", {}), "dtype": said}
        self.defaults = {"source": self.defaults.get("source") or source_of(self), "fields": fields}

    @classmethod
    def from_dict(cls, config_dict: dict) -> ABConfig:
        """Back from ``dataclasses.asdict`` (how a config reaches an arm's process)."""
        ab = {**config_dict["ab"], "arms": tuple(config_dict["ab"]["arms"])}
        train = config_from_data(config_dict["train"], source="slipstream ab")
        return cls(train, ABSection(**ab), config_dict.get("defaults") or {})


def source_of(config: ABConfig) -> str:
    """Whose defaults the train config took."""
    if config.ab.train_config:
        return config.ab.train_config  # its dtype auto, resolved
    if is_model_dir(config.model):
        return "slipstream train's defaults (a model directory)"
    return "the A/B's defaults for a built-in shape"


def resolve_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


# `slipstream ab`'s workload options, each a `--set` of one train key (bench/command.py); the record
# keeps the workload under these names (bench/report.py compares records by them). --model and
# --lora-rank set two keys each (the path or the preset; lora.enabled beside the rank).
TRAIN_FLAGS = {
    "layers": ("model.layers", "shorten a built-in shape to N layers"),
    "data": (
        "data.path",
        "a file slipstream train reads (JSONL, JSON, Parquet, datasets); default: demo rows",
    ),
    "response_only": ("data.response_only", "labels on the assistant's turns only"),
    "chat_template": (
        "data.chat_template",
        "render chats with this template: a .jinja file or tokenizer dir",
    ),
    "objective": (
        "training.objective",
        "sft (documents), dpo / orpo (--data holds preference pairs; arms: --preset dpo / --preset orpo), "
        "or grpo (--data holds prompt rows, --config RUN.yaml its rewards; arms: --preset grpo)",
    ),
    "beta": ("preference.beta", "the preference objective's beta (dpo; orpo: its lambda)"),
    # rows that start with the same tokens run with that start once, in the arms that share (data.prefix_groups)
    "share_prefixes": (
        "data.share_prefixes",
        "run what rows share once: groups (one start), tree (every history); auto: where the cost model says",
    ),
    "step_order": (
        "data.step_order",
        "which rows form a step: shuffled bins, or histories (rows sharing a history in one step)",
    ),
    "max_seq_len": ("data.max_seq_len", "tokens per packed micro-batch"),
    # bfd's bins gather similar lengths, so they also spare the padded arm most of its padding
    "batching": (
        "data.batching",
        "rows per micro-batch: best-fit-decreasing bins, or shuffled order up to the budget "
        "(sequential: the batches padded training usually sees)",
    ),
    "overflow": ("data.overflow", "a sample longer than --max-seq-len: cut it, or split it in pieces"),
    "grad_accum": ("training.grad_accum", "micro-batches per step"),
    "lr": ("optimizer.lr", "peak learning rate (default: 2e-4 for a model directory; 2e-3 for a shape)"),
    "schedule": (
        "optimizer.schedule",
        "over --steps (default: cosine for a model directory; constant for a shape)",
    ),
    "lr_warmup_steps": ("optimizer.warmup_steps", "steps the schedule warms the learning rate up over"),
    "seed": ("seed", "seeds the preset's weights, the demo rows, the bin order and the adapter"),
    "num_rows": ("data.demo_rows", "built-in demo rows to draw from"),
    "dtype": (
        "model.dtype",
        "every arm's parameters; auto: bf16 where native (default for a directory; shape: fp32)",
    ),
    "lora_alpha": ("lora.alpha", "the LoRA's alpha (default: 2 x rank for a shape)"),
    "lora_targets": ("lora.target_modules", "comma-separated modules the LoRA wraps"),
}


def record_config(config: ABConfig) -> dict[str, Any]:
    """The record's ``config``: the A/B's keys, the workload under its option names (what the reports
    read, older records' names too), and the whole train config under ``train``."""
    train = config.train
    online = any(ARM_SPECS[arm].engine for arm in config.ab.arms)  # arms that sample their rollouts
    # each workload option's value: its dotted train key's
    flat = {
        name: reduce(getattr, k.split("."), train) for name, (k, _) in TRAIN_FLAGS.items() if "lora" not in k
    }
    default = speedups_module.Speedups()
    return {  # in the order of the A/B's earlier fields: a report's labels list them so
        "model": config.model,
        **flat,
        "checkpointing": train.speedups.checkpointing or "off",
        "speedups": {
            f.name: getattr(train.speedups, f.name)
            for f in dataclasses.fields(train.speedups)
            if f.name != "checkpointing" and getattr(train.speedups, f.name) != getattr(default, f.name)
        },
        "lora_rank": config.lora_rank,
        "lora_alpha": train.lora.alpha if config.lora_rank else None,
        "lora_targets": tuple(train.lora.target_modules),
        "lora_modules_to_save": tuple(train.lora.modules_to_save),
        **dataclasses.asdict(config.ab),
        "grpo": dataclasses.asdict(train.grpo) if online else {},  # online RL's settings (rewards, G)
        "defaults": config.defaults,
        "train": train.to_dict(),
    }
