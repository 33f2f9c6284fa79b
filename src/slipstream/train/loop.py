"""``slipstream train``: a lean LoRA / QLoRA SFT loop of our own, resumable, every speedup on.

rows -> tokens -> best-fit-decreasing bins (seeded) -> packed micro-batches -> optimized
model -> token-weighted step -> metrics JSONL, checkpoints, the final PEFT adapter.

``train`` is set-up (``_set_up``), the step loop with its metrics (``_run_steps``), then the
summary and the final adapter. Checkpoints (every ``training.checkpoint_every`` steps, and
when Ctrl-C stops the run) hold the trainable weights, the optimizer and scheduler, every RNG
state, the step (which fixes the data position: the order of micro-batches is a pure function
of the seed) and a fingerprint of the config, data and tokenizer; ``--resume`` continues from
the newest usable one, refuses if what it was computed from changed, and reproduces the
uninterrupted run. What is read and written of them is in ``checkpoints.py``; see also
``fingerprint.py``, ``interrupt.py`` and, for what a run may do to its output directory,
``output_dir.py``.
"""

from __future__ import annotations

import json
import logging
import math
import random
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_scheduler

from ..atomic import write_text_atomically
from ..data import (
    DataError,
    DataReport,
    PackingReport,
    demo_samples,
    demo_tokenizer,
    load_samples,
    pack_samples,
)
from ..data.cache import cache_root
from ..data.labels import count_label_tokens
from ..models import build_model
from ..models.qlora import load_for_qlora
from ..moe.experts import experts_modules
from ..moe.lora import add_expert_lora
from ..optimize import optimize, state_of
from ..packing import collate_packed
from ..packing.pairs import collate_pairs, counted_tokens, pair_documents, pair_tokens
from ..preference import PairReport, evaluate_pairs, load_pairs, pack_pairs, preference_step, split_pairs
from ..preference.objective import reference_sums
from ..preference.reference import cache_key, precomputed_reference, reference_cached, weights_fingerprint
from ..utilisation import FlopProfile, docs_micro_batch, flop_profile, matmul_peak
from .checkpoints import (
    Checkpoint,
    ResumePoint,
    apply_checkpoint,
    checkpoint_and_prune,
    load_resume_point,
    newest_checkpoint,
    save_checkpoint,
    save_final,
)
from .config import ConfigError, TrainConfig
from .distributed import Distributed, full_trainable_state, setup, shutdown, unwrap, wrap
from .errors import TrainError, TrainInterrupted
from .evaluation import EvalSet, eval_set, evaluate, rank_share, split_rows
from .fingerprint import fingerprint as run_fingerprint
from .interrupt import GracefulStop, stop_agreed
from .lock import RunLock
from .nonfinite import NonFiniteSteps, finite_or_none
from .output_dir import (
    CHECKPOINTS,
    CONFIG,
    FINISHED,
    METRICS,
    SAMPLES,
    TENSORBOARD,
    prepare_output,
    rewind_metrics,
)
from .precision import resolve_dtype
from .preflight import (
    check_labels_left,
    check_lora_targets,
    check_model_dir,
    check_token_ids,
    weights_error,
    with_chat_template,
)
from .samples import Samples
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
def load_tokenizer(config: TrainConfig):
    if config.model.preset is not None:
        return with_chat_template(demo_tokenizer(), config)
    check_model_dir(
        config.model.path
    )  # before anything reads it: a missing directory is not a network problem
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            config.model.path, local_files_only=True, trust_remote_code=config.model.trust_remote_code
        )
    except (OSError, ValueError) as error:
        raise TrainError(
            f"{config.model.path}: no usable tokenizer saved beside the model ({error})"
        ) from None
    return with_chat_template(tokenizer, config)  # data.chat_template: another template than the model's


def _samples(config: TrainConfig, tokenizer, path: str | None = None):
    """The samples of the training data (``path`` None), or of another file read the same way."""
    if path is None and config.data.path is None:
        samples = demo_samples(
            tokenizer,
            num_rows=config.data.demo_rows,
            seed=config.seed,
            response_only=config.data.response_only,
        )
        return samples, None
    path = config.data.path if path is None else path
    try:
        samples, report = load_samples(
            path,
            tokenizer,
            response_only=config.data.response_only,
            on_bad_row="skip" if config.data.skip_bad_rows else "error",
            cache=config.data.cache,
        )
    except ValueError as error:  # the tokenizer cannot do what the data asks (no chat template, say)
        if isinstance(error, DataError):
            raise
        where = config.model.path or f"model.preset {config.model.preset}"
        raise TrainError(f"{path}: {error} (the tokenizer of {where})") from None
    if not samples:
        raise TrainError(f"{path}: no usable rows ({report.summary()})")
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


