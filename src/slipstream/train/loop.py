"""``slipstream train``: a lean LoRA / QLoRA loop of our own, resumable, every speedup on, any objective.

rows -> tokens -> best-fit-decreasing bins (seeded) -> packed micro-batches -> optimized
model -> the objective's token- (pair-) weighted step -> metrics JSONL, checkpoints, the final
PEFT adapter.

``train`` is set-up (``setup.py``), the step loop (``_run_steps``, here), then the summary
(``metrics.py``) and the final adapter. What the run trains for is an objective
(``slipstream.objectives``: sft, dpo, ipo, simpo, orpo, or one registered by the user): its rows,
its bins, what runs before step 0, each micro-batch's loss and metrics and its evaluation; the
loop calls it and never asks its name. Checkpoints (every ``training.checkpoint_every`` steps,
and when Ctrl-C stops the run) hold the trainable weights, the optimizer and scheduler, every
RNG state, the step (which fixes the data position: the order of micro-batches is a pure
function of the seed) and a fingerprint of the config, data and tokenizer; ``--resume``
continues from the newest usable one, refuses if what it was computed from changed, and
reproduces the uninterrupted run. What is read and written of them is in ``checkpoints.py``;
see also ``fingerprint.py``, ``interrupt.py`` and, for what a run may do to its output
directory, ``output_dir.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from tqdm import tqdm

from ..utilisation import docs_micro_batch
from .checkpoints import newest_checkpoint, prune_checkpoints, save_checkpoint, save_final
from .config import TrainConfig
from .distributed import full_trainable_state, shutdown
from .errors import TrainInterrupted
from .interrupt import GracefulStop, stop_agreed
from .metrics import _Metrics, _summary
from .nonfinite import NonFiniteSteps, finite_or_none
from .output_dir import CHECKPOINTS
from .samples import Samples
from .setup import _Run, _set_up


def _train_step(run: _Run, step: int) -> tuple[float, float, int, bool]:
    """Step ``step`` (the driver's: this rank's share of its bins). Returns its loss (over every rank),
    grad norm, tokens, and whether it was finite (applied); every rank gets the same loss and verdict.
    The step's metrics (and its pairs) are kept in ``run.last_metrics``."""
    done = run.driver.step(step)  # GRPO samples its rollouts in the objective's plan
    run.last_metrics = {**done.metrics, "pairs": done.pairs}
    run.last_plan = done.plan
    return done.loss, done.grad_norm, done.tokens, done.finite


def _evaluate(run: _Run, step: int) -> dict[str, float | None]:
    """The eval metrics after step ``step`` (every rank); the loss, where the objective has one, kept
    in ``run.eval_losses``; a non-finite value is None, and said."""
    driver = run.driver
    metrics = {
        k: finite_or_none(v)
        for k, v in driver.objective.evaluate(driver.model, driver.evals, driver.info, driver.device).items()
    }
    if len(metrics) > 1 or "loss" not in metrics:  # more than a loss: the reward metrics, say
        run.eval_metrics.append((step, metrics))
    if "loss" in metrics:
        loss = metrics["loss"]
        if loss is None and driver.info.is_main:
            tqdm.write(f"slipstream train: the eval loss after step {step} is not finite: recorded as null")
        run.eval_losses.append((step, loss))
    return metrics


def _evaluation_point(run: _Run, step: int) -> bool:
    """Every ``training.eval_every`` steps (0: none) and the last."""
    every = run.driver.config.training.eval_every
    return step == run.driver.total or (every > 0 and step % every == 0)


def _checkpoint(run: _Run, step: int, loss: float | None) -> None:
    """Save step ``step``'s checkpoint, then keep the newest ``training.keep_checkpoints``."""
    driver = run.driver
    save_checkpoint(
        driver.out,
        step,
        driver.model,
        driver.optimizer,
        driver.scheduler,
        loss=loss,
        fingerprint=run.fingerprint,
    )
    prune_checkpoints(driver.out, driver.config.training.keep_checkpoints, step)


def _stop(run: _Run, requested: str | None, step: int, loss: float | None, saved: bool) -> TrainInterrupted:
    """Save step ``step`` (if not just saved) for a stop every rank agreed on; the error that says so."""
    driver = run.driver
    if driver.info.strategy == "fsdp2":
        where = "no checkpoint (training.distributed fsdp2 cannot write checkpoints yet)"
        how = "run it again to start over"
    else:
        if driver.info.is_main and not saved:
            _checkpoint(run, step, loss)
        driver.info.barrier()
        where = f"checkpoint {driver.out / CHECKPOINTS / f'step-{step:06d}'}"
        how = "run the same command with --resume to continue"
    return TrainInterrupted(
        f"{requested or 'a stop request on another rank'}: stopped after step "
        f"{step} of {driver.total}; {where}: {how}"
    )


