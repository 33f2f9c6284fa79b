"""The A/B harness: the same model, data, batch and seed under each arm; time, memory, loss.

Each arm runs in its own process (fresh allocator, no state leaking between arms), arms
interleave over repeats, warm-up steps are excluded from timing, and every arm trains on
the very same packed bins from the same initial weights. The loss curves must agree: if they
move, something other than scheduling changed. The arms themselves are in ``arms.py``.

Utilisation: every step's model FLOPs are counted from the arm's model and the step's documents
(``slipstream.utilisation.flops``), and the device's matmul peak is measured once (cached) in the
run's dtype at the arms' thread count; each arm's MFU is the reference arm's model FLOPs over its
own timed steps over that peak. Every arm trains the same documents, model and LoRA, so the same
model FLOPs apply to all of them, peers included: a padded arm's padding and a stock arm's LM head
on unlabelled rows are work the model does not need, and MFU does not count them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import math
import multiprocessing
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from ..data import pack_samples
from ..noise import hide_known_noise, known_noise_hidden_here
from ..offload import device_activation_bytes
from ..optimize import base_model
from ..train.step import train_step
from ..utilisation import docs_micro_batch, flop_profile, matmul_peak, profile_step
from .ab_config import ABConfig, resolve_device
from .arms import ARM_SPECS, build_arm_model, micro_batch_inputs
from .ceiling import proc_status_kib, search_all
from .counters import HostSyncCounter
from .fingerprint import fingerprint
from .inputs import ABInputError, ab_samples, ab_tokenizer, check_token_ids, inputs_record, vocab_size
from .stats import loss_parity, speedup


@dataclass
class ArmResult:
    arm: str
    step_s: list[float]
    forward_s: list[float]
    backward_s: list[float]
    tokens: list[int]
    loss: list[float]
    grad_norm: list[float]
    host_syncs_per_step: int | None  # None: not counted (a peer run outside our counter)
    host_syncs_by_op: dict[str, int]
    peak_memory_mb: float
    memory_kind: str
    attn_implementation: str
    policies: list[str] = field(default_factory=list)
    # kept on the device at the end of forward (hardware-independent); None: not measured
    activation_bytes: int | None = 0
    dtype: str = ""  # the parameters' dtype the arm trained (a peer on its defaults may pick its own)
    # model FLOPs of each step (forward + backward, utilisation.flops), from this arm's model; None: not counted
    model_flops: list[int] | None = None
    # the untimed forward that measures activation_bytes (a compiled arm compiles its forward there)
    probe_forward_s: float = 0.0
    # batches and attention calls its packed SDPA ran grouped / per document over all its steps
    # (packing.grouping.GroupingCounts.to_dict); None: no packed attention in this arm
    attention_grouping_counts: dict[str, int] | None = None
    # --profile-step: one more step under torch.profiler (utilisation.step_profile); None: not profiled
    step_profile: dict[str, Any] | None = None
    # the learning rate each step ran with (the run's schedule); None: the peer keeps its own
    lr: list[float] | None = None
    # weights moved by one ulp before step 0 (a sensitivity run, ``perturb``); 0: none
    perturbed_weights: int = 0


def prepare_bins(config: ABConfig) -> tuple[list[list[list[dict]]], int, dict]:
    """The packed bins of every step (``[step][micro_batch] -> docs``), the vocab size and a packing report."""
    tokenizer = ab_tokenizer(config)
    samples = ab_samples(config, tokenizer)
    vocab = vocab_size(config, tokenizer)
    source = config.data or "the demo rows"
    check_token_ids(samples, vocab, source)
    bins, report = pack_samples(
        samples, config.max_seq_len, seed=config.seed, overflow=config.overflow, strategy=config.batching
    )
    needed = config.steps * config.grad_accum
    if len(bins) < needed:
        raise ABInputError(
            f"{source} packs into {len(bins)} bins of {config.max_seq_len} tokens, fewer than steps x "
            f"grad_accum = {needed} (lower --steps, or --max-seq-len)"
        )
    bins = bins[:needed]
    plan = [bins[i * config.grad_accum : (i + 1) * config.grad_accum] for i in range(config.steps)]
    slim = [
        [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in mb] for mb in step] for step in plan
    ]
    return slim, vocab, dataclasses.asdict(report)


def peak_memory_mb(device: str) -> float:
    """CUDA: max allocated. CPU: this process's peak RSS (VmHWM where Linux has it: ru_maxrss
    carries a big parent's figure across fork + exec)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:
        return proc_status_kib("VmHWM") / 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def perturb_by_one_ulp(model: torch.nn.Module, seed: int) -> int:
    """Move every floating-point weight of ``model`` one ulp up or down (random signs from ``seed``),
    in place: the smallest change its dtype can make. Returns the number of values moved."""
    generator = torch.Generator().manual_seed(seed)
    moved = 0
    with torch.no_grad():
        for param in model.parameters():
            if not param.is_floating_point():
                continue
            up = torch.rand(param.shape, generator=generator) < 0.5
            toward = torch.where(up, float("inf"), float("-inf")).to(param.device, param.dtype)
            param.copy_(torch.nextafter(param, toward))
            moved += param.numel()
    return moved