def load_model(config: TrainConfig, vocab_size: int, dtype: torch.dtype):
    if config.model.preset is not None:
        if config.quantization.four_bit:
            raise ConfigError(
                "quantization.four_bit loads a model directory: set model.path, not model.preset"
            )
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
        return load_for_qlora(
            path,
            double_quant=config.quantization.double_quant,
            compute_dtype=dtype,
            trust_remote_code=config.model.trust_remote_code,
        )
    try:
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype, trust_remote_code=config.model.trust_remote_code
        )
    except Exception as error:  # safetensors, torch and transformers each raise their own kinds
        raise weights_error(path, error) from None


def apply_lora(model, config: TrainConfig):
    if not config.lora.enabled:
        return model
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


def _step_plan(num_bins: int, config: TrainConfig, world_size: int = 1) -> tuple[int, Callable]:
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


@dataclass
class _Run:
    """A run once set up: what the step loop trains, and what the summary reports."""

    config: TrainConfig
    info: Distributed
    out: Path
    tokenizer: Any
    bins: list[list[dict]]
    label_tokens: list[int]  # per bin: what weights the loss, known to every rank without communication
    packing: PackingReport
    data_report: DataReport | None
    dtype: torch.dtype
    device: torch.device
    fingerprint: dict | None  # rank 0 only
    point: ResumePoint
    model: torch.nn.Module
    policies: list[str]
    optimizer: torch.optim.Optimizer
    scheduler: Any
    total: int
    bins_for: Callable[[int], list[int]]
    lock: RunLock | None  # the output directory's, held by rank 0 until the run ends
    evals: EvalSet | None = None  # data.eval_path / data.eval_fraction
    start: int = 0  # the step resumed from
    # (step, eval loss or None where not finite), the resumed run's earlier ones too
    eval_losses: list[tuple[int, float | None]] = field(default_factory=list)
    flops: FlopProfile | None = None  # the model's FLOPs per token, head row and attention pair
    matmul_peak: dict | None = None  # the device's measured peak (rank 0), utilisation.matmul_peak
    # this invocation's steps: (model FLOPs of the whole step, every rank's bins; seconds; tokens)
    step_work: list[tuple[int, float, int]] = field(default_factory=list)
    # a preference objective: each bin's reference sums (precomputed), the eval pairs and theirs
    reference: list[torch.Tensor] | None = None
    eval_reference: list[torch.Tensor] | None = None
    eval_metrics: list[tuple[int, dict]] = field(default_factory=list)
    last_preference: dict | None = None  # the last step's loss and reward metrics

    @property
    def preference(self) -> bool:
        return self.config.training.objective != "sft"


@dataclass
class PairEvalSet:
    """The held-out pairs, packed as training packs its own, and what ``run.json`` says of them."""

    bins: list[list[dict]]
    source: str
    rows: int

    def summary(self) -> dict:
        return {"source": self.source, "pairs": self.rows}


def _pair_data(config: TrainConfig, tokenizer, info: Distributed):
    """A preference objective's pairs, their bins and the held-out pairs; what was skipped or cut is said."""

    def read(path: str) -> tuple[list[dict], PairReport]:
        try:
            return load_pairs(
                path,
                tokenizer,
                max_seq_len=config.data.max_seq_len,
                on_bad_row="skip" if config.data.skip_bad_rows else "error",
            )
        except ValueError as error:  # the tokenizer cannot do what the data asks (no chat template, say)
            if isinstance(error, DataError):
                raise
            raise TrainError(
                f"{path}: {error} (the tokenizer of {config.model.path or config.model.preset})"
            ) from None

    pairs, report = read(config.data.path)
    evals = None
    if config.data.eval_fraction is not None:
        pairs, held_out = split_pairs(pairs, config.data.eval_fraction, config.seed, config.data.path)
        evals = PairEvalSet(
            pack_pairs(held_out, config.data.max_seq_len, config.seed),
            f"data.eval_fraction {config.data.eval_fraction:g} of {config.data.path}",
            len(held_out),
        )
    elif config.data.eval_path is not None:
        try:
            held_out, eval_report = read(config.data.eval_path)
        except DataError as error:
            raise TrainError(f"{error} (data.eval_path)") from None
        if info.is_main and (eval_report.data.skipped or eval_report.truncated):
            tqdm.write(f"slipstream train: eval pairs: {eval_report.summary()}")
        evals = PairEvalSet(
            pack_pairs(held_out, config.data.max_seq_len, config.seed), config.data.eval_path, len(held_out)
        )
    bins = pack_pairs(pairs, config.data.max_seq_len, config.seed)
    if info.is_main:
        tqdm.write(f"slipstream train: {report.summary()}")  # skipped rows and cut pairs are always said
    real = sum(pair_tokens(pair, config.preference.prefix_sharing) for pair in pairs)
    # bins are filled by the shared length whichever layout runs (the same pairs per step either way);
    # unshared, a row runs each prompt twice and may pass max_seq_len: its slots are then its length
    capacity = sum(
        max(config.data.max_seq_len, sum(pair_tokens(p, config.preference.prefix_sharing) for p in b))
        for b in bins
    )
    packing = PackingReport(
        num_samples=len(pairs),
        num_bins=len(bins),
        real_tokens=real,
        capacity=capacity,
        efficiency=real / capacity,
    )
    logger.info("%s (pairs)", packing.summary())
    return pairs, bins, packing, report, evals


