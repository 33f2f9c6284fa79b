"""Checkpoints and the final adapter: written whole or not at all, checked before use, pruned,
and skipped when damaged. Everything the loop reads or writes of them is here.

``checkpoints/step-NNNNNN/`` holds ``trainable.safetensors`` (the trainable weights),
``trainer_state.pt`` (optimizer, scheduler, every RNG state) and ``state.json`` (the step,
its loss and the run's fingerprint, see ``fingerprint.py``). A checkpoint, like the final
``adapter/``, is written under a temporary name and renamed when complete; one it replaces or
prunes is first renamed aside and then deleted (``atomic.atomic_directory``), so a reader
never sees half of one. ``--resume`` reads the newest checkpoint whole before touching the
model; if it is damaged (a file missing or unreadable) it warns and falls back to the
previous one.

``training.keep_checkpoints: N`` keeps the newest N complete checkpoints after each save
(0 keeps all); the one just written is always kept.

Nothing non-finite is kept: a checkpoint or adapter whose weights or optimizer state hold a
NaN or an infinity is refused before anything is written (``TrainError``), a checkpoint that
holds one (written by an older slipstream) counts as damaged when read, and pruning counts
only finite checkpoints, so it never removes a finite one in favour of a non-finite one.

A run stopped by a non-finite step N marks the checkpoint of step N-1, if there is one
(``leads_to_nonfinite`` in its ``state.json``): its weights, data position and RNG state
compute step N again exactly, whatever the learning rate, so ``--resume`` passes over it to an
older checkpoint, with a warning, unless the run now skips non-finite steps
(``training.on_nonfinite: skip``).
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..atomic import atomic_directory, discard_directory, write_text_atomically
from ..moe.lora import save_expert_lora
from .distributed import Distributed, unwrap
from .errors import TrainError
from .fingerprint import compare
from .output_dir import ADAPTER, CHECKPOINTS, FINISHED

logger = logging.getLogger("slipstream")

CHECKPOINT_FORMAT = 1
WEIGHTS, TRAINER_STATE, STATE = "trainable.safetensors", "trainer_state.pt", "state.json"
_NAME = re.compile(r"^step-(\d+)$")


class DamagedCheckpoint(Exception):
    """A checkpoint that cannot be used; the message says which file and why."""


@dataclass
class Checkpoint:
    path: Path
    step: int
    state: dict[str, Any]  # state.json
    weights: dict[str, torch.Tensor]
    trainer: dict[str, Any]  # optimizer, scheduler, rng

    @property
    def loss(self) -> float | None:
        return self.state.get("loss")


@dataclass
class ResumePoint:
    """Where ``--resume`` continues from, and what it had to accept or skip on the way."""

    path: Path | None = None  # None: no checkpoint, start at step 0
    step: int = 0
    loss: float | None = None
    skipped: list[str] = field(default_factory=list)  # damaged checkpoints passed over
    forced: list[str] = field(default_factory=list)  # changes accepted with --force


# ----------------------------------------------------------------------------- writing
def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in unwrap(model).named_parameters() if p.requires_grad}


def _floating(tensors: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """Every floating tensor in ``tensors`` (nested dicts / lists / tuples), with its dotted name."""
    if isinstance(tensors, torch.Tensor):
        return [(prefix or "a tensor", tensors)] if tensors.is_floating_point() else []
    if isinstance(tensors, dict):
        items = tensors.items()
    elif isinstance(tensors, (list, tuple)):
        items = enumerate(tensors)
    else:
        return []
    return [
        found for key, value in items for found in _floating(value, f"{prefix}.{key}" if prefix else str(key))
    ]


def first_nonfinite(tensors: Any) -> str | None:
    """The name of the first floating tensor in ``tensors`` with a NaN or an inf (one host read per device)."""
    named = _floating(tensors)
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, tensor) in enumerate(named):
        by_device.setdefault(tensor.device, []).append(index)
    bad = []
    for indices in by_device.values():
        finite = torch.stack([torch.isfinite(named[i][1]).all() for i in indices]).tolist()
        bad += [i for i, ok in zip(indices, finite, strict=True) if not ok]
    return named[min(bad)][0] if bad else None


def _refuse_nonfinite(where: Path, what: str, tensors: Any) -> None:
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise TrainError(
            f"{where}: not written: {what} {bad!r} holds NaN or infinite values "
            f"(the run diverged; earlier checkpoints are kept)"
        )


def save_checkpoint(
    out: Path,
    step: int,
    model,
    optimizer,
    scheduler,
    *,
    loss: float | None = None,
    fingerprint: dict | None = None,
) -> Path:
    """``checkpoints/step-NNNNNN``, written under a temporary name and renamed when complete."""
    final = Path(out) / CHECKPOINTS / f"step-{step:06d}"
    state = {"format": CHECKPOINT_FORMAT, "step": step, "loss": loss, "fingerprint": fingerprint}
    weights, optimizer_state = _trainable(model), optimizer.state_dict()
    _refuse_nonfinite(final, "the trainable weight", weights)
    _refuse_nonfinite(final, "the optimizer state", optimizer_state["state"])
    try:
        with atomic_directory(final) as tmp:
            save_file(weights, str(tmp / WEIGHTS))
            trainer = {"optimizer": optimizer_state, "scheduler": scheduler.state_dict(), "rng": rng_state()}
            torch.save(trainer, tmp / TRAINER_STATE)
            (tmp / STATE).write_text(json.dumps(state, indent=1) + "\n")
    except OSError as error:  # a full disk, say: no half checkpoint stays behind
        raise TrainError(f"{final}: cannot write the checkpoint ({error.strerror or error})") from None
    return final


def prune_checkpoints(out: Path, keep: int, newest_step: int) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints up to ``newest_step`` (0: keep all); delete older ones.

    Checkpoints past ``newest_step`` (left by a run that fell back from a damaged one) are
    not touched: the run overwrites them when it gets there.
    """
    if keep < 0:
        raise ValueError(f"keep must be at least 0, got {keep}")
    steps = [(step, path) for step, path in _step_dirs(out) if step <= newest_step]
    complete = [step for step, path in steps if _complete_and_finite(path)]
    if keep == 0 or len(complete) <= keep:
        return []
    oldest_kept = complete[keep - 1]
    removed = []
    for step, path in steps:
        if step < oldest_kept:  # older than every kept one, complete or not
            discard_directory(path)
            removed.append(path)
    if removed:
        logger.info("pruned %d old checkpoint(s): %s", len(removed), ", ".join(p.name for p in removed))
    return removed


