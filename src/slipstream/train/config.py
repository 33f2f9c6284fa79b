"""The training config: YAML validated into small dataclasses, with errors that name the key.

An unknown or misspelled key is an error naming it and the closest valid key; a value of
the wrong type names its key and the type expected. ``--set section.key=value`` overrides
are parsed as YAML scalars and validated the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A config problem; the message names the file and the key."""


@dataclass
class ModelConfig:
    path: str | None = None  # a local directory saved with save_pretrained (with its tokenizer)
    preset: str | None = None  # or a built-in shape (random init), e.g. "demo", "qwen3-moe"
    layers: int | None = None  # shorten a preset
    dtype: str = (
        "auto"  # bfloat16 where the device runs it fast (CUDA sm80+, AMX / AVX512-BF16 CPUs), else float32
    )
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    path: str | None = None  # JSONL / JSON / Parquet / datasets-on-disk; None = the built-in demo data
    demo_rows: int = 2000
    response_only: bool = False
    skip_bad_rows: bool = False
    max_seq_len: int = 1024
    overflow: str = "truncate"  # or "split"


@dataclass
class LoraConfig:
    enabled: bool = True
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    experts: bool = False  # per-expert LoRA on MoE expert projections
    modules_to_save: list[str] = field(
        default_factory=list
    )  # trained in full beside the adapter, e.g. lm_head


@dataclass
class QuantizationConfig:
    four_bit: bool = False
    double_quant: bool = False


@dataclass
class OptimizerConfig:
    lr: float = 2e-4
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    schedule: str = "cosine"  # or "linear", "constant"
    warmup_steps: int = 0
    max_grad_norm: float = 1.0


@dataclass
class TrainingConfig:
    steps: int | None = None  # optimizer steps; or
    epochs: int | None = None
    grad_accum: int = 1  # packed micro-batches per optimizer step
    checkpoint_every: int = 0  # steps; 0 = only the final adapter
    keep_checkpoints: int = 3  # complete checkpoints kept (older ones pruned; the newest is never removed)
    log_every: int = 1
    tensorboard: bool = False
    distributed: str = "ddp"  # under torchrun: "ddp" or "fsdp2" (fully_shard)


@dataclass
class SpeedupsConfig:
    packed_attention: bool = True
    moe_routing: str | None = None  # None = "sorted" for MoE models
    checkpointing: str = "off"
    chunked_loss: bool | None = None  # None = on where the model supports it (logged); false = stock loss
    loss_chunk_tokens: int | None = None  # None = from a memory budget


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    quantization: QuantizationConfig = field(default_factory=QuantizationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    speedups: SpeedupsConfig = field(default_factory=SpeedupsConfig)
    output_dir: str = "runs/train"
    seed: int = 0

    def validate(self, source: str) -> TrainConfig:
        def fail(message):
            raise ConfigError(f"{source}: {message}")

        if (self.model.path is None) == (self.model.preset is None):
            fail("model: give exactly one of 'model.path' (a local directory) or 'model.preset'")
        if (self.training.steps is None) == (self.training.epochs is None):
            fail("training: give exactly one of 'training.steps' or 'training.epochs'")
        for key, value in (
            ("training.steps", self.training.steps),
            ("training.epochs", self.training.epochs),
            ("training.grad_accum", self.training.grad_accum),
            ("data.max_seq_len", self.data.max_seq_len),
            ("lora.rank", self.lora.rank),
            ("speedups.loss_chunk_tokens", self.speedups.loss_chunk_tokens),
        ):
            if value is not None and value < 1:
                fail(f"{key} must be at least 1, got {value}")
        choices = {
            "data.overflow": (self.data.overflow, ("truncate", "split")),
            "optimizer.schedule": (self.optimizer.schedule, ("cosine", "linear", "constant")),
            "model.dtype": (self.model.dtype, ("auto", "float32", "bfloat16", "float16")),
            "speedups.checkpointing": (
                self.speedups.checkpointing,
                ("off", "recompute", "offload", "offload-double", "auto"),
            ),
        }
        for key, (value, allowed) in choices.items():
            if value not in allowed:
                fail(f"{key} must be one of {', '.join(allowed)}, got {value!r}")
        if self.training.distributed not in ("ddp", "fsdp2"):
            fail(f"training.distributed must be 'ddp' or 'fsdp2', got {self.training.distributed!r}")
        if self.training.distributed == "fsdp2" and (self.training.checkpoint_every or self.lora.experts):
            fail(
                "training.distributed 'fsdp2' does not support training.checkpoint_every or lora.experts yet"
            )
        if self.speedups.moe_routing not in (None, "sorted", "stock"):
            fail(f"speedups.moe_routing must be 'sorted' or 'stock', got {self.speedups.moe_routing!r}")
        if self.quantization.four_bit and not self.lora.enabled:
            fail("quantization.four_bit trains adapters only: set lora.enabled true")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, expected: Any, key: str, source: str) -> Any:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(expected)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key, source)
            except ConfigError as error:
                errors.append(error)
        raise errors[0]
    if origin is list:
        (item,) = typing.get_args(expected)
        if not isinstance(value, list):
            raise ConfigError(f"{source}: '{key}' must be a list, got {type(value).__name__}")
        return [_coerce(v, item, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is bool and not isinstance(value, bool):
        raise ConfigError(f"{source}: '{key}' must be true or false, got {value!r}")
    if expected in (int, float, str) and (not isinstance(value, expected) or isinstance(value, bool)):
        raise ConfigError(f"{source}: '{key}' must be {expected.__name__}, got {value!r}")
    return value


def _build(cls, data: Any, prefix: str, source: str):
    if not isinstance(data, dict):
        where = f"'{prefix}'" if prefix else "the top level"
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(data).__name__}")
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in types_:
            valid = [f"{prefix}{name}" for name in types_]
            close = difflib.get_close_matches(full, valid, n=1, cutoff=0.5)
            hint = f" (did you mean '{close[0]}'?)" if close else f" (valid: {', '.join(valid)})"
            raise ConfigError(f"{source}: unknown key '{full}'{hint}")
        expected = types_[key]
        if dataclasses.is_dataclass(expected):
            kwargs[key] = _build(expected, value if value is not None else {}, f"{full}.", source)
        else:
            kwargs[key] = _coerce(value, expected, full, source)
    return cls(**kwargs)


def _apply_override(data: dict, override: str, source: str) -> None:
    if "=" not in override:
        raise ConfigError(f"{source}: --set {override!r} must look like section.key=value")
    dotted, raw = override.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as error:
        raise ConfigError(f"{source}: --set {dotted}: not a YAML value ({error})") from None
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{source}: --set {dotted}: '{part}' is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> TrainConfig:
    """Read, override and validate a training config; every error names the file and key."""
    path = Path(path)
    source = str(path)
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
    for override in overrides:
        _apply_override(data, override, source)
    config = _build(TrainConfig, data, "", source)
    base = path.parent
    for section, key in (("model", "path"), ("data", "path")):
        value = getattr(getattr(config, section), key)
        if value is not None and not Path(value).is_absolute():
            setattr(
                getattr(config, section),
                key,
                str((base / value).resolve()) if (base / value).exists() else value,
            )
    return config.validate(source)
