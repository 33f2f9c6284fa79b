"""The training config: YAML validated into small dataclasses, with errors that name the key.

Every rule a value must follow is declared on its field, and checked in one place
(``_coerce``): the type, the choices (``Literal``) and the range (``Annotated[..., Range]``).
An unknown or misspelled key is an error naming it and the closest valid key. Every error is
one line naming the file and, where the YAML has it, the line: ``config.yaml:7: 'optimizer.lr'
must be > 0, got -0.1``. ``--set section.key=value`` overrides are parsed as YAML scalars and
validated the same way; a number written ``1e-4`` (a string to YAML 1.1) is read as a number.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml

from ..fields import (  # noqa: F401 - re-exported: the config's field types and rules
    ConfigError,
    Dtype,
    Length,
    NonNegative,
    Positive,
    Range,
)
from ..fields import coerce as _coerce
from ..fields import field_types as _field_types
from ..objectives import objective_for, objective_names  # the registry (importing it registers)
from ..objectives.grpo import GRPOSettings
from ..objectives.kto import KTOSettings
from ..objectives.pairs import PairSettings
from ..objectives.reward import RewardSettings
from ..speedups import Speedups
from .distributed import Strategy


@dataclass
class ModelConfig:
    path: str | None = None  # a local directory saved with save_pretrained (with its tokenizer)
    preset: str | None = None  # or a built-in shape (random init), e.g. "demo", "qwen3-moe"
    layers: Positive | None = None  # shorten a preset
    # bfloat16 where the device runs it fast (CUDA sm80+, AMX / AVX512-BF16), else float32
    dtype: Dtype = "auto"
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    path: str | None = None  # JSONL / JSON / Parquet / datasets-on-disk; None = the built-in demo data
    demo_rows: Positive = 2000
    response_only: bool = False
    skip_bad_rows: bool = False  # skip (and report) bad rows and samples left without labels, or stop
    max_seq_len: Annotated[int, Range(ge=2)] = 1024
    overflow: Literal["truncate", "split"] = "truncate"
    # which rows share a micro-batch: best-fit-decreasing bins (similar lengths together, little padding
    # for any layout), or the rows in a seeded shuffled order up to max_seq_len (the batches padded
    # training usually sees); SFT rows only
    batching: Literal["bfd", "sequential"] = "bfd"
    cache: bool = True  # keep tokenized samples under $SLIPSTREAM_CACHE and reuse them
    # rows that share tokens run them once: each step's own rows regrouped, never other rows
    # (data.steps). "groups": one shared start per group of rows (data.prefix_groups); "tree": every
    # shared history once, at every level (data.prefix_tree: multi-turn rows, reasoning chats, agent
    # steps); "on": the faster of the two; auto: the faster where the device's cost model says it saves
    # time and the packed attention and the chunked loss run (objectives.sharing). Preference pairs
    # (each runs its prompt once already): "tree" / "on" share the histories pairs' prompts share
    # (data.pair_trees), auto where it is modelled faster; GRPO (each group's prompt once already): "tree" /
    # "on" run a micro-batch's prompts and completions as prefix trees, auto per micro-batch where they are
    # modelled faster (objectives.grpo_sharing); "groups" is SFT's only
    share_prefixes: Literal["auto", "on", "off", "groups", "tree"] = "auto"
    # which rows form a step (data.steps), the same for every layout: "shuffled" (whole-row bins in a
    # seeded order each epoch) or "histories" (rows that share a history, a conversation's rows one per
    # turn, in the same step, so share_prefixes can run it once; the steps in a seeded order each epoch)
    step_order: Literal["shuffled", "histories"] = "shuffled"
    # render chats with this template instead of the tokenizer's: a .jinja (text) file, or a
    # model / tokenizer directory whose template is taken
    chat_template: str | None = None
    # validation: a second data file, tokenized and packed like the training data; or
    eval_path: str | None = None
    # a seeded share of the training rows, split off by row before packing (never trained on)
    eval_fraction: Annotated[float, Range(gt=0, lt=1)] | None = None


@dataclass
class LoraConfig:
    enabled: bool = True
    rank: Positive = 8
    alpha: Annotated[float, Range(gt=0)] = 16.0
    dropout: Annotated[float, Range(ge=0, lt=1)] = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    experts: bool = False  # per-expert LoRA on MoE expert projections
    modules_to_save: list[str] = field(default_factory=list)  # trained in full beside it, e.g. lm_head


@dataclass
class QuantizationConfig:
    four_bit: bool = False
    double_quant: bool = False


# the learning rate over the run (transformers' get_scheduler)
Schedule = Literal["cosine", "linear", "constant"]


@dataclass
class OptimizerConfig:
    lr: Annotated[float, Range(gt=0)] = 2e-4
    weight_decay: Annotated[float, Range(ge=0)] = 0.0
    betas: Annotated[list[float], Range(ge=0, lt=1), Length(2)] = field(default_factory=lambda: [0.9, 0.999])
    schedule: Schedule = "cosine"
    warmup_steps: NonNegative = 0
    max_grad_norm: Annotated[float, Range(ge=0)] = 1.0  # 0 = no clipping


# What the run trains for: a name registered in slipstream.objectives (next-token sft, or a
# preference loss on {prompt, chosen, rejected} pairs: dpo, ipo, the reference-free simpo and orpo),
# checked against the registry when the config is validated.
Objective = str


@dataclass
class TrainingConfig:
    objective: Objective = "sft"
    steps: Positive | None = None  # optimizer steps; or
    epochs: Positive | None = None
    grad_accum: Positive = 1  # packed micro-batches per optimizer step
    checkpoint_every: NonNegative = 0  # steps; 0 = only the final adapter
    # complete checkpoints kept (older ones pruned; the newest is never removed)
    keep_checkpoints: NonNegative = 3
    log_every: Positive = 1
    tensorboard: bool = False
    distributed: Strategy = "ddp"  # under torchrun: DDP or FSDP2 (fully_shard)
    # a step whose loss or gradient norm is NaN / infinite is never applied; then either stop
    # the run (exit non-zero, naming the last finite checkpoint) or skip the step and go on
    on_nonfinite: Literal["stop", "skip"] = "stop"
    max_consecutive_skips: Positive = 5  # with on_nonfinite: skip, stop after this many in a row
    # with data.eval_path or data.eval_fraction: the eval loss every this many steps and at the
    # end; 0 = only at the end
    eval_every: NonNegative = 0
    # with an eval set: also evaluate the starting weights, before step 1 (step 0 in metrics.jsonl): the
    # figure the run improves on (GRPO: the base model's held-out reward)
    eval_at_start: bool = False
    # prompts answered greedily (chat template, no_grad) into samples.jsonl at every
    # evaluation: every eval_every steps and at the end, with or without an eval set
    sample_prompts: list[str] = field(default_factory=list)
    sample_max_new_tokens: Positive = 64  # the most tokens each answer may take


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    preference: PairSettings = field(default_factory=PairSettings)
    kto: KTOSettings = field(default_factory=KTOSettings)  # training.objective kto (beta: preference.beta)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    reward: RewardSettings = field(default_factory=RewardSettings)  # training.objective reward
    speedups: Speedups = field(default_factory=Speedups)  # the same type optimize() takes
    output_dir: str = "runs/train"
    seed: NonNegative = 0

    def validate(self, source: str, lines: dict[str, int] | None = None) -> TrainConfig:
        """The rules that tie fields together (each field's own were checked as it was read)."""

        def fail(key: str, message: str):
            raise ConfigError(f"{_where(source, lines, key)}: {message}")

        if (self.model.path is None) == (self.model.preset is None):
            fail("model", "give exactly one of 'model.path' (a local directory) or 'model.preset'")
        if (self.training.steps is None) == (self.training.epochs is None):
            fail("training", "give exactly one of 'training.steps' or 'training.epochs'")
        if self.training.distributed == "fsdp2" and (self.training.checkpoint_every or self.lora.experts):
            fail(
                "training.distributed",
                "training.distributed 'fsdp2' does not support training.checkpoint_every or lora.experts yet",
            )
        for index, prompt in enumerate(self.training.sample_prompts):
            if not prompt.strip():
                fail(
                    "training.sample_prompts", f"'training.sample_prompts[{index}]' is empty: write a prompt"
                )
        if self.training.sample_prompts and self.training.distributed == "fsdp2":
            fail(
                "training.sample_prompts",
                "training.sample_prompts is not supported with training.distributed 'fsdp2' yet",
            )
        if self.data.eval_path is not None and self.data.eval_fraction is not None:
            fail(
                "data.eval_path",
                "give one of 'data.eval_path' (a second data file) or 'data.eval_fraction' "
                "(a share of the training rows), not both",
            )
        if self.data.chat_template is not None and not self.data.chat_template.strip():
            fail(
                "data.chat_template",
                "'data.chat_template' is empty: give a template file or a tokenizer directory, or leave it out",
            )
        if self.quantization.four_bit and not self.lora.enabled:
            fail("quantization.four_bit", "quantization.four_bit trains adapters only: set lora.enabled true")
        if self.lora.enabled and not self.lora.target_modules:
            fail("lora.target_modules", "'lora.target_modules' is empty: name the modules the adapter wraps")
        if not self.output_dir.strip():
            fail("output_dir", "'output_dir' is empty")
        try:
            objective = objective_for(self.training.objective)
        except KeyError:
            fail(
                "training.objective",
                f"'training.objective' must be a registered objective ({', '.join(objective_names())}), "
                f"got {self.training.objective!r}",
            )
        objective.validate(self, fail)
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- reading values


def _where(source: str, lines: dict[str, int] | None, key: str) -> str:
    """``file:line`` of a key where the YAML gave it (or its section's), else ``file``."""
    if not lines:
        return source
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        line = lines.get(".".join(parts[:depth]))
        if line is not None:
            return f"{source}:{line}" if line > 0 else source
    return source


def _build(cls, data: Any, prefix: str, source: str, lines: dict[str, int]):
    if not isinstance(data, dict):
        where = f"'{prefix.rstrip('.')}'" if prefix else "the top level"
        raise ConfigError(
            f"{_where(source, lines, prefix.rstrip('.'))}: {where} must be a mapping, got {type(data).__name__}"
        )
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types_:
            valid = [f"{prefix}{name}" for name in types_]
            close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(valid)})"
            raise ConfigError(f"{_where(source, lines, full)}: unknown key '{full}'{hint}")
        expected = types_[key]
        if dataclasses.is_dataclass(expected):
            kwargs[key] = _build(expected, value if value is not None else {}, f"{full}.", source, lines)
        else:
            kwargs[key] = _coerce(value, expected, full, _where(source, lines, full))
    return cls(**kwargs)