def run_arm(config_dict: dict, arm: str, plan: list, vocab_size: int, perturb: bool = False) -> dict:
    """Train ``config.steps`` steps under ``arm`` in this process; returns an ArmResult as a dict,
    or ``{"arm", "skipped": reason}`` for a peer that cannot run here. ``perturb``: from its weights
    moved by one ulp (:func:`perturb_by_one_ulp`), the run's sensitivity (``stats.loss_parity``)."""
    config = ABConfig.from_dict(config_dict)
    device = resolve_device(config.device)
    spec = ARM_SPECS[arm]
    if spec.peer:
        from .peers import unavailable

        reason = unavailable(spec.peer, config, device)
        if reason:
            return {"arm": arm, "skipped": reason}
        if spec.peer.startswith("unsloth"):
            from .peers.unsloth_arm import run_unsloth_arm

            return run_unsloth_arm(config, arm, plan, vocab_size)
    model, state = build_arm_model(config, arm, vocab_size, device)
    moved = perturb_by_one_ulp(model, config.seed + 1) if perturb else 0
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    trl_step = None
    if spec.peer == "trl":
        from .peers.trl_step import TrlStep

        trl_step = TrlStep(model, config, ab_tokenizer(config), device)
        state.policies.extend(trl_step.policies)

    def inputs_of(docs):
        return trl_step.collate(docs) if trl_step else micro_batch_inputs(arm, docs, device)

    profile = flop_profile(model)
    model_flops = [profile.step_flops(docs_micro_batch(docs) for docs in micro_docs) for micro_docs in plan]
    first_inputs, _ = inputs_of(plan[0][0])
    probe_started = time.perf_counter()
    activation_bytes = device_activation_bytes(model, first_inputs, state.offload_manager if state else None)
    probe_forward_s = time.perf_counter() - probe_started
    if state is not None:
        state.grouping_counts.reset()  # the steps' batches only, not the probe's
    if trl_step:
        step_fn = trl_step  # TRL's trainer, with its own optimizer, scheduler and clipping
    else:
        from transformers import get_scheduler  # the schedule slipstream train steps (optimizer.schedule)

        optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0
        )
        scheduler = get_scheduler(
            config.schedule,
            optimizer,
            num_warmup_steps=config.lr_warmup_steps,
            num_training_steps=config.steps,
        )

        def step_fn(micro, model_context=contextlib.nullcontext):
            lr = optimizer.param_groups[0]["lr"]
            metrics = train_step(model, micro, optimizer, model_context=model_context)
            scheduler.step()
            return {**metrics, "lr": lr}

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    result = ArmResult(
        arm=arm,
        step_s=[],
        forward_s=[],
        backward_s=[],
        tokens=[],
        loss=[],
        grad_norm=[],
        host_syncs_per_step=0,
        host_syncs_by_op={},
        peak_memory_mb=0.0,
        memory_kind="cuda max allocated" if device == "cuda" else "cpu peak RSS",
        attn_implementation=base_model(model).config._attn_implementation,
        policies=state.policies if state else [],  # the model's own list: first-step decisions join it
        activation_bytes=activation_bytes,
        dtype=dtype,
        model_flops=model_flops,
        probe_forward_s=probe_forward_s,
        lr=[],
        perturbed_weights=moved,
    )
    for step, micro_docs in enumerate(plan):
        micro = [inputs_of(docs) for docs in micro_docs]
        tokens = sum(len(d["input_ids"]) for docs in micro_docs for d in docs)
        sync()
        start = time.perf_counter()
        if step == 0:  # a warm-up step: count the model's host syncs where the counter's cost is untimed
            syncs = HostSyncCounter()
            metrics = step_fn(micro, model_context=lambda counter=syncs: counter)
            result.host_syncs_by_op = dict(syncs.by_op)
            result.host_syncs_per_step = syncs.total
        else:
            metrics = step_fn(micro)
        sync()
        result.step_s.append(time.perf_counter() - start)
        result.forward_s.append(metrics["forward_s"])
        result.backward_s.append(metrics["backward_s"])
        result.tokens.append(tokens)
        result.loss.append(metrics["loss"])
        result.grad_norm.append(metrics["grad_norm"])
        result.lr.append(metrics["lr"])
    result.peak_memory_mb = peak_memory_mb(device)
    if state is not None and state.packed_attention is not None:
        result.attention_grouping_counts = state.grouping_counts.to_dict()
    if config.profile_step:  # after the figures above: its profiler overhead touches none of them
        last = plan[-1]
        micro = [inputs_of(docs) for docs in last]
        peak = matmul_peak(device, getattr(torch, config.dtype), config.threads)  # the record's, cached
        result.step_profile = profile_step(
            lambda: step_fn(micro),
            device,
            linear_flops=sum(profile.linear_flops(*docs_micro_batch(docs)) for docs in last),
            peak_flops_per_s=peak["flops_per_s"],
        )
    if trl_step:
        trl_step.close()
    return dataclasses.asdict(result)