def _data(config: TrainConfig, tokenizer, info: Distributed):
    """Samples and their bins, and the eval set; the rows skipped and the samples cut are always said."""
    if config.training.objective != "sft":
        return _pair_data(config, tokenizer, info)
    samples, data_report = _samples(config, tokenizer)
    evals = None
    if config.data.eval_fraction is not None:
        source = config.data.path or "the demo data"
        samples, held_out = split_rows(samples, config.data.eval_fraction, config.seed, source)
        evals = _eval_set(config, held_out, f"data.eval_fraction {config.data.eval_fraction:g} of {source}")
    elif config.data.eval_path is not None:
        try:
            held_out, eval_report = _samples(config, tokenizer, config.data.eval_path)
        except DataError as error:
            raise TrainError(f"{error} (data.eval_path)") from None
        if info.is_main and eval_report.skipped:
            tqdm.write(
                f"slipstream train: eval data: {eval_report.summary()}"
            )  # skipped rows are always said
        evals = _eval_set(config, held_out, config.data.eval_path)
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
    if evals is not None:
        logger.info("eval set: %s", evals.summary())
    return samples, bins, packing, data_report, evals


def _eval_set(config: TrainConfig, samples: list[dict], source: str) -> EvalSet:
    return eval_set(
        samples, source, max_seq_len=config.data.max_seq_len, seed=config.seed, overflow=config.data.overflow
    )


def _trainable_model(
    config: TrainConfig,
    tokenizer,
    samples,
    device,
    dtype,
    dtype_policy: str,
    info,
    evals: EvalSet | None,
    expected_steps: int | None = None,
):
    """The model loaded, checked, optimized, with its adapters and wrapped for the ranks; and its policies."""
    model = load_model(config, len(tokenizer), dtype)
    check_lora_targets(model, config)
    preference = config.training.objective != "sft"
    check_token_ids(
        pair_documents(samples) if preference else samples, model, config.data.path or "the demo data"
    )
    if evals is not None and config.data.eval_path is not None:
        held_out = [d for b in evals.bins for d in b]
        check_token_ids(pair_documents(held_out) if preference else held_out, model, config.data.eval_path)
    if not config.quantization.four_bit:
        model.to(device)
    try:
        # the config's section is a Speedups; the step count decides compile "auto"
        optimize(model, config.speedups, expected_steps=expected_steps)
    except NotImplementedError as error:  # a refusal (UnsupportedArchitecture, ...): say it in config terms
        raise TrainError(
            f"{config.model.path or config.model.preset}: {error}{config_advice(str(error))}"
        ) from error
    torch.manual_seed(config.seed)  # adapters start the same whatever the set-up consumed
    model = apply_lora(model, config)
    model.train()
    # The model's own list: decisions made on the first step (loss chunk size) join it there.
    policies = state_of(model).policies
    policies.insert(0, dtype_policy)
    return wrap(model, info), policies


def _optimizer(config: TrainConfig, model, device: torch.device, info: Distributed):
    params = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if device.type in ("cuda", "cpu") and info.strategy != "fsdp2" else {}
    return torch.optim.AdamW(
        params,
        lr=config.optimizer.lr,
        betas=tuple(config.optimizer.betas),
        weight_decay=config.optimizer.weight_decay,
        **fused,
    )