def _complete_and_finite(path: Path) -> bool:
    """A checkpoint pruning may count: complete, and its recorded loss not NaN / infinite."""
    try:
        loss = json.loads((path / STATE).read_text()).get("loss")
    except (OSError, ValueError, AttributeError):
        return False
    return loss is None or (isinstance(loss, (int, float)) and math.isfinite(loss))


LEADS_TO_NONFINITE = "leads_to_nonfinite"


def mark_leads_to_nonfinite(out: Path, nonfinite_step: int) -> Path | None:
    """Mark the checkpoint right before non-finite step ``nonfinite_step`` (if any); its path."""
    path = Path(out) / CHECKPOINTS / f"step-{nonfinite_step - 1:06d}"
    try:
        state = json.loads((path / STATE).read_text())
    except (OSError, ValueError):
        return None
    state[LEADS_TO_NONFINITE] = nonfinite_step
    write_text_atomically(path / STATE, json.dumps(state, indent=1) + "\n")
    return path


def _leads_to_nonfinite(path: Path) -> int | None:
    try:
        return json.loads((path / STATE).read_text()).get(LEADS_TO_NONFINITE)
    except (OSError, ValueError, AttributeError):
        return None


def newest_resumable(out: Path) -> Path | None:
    """The newest complete checkpoint that does not lead straight into a non-finite step."""
    for _, path in _step_dirs(out):
        if (path / STATE).is_file() and _leads_to_nonfinite(path) is None:
            return path
    return None


# ----------------------------------------------------------------------------- reading
def _step_dirs(out: Path) -> list[tuple[int, Path]]:
    """Every ``step-N`` folder, newest first (complete or not)."""
    root = Path(out) / CHECKPOINTS
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found, reverse=True)


