"""A reduced-precision A/B's step 0 against the truth: the same step once more in fp32.

In bf16 two correct arms compute step 0 apart (each rounds in its own kernel order), and their
difference alone cannot say which of them is off. So a bf16 / fp16 run computes that step once more
in fp32, once for the run: the reference arm (the first that ran, the one every loss curve is compared
with; a stock arm in every preset but ORPO's) in a fresh process after the arms, from the very same
weights and adapter cast up to fp32 (``arm_result.open_arm_model(fp32=True)``), on the same step-0
micro-batches in its own layout; its update is discarded. Every arm kept its step-0 gradient
(``step_gradient.HeldGradient``, the first repeat's), so each arm's distance to the fp32 step is its
loss's, its gradient norm's and its gradient's cosine with fp32's, and ``stats.against_fp32`` judges it
next to the reference arm's own distance (``summarize`` hands that to ``stats.loss_parity`` in place of
the strict step-0 tolerance). What the record keeps: ``fp32_step0`` (the fp32 figures, each arm's
distances), and per arm ``step0_vs_fp32``; the gradients themselves are removed with their directory.

Every arm that trains in this process can take part: slipstream's, the stock ones, TRL's (SFT, DPO and
GRPO alike: a DPO arm's reference pass and a GRPO arm's update on the shared rollouts run in fp32 too;
a GRPO reference samples its step's completions once more, unused). An arm that runs in a process of
its own (Unsloth's) keeps no gradient: its loss and gradient norm are judged, its cosine is not; with
Unsloth as the reference arm there is no fp32 step, and step 0 is judged strictly, as in fp32.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Iterator

import torch

from .ab_config import ABConfig
from .arm_run import open_arm
from .arms import ARM_SPECS
from .lockstep import run_in_fresh_process
from .step_gradient import gradient_cosine

REDUCED_PRECISION = ("bfloat16", "float16")
HOW = "the reference arm's step 0 once more, its weights cast up to fp32 (forward and backward; the update discarded)"


@contextlib.contextmanager
def gradient_directory(config: ABConfig) -> Iterator[str | None]:
    """Where the arms keep their step-0 gradients (None in fp32: none is kept, step 0 is judged without
    an fp32 step); removed afterwards."""
    if config.train.model.dtype not in REDUCED_PRECISION:
        yield None
        return
    directory = tempfile.mkdtemp(prefix="slipstream-ab-step0-")
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def fp32_step0(config_dict: dict, arm: str, plan: list, vocab_size: int, gradient_dir: str) -> dict:
    """In this (fresh) process: ``arm`` opened as the run opened it, its weights cast up to fp32, and its
    step 0 trained once: that step's loss, gradient norm and kept gradient."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on a GPU too
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(gradient_dir, exist_ok=True)
    quiet = {**config_dict, "profile_step": False, "keep_pages_warm": False}
    session = open_arm(quiet, arm, plan[:1], vocab_size, fp32=True, gradient_dir=gradient_dir)
    if isinstance(session, dict):  # (a peer that cannot run here: it did not run in the arms either)
        return {"skipped": session.get("skipped", f"{arm} ran in a process of its own")}
    started = time.perf_counter()
    session.step(0)
    seconds = time.perf_counter() - started
    result = session.finish()
    return {
        "loss": result["loss"][0],
        "grad_norm": result["grad_norm"][0],
        "dtype": result["dtype"],
        "step_s": seconds,
        "gradient": result["step0_gradient"],
    }


def distances(truth: dict, run: dict) -> dict:
    """An arm's step 0 (``run``: its first repeat) against the fp32 step: the loss's difference relative
    to fp32's (to 1 where fp32's is below 1: a GRPO loss starts near 0), the gradient norm's relative to
    fp32's, and the cosine of the two gradients (None, with ``cosine_not_measured``, where one is missing)."""
    loss = abs(run["loss"][0] - truth["loss"]) / max(abs(truth["loss"]), 1.0)
    grad_norm = abs(run["grad_norm"][0] - truth["grad_norm"]) / max(abs(truth["grad_norm"]), 1e-12)
    cosine, why = gradient_cosine(truth.get("gradient"), run.get("step0_gradient"))
    return {
        "loss": loss,
        "grad_norm": grad_norm,
        "cosine": cosine,
        **({"cosine_not_measured": why} if why else {}),
    }


def _kept(found: dict | None) -> dict | None:
    """A kept gradient as the record keeps it: how much was compared, not where it was."""
    if not found or "skipped" in found:
        return found
    return {"parameters": len(found["names"]), "values": sum(found["sizes"])}


def measure_fp32_step0(
    config: ABConfig, runs: dict[str, list[dict]], plan: list, vocab_size: int, gradient_dir: str
) -> dict:
    """The fp32 step of the run (see the module) and every arm's distance to it (``arms``); each run's
    kept gradient is read, then replaced in ``runs`` by its size (the files go with ``gradient_dir``)."""
    ran = [arm for arm, arm_runs in runs.items() if not any("skipped" in run for run in arm_runs)]
    if not ran:
        return {"skipped": "no arm ran"}
    reference = ran[0]
    about = {"arm": reference, "how": HOW}
    peer = ARM_SPECS[reference].peer
    if peer and peer.startswith("unsloth"):
        found = {
            "skipped": "the reference arm runs in Unsloth's own process, which this harness cannot cast to fp32"
        }
    else:
        try:
            found = run_in_fresh_process(
                fp32_step0,
                dataclasses.asdict(config),
                reference,
                plan,
                vocab_size,
                os.path.join(gradient_dir, "fp32"),
            )
        except Exception as error:  # noqa: BLE001 - the arms' figures stand; step 0 is judged strictly
            # (an fp32 model takes twice a bf16 one's memory: a device that held the arms may not hold it)
            found = {"skipped": f"the fp32 step failed: {type(error).__name__}: {error}".splitlines()[0]}
    if "skipped" not in found:
        found["arms"] = {arm: distances(found, runs[arm][0]) for arm in ran}
        found["gradient"] = _kept(found["gradient"])
    for arm_runs in runs.values():
        for run in arm_runs:
            if "step0_gradient" in run:
                run["step0_gradient"] = _kept(run["step0_gradient"])
    return {**about, **found}