def _set_up(config: TrainConfig, *, resume: bool, overwrite: bool, force: bool) -> _Run:
    """Everything before the first step, in an order the seeds depend on; every rank runs it."""
    if config.quantization.four_bit:  # said before any data is read or anything is written
        from ..extras import require

        require("bitsandbytes", "quantization.four_bit (QLoRA)")
    info = setup(config.training.distributed)
    out = Path(config.output_dir)
    lock = RunLock.acquire(out) if info.is_main else None  # before anything there is read or changed
    try:
        return _set_up_locked(config, info, out, lock, resume=resume, overwrite=overwrite, force=force)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _set_up_locked(
    config: TrainConfig,
    info: Distributed,
    out: Path,
    lock: RunLock | None,
    *,
    resume: bool,
    overwrite: bool,
    force: bool,
) -> _Run:
    resumable = prepare_output(out, resume=resume, overwrite=overwrite) if info.is_main else False
    info.barrier()
    random.seed(config.seed)
    torch.manual_seed(config.seed)
    tokenizer = load_tokenizer(config)
    samples, bins, packing, data_report, evals = _data(config, tokenizer, info)
    device = info.device()
    dtype, dtype_policy = resolve_dtype(config.model.dtype, device)
    fingerprint = (
        run_fingerprint(config, tokenizer, world_size=info.world_size, dtype=dtype) if info.is_main else None
    )
    point, checkpoint = load_resume_point(
        out,
        fingerprint,
        info,
        resumable=resume and resumable,
        force=force,
        skips_nonfinite=config.training.on_nonfinite == "skip",
    )
    if info.is_main:
        tqdm.write(f"slipstream train: {dtype_policy}")
    # measured once per device, dtype, threads and torch (cached), before the model takes the memory
    peak = matmul_peak(device, dtype) if info.is_main else None
    total, bins_for = _step_plan(len(bins), config, info.world_size)
    model, policies = _trainable_model(
        config, tokenizer, samples, device, dtype, dtype_policy, info, evals, expected_steps=total
    )
    optimizer = _optimizer(config, model, device, info)
    scheduler = get_scheduler(
        config.optimizer.schedule,
        optimizer,
        num_warmup_steps=config.optimizer.warmup_steps,
        num_training_steps=total,
    )
    run = _Run(
        config=config,
        info=info,
        out=out,
        tokenizer=tokenizer,
        bins=bins,
        # the loss's weight of each bin: its label tokens (SFT) or its pairs (a preference loss)
        label_tokens=[len(b) if config.training.objective != "sft" else count_label_tokens(b) for b in bins],
        packing=packing,
        data_report=data_report,
        dtype=dtype,
        device=device,
        fingerprint=fingerprint,
        point=point,
        model=model,
        policies=policies,
        optimizer=optimizer,
        scheduler=scheduler,
        total=total,
        bins_for=bins_for,
        lock=lock,
        evals=evals,
        flops=flop_profile(unwrap(model)),
        matmul_peak=peak,
    )
    if run.preference:
        _reference_pass(run)  # before a checkpoint's weights are loaded: the policy as it starts
    run.start = _restore(run, checkpoint, resume=resume)
    del checkpoint  # its tensors are in the model now
    if info.is_main:
        write_text_atomically(out / CONFIG, json.dumps(config.to_dict(), indent=1))
    info.barrier()
    return run


def _restore(run: _Run, checkpoint: Checkpoint | None, *, resume: bool) -> int:
    """Load the checkpoint resumed from and keep the metrics up to it; the step to start at."""
    info, point = run.info, run.point
    if checkpoint is None:
        if resume and info.is_main:
            logger.warning("%s: no checkpoint to resume from: starting at step 0", run.out)
        if info.is_main:
            rewind_metrics(run.out, 0)
            rewind_metrics(run.out, 0, SAMPLES)
        return 0
    start = apply_checkpoint(checkpoint, run.model, run.optimizer, run.scheduler)
    _config_hyperparameters(run)
    if start > run.total:
        raise TrainError(
            f"{point.path}: the checkpoint is at step {start}, past this run's {run.total} steps"
        )
    if info.is_main:
        kept = rewind_metrics(run.out, start)
        if (run.out / SAMPLES).exists():
            rewind_metrics(run.out, start, SAMPLES)  # the answers after it are given again
        run.eval_losses = [(r["step"], r["eval_loss"]) for r in kept if "eval_loss" in r]
        if point.loss is None and kept:  # a checkpoint from before state.json held the loss
            point.loss = kept[-1]["loss"]
    logger.info("resumed from %s (step %d)", point.path, start)
    return start