def run_in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process (spawned: fresh allocator, no state shared between arms).

    It hides the known third-party noise (``slipstream.noise``) when this process does."""
    context = multiprocessing.get_context("spawn")
    initializer = hide_known_noise if known_noise_hidden_here() else None
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=initializer
    ) as pool:
        return pool.submit(fn, *args).result()


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def skipped_reason(runs: list[dict]) -> str | None:
    """Why an arm did not run (a peer that cannot run here), or None."""
    return next((run["skipped"] for run in runs if "skipped" in run), None)


def _looser(dtype: str, other: str) -> str:
    """The dtype whose loss tolerance applies to a pair of arms (a peer may pick bf16 on its defaults)."""
    return "bfloat16" if "bfloat16" in (dtype, other) else "float16" if "float16" in (dtype, other) else dtype


def reference_model_flops(arms: dict[str, list[dict]]) -> list[int] | None:
    """Each step's model FLOPs, as the first arm that counted them counted them (None: no arm did)."""
    for runs in arms.values():
        for run in runs:
            if run.get("model_flops"):
                return run["model_flops"]
    return None


def utilisation(config: ABConfig, runs: list[dict], flops: list[int] | None, peak: dict | None) -> dict:
    """``model_flops_per_step`` (the mean over timed steps), ``achieved_tflops`` (model FLOPs over the
    timed steps' time, all repeats) and ``mfu`` (that over the measured peak); {} without a count."""
    if not flops:
        return {}
    timed_flops = sum(sum(flops[config.warmup : len(run["step_s"])]) for run in runs)
    seconds = sum(sum(run["step_s"][config.warmup :]) for run in runs)
    steps = sum(len(run["step_s"][config.warmup :]) for run in runs)
    achieved = timed_flops / seconds if seconds > 0 else 0.0
    found = {"model_flops_per_step": timed_flops / max(steps, 1), "achieved_tflops": achieved / 1e12}
    if peak and peak.get("flops_per_s"):
        found["mfu"] = achieved / peak["flops_per_s"]
    return found


