"""What a checkpoint was computed from, so that ``--resume`` can say exactly what changed.

Every checkpoint's ``state.json`` holds a fingerprint of three things:

- the config's keys that change what is computed, by value (so a change reads
  ``config changed: lora.rank 8 -> 16``), with ``model.dtype`` as resolved on the machine and
  the torchrun world size (the step plan depends on it). Left out, because they change where
  or how often results are written, or how the same computation runs, never its result:
  ``output_dir``, ``training.checkpoint_every``, ``training.keep_checkpoints``,
  ``training.log_every``, ``training.tensorboard``, ``training.distributed``,
  ``training.on_nonfinite`` and ``training.max_consecutive_skips`` (a finite step is computed
  the same under either; a non-finite one is never applied), every
  ``speedups.*`` key and ``data.cache``; ``data.eval_path``, ``training.eval_every``,
  ``training.sample_prompts`` and ``training.sample_max_new_tokens`` (evaluation and greedy
  answers read the model, never change it or any RNG; ``data.eval_fraction`` is
  fingerprinted, since it takes rows out of training); ``data.path`` too, since the data's content is
  hashed instead (a moved file resumes, an edited one does not), and ``data.chat_template``,
  whose template is in the tokenizer's fingerprint. A key added to the config
  later is fingerprinted unless it is added here;
- the data: a SHA-256 of the file's bytes (of every file, with its relative path, for a
  ``datasets`` directory), or of the built-in demo rows when ``data.path`` is unset;
- the tokenizer: a SHA-256 of its vocabulary and merges (the fast tokenizer's JSON, or the
  vocabulary), of its chat template, and its special tokens.

Any difference refuses the resume. ``force`` accepts the differences that leave the
checkpoint loadable (data, tokenizer, optimizer, schedule, steps ...) with a warning, but
never the ones that change the adapter's shape or the model under it (``STRUCTURAL``).
Keys only one side knows (the fingerprints come from different slipstream versions) are
not compared.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..data import demo_rows
from ..data.samples import hash_path, tokenizer_parts
from .errors import TrainError

FINGERPRINT_FORMAT = 1

NOT_FINGERPRINTED = (
    "output_dir",
    "data.path",
    "data.chat_template",  # the template itself is in the tokenizer's fingerprint
    "data.cache",
    "data.eval_path",
    "training.checkpoint_every",
    "training.keep_checkpoints",
    "training.log_every",
    "training.tensorboard",
    "training.distributed",
    "training.on_nonfinite",
    "training.max_consecutive_skips",
    "training.eval_every",
    "training.sample_prompts",
    "training.sample_max_new_tokens",
)
NOT_FINGERPRINTED_SECTIONS = ("speedups.",)
WORLD_SIZE = "torchrun world size"
# A checkpoint cannot be loaded across these, not even with --force.
STRUCTURAL = frozenset(
    {
        "model.preset",
        "model.layers",
        "quantization.four_bit",
        "lora.enabled",
        "lora.rank",
        "lora.target_modules",
        "lora.experts",
        "lora.modules_to_save",
    }
)


@dataclass(frozen=True)
class Change:
    what: str  # e.g. "config changed: lora.rank 8 -> 16"
    structural: bool = False  # the checkpoint cannot be loaded across it


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_fingerprint(config, *, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    flat = _flatten(config.to_dict())
    kept = {
        key: value
        for key, value in flat.items()
        if key not in NOT_FINGERPRINTED and not key.startswith(NOT_FINGERPRINTED_SECTIONS)
    }
    kept["model.dtype"] = str(dtype).removeprefix("torch.")
    kept[WORLD_SIZE] = world_size
    return json.loads(json.dumps(kept))  # as it reads back from state.json (tuples -> lists)


def data_fingerprint(config) -> dict[str, Any]:
    if config.data.path is None:
        rows = demo_rows(config.data.demo_rows, config.seed)
        sha = hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
        return {"kind": "demo", "path": None, "sha256": sha}
    path = Path(config.data.path)
    try:
        sha, size = hash_path(path)
    except OSError as error:
        raise TrainError(
            f"{path}: cannot read the data to fingerprint it ({error.strerror or error})"
        ) from None
    kind = "data directory" if path.is_dir() else "data file"
    return {"kind": kind, "path": str(path), "sha256": sha, "bytes": size}


def _describe(data: dict[str, Any]) -> str:
    return (
        "the built-in demo data" if data.get("kind") == "demo" else f"{data.get('kind')} {data.get('path')}"
    )


def fingerprint(config, tokenizer, *, world_size: int, dtype: torch.dtype) -> dict[str, Any]:
    """The fingerprint a checkpoint of this run stores (JSON-ready)."""
    data = data_fingerprint(config)
    return {
        "format": FINGERPRINT_FORMAT,
        "config": config_fingerprint(config, world_size=world_size, dtype=dtype),
        "data": data,
        "tokenizer": tokenizer_parts(tokenizer),
    }


def compare(saved: dict[str, Any], current: dict[str, Any]) -> list[Change]:
    """What differs between a checkpoint's fingerprint and this run's, in words."""
    changes = []
    old_config, new_config = saved.get("config", {}), current["config"]
    differ = [
        key for key in sorted(old_config.keys() & new_config.keys()) if old_config[key] != new_config[key]
    ]
    for structural in (True, False):
        keys = [key for key in differ if (key in STRUCTURAL) == structural]
        if keys:
            shown = ", ".join(
                f"{key} {json.dumps(old_config[key])} -> {json.dumps(new_config[key])}" for key in keys
            )
            changes.append(Change(f"config changed: {shown}", structural))
    old_data, new_data = saved.get("data"), current["data"]
    if old_data is not None and old_data.get("sha256") != new_data["sha256"]:
        hashes = f"sha256 {str(old_data.get('sha256'))[:12]} -> {new_data['sha256'][:12]}"
        if _describe(old_data) != _describe(new_data):
            what = f"data changed since the checkpoint ({_describe(old_data)} -> {_describe(new_data)}, {hashes})"
        elif new_data["kind"] == "demo":
            what = (
                f"the built-in demo data changed since the checkpoint ({hashes}: another slipstream version?)"
            )
        else:
            what = f"{new_data['kind']} changed since the checkpoint ({new_data['path']}: {hashes})"
        changes.append(Change(what))
    old_tokenizer, new_tokenizer = saved.get("tokenizer"), current["tokenizer"]
    if old_tokenizer is not None:
        parts = [
            key
            for key in sorted(old_tokenizer.keys() & new_tokenizer.keys())
            if old_tokenizer[key] != new_tokenizer[key]
        ]
        if parts:
            changes.append(Change(f"tokenizer changed since the checkpoint ({', '.join(parts)})"))
    return changes
