"""``slipstream train``: a lean LoRA / QLoRA SFT loop of our own, resumable, every speedup on.

rows -> tokens -> best-fit-decreasing bins (seeded) -> packed micro-batches -> optimized
model -> token-weighted step -> metrics JSONL, checkpoints, the final PEFT adapter.

Checkpoints (every ``training.checkpoint_every`` steps, and when Ctrl-C stops the run) hold
the trainable weights, the optimizer and scheduler, every RNG state, the step (which fixes the
data position: the order of micro-batches is a pure function of the seed) and a fingerprint of
the config, data and tokenizer. Each is written under a temporary name and renamed when
complete, so an interrupted write is never picked up; ``--resume`` continues from the newest
usable one, refuses if what it was computed from changed, and reproduces the uninterrupted
run. See ``checkpoints.py``, ``fingerprint.py``, ``interrupt.py`` and, for what a run may do
to its output directory, ``output_dir.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import shutil
import signal
import time
from pathlib import Path

import torch

from ..atomic import write_text_atomically
from ..data import DataError
from .checkpoints import (
    DamagedCheckpoint,
    ResumePoint,
    apply_checkpoint,
    find_resume_point,
    newest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from .config import ConfigError, TrainConfig
from .distributed import unwrap
from .errors import TrainError, TrainInterrupted
from .fingerprint import fingerprint as run_fingerprint
from .interrupt import GracefulStop, fault_interrupt_step, send_interrupt
from .output_dir import CHECKPOINTS, FINISHED, METRICS, prepare_output
from .precision import resolve_dtype
from .preflight import check_labels_left, check_lora_targets, check_model_dir, check_token_ids, weights_error
from .step import train_step

logger = logging.getLogger("slipstream")

__all__ = [
    "CHECKPOINTS",
    "FINISHED",
    "TrainError",
    "TrainInterrupted",
    "newest_checkpoint",
    "save_checkpoint",
    "train",
]


# ----------------------------------------------------------------------------- set-up
def _tokenizer(config: TrainConfig):
    if config.model.preset is not None:
        from ..data import demo_tokenizer

        return demo_tokenizer()
    from transformers import AutoTokenizer

    check_model_dir(
        config.model.path
    )  # before anything reads it: a missing directory is not a network problem
    try:
        return AutoTokenizer.from_pretrained(
            config.model.path, local_files_only=True, trust_remote_code=config.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise TrainError(
            f"{config.model.path}: no usable tokenizer saved beside the model ({error})"
        ) from None


def _samples(config: TrainConfig, tokenizer):
    from ..data import demo_samples, load_samples

    if config.data.path is None:
        samples = demo_samples(
            tokenizer,
            num_rows=config.data.demo_rows,
            seed=config.seed,
            response_only=config.data.response_only,
        )
        return samples, None
    try:
        samples, report = load_samples(
            config.data.path,
            tokenizer,
            response_only=config.data.response_only,
            on_bad_row="skip" if config.data.skip_bad_rows else "error",
            cache=config.data.cache,
        )
    except ValueError as error:  # the tokenizer cannot do what the data asks (no chat template, say)
        if isinstance(error, DataError):
            raise
        where = config.model.path or f"model.preset {config.model.preset}"
        raise TrainError(f"{config.data.path}: {error} (the tokenizer of {where})") from None
    if not samples:
        raise TrainError(f"{config.data.path}: no usable rows ({report.summary()})")
    return samples, report


_OPTIMIZE_ADVICE = re.compile(r"optimize\(model, (\w+)=([^)]+)\)")


def config_advice(message: str) -> str:
    """The config line for the ``slipstream.optimize(model, key=value)`` a refusal advises."""
    match = _OPTIMIZE_ADVICE.search(message)
    if not match:
        return ""
    key, value = match.group(1), match.group(2).strip("'\"")
    value = {"False": "false", "True": "true", "None": "null"}.get(value, value)
    return f" (in the config: speedups.{key}: {value})"


def _model(config: TrainConfig, vocab_size: int, dtype: torch.dtype):
    if config.model.preset is not None:
        if config.quantization.four_bit:
            raise ConfigError(
                "quantization.four_bit loads a model directory: set model.path, not model.preset"
            )
        from ..models import build_model

        try:
            return build_model(
                config.model.preset,
                vocab_size=vocab_size,
                layers=config.model.layers,
                seed=config.seed,
                dtype=dtype,
            )
        except KeyError as error:
            raise ConfigError(f"model.preset: {error.args[0]}") from None
    path = check_model_dir(config.model.path)
    if config.quantization.four_bit:
        from ..models.qlora import load_for_qlora

        return load_for_qlora(
            path,
            double_quant=config.quantization.double_quant,
            compute_dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, trust_remote_code=config.model.trust_remote_code
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own kinds
        raise weights_error(path, error) from None


def _apply_lora(model, config: TrainConfig):
    if not config.lora.enabled:
        return model
    from peft import LoraConfig, get_peft_model

    from ..moe.experts import experts_modules
    from ..moe.lora import add_expert_lora

    lora = LoraConfig(
        r=config.lora.rank,
        lora_alpha=config.lora.alpha,
        lora_dropout=config.lora.dropout,
        target_modules=config.lora.target_modules,
        task_type="CAUSAL_LM",
        modules_to_save=config.lora.modules_to_save or None,
    )
    model = get_peft_model(model, lora)
    if config.lora.experts:
        if not experts_modules(model):
            raise ConfigError("lora.experts is true but the model has no MoE experts")
        add_expert_lora(model, r=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout)
    return model


def _step_plan(num_bins: int, config: TrainConfig, world_size: int = 1) -> tuple[int, callable]:
    """Total steps, and step -> the bin indices of the whole (all-rank) step.

    Each epoch is a seeded permutation of the bins; a step takes ``grad_accum x world_size``
    of them, so N ranks at grad_accum G see the batches one process sees at G x N.
    """
    per_step = config.training.grad_accum * world_size
    per_epoch = math.ceil(num_bins / per_step)
    total = config.training.steps or per_epoch * config.training.epochs
    orders: dict[int, list[int]] = {}

    def bins_for(step: int) -> list[int]:
        out = []
        for j in range(per_step):
            flat = step * per_step + j
            epoch, position = divmod(flat, num_bins)
            if epoch not in orders:
                order = list(range(num_bins))
                random.Random(config.seed * 1_000_003 + epoch).shuffle(order)
                orders[epoch] = order
            out.append(orders[epoch][position])
        return out

    return total, bins_for


# ----------------------------------------------------------------------------- loss weights, outputs
def _label_tokens(docs: list[dict]) -> int:
    """The label tokens a packed bin contributes to the loss (each document's first label is masked)."""
    from ..data.labels import IGNORE_INDEX

    return sum(sum(1 for label in doc["labels"][1:] if label != IGNORE_INDEX) for doc in docs)


def _save_final(out: Path, model, tokenizer, config: TrainConfig, summary: dict, state=None) -> Path:
    """The adapter (or the fine-tuned model) in PEFT / transformers format, then run.json."""
    adapter = out / "adapter"
    tmp = out / f".adapter.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model = unwrap(model)
    model.save_pretrained(tmp, **({"state_dict": state} if state is not None else {}))
    if config.lora.enabled and config.lora.experts:
        from ..moe.lora import save_expert_lora

        save_expert_lora(model, tmp / "experts")
    tokenizer.save_pretrained(tmp)
    if adapter.exists():
        shutil.rmtree(adapter)
    os.replace(tmp, adapter)
    write_text_atomically(out / FINISHED, json.dumps({"status": "finished", **summary}, indent=1))
    return adapter


# ----------------------------------------------------------------------------- the loop
def train(
    config: TrainConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    force: bool = False,
):
    """Run the training described by ``config``; returns ``(model, summary)``.

    ``resume`` continues from the newest usable checkpoint in ``config.output_dir`` after
    checking it was computed from the same config, data and tokenizer; ``force`` accepts a
    change that leaves the checkpoint loadable (the data, say). ``overwrite`` starts over in
    a directory slipstream marked as its own. Ctrl-C saves a checkpoint of the last completed
    step and raises ``TrainInterrupted``. Under torchrun every rank runs this; each takes its
    share of every step and rank 0 writes.
    """
    from tqdm import tqdm

    from .. import collate_packed, optimize
    from ..data import pack_samples
    from .distributed import full_trainable_state, setup, shutdown, wrap

    info = setup(config.training.distributed)
    out = Path(config.output_dir)
    resumable = False
    if info.is_main:
        resumable = prepare_output(out, resume=resume, overwrite=overwrite)
    info.barrier()
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = _tokenizer(config)
    samples, data_report = _samples(config, tokenizer)
    bins, packing = pack_samples(
        samples, config.data.max_seq_len, seed=config.seed, overflow=config.data.overflow
    )
    check_labels_left(packing.no_labels, config)
    if not bins:
        raise TrainError(
            f"{config.data.path or 'the demo data'}: no sample left to train on ({packing.summary()})"
        )
    if info.is_main and data_report is not None and (data_report.skipped or data_report.cached):
        tqdm.write(f"slipstream train: {data_report.summary()}")  # skipped rows are always said
    if info.is_main and (packing.no_labels or packing.truncated):
        tqdm.write(f"slipstream train: {packing.summary()}")
    logger.info("%s", packing.summary())
    device = info.device()
    dtype, dtype_policy = resolve_dtype(config.model.dtype, device)
    fingerprint = (
        run_fingerprint(config, tokenizer, world_size=info.world_size, dtype=dtype) if info.is_main else None
    )
    point, checkpoint = _resume_point(out, fingerprint, resume and resumable, force, info)
    if info.is_main:
        tqdm.write(f"slipstream train: {dtype_policy}")
    model = _model(config, len(tokenizer), dtype)
    check_lora_targets(model, config)
    check_token_ids(samples, model, config.data.path or "the demo data")
    if not config.quantization.four_bit:
        model.to(device)
    try:
        optimize(
            model,
            packed_attention=config.speedups.packed_attention,
            moe_routing=config.speedups.moe_routing,
            checkpointing=config.speedups.checkpointing,
            chunked_loss=config.speedups.chunked_loss,
            loss_chunk_tokens=config.speedups.loss_chunk_tokens,
        )
    except NotImplementedError as error:  # a refusal (UnsupportedArchitecture, ...): say it in config terms
        raise TrainError(
            f"{config.model.path or config.model.preset}: {error}{config_advice(str(error))}"
        ) from error
    torch.manual_seed(config.seed)  # adapters start the same whatever the set-up consumed
    model = _apply_lora(model, config)
    model.train()
    # The model's own list: decisions made on the first step (loss chunk size) join it there.
    policies = model.slipstream.policies if hasattr(model, "get_base_model") else model.slipstream.policies
    policies.insert(0, dtype_policy)
    model = wrap(model, info)
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type in ("cuda", "cpu") and info.strategy != "fsdp2" else {}
    optimizer = torch.optim.AdamW(
        params,
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        weight_decay=config.optimizer.weight_decay,
        **fused,
    )
    total, bins_for = _step_plan(len(bins), config, info.world_size)
    from transformers import get_scheduler

    scheduler = get_scheduler(
        config.optimizer.schedule,
        optimizer,
        num_warmup_steps=config.optimizer.warmup_steps,
        num_training_steps=total,
    )
    start = 0
    metrics_path = out / METRICS
    if checkpoint is not None:
        start = apply_checkpoint(checkpoint, model, optimizer, scheduler)
        checkpoint = None  # its tensors are in the model now
        if start > total:
            raise TrainError(
                f"{point.path}: the checkpoint is at step {start}, past this run's {total} steps"
            )
        if info.is_main:
            kept = (
                [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= start]
                if metrics_path.exists()
                else []
            )
            write_text_atomically(metrics_path, "".join(line + "\n" for line in kept))
            if point.loss is None and kept:  # a checkpoint from before state.json held the loss
                point.loss = json.loads(kept[-1])["loss"]
        logger.info("resumed from %s (step %d)", point.path, start)
    else:
        if resume and info.is_main:
            logger.warning("%s: no checkpoint to resume from: starting at step 0", out)
        if metrics_path.exists() and info.is_main:
            metrics_path.unlink()
    if info.is_main:
        write_text_atomically(out / "config.json", json.dumps(config.to_dict(), indent=1))
    info.barrier()
    kill_after = int(
        os.environ.get("SLIPSTREAM_FAULT_KILL_AFTER_STEP", "0")
    )  # a fault-injection hook for tests
    interrupt_after = fault_interrupt_step(info.rank)  # another one: Ctrl-C after that step
    writer = _tensorboard(out) if config.training.tensorboard and info.is_main else None
    label_tokens = [_label_tokens(b) for b in bins]
    losses: list[float] = []
    begin = time.perf_counter()
    tokens_seen = 0
    bar = tqdm(
        range(start, total),
        initial=start,
        total=total,
        desc="train",
        disable=not (progress and info.is_main),
        unit="step",
    )
    metrics = metrics_path.open("a") if info.is_main else None
    step, stop = start, GracefulStop()
    try:
        stop.install()
        for step in bar:
            step_bins = bins_for(step)
            micro = []
            for index in step_bins[info.rank :: info.world_size]:
                batch = collate_packed(bins[index], device=device)
                micro.append((batch.model_inputs(), batch.num_label_tokens))
            tokens_seen += sum(len(d["input_ids"]) for index in step_bins for d in bins[index])
            result = train_step(
                model,
                micro,
                optimizer,
                max_grad_norm=config.optimizer.max_grad_norm,
                global_tokens=sum(label_tokens[i] for i in step_bins),
                loss_scale=info.world_size,
            )
            scheduler.step()
            loss = info.sum(result["loss"])
            elapsed = time.perf_counter() - begin
            record = {
                "step": step + 1,
                "loss": loss,
                "grad_norm": result["grad_norm"],
                "lr": scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_seen / elapsed,
                "elapsed_s": elapsed,
            }
            losses.append(loss)
            if metrics is not None and ((step + 1) % config.training.log_every == 0 or step + 1 == total):
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                if writer is not None:
                    for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                        writer.add_scalar(f"train/{key}", record[key], step + 1)
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}")
            saved = False
            if config.training.checkpoint_every and (step + 1) % config.training.checkpoint_every == 0:
                if info.is_main:
                    _checkpoint(out, step + 1, model, optimizer, scheduler, loss, fingerprint, config)
                saved = True
                info.barrier()
            if kill_after and step + 1 == kill_after:
                if metrics is not None:
                    metrics.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if interrupt_after and step + 1 == interrupt_after:
                send_interrupt()
            if _stop_agreed(stop.requested, info):
                if info.strategy == "fsdp2":
                    where = "no checkpoint (training.distributed fsdp2 cannot write checkpoints yet)"
                    how = "run it again to start over"
                else:
                    if info.is_main and not saved:
                        _checkpoint(out, step + 1, model, optimizer, scheduler, loss, fingerprint, config)
                    info.barrier()
                    where = f"checkpoint {out / CHECKPOINTS / f'step-{step + 1:06d}'}"
                    how = "run the same command with --resume to continue"
                raise TrainInterrupted(
                    f"{stop.requested or 'a stop request on another rank'}: stopped after step "
                    f"{step + 1} of {total}; {where}: {how}"
                )
    except KeyboardInterrupt as error:
        if isinstance(error, TrainInterrupted):
            raise
        newest = newest_checkpoint(out)
        raise TrainInterrupted(
            f"stopped at once during step {step + 1} of {total} (a second Ctrl-C), nothing saved for it: "
            + (
                f"--resume continues from {newest}"
                if newest is not None
                else "no checkpoint to resume from (--resume starts over)"
            )
        ) from None
    finally:
        stop.restore()
        if metrics is not None:
            metrics.close()
        if writer is not None:
            writer.close()
    summary = {
        "steps": total,
        "final_loss": losses[-1] if losses else point.loss,
        "data": data_report.to_dict() if data_report is not None else {"source": "built-in demo data"},
        "packing": packing.summary(),
        "policies": list(policies),
        "dtype": str(dtype).removeprefix("torch."),
        "world_size": info.world_size,
        "distributed": info.strategy,
    }
    if point.path is not None:
        summary["resumed"] = {
            "from": str(point.path),
            "step": point.step,
            "skipped_damaged": point.skipped,
            "forced": point.forced,
        }
    state = full_trainable_state(model, info) if info.strategy == "fsdp2" else None  # collective: every rank
    if info.is_main:
        _save_final(out, model, tokenizer, config, summary, state)
    info.barrier()
    shutdown(info)
    return model, summary


def _checkpoint(out, step, model, optimizer, scheduler, loss, fingerprint, config: TrainConfig) -> Path:
    path = save_checkpoint(out, step, model, optimizer, scheduler, loss=loss, fingerprint=fingerprint)
    prune_checkpoints(out, config.training.keep_checkpoints, step)
    return path


def _stop_agreed(requested: str | None, info) -> bool:
    """Whether any rank was asked to stop (every rank calls this after every step)."""
    if not info.enabled:
        return requested is not None
    return info.sum(1.0 if requested is not None else 0.0) > 0


def _resume_point(out: Path, fingerprint, resumable: bool, force: bool, info):
    """Rank 0 picks and checks the checkpoint; every rank gets its verdict and reads it."""
    point, checkpoint, error = ResumePoint(), None, None
    if info.is_main and resumable:
        try:
            point, checkpoint = find_resume_point(out, fingerprint, force=force)
        except TrainError as caught:
            error = str(caught)
    if info.enabled:
        import torch.distributed as dist

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


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(f"training.tensorboard needs the tensorboard package ({error})") from None
    return SummaryWriter(str(out / "tensorboard"))