def summarize(
    config: ABConfig,
    arms: dict[str, list[dict]],
    peak: dict | None = None,
    sensitivity: list[float] | None = None,
) -> dict:
    """Per-arm medians and throughput; speedups (with 95% intervals) against each baseline arm
    (stock and peers); loss parity against the first arm that ran (``stats.loss_parity``: step 0
    strictly, then the curve, then, beyond the tolerance, against ``sensitivity``: that arm's loss
    curve from weights moved by one ulp); model FLOPs and MFU against ``peak``
    (``utilisation.matmul_peak``). Skipped arms keep their reason."""
    summary: dict[str, Any] = {}
    timed: dict[str, list[float]] = {}
    ran = {arm: runs for arm, runs in arms.items() if skipped_reason(runs) is None}
    flops = reference_model_flops(ran)
    for arm, runs in arms.items():
        if arm not in ran:
            summary[arm] = {"skipped": skipped_reason(runs)}
            continue
        step_s = [s for run in runs for s in run["step_s"][config.warmup :]]
        tokens = [t for run in runs for t in run["tokens"][config.warmup :]]
        timed[arm] = step_s
        first = runs[0]
        summary[arm] = {
            "median_step_s": statistics.median(step_s),
            "median_forward_s": _median(f for run in runs for f in run.get("forward_s", [])[config.warmup :]),
            "median_backward_s": _median(
                b for run in runs for b in run.get("backward_s", [])[config.warmup :]
            ),
            "tokens_per_s": sum(tokens) / sum(step_s),
            "peak_memory_mb": max(run["peak_memory_mb"] for run in runs),
            "memory_kind": first["memory_kind"],
            "activation_bytes": first.get("activation_bytes", 0),
            "host_syncs_per_step": first["host_syncs_per_step"],
            "attn_implementation": first["attn_implementation"],
            "dtype": first.get("dtype") or config.dtype,
            "final_loss": first["loss"][-1],
            "step_profile": first.get("step_profile"),  # --profile-step (first repeat); None: not profiled
            # what the warm-up steps and the activation probe's forward took beyond as many timed
            # steps (a compile's cold start shows here: its forward compiles in the probe)
            "warmup_extra_s": sum(first["step_s"][: config.warmup])
            + first.get("probe_forward_s", 0.0)
            - config.warmup * statistics.median(first["step_s"][config.warmup :]),
            **utilisation(config, runs, flops, peak),
        }
    if not ran:
        return summary
    reference = next(iter(ran))
    first = ran[reference][0]
    for arm in ran:
        dtype = _looser(summary[reference]["dtype"], summary[arm]["dtype"])
        run = ran[arm][0]
        parity = loss_parity(
            first["loss"], run["loss"], dtype, first.get("grad_norm"), run.get("grad_norm"), sensitivity
        )
        summary[arm]["loss_vs_" + reference] = parity.verdict
        summary[arm]["loss_max_rel_diff"] = parity.max_rel_diff
        summary[arm]["loss_parity"] = dataclasses.asdict(parity)
    baselines = [a for a in ran if ARM_SPECS[a].stock]
    for arm in ran:
        if ARM_SPECS[arm].stock:
            continue
        for base in baselines:
            summary[arm][f"speedup_vs_{base}"] = summary[arm]["tokens_per_s"] / summary[base]["tokens_per_s"]
            interval = speedup(timed[base], timed[arm], seed=config.seed)
            summary[arm][f"interval_vs_{base}"] = dataclasses.asdict(interval)
    _compile_break_even(summary, ran)
    return summary


