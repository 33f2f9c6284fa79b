"""Doctor's model: ``--model`` resolved (a preset or a local config) to its full-size config, which
the decisions read, and the tiny random model of its family, which the checks build."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..models import TINY, build_config, build_model, model_names
from ..models.tiny_any import causal_lm_class, random_model, shrink_config, tiny_config
from ..noise import quiet_transformers
from ..speedups.base import dtype_name, one_line  # noqa: F401 - doctor's rooms take them from here

DEFAULT_MODEL = "demo"  # the demo's model (`slipstream ab` with no arguments): a Qwen3 shape
MOE_STAND_IN = "qwen3-moe"  # the MoE check's model when the requested family has no experts


class DoctorError(ValueError):
    """A doctor request that cannot be run (an unknown model, an unreadable config): exit status 2."""


@dataclass
class CheckedModel:
    """The requested model: its full-size config (what decisions read) and the tiny one checked."""

    asked: str
    source: str  # "default preset", "preset", "local config"
    family: str  # transformers model_type
    config: Any  # full-size config
    tiny: Any  # the tiny config the checks build
    build: Callable[[int], torch.nn.Module] = field(repr=False)  # seed -> fp32 random model
    note: str = ""

    def describe(self) -> str:
        return f"{self.asked} ({self.source}, {self.family} family)" + (f"; {self.note}" if self.note else "")


def shape_of(config: Any) -> str:
    """One line for a (tiny) config's shape."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config

    def get(*keys: str) -> Any:
        return next((getattr(text, k) for k in keys if isinstance(getattr(text, k, None), int)), None)

    parts = [
        f"hidden {get('hidden_size', 'd_model', 'n_embd')}",
        f"{get('num_hidden_layers', 'n_layer')} layers",
    ]
    heads, kv = get("num_attention_heads", "n_head"), get("num_key_value_heads")
    if heads:
        parts.append(f"{heads} heads" + (f" / {kv} kv" if kv and kv != heads else ""))
    experts = get("num_experts", "num_local_experts", "n_routed_experts")
    if experts and experts > 1:
        parts.append(f"{experts} experts top-{get('num_experts_per_tok', 'moe_topk') or '?'}")
    window = get("sliding_window")
    if window:
        parts.append(f"window {window}")
    parts.append(f"vocab {get('vocab_size')}")
    return ", ".join(parts)


def resolve_model(asked: str | None) -> CheckedModel:
    """``--model``: a preset name (``slipstream.models.model_names()``) or a local directory with a
    config.json; None: the demo model. Raises DoctorError naming what is wrong."""
    if asked is None or asked in model_names():
        name = asked or DEFAULT_MODEL
        config = build_config(name)
        source = "preset" if asked else "default preset: the demo model"
        if name in TINY:  # already tiny: checked as it is
            return CheckedModel(
                name,
                source,
                config.model_type,
                config,
                config,
                lambda seed: build_model(name, seed=seed, attn_implementation="eager"),
            )
        return _shrunk(name, source, config)
    path = Path(asked).expanduser()
    if not path.is_dir():
        raise DoctorError(f"--model {asked}: not a preset ({', '.join(model_names())}) and no such directory")
    if not (path / "config.json").is_file():
        raise DoctorError(f"--model {asked}: no config.json in this directory")
    from transformers import AutoConfig

    try:
        with quiet_transformers():
            config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable config is the same answer
        raise DoctorError(f"--model {asked}: config.json could not be read ({one_line(error)})") from error
    try:
        causal_lm_class(config.model_type)
    except (KeyError, AttributeError) as error:
        raise DoctorError(
            f"--model {asked}: model_type {config.model_type!r} has no causal-LM class in transformers' registry"
        ) from error
    return _shrunk(str(asked), "local config", config)


def _shrunk(asked: str, source: str, config: Any) -> CheckedModel:
    """A full-size config checked as a tiny model of its family (its own values kept where they fit)."""
    family = config.model_type
    note = ""
    try:
        with quiet_transformers():
            tiny = shrink_config(config)
            random_model(tiny, seed=0)  # built once here, so a config that cannot shrink says so now
    except Exception as error:  # noqa: BLE001 - any failure: the family's defaults instead
        note = f"its own values did not shrink ({one_line(error)[:80]}); the family's defaults were used"
        try:
            with quiet_transformers():
                tiny = tiny_config(family)
                random_model(tiny, seed=0)
        except Exception as again:  # noqa: BLE001
            raise DoctorError(
                f"--model {asked}: no tiny {family} model builds here ({one_line(again)})"
            ) from again

    def build(seed: int) -> torch.nn.Module:
        with quiet_transformers():
            return random_model(tiny, seed=seed)

    return CheckedModel(asked, source, family, config, tiny, build, note)