def _key_lines(text: str) -> dict[str, int]:
    """``{"optimizer.lr": 7, ...}``: the line of every key of a YAML mapping, nested keys dotted."""
    lines: dict[str, int] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode):
                    dotted = f"{prefix}{key_node.value}"
                    lines[dotted] = key_node.start_mark.line + 1
                    walk(value_node, f"{dotted}.")

    with contextlib.suppress(yaml.YAMLError):  # safe_load reports it
        walk(yaml.compose(text), "")
    return lines


def _apply_override(data: dict, override: str, source: str, lines: dict[str, int]) -> None:
    if "=" not in override:
        raise ConfigError(f"{source}: --set {override!r} must look like section.key=value")
    dotted, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as error:
        raise ConfigError(f"--set {dotted}: not a YAML value ({error})") from None
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
    node[parts[-1]] = value
    lines[dotted] = 0  # errors about it name the file, not a line the --set did not come from


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read, override and validate a training config; every error names the file, line and key."""
    path = Path(path)
    source = str(path)
    if path.is_dir():
        raise ConfigError(f"{source}: is a directory, not a YAML config file")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such config file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{source}: cannot read it ({error})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{source}{where}: invalid YAML ({getattr(error, 'problem', error)})") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections")
    return config_from_data(data, overrides, source, _key_lines(text), path.parent)


def config_from_data(
    data: dict,
    overrides: list[str] | tuple[str, ...] = (),
    source: str = "the config",
    lines: dict[str, int] | None = None,
    base: Path | None = None,
) -> TrainConfig:
    """A config from its mapping (a YAML file's, or one built in, as ``slipstream ab`` builds one),
    overridden and validated; relative paths are taken from ``base`` (the file's directory) where given."""
    data, lines = dict(data), dict(lines or {})
    for override in overrides:
        _apply_override(data, override, source, lines)
    data.pop("ab", None)  # `slipstream ab`'s section of the same file (bench/command.py reads it)
    config = _build(TrainConfig, data, "", source, lines)
    if base is not None:
        for dotted in ("model.path", "data.path", "data.eval_path", "data.chat_template"):
            section, key = dotted.split(".")
            holder = getattr(config, section)
            value = getattr(holder, key)
            if value is not None and not Path(value).is_absolute() and (base / value).exists():
                setattr(holder, key, str((base / value).resolve()))
        config.grpo.rewards = [_reward_near(spec, base) for spec in config.grpo.rewards]
        config.grpo.tools = [_reward_near(spec, base) for spec in config.grpo.tools]  # files near it too
        if config.grpo.environment is not None:
            config.grpo.environment = _reward_near(config.grpo.environment, base)
    return config.validate(source, lines)


def _reward_near(spec: Any, base: Path) -> Any:
    """A ``grpo.rewards`` entry naming a file next to the config (``rewards.py:fn``, ``rewards:fn``) or a
    reward model directory relative to it, made absolute; a built-in or an importable module is left as it is."""
    function = spec.get("function") if isinstance(spec, dict) else spec
    if not isinstance(function, str):
        return spec
    if ":" not in function:
        folder = Path(function) if Path(function).is_absolute() else base / function
        if not (folder / "config.json").is_file():
            return spec
        resolved = str(folder.resolve())
        return resolved if isinstance(spec, str) else {**spec, "function": resolved}
    module, _, name = function.rpartition(":")
    if module.endswith(".py"):
        candidate = Path(module) if Path(module).is_absolute() else base / module
    elif "." not in module and "/" not in module:
        candidate = base / f"{module}.py"
    else:
        return spec
    if not candidate.is_file():
        return spec
    resolved = f"{candidate.resolve()}:{name}"
    return resolved if isinstance(spec, str) else {**spec, "function": resolved}


def run_config(path: str | Path) -> TrainConfig:
    """The config a run wrote to its ``config.json`` (``TrainConfig.to_dict``), read back and validated.

    One reader for everything that works from a finished run (``generate``, ``export``); an error
    is a ``ConfigError`` naming the file."""
    path = Path(path)
    source = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{source}: no such file (the run never got past its set-up)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(f"{source}: cannot read the run's config ({error})") from None
    return _build(TrainConfig, data, "", source, {}).validate(source)