def _compile_break_even(summary: dict, ran: dict[str, list[dict]]) -> None:
    """Beside ``slipstream-no-compile``, each arm that compiled its layers gets its measured cold
    start (``compile_cold_start_s``: its warm-up's extra time over the eager arm's) and how many
    steps after it pay that back (``compile_break_even_step``: cold start / time saved a step;
    None where its steps are no faster)."""
    eager = summary.get("slipstream-no-compile")
    if eager is None or "median_step_s" not in eager:
        return
    for arm, runs in ran.items():
        if not any(p.startswith("compile: decoder layers") for p in runs[0].get("policies", [])):
            continue
        cold = summary[arm]["warmup_extra_s"] - eager["warmup_extra_s"]
        saved = eager["median_step_s"] - summary[arm]["median_step_s"]
        summary[arm]["compile_cold_start_s"] = cold
        summary[arm]["compile_break_even_step"] = math.ceil(max(cold, 0.0) / saved) if saved > 0 else None


def needs_sensitivity(summary: dict) -> bool:
    """Whether an arm passed step 0 but went past the tolerance later (its verdict waits on the
    run's sensitivity)."""
    return any(s.get("loss_parity", {}).get("needs_sensitivity") for s in summary.values())


def measure_sensitivity(config: ABConfig, runs: dict[str, list[dict]], plan: list, vocab_size: int) -> dict:
    """The reference arm (the first that ran) again, in a fresh process, from its weights moved by
    one ulp: how far this run's loss curve moves from a difference no arm made."""
    reference = next(arm for arm, arm_runs in runs.items() if skipped_reason(arm_runs) is None)
    about = {"arm": reference, "perturbation": "every weight moved by one ulp, random signs"}
    if ARM_SPECS[reference].peer and ARM_SPECS[reference].peer.startswith("unsloth"):
        return {
            **about,
            "skipped": "the reference arm runs in Unsloth's own process, which cannot be perturbed",
        }
    run = run_in_fresh_process(run_arm, dataclasses.asdict(config), reference, plan, vocab_size, True)
    return {
        **about,
        "loss": run["loss"],
        "grad_norm": run["grad_norm"],
        "weights_moved": run["perturbed_weights"],
    }


def parity_failures(record: dict) -> list[str]:
    """Arms whose loss curve diverged from the reference arm's."""
    return [
        arm
        for arm, s in record["summary"].items()
        if any(v == "diverged" for k, v in s.items() if k.startswith("loss_vs_"))
    ]


def run_ab(config: ABConfig, progress: bool = True) -> dict:
    """Run every arm ``config.repeats`` times (interleaved) and return the full record."""
    plan, vocab_size, packing = prepare_bins(config)
    # the peak the arms could reach: their device, dtype and threads (measured once per machine, cached)
    peak = matmul_peak(resolve_device(config.device), getattr(torch, config.dtype), config.threads)
    runs: dict[str, list[dict]] = {arm: [] for arm in config.arms}
    jobs = [(repeat, arm) for repeat in range(config.repeats) for arm in config.arms]
    for _, arm in tqdm(jobs, desc="A/B arms", disable=not progress, unit="arm"):
        runs[arm].append(run_in_fresh_process(run_arm, dataclasses.asdict(config), arm, plan, vocab_size))
    summary = summarize(config, runs, peak)
    sensitivity = None
    if needs_sensitivity(summary):
        sensitivity = measure_sensitivity(config, runs, plan, vocab_size)
        if sensitivity.get("loss"):
            summary = summarize(config, runs, peak, sensitivity["loss"])
    record = {
        "kind": "slipstream-ab",
        "config": dataclasses.asdict(config),
        "inputs": inputs_record(config),  # the model and data, named and fingerprinted
        "vocab_size": vocab_size,
        # The arms' own thread count (--threads), not this parent process's.
        "fingerprint": {**fingerprint(), **({"torch_threads": config.threads} if config.threads else {})},
        "packing": packing,
        "summary": summary,
        **({"sensitivity": sensitivity} if sensitivity else {}),
        "matmul_peak": peak,
        "runs": runs,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if config.max_tokens_within:
        record["ceiling"] = search_all(config, vocab_size, run_in_fresh_process, progress)
        for arm, found in record["ceiling"].items():
            record["summary"][arm]["max_tokens_within"] = found["max_tokens"]
    return record