def _run_steps(
    run: _Run, *, progress: bool, after_step: Callable[[int], None] | None
) -> tuple[list[float], NonFiniteSteps]:
    """Steps ``run.start`` to ``driver.total``; returns the finite losses and the non-finite count.

    Ctrl-C stops after a whole step; a non-finite step stops the run or is skipped
    (``nonfinite.NonFiniteSteps``)."""
    driver = run.driver
    config, info, total = driver.config, driver.info, driver.total
    metrics = _Metrics(run)
    samples = Samples(
        driver.out,
        config.training.sample_prompts,
        config.training.sample_max_new_tokens,
        main=info.is_main,
        evaluated=driver.evals is not None and bool(driver.objective.keeps_samples),
    )
    nonfinite = NonFiniteSteps(driver.config, driver.info, driver.out, driver.total, driver.model)
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
    if config.training.eval_at_start and driver.evals is not None and run.start == 0:
        evaluated = time.perf_counter()  # the starting weights' figures, the base a run improves on
        found = _evaluate(run, 0)
        samples.keep(0, driver.objective.eval_samples())
        metrics.log({"step": 0, **{f"eval_{name}": value for name, value in found.items()}})
        eval_seconds += time.perf_counter() - evaluated
        if info.is_main:
            shown = ", ".join(f"{k} {'null' if v is None else f'{v:.4f}'}" for k, v in found.items())
            tqdm.write(f"slipstream train: eval before step 1: {shown}")
    try:
        stop.install()
        for step in bar:
            stepped = time.perf_counter()
            loss, grad_norm, tokens, finite = _train_step(run, step)  # (its loss is read: the step is done)
            # the step's model FLOPs on every rank: each bin's documents, the LM head on its labelled rows
            flops = run.flops.step_flops(docs_micro_batch(documents) for documents in run.last_plan.documents)
            run.step_work.append((flops, time.perf_counter() - stepped, tokens))
            tokens_seen += tokens
            elapsed = time.perf_counter() - begin
            record = {
                "step": step + 1,
                "loss": finite_or_none(loss),
                "grad_norm": finite_or_none(grad_norm),
                "lr": driver.scheduler.get_last_lr()[0],
                "tokens_per_s": tokens_seen / max(elapsed - eval_seconds, 1e-9),  # training time only
                "elapsed_s": elapsed,
            }
            result = run.last_metrics
            for name in driver.objective.metrics[1:]:  # beyond the loss: the reward metrics, say
                record[name] = finite_or_none(result[name])
            # the objective's host values (GRPO: rewards, lengths; a device scalar it kept during the step
            # is read now, after the step's own read)
            record.update({k: v.item() if torch.is_tensor(v) else v for k, v in run.last_plan.record.items()})
            if result["pairs"]:
                pairs_seen += result["pairs"]
                record["pairs_per_s"] = pairs_seen / max(elapsed - eval_seconds, 1e-9)
            if driver.evals is not None and _evaluation_point(run, step + 1):
                evaluated = time.perf_counter()
                found = _evaluate(run, step + 1)
                samples.keep(step + 1, driver.objective.eval_samples())
                for name, value in found.items():  # the loss first, where the objective has one
                    record[f"eval_{name}"] = value
                eval_seconds += time.perf_counter() - evaluated
                name, value = next(iter(found.items()))
                postfix[f"eval_{name}"] = "null" if value is None else f"{value:.4f}"
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
                # training.sample_prompts' answers (rank 0)
                samples.write(driver.model, driver.tokenizer, step + 1)
                tqdm.write(f"slipstream train: samples at step {step + 1} -> {samples.path}")
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
        newest = newest_checkpoint(driver.out)
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
        run.driver.objective.after_training()  # e.g. a rollout engine's process stops, however the run ended
        if run.lock is not None:
            run.lock.release()


def _train_and_save(run: _Run, *, progress: bool, after_step: Callable[[int], None] | None):
    driver = run.driver
    config = driver.config
    losses, nonfinite = _run_steps(run, progress=progress, after_step=after_step)
    summary = _summary(run, losses, nonfinite)
    info = driver.info
    # a collective under FSDP2: every rank gathers, rank 0 writes
    state = full_trainable_state(driver.model, info) if info.strategy == "fsdp2" else None
    nonfinite.check_weights(driver.total, state)
    del nonfinite  # it holds the ranks' wrapper, which must go before the process group (shutdown)
    if info.is_main:
        save_final(
            driver.out,
            driver.model,
            driver.tokenizer,
            summary,
            state=state,
            expert_lora=config.lora.enabled and config.lora.experts,
        )
    info.barrier()
    driver.drop_wrapper()
    shutdown(info)
    return driver.model, summary
