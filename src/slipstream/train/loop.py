"""``slipstream train``: a lean LoRA / QLoRA SFT loop of our own, resumable, every speedup on.

rows -> tokens -> best-fit-decreasing bins (seeded) -> packed micro-batches -> optimized
model -> token-weighted step -> metrics JSONL, checkpoints, the final PEFT adapter.

Checkpoints (every ``training.checkpoint_every`` steps) hold the trainable weights, the
optimizer and scheduler, every RNG state and the step (which fixes the data position: the
order of micro-batches is a pure function of the seed). Each is written under a temporary
name and renamed when complete, so an interrupted write is never picked up; ``--resume``
continues from the newest complete one and reproduces the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import signal
import time
from pathlib import Path

import torch

from ..atomic import write_text_atomically
from .config import ConfigError, TrainConfig
from .distributed import unwrap
from .precision import resolve_dtype
from .step import train_step

logger = logging.getLogger("slipstream")

FINISHED = "run.json"
CHECKPOINTS = "checkpoints"


class TrainError(RuntimeError):
    """A problem with the run itself (not the config): the message says what and where."""


# ----------------------------------------------------------------------------- set-up
def _tokenizer(config: TrainConfig):
    if config.model.preset is not None:
        from ..data import demo_tokenizer

        return demo_tokenizer()
    from transformers import AutoTokenizer

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
    samples, report = load_samples(
        config.data.path,
        tokenizer,
        response_only=config.data.response_only,
        on_bad_row="skip" if config.data.skip_bad_rows else "error",
    )
    if not samples:
        raise TrainError(f"{config.data.path}: no usable rows ({report.summary()})")
    return samples, report


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
    path = Path(config.model.path)
    if not (path / "config.json").exists():
        raise TrainError(f"{path}: not a model directory (no config.json)")
    if config.quantization.four_bit:
        from ..models.qlora import load_for_qlora

        return load_for_qlora(
            path,
            double_quant=config.quantization.double_quant,
            compute_dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype=dtype, trust_remote_code=config.model.trust_remote_code
    )


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


# ----------------------------------------------------------------------------- checkpoints
def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in unwrap(model).named_parameters() if p.requires_grad}


def _label_tokens(docs: list[dict]) -> int:
    """The label tokens a packed bin contributes to the loss (each document's first label is masked)."""
    from ..packing import IGNORE_INDEX

    return sum(sum(1 for label in doc["labels"][1:] if label != IGNORE_INDEX) for doc in docs)


def save_checkpoint(out: Path, step: int, model, optimizer, scheduler) -> Path:
    """``checkpoints/step-NNNNNN``, written under a temporary name and renamed when complete."""
    from safetensors.torch import save_file

    final = out / CHECKPOINTS / f"step-{step:06d}"
    tmp = out / CHECKPOINTS / f".step-{step:06d}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(_trainable(model), str(tmp / "trainable.safetensors"))
    torch.save(
        {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": _rng_state()},
        tmp / "trainer_state.pt",
    )
    (tmp / "state.json").write_text(json.dumps({"step": step}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    return final


def newest_checkpoint(out: Path) -> Path | None:
    """The newest complete checkpoint (temporary, half-written ones are ignored)."""
    root = out / CHECKPOINTS
    if not root.is_dir():
        return None
    complete = [p for p in root.iterdir() if p.name.startswith("step-") and (p / "state.json").exists()]
    return max(complete, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def _load_checkpoint(path: Path, model, optimizer, scheduler) -> int:
    from safetensors.torch import load_file

    weights = load_file(str(path / "trainable.safetensors"))
    params = dict(unwrap(model).named_parameters())
    with torch.no_grad():
        for name, tensor in weights.items():
            if name not in params:
                raise TrainError(f"{path}: checkpoint has {name!r}, which this model does not")
            params[name].copy_(tensor)
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return json.loads((path / "state.json").read_text())["step"]


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
def _prepare_output(out: Path, resume: bool, overwrite: bool) -> None:
    if (out / FINISHED).exists() and not overwrite:
        raise TrainError(f"{out} already holds a finished run ({FINISHED}); pass --overwrite to replace it")
    if out.exists() and overwrite and not resume:
        shutil.rmtree(out)
    if out.exists() and not resume and any(out.iterdir()):
        raise TrainError(
            f"{out} is not empty: pass --resume to continue its run or --overwrite to start over"
        )
    out.mkdir(parents=True, exist_ok=True)


def train(config: TrainConfig, resume: bool = False, overwrite: bool = False, progress: bool = True):
    """Run the training described by ``config``; returns ``(model, summary)``.

    Under torchrun every rank runs this; each takes its share of every step and rank 0 writes.
    """
    from tqdm import tqdm

    from .. import collate_packed, optimize
    from ..data import pack_samples
    from .distributed import full_trainable_state, setup, shutdown, wrap

    info = setup(config.training.distributed)
    out = Path(config.output_dir)
    if info.is_main:
        _prepare_output(out, resume, overwrite)
    info.barrier()
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = _tokenizer(config)
    samples, data_report = _samples(config, tokenizer)
    bins, packing = pack_samples(
        samples, config.data.max_seq_len, seed=config.seed, overflow=config.data.overflow
    )
    if data_report is not None:
        logger.info("%s", data_report.summary())
    logger.info("%s", packing.summary())
    device = info.device()
    dtype, dtype_policy = resolve_dtype(config.model.dtype, device)
    if info.is_main:
        tqdm.write(f"slipstream train: {dtype_policy}")
    model = _model(config, len(tokenizer), dtype)
    if not config.quantization.four_bit:
        model.to(device)
    optimize(
        model,
        packed_attention=config.speedups.packed_attention,
        moe_routing=config.speedups.moe_routing,
        checkpointing=config.speedups.checkpointing,
        chunked_loss=config.speedups.chunked_loss,
        loss_chunk_tokens=config.speedups.loss_chunk_tokens,
    )
    torch.manual_seed(config.seed)  # adapters start the same whatever the set-up consumed
    model = _apply_lora(model, config)
    model.train()
    # The model's own list: decisions made on the first step (loss chunk size) join it there.
    policies = (
        model.get_base_model().slipstream_state.policies
        if hasattr(model, "get_base_model")
        else model.slipstream_state.policies
    )
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
    metrics_path = out / "metrics.jsonl"
    if resume and (checkpoint := newest_checkpoint(out)) is not None:
        start = _load_checkpoint(checkpoint, model, optimizer, scheduler)
        if info.is_main:
            kept = (
                [line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= start]
                if metrics_path.exists()
                else []
            )
            write_text_atomically(metrics_path, "".join(line + "\n" for line in kept))
        logger.info("resumed from %s (step %d)", checkpoint, start)
    elif metrics_path.exists() and info.is_main:
        metrics_path.unlink()
    if info.is_main:
        write_text_atomically(out / "config.json", json.dumps(config.to_dict(), indent=1))
    info.barrier()
    kill_after = int(
        os.environ.get("SLIPSTREAM_FAULT_KILL_AFTER_STEP", "0")
    )  # a fault-injection hook for tests
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
    try:
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
            if config.training.checkpoint_every and (step + 1) % config.training.checkpoint_every == 0:
                if info.is_main:
                    save_checkpoint(out, step + 1, model, optimizer, scheduler)
                info.barrier()
            if kill_after and step + 1 == kill_after:
                if metrics is not None:
                    metrics.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    finally:
        if metrics is not None:
            metrics.close()
    if writer is not None:
        writer.close()
    summary = {
        "steps": total,
        "final_loss": losses[-1] if losses else None,
        "packing": packing.summary(),
        "policies": list(policies),
        "dtype": str(dtype).removeprefix("torch."),
        "world_size": info.world_size,
        "distributed": info.strategy,
    }
    state = full_trainable_state(model, info) if info.strategy == "fsdp2" else None  # collective: every rank
    if info.is_main:
        _save_final(out, model, tokenizer, config, summary, state)
    info.barrier()
    shutdown(info)
    return model, summary


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(f"training.tensorboard needs the tensorboard package ({error})") from None
    return SummaryWriter(str(out / "tensorboard"))