def newest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint folder (temporary, half-written ones are ignored); not read."""
    return next((path for _, path in _step_dirs(out) if (path / STATE).is_file()), None)


def read_checkpoint(path: Path) -> Checkpoint:
    """Read a checkpoint whole; ``DamagedCheckpoint`` says which file is missing or unreadable."""
    path = Path(path)
    match = _NAME.match(path.name)
    if match is None:
        raise DamagedCheckpoint(f"{path.name} is not a checkpoint name (step-NNNNNN)")

    def need(name: str) -> Path:
        if not (path / name).is_file():
            raise DamagedCheckpoint(f"{name} is missing")
        if (path / name).stat().st_size == 0:
            raise DamagedCheckpoint(f"{name} is empty")
        return path / name

    try:
        state = json.loads(need(STATE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DamagedCheckpoint(f"{STATE} is unreadable ({error})") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DamagedCheckpoint(f"{STATE} has no step")
    if state["step"] != int(match.group(1)):
        raise DamagedCheckpoint(f"{STATE} says step {state['step']}")
    weights_file = need(WEIGHTS)
    try:
        weights = load_file(str(weights_file))
    except Exception as error:  # safetensors raises its own SafetensorError, or OSError
        raise DamagedCheckpoint(f"{WEIGHTS} is unreadable ({_short(error)})") from None
    trainer_file = need(TRAINER_STATE)
    try:
        trainer = torch.load(trainer_file, weights_only=True)
    except Exception as error:  # a truncated or garbled pickle: any of a dozen exception types
        raise DamagedCheckpoint(f"{TRAINER_STATE} is unreadable ({_short(error)})") from None
    if not isinstance(trainer, dict) or not {"optimizer", "scheduler", "rng"} <= trainer.keys():
        raise DamagedCheckpoint(f"{TRAINER_STATE} lacks the optimizer, scheduler or RNG state")
    bad = first_nonfinite(weights) or first_nonfinite(trainer["optimizer"])
    if bad is not None:  # written by a slipstream that kept diverged runs' checkpoints
        raise DamagedCheckpoint(f"{bad!r} holds NaN or infinite values (a diverged run)")
    return Checkpoint(path=path, step=state["step"], state=state, weights=weights, trainer=trainer)


def _short(error: Exception) -> str:
    """The gist of a loader's error: its type and first sentence (not torch's advice to unpickle unsafely)."""
    text = str(error)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    first = lines[0].split(". ")[0].rstrip(".") if lines else ""
    return f"{type(error).__name__}: {first}" if first else type(error).__name__


def find_resume_point(
    out: Path, fingerprint: dict, *, force: bool = False, skips_nonfinite: bool = False
) -> tuple[ResumePoint, Checkpoint | None]:
    """The newest usable checkpoint, checked against this run's ``fingerprint``.

    Damaged checkpoints are skipped with a warning, and so are those that lead straight into
    a non-finite step unless this run skips such steps (``skips_nonfinite``); a fingerprint mismatch raises
    ``TrainError`` saying what changed (``force`` accepts the changes that leave the
    checkpoint loadable, with a warning); so does having checkpoints none of which is usable.
    """
    point = ResumePoint()
    candidates = _step_dirs(out)
    chosen = None
    for _, path in candidates:
        nonfinite_next = None if skips_nonfinite else _leads_to_nonfinite(path)
        if nonfinite_next is not None:
            why = (
                f"its weights computed the non-finite step {nonfinite_next}, and would again "
                "(resume from it with --set training.on_nonfinite=skip to skip that step)"
            )
            point.skipped.append(f"{path.name}: {why}")
            logger.warning("%s: passed over: %s; falling back to an older checkpoint", path, why)
            continue
        try:
            chosen = read_checkpoint(path)
            break
        except DamagedCheckpoint as error:
            point.skipped.append(f"{path.name}: {error}")
            logger.warning("%s is damaged: %s; falling back to an older checkpoint", path, error)
    if chosen is None:
        if candidates:
            raise TrainError(
                f"{Path(out) / CHECKPOINTS}: no usable checkpoint to resume from "
                f"({'; '.join(point.skipped)}): pass --overwrite to start over"
            )
        return point, None
    saved = chosen.state.get("fingerprint")
    if saved is None:
        if not force:
            raise TrainError(
                f"{chosen.path}: cannot check what this checkpoint was computed from (no fingerprint: "
                "an older slipstream wrote it): pass --force to resume it unchecked"
            )
        point.forced.append("no fingerprint (an older slipstream wrote the checkpoint)")
    else:
        changes = compare(saved, fingerprint)
        structural = [change.what for change in changes if change.structural]
        if structural:
            raise TrainError(
                f"cannot resume from {chosen.path}: {'; '.join(c.what for c in changes)} "
                "(the checkpoint's adapter does not fit this model, not even with --force): "
                "start over with --overwrite or use another output_dir"
            )
        if changes and not force:
            raise TrainError(
                f"cannot resume from {chosen.path}: {'; '.join(c.what for c in changes)}: "
                "pass --force to resume anyway"
            )
        point.forced.extend(change.what for change in changes)
    for what in point.forced:
        logger.warning("%s: resuming anyway (--force): %s", chosen.path, what)
    point.path, point.step, point.loss = chosen.path, chosen.step, chosen.loss
    return point, chosen


def load_resume_point(
    out: Path,
    fingerprint: dict | None,
    info: Distributed,
    *,
    resumable: bool,
    force: bool,
    skips_nonfinite: bool = False,
) -> tuple[ResumePoint, Checkpoint | None]:
    """Rank 0 picks and checks the checkpoint; every rank gets its verdict and reads it."""
    point, checkpoint, error = ResumePoint(), None, None
    if info.is_main and resumable:
        try:
            point, checkpoint = find_resume_point(
                out, fingerprint, force=force, skips_nonfinite=skips_nonfinite
            )
        except TrainError as caught:
            error = str(caught)
    if info.enabled:
        box = [(point, error)]
        dist.broadcast_object_list(box, src=0)
        point, error = box[0]
    if error is not None:
        raise TrainError(error)
    if point.path is not None and checkpoint is None:
        try:
            checkpoint = read_checkpoint(point.path)
        except DamagedCheckpoint as damaged:
            raise TrainError(f"{point.path}: {damaged}") from None
    return point, checkpoint


def apply_checkpoint(checkpoint: Checkpoint, model, optimizer, scheduler) -> int:
    """Load a checkpoint read by ``read_checkpoint`` into the model, optimizer, scheduler and RNGs."""
    params = {n: p for n, p in unwrap(model).named_parameters() if p.requires_grad}
    where = checkpoint.path
    extra = sorted(checkpoint.weights.keys() - params.keys())
    if extra:
        raise TrainError(f"{where}: the checkpoint has {extra[0]!r}, which this model does not train")
    missing = sorted(params.keys() - checkpoint.weights.keys())
    if missing:
        raise TrainError(f"{where}: the checkpoint lacks {missing[0]!r}, which this model trains")
    for name, tensor in checkpoint.weights.items():
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise TrainError(
                f"{where}: {name!r} has shape {tuple(tensor.shape)} in the checkpoint "
                f"but {tuple(params[name].shape)} in this model"
            )
    with torch.no_grad():
        for name, tensor in checkpoint.weights.items():
            params[name].copy_(tensor)
    try:
        optimizer.load_state_dict(checkpoint.trainer["optimizer"])
        scheduler.load_state_dict(checkpoint.trainer["scheduler"])
    except (ValueError, KeyError, RuntimeError) as error:
        raise TrainError(f"{where}: the optimizer state does not fit this run ({_short(error)})") from None
    set_rng_state(checkpoint.trainer["rng"])
    return checkpoint.step


# ----------------------------------------------------------------------------- the final adapter
def save_final(
    out: Path, model, tokenizer, summary: dict, *, state: dict | None = None, expert_lora: bool = False
) -> None:
    """The adapter (or the fine-tuned model) in PEFT / transformers format, then ``run.json``.

    ``state``: the full trainable state when the model is sharded (FSDP2), gathered on every rank.
    """
    adapter = Path(out) / ADAPTER
    model = unwrap(model)
    trained = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}  # read where it lies
    _refuse_nonfinite(adapter, "the trainable weight", state if state is not None else trained)
    with atomic_directory(adapter) as tmp:
        model.save_pretrained(tmp, **({"state_dict": state} if state is not None else {}))
        if expert_lora:
            save_expert_lora(model, tmp / "experts")
        tokenizer.save_pretrained(tmp)
    write_text_atomically(Path(out) / FINISHED, json.dumps({"status": "finished", **summary}, indent=1))