def _config_hyperparameters(run: _Run) -> None:
    """The config's optimizer settings over those a checkpoint restored (``--resume --force`` with a changed lr).

    ``load_state_dict`` brings back the checkpoint's lr, betas and weight decay with the moments,
    and the scheduler its base lr, so a changed ``optimizer.lr`` would silently not apply. The
    schedule itself (its shape, warmup) is this run's; the lr is recomputed for the step resumed at.
    """
    settings = run.config.optimizer
    for group in run.optimizer.param_groups:
        group.update(initial_lr=settings.lr, betas=tuple(settings.betas), weight_decay=settings.weight_decay)
    scheduler = run.scheduler
    scheduler.base_lrs = [settings.lr] * len(run.optimizer.param_groups)
    lrs = [
        lr * factor(scheduler.last_epoch)
        for lr, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
    ]
    for group, lr in zip(run.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (torch keeps no public setter)


# ----------------------------------------------------------------------------- preference
def _chunked(run: _Run) -> bool:
    state = state_of(unwrap(run.model))
    return state is not None and state.chunked_loss is not None


def _reference_pass(run: _Run) -> None:
    """``preference.reference: precomputed``: every bin's reference sums (train and eval), once, cached."""
    config = run.config
    settings = config.preference
    if config.training.objective == "simpo" or settings.reference != "precomputed":
        if run.info.is_main:
            tqdm.write(
                "slipstream train: reference: none (SimPO is reference-free)"
                if config.training.objective == "simpo"
                else "slipstream train: reference: per_step (a no_grad forward with the adapter off in every step)"
            )
        return
    model = unwrap(run.model)
    chunked = _chunked(run)
    preset = None
    if config.model.path is None:
        preset = {"preset": config.model.preset, "layers": config.model.layers, "seed": config.seed}
    weights = weights_fingerprint(config.model.path, preset)
    base = {
        "dtype": str(run.dtype),
        "device": run.device.type,
        "four_bit": config.quantization.four_bit,
        "double_quant": config.quantization.double_quant,
        "prefix_sharing": settings.prefix_sharing,
        "chunked": chunked,
        "torch": torch.__version__,
    }

    def compute(pairs):
        batch = collate_pairs(pairs, settings.prefix_sharing, device=run.device)
        return reference_sums(model, batch, chunked, adapter=False)

    started = time.perf_counter()
    sets = [("train", run.bins)] + ([("eval", run.evals.bins)] if run.evals is not None else [])
    computed = False
    for name, bins in sets:
        key = cache_key(weights, {**base, "set": name}, bins)
        if run.info.enabled and config.data.cache and run.info.strategy != "fsdp2":
            # DDP: rank 0 computes and writes, the others read it
            if run.info.is_main:
                precomputed_reference(key, bins, compute, cache=True)
            run.info.barrier()
        if run.info.strategy == "fsdp2":
            # every forward is a collective (the parameters are gathered): every rank reads, or every
            # rank computes (and rank 0 writes), as the cache says before any of them writes
            cached = config.data.cache and reference_cached(key)
            run.info.barrier()
            sums, how = precomputed_reference(
                key, bins, compute, cache=cached or (config.data.cache and run.info.is_main)
            )
            run.info.barrier()
        else:
            sums, how = precomputed_reference(key, bins, compute, cache=config.data.cache)
        computed = computed or "computed" in how
        if name == "train":
            run.reference = sums
        else:
            run.eval_reference = sums
    seconds = time.perf_counter() - started
    count = sum(len(bins) for _, bins in sets)
    where = cache_root() / "reference"
    line = (
        f"reference log-probs computed once in {seconds:.1f} s before step 0 ({count} bins, "
        + ("train and eval" if len(sets) > 1 else "train")
        + (f"; cached under {where})" if config.data.cache else ")")
        if computed
        else f"reference log-probs read from the cache ({where}; {count} bins)"
    )
    run.policies.append(line)
    if run.info.is_main:
        tqdm.write(f"slipstream train: {line}")


def _preference_train_step(run: _Run, step: int) -> dict:
    config, settings = run.config, run.config.preference
    step_bins = run.bins_for(step)
    chunked = _chunked(run)
    micro = []
    for index in step_bins[run.info.rank :: run.info.world_size]:
        batch = collate_pairs(run.bins[index], settings.prefix_sharing, device=run.device)
        micro.append((batch, run.reference[index] if run.reference is not None else None))
    per_step = config.training.objective != "simpo" and run.reference is None
    result = preference_step(
        run.model,
        micro,
        run.optimizer,
        loss=config.training.objective,
        beta=settings.beta,
        simpo_gamma=settings.simpo_gamma,
        chunked=chunked,
        reference=(lambda batch: reference_sums(run.model, batch, chunked, adapter=True))
        if per_step
        else None,
        max_grad_norm=config.optimizer.max_grad_norm,
        global_pairs=sum(run.label_tokens[i] for i in step_bins),
        loss_scale=run.info.world_size,
        reduce=run.info.sum_tensor,
    )
    run.scheduler.step()
    result["tokens"] = sum(counted_tokens(run.bins[index]) for index in step_bins)
    result["pairs"] = sum(len(run.bins[index]) for index in step_bins)
    return result


def _preference_evaluate(run: _Run) -> dict:
    settings, info = run.config.preference, run.info
    batches = []
    # every rank as many forwards (FSDP2 gathers in each), the last ones repeated and not counted
    for index, counts in rank_share(len(run.evals.bins), info.rank, info.world_size):
        batch = collate_pairs(run.evals.bins[index], settings.prefix_sharing, device=run.device)
        batches.append((batch, run.eval_reference[index] if run.eval_reference is not None else None, counts))
    if run.config.training.objective != "simpo" and run.eval_reference is None:  # per_step
        chunked = _chunked(run)
        batches = [(b, reference_sums(run.model, b, chunked, adapter=True), c) for b, _, c in batches]
    return evaluate_pairs(
        run.model,
        batches,
        loss=run.config.training.objective,
        beta=settings.beta,
        simpo_gamma=settings.simpo_gamma,
        chunked=_chunked(run),
        reduce=info.sum_tensor,
    )


# ----------------------------------------------------------------------------- the loop
def _train_step(run: _Run, step: int) -> tuple[float, float, int, bool]:
    """Step ``step``: this rank's share of its bins. Returns its loss (over every rank), grad norm,
    tokens, and whether it was finite (applied); every rank gets the same loss and verdict."""
    if run.preference:
        result = _preference_train_step(run, step)
        run.last_preference = result
        return result["loss"], result["grad_norm"], result["tokens"], result["finite"]
    step_bins = run.bins_for(step)
    micro = []
    for index in step_bins[run.info.rank :: run.info.world_size]:
        batch = collate_packed(run.bins[index], device=run.device)
        micro.append((batch.model_inputs(), batch.num_label_tokens))
    result = train_step(
        run.model,
        micro,
        run.optimizer,
        max_grad_norm=run.config.optimizer.max_grad_norm,
        global_tokens=sum(run.label_tokens[i] for i in step_bins),
        loss_scale=run.info.world_size,
        reduce_loss=run.info.sum_tensor,
    )
    run.scheduler.step()  # a skipped step keeps the plan: the lr stays a function of the step
    tokens = sum(len(d["input_ids"]) for index in step_bins for d in run.bins[index])
    return result["loss"], result["grad_norm"], tokens, result["finite"]


def _step_flops(run: _Run, step: int) -> int:
    """Model FLOPs of step ``step`` on every rank: each bin's documents, the LM head on its labelled rows."""
    if run.preference:
        return run.flops.step_flops(
            docs_micro_batch(pair_documents(run.bins[index])) for index in run.bins_for(step)
        )
    return run.flops.step_flops(docs_micro_batch(run.bins[index]) for index in run.bins_for(step))


def _utilisation(run: _Run) -> dict:
    """``run.json``'s model FLOPs and MFU: the total model FLOPs over the total step time of this
    invocation's steps, the first left out as warm-up when there are more (evaluation, samples and
    checkpoints are outside the step time), over the measured peak of every rank's device."""
    work = run.step_work[1:] if len(run.step_work) > 1 else run.step_work
    flops, seconds, tokens = (sum(item[i] for item in work) for i in range(3))
    if not work or seconds <= 0 or not tokens:
        return {}
    achieved = flops / seconds
    found = {
        "model_flops_per_token": flops / tokens,
        "model_flops_per_step": flops / len(work),
        "achieved_tflops": achieved / 1e12,
        "mfu_steps": len(work),
    }
    if run.matmul_peak:
        found["mfu"] = achieved / (run.matmul_peak["flops_per_s"] * run.info.world_size)
        found["matmul_peak"] = run.matmul_peak
    return found


class _Metrics:
    """``metrics.jsonl`` (every ``training.log_every`` steps and the last) and TensorBoard; rank 0 writes."""

    def __init__(self, run: _Run) -> None:
        self.every, self.total = run.config.training.log_every, run.total
        main = run.info.is_main
        self.writer = _tensorboard(run.out) if run.config.training.tensorboard and main else None
        self.stream = (run.out / METRICS).open("a") if main else None

    def log(self, record: dict) -> None:
        """Every ``log_every`` steps, the last, every non-finite step and every evaluated one (always kept)."""
        step = record["step"]
        event = "nonfinite" in record or "eval_loss" in record
        if self.stream is None or (step % self.every != 0 and step != self.total and not event):
            return
        self.stream.write(json.dumps(record, allow_nan=False) + "\n")
        self.stream.flush()
        if self.writer is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s"):
                if record[key] is not None:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
            if record.get("eval_loss") is not None:
                self.writer.add_scalar("eval/loss", record["eval_loss"], step)

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.writer is not None:
            self.writer.close()


def _tensorboard(out: Path):
    try:  # function-level: tensorboard is optional, needed only with training.tensorboard
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError(f"training.tensorboard needs the tensorboard package ({error})") from None
    return SummaryWriter(str(out / TENSORBOARD))


def _evaluate(run: _Run, step: int) -> float | None:
    """The eval loss after step ``step`` (every rank), kept in ``run.eval_losses``; a non-finite one is None, and said."""
    if run.preference:
        metrics = {k: finite_or_none(v) for k, v in _preference_evaluate(run).items()}
        run.eval_metrics.append((step, metrics))
        loss = metrics["loss"]
    else:
        loss = finite_or_none(evaluate(run.model, run.evals, run.info, run.device))
    if loss is None and run.info.is_main:
        tqdm.write(f"slipstream train: the eval loss after step {step} is not finite: recorded as null")
    run.eval_losses.append((step, loss))
    return loss


def _evaluation_point(run: _Run, step: int) -> bool:
    """Every ``training.eval_every`` steps (0: none) and the last."""
    every = run.config.training.eval_every
    return step == run.total or (every > 0 and step % every == 0)


def _due_for_eval(run: _Run, step: int) -> bool:
    """``training.eval_every`` steps and the last, when there is an eval set."""
    return run.evals is not None and _evaluation_point(run, step)


def _write_samples(run: _Run, samples: Samples, step: int) -> None:
    """``training.sample_prompts``' answers after step ``step`` into ``samples.jsonl`` (rank 0), and said."""
    samples.write(run.model, run.tokenizer, step)
    tqdm.write(f"slipstream train: samples at step {step} -> {samples.path}")


def _checkpoint(run: _Run, step: int, loss: float | None) -> None:
    checkpoint_and_prune(
        run.out,
        step,
        run.model,
        run.optimizer,
        run.scheduler,
        loss=loss,
        fingerprint=run.fingerprint,
        keep=run.config.training.keep_checkpoints,
    )


def _stop(run: _Run, requested: str | None, step: int, loss: float | None, saved: bool) -> TrainInterrupted:
    """Save step ``step`` (if not just saved) for a stop every rank agreed on; the error that says so."""
    if run.info.strategy == "fsdp2":
        where = "no checkpoint (training.distributed fsdp2 cannot write checkpoints yet)"
        how = "run it again to start over"
    else:
        if run.info.is_main and not saved:
            _checkpoint(run, step, loss)
        run.info.barrier()
        where = f"checkpoint {run.out / CHECKPOINTS / f'step-{step:06d}'}"
        how = "run the same command with --resume to continue"
    return TrainInterrupted(
        f"{requested or 'a stop request on another rank'}: stopped after step "
        f"{step} of {run.total}; {where}: {how}"
    )


def _run_steps(
    run: _Run, *, progress: bool, after_step: Callable[[int], None] | None
) -> tuple[list[float], NonFiniteSteps]:
    """Steps ``run.start`` to ``run.total``; returns the finite losses and the non-finite count.

    Ctrl-C stops after a whole step; a non-finite step stops the run or is skipped
    (``nonfinite.NonFiniteSteps``)."""
    config, info, total = run.config, run.info, run.total
    metrics = _Metrics(run)
    samples = Samples(
        run.out,
        config.training.sample_prompts,
        config.training.sample_max_new_tokens,
        main=info.is_main,
    )
    nonfinite = NonFiniteSteps(run.config, run.info, run.out, run.total, run.model)
    losses: list[float] = []
    begin = time.perf_counter()
    tokens_seen = pairs_seen = 0
    eval_seconds = 0.0  # evaluations and samples: not training time
    bar = tqdm(
        range(run.start, total),
        initial=run.start,
        total=total,
        desc="train",
        disable=not (progress and info.is_main),
        unit="step",
    )
    step, stop = run.start, GracefulStop()
    postfix: dict[str, str] = {}  # the last eval loss, shown until the next
    try:
        stop.install()
        for step in bar:
            stepped = time.perf_counter()
            loss, grad_norm, tokens, finite = _train_step(run, step)  # (its loss is read: the step is done)
            run.step_work.append((_step_flops(run, step), time.perf_counter() - stepped, tokens))
            tokens_seen += tokens
            elapsed = time.perf_counter() - begin
            record = {
                "step": step + 1,
                "loss": finite_or_none(loss),
                "grad_norm": finite_or_none(grad_norm),
                "lr": run.scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_seen / max(elapsed - eval_seconds, 1e-9),  # training time only
                "elapsed_s": elapsed,
            }
            if run.preference:
                result = run.last_preference
                for name in ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy"):
                    record[name] = finite_or_none(result[name])
                pairs_seen += result["pairs"]
                record["pairs_per_s"] = pairs_seen / max(elapsed - eval_seconds, 1e-9)
            if _due_for_eval(run, step + 1):
                evaluated = time.perf_counter()
                record["eval_loss"] = _evaluate(run, step + 1)
                if run.preference:
                    for name, value in run.eval_metrics[-1][1].items():
                        if name != "loss":
                            record[f"eval_{name}"] = value
                eval_seconds += time.perf_counter() - evaluated
                postfix["eval_loss"] = "null" if record["eval_loss"] is None else f"{record['eval_loss']:.4f}"
            if finite:
                nonfinite.finite()
                losses.append(loss)
                metrics.log(record)
            else:  # the update was dropped; the record says which value was not finite
                names = [n for n, v in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(v)]
                metrics.log({**record, "nonfinite": names, "skipped": config.training.on_nonfinite == "skip"})
                line = nonfinite.record(step + 1, loss, grad_norm)  # raises to stop the run
                if info.is_main:
                    tqdm.write(line)
            if samples.enabled and _evaluation_point(run, step + 1):
                answered = time.perf_counter()
                _write_samples(run, samples, step + 1)
                eval_seconds += time.perf_counter() - answered
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", **postfix)
            saved = False
            if config.training.checkpoint_every and (step + 1) % config.training.checkpoint_every == 0:
                nonfinite.check_weights(step + 1)
                if info.is_main:
                    _checkpoint(run, step + 1, finite_or_none(loss))
                saved = True
                info.barrier()
            if after_step is not None:
                after_step(step + 1)
            if stop_agreed(stop.requested, info):
                raise _stop(run, stop.requested, step + 1, finite_or_none(loss), saved)
    except KeyboardInterrupt as error:
        if isinstance(error, TrainInterrupted):
            raise
        newest = newest_checkpoint(run.out)
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
        metrics.close()
        samples.close()
    return losses, nonfinite


# ----------------------------------------------------------------------------- finishing
def _summary(run: _Run, losses: list[float], nonfinite: NonFiniteSteps) -> dict:
    """What ``run.json`` records and ``train`` returns."""
    data = run.data_report.to_dict() if run.data_report is not None else {"source": "built-in demo data"}
    summary = {
        "steps": run.total,
        "final_loss": losses[-1] if losses else run.point.loss,
        "data": data,
        "packing": run.packing.summary(),
        "policies": list(run.policies),
        "dtype": str(run.dtype).removeprefix("torch."),
        "world_size": run.info.world_size,
        "distributed": run.info.strategy,
        "skipped_nonfinite_steps": nonfinite.skipped,
        **_utilisation(run),
    }
    state = state_of(run.model)
    if state is not None and state.packed_attention is not None:
        # this invocation's batches (train and eval) whose packed SDPA ran grouped / per document
        summary["attention_grouping_counts"] = state.grouping_counts.to_dict()
    if run.evals is not None:
        summary["eval"] = _eval_summary(run)
    if run.preference:
        settings = run.config.preference
        last = run.last_preference
        summary["preference"] = {
            "objective": run.config.training.objective,
            "beta": settings.beta,
            "prefix_sharing": settings.prefix_sharing,
            "reference": "none" if run.config.training.objective == "simpo" else settings.reference,
            "pairs": sum(len(b) for b in run.bins),
            "last_step": None
            if last is None
            else {
                k: last[k]
                for k in ("loss", "chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy")
            },
        }
        if run.eval_metrics:
            summary["eval"]["metrics"] = [{"step": step, **values} for step, values in run.eval_metrics]
    if run.point.path is not None:
        summary["resumed"] = {
            "from": str(run.point.path),
            "step": run.point.step,
            "skipped_damaged": run.point.skipped,
            "forced": run.point.forced,
        }
    return summary


def _eval_summary(run: _Run) -> dict:
    """``run.json``'s ``eval``: the best and the last eval loss with their steps, and the eval set."""
    finite = [(step, loss) for step, loss in run.eval_losses if loss is not None]
    best = min(finite, key=lambda item: item[1]) if finite else None
    last = run.eval_losses[-1] if run.eval_losses else None
    return {
        "best": {"step": best[0], "loss": best[1]} if best else None,
        "last": {"step": last[0], "loss": last[1]} if last else None,
        **run.evals.summary(),
    }


def train(
    config: TrainConfig,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    force: bool = False,
    after_step: Callable[[int], None] | None = None,
):
    """Run the training described by ``config``; returns ``(model, summary)``.

    ``resume`` continues from the newest usable checkpoint in ``config.output_dir`` after
    checking it was computed from the same config, data and tokenizer; ``force`` accepts a
    change that leaves the checkpoint loadable (the data, say). ``overwrite`` starts over in
    a directory slipstream marked as its own. Ctrl-C saves a checkpoint of the last completed
    step and raises ``TrainInterrupted``. Under torchrun every rank runs this; each takes its
    share of every step and rank 0 writes. ``after_step(n)`` runs on every rank once step n
    is complete (checkpoint included), before a stop request is looked at: tests inject
    their faults there.
    """
    run = _set_up(config, resume=resume, overwrite=overwrite, force=force)
    try:
        return _train_and_save(run, progress=progress, after_step=after_step)
    finally:
        if run.lock is not None:
            run.lock.release()


def _train_and_save(run: _Run, *, progress: bool, after_step: Callable[[int], None] | None):
    config = run.config
    losses, nonfinite = _run_steps(run, progress=progress, after_step=after_step)
    summary = _summary(run, losses, nonfinite)
    info = run.info
    # a collective under FSDP2: every rank gathers, rank 0 writes
    state = full_trainable_state(run.model, info) if info.strategy == "fsdp2" else None
    nonfinite.check_weights(run.total, state)
    if info.is_main:
        save_final(
            run.out,
            run.model,
            run.tokenizer,
            summary,
            state=state,
            expert_lora=config.lora.enabled and config.lora.experts,
        )
    info.barrier()
    shutdown(info)
    return run.model, summary
