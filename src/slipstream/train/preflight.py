"""Checks that run before the first step, so a mistake costs seconds, not a crash minutes in.

Each raises a ``TrainError`` whose one line names the config key or file and says what to do:
the model directory and its weight files, then, once the model is loaded, :func:`check_loaded_model`:
LoRA's target modules against the model's module names, and the data's token ids against the model's
vocabulary (samples that ``max_seq_len`` would leave with no label are SFT's check:
``objectives.sft.check_labels_left``; the chat template ``data.chat_template`` names is read with the
tokenizer: ``inputs.with_chat_template``).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from ..data.token_ids import check_ids_in_vocab
from .config import TrainConfig
from .errors import TrainError


def check_model_dir(path: str | Path) -> Path:
    """``model.path`` is a directory saved with ``save_pretrained`` (before anything reads it)."""
    path = Path(path)
    if not path.exists():
        raise TrainError(
            f"model.path {path}: no such directory (models are read from disk, never downloaded)"
        )
    if not path.is_dir():
        raise TrainError(f"model.path {path}: is a file; give the directory save_pretrained wrote")
    if not (path / "config.json").exists():
        raise TrainError(f"model.path {path}: not a model directory (no config.json)")
    return path


def weights_error(path: str | Path, error: Exception) -> TrainError:
    """A failed model load, with the weight file at fault named where one can be found."""
    from safetensors import safe_open

    for file in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    handle.get_slice(key)
        except Exception as problem:  # the file at fault: its own error says how
            return TrainError(f"{file}: damaged weight file ({' '.join(str(problem).split())})")
    return TrainError(f"model.path {path}: cannot load the model ({' '.join(str(error).split())})")


def check_loaded_model(
    model: torch.nn.Module,
    config: TrainConfig,
    documents: Sequence[dict],
    held_out: Sequence[dict] | None = None,
) -> None:
    """The loaded model against the config and the data, in one call: LoRA's targets, then every
    token id of the training documents and of ``data.eval_path``'s (``held_out``) in its vocabulary."""
    check_lora_targets(model, config)
    check_token_ids(documents, model, config.data.path or "the demo data")
    if held_out is not None:
        check_token_ids(held_out, model, config.data.eval_path)


def check_lora_targets(model: torch.nn.Module, config: TrainConfig) -> None:
    """Every ``lora.target_modules`` / ``lora.modules_to_save`` entry matches a module, as PEFT
    matches them (the full name, or its last dotted parts; a regex when the entry is one)."""
    if not config.lora.enabled:
        return
    names = [name for name, _ in model.named_modules() if name]
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    for key in ("target_modules", "modules_to_save"):
        for target in getattr(config.lora, key):
            if any(_matches(name, target) for name in names):
                continue
            close = difflib.get_close_matches(target, leaves, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (its modules: {', '.join(leaves[:30])})"
            raise TrainError(f"lora.{key}: {target!r} matches no module of {type(model).__name__}{hint}")


def _matches(name: str, target: str) -> bool:
    if name == target or name.endswith(f".{target}"):
        return True
    try:
        return re.fullmatch(target, name) is not None
    except re.error:
        return False


def check_token_ids(samples: Sequence[dict], model: torch.nn.Module, source: str) -> None:
    """Every input id exists in the model's embedding (a bigger tokenizer than model is a setup error)."""
    embeddings = model.get_input_embeddings()
    rows = embeddings.num_embeddings if hasattr(embeddings, "num_embeddings") else embeddings.weight.shape[0]
    check_ids_in_vocab(samples, rows, source, error=TrainError, advice=" (or resize the embeddings first)")
