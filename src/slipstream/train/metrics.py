"""``slipstream train``'s records: ``metrics.jsonl`` and TensorBoard per step, and ``run.json``'s summary
(the objective's own section, the eval losses, the model FLOPs and MFU)."""

from __future__ import annotations

import json
from pathlib import Path

from ..optimize import state_of
from .config import ConfigError
from .nonfinite import NonFiniteSteps
from .output_dir import METRICS, TENSORBOARD
from .setup import _Run


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
        found["mfu"] = achieved / (run.matmul_peak["flops_per_s"] * run.driver.info.world_size)
        found["matmul_peak"] = run.matmul_peak
    return found


class _Metrics:
    """``metrics.jsonl`` (every ``training.log_every`` steps and the last) and TensorBoard; rank 0 writes."""

    def __init__(self, run: _Run) -> None:
        driver = run.driver
        self.every, self.total = driver.config.training.log_every, driver.total
        self.objective_metrics = driver.objective.metrics[1:]  # beyond the loss: the reward metrics, say
        main = driver.info.is_main
        self.writer = _tensorboard(driver.out) if driver.config.training.tensorboard and main else None
        self.stream = (driver.out / METRICS).open("a") if main else None

    def log(self, record: dict) -> None:
        """Every ``log_every`` steps, the last, every non-finite step and every evaluated one (always kept)."""
        step = record["step"]
        event = "nonfinite" in record or any(key.startswith("eval_") for key in record)
        if self.stream is None or (step % self.every != 0 and step != self.total and not event):
            return
        self.stream.write(json.dumps(record, allow_nan=False) + "\n")
        self.stream.flush()
        if self.writer is not None:
            for key in ("loss", "grad_norm", "lr", "tokens_per_s", *self.objective_metrics):
                if record.get(key) is not None:
                    self.writer.add_scalar(f"train/{key}", record[key], step)
            for key in ("loss", *self.objective_metrics):
                if record.get(f"eval_{key}") is not None:
                    self.writer.add_scalar(f"eval/{key}", record[f"eval_{key}"], step)

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


def _summary(run: _Run, losses: list[float], nonfinite: NonFiniteSteps) -> dict:
    """What ``run.json`` records and ``train`` returns."""
    driver = run.driver
    data = run.data_report.to_dict() if run.data_report is not None else {"source": "built-in demo data"}
    summary = {
        "steps": driver.total,
        "final_loss": losses[-1] if losses else run.point.loss,
        "data": data,
        "packing": run.packing.summary(),
        "policies": list(driver.policies),
        "dtype": str(driver.dtype).removeprefix("torch."),
        "world_size": driver.info.world_size,
        "distributed": driver.info.strategy,
        "skipped_nonfinite_steps": nonfinite.skipped,
        **_utilisation(run),
    }
    state = state_of(driver.model)
    if state is not None and state.packed_attention is not None:
        # this invocation's batches (train and eval) whose packed SDPA ran grouped / per document
        summary["attention_grouping_counts"] = state.grouping_counts.to_dict()
    if driver.evals is not None:
        summary["eval"] = _eval_summary(run)
    summary.update(driver.objective.summary(driver.bins, run.last_metrics))
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
        **run.driver.evals.summary(),
    }
