"""The A/B harness: the same model, data, batch and seed under each arm; time, memory, loss.

Each arm runs in its own process (fresh allocator, no state leaking between arms; ``arm_run.py``),
the arms in lockstep where they fit side by side, a step of each in turn (``lockstep.py``), repeats
starting from another arm each time; warm-up steps are excluded from timing, and every arm trains
on the very same packed bins from the same initial weights. The loss curves must agree: if they
move, something other than scheduling changed. The arms themselves are in ``arms.py``.

Utilisation: every step's model FLOPs are counted from the arm's model and the step's documents
(``slipstream.utilisation.flops``), and the device's matmul peak is measured once (cached) in the
run's dtype at the arms' thread count; each arm's MFU is the reference arm's model FLOPs over its
own timed steps over that peak. Every arm trains the same documents, model and LoRA, so the same
model FLOPs apply to all of them, peers included: a padded arm's padding and a stock arm's LM head
on unlabelled rows are work the model does not need, and MFU does not count them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from typing import Any

import torch
from tqdm import tqdm

from ..data.prefix_groups import combined, share_rows
from ..data.prefix_tree import combined_tree_reports, share_rows_as_trees
from ..data.token_ids import check_ids_in_vocab
from ..hardware import crowded
from ..objectives import objective_for
from ..utilisation import matmul_peak
from . import ablation
from .ab_config import ABConfig, record_config, resolve_device
from .arm_result import perturb_by_one_ulp
from .arm_run import run_arm
from .arms import ARM_SPECS, arm_overrides, shares_prefixes
from .ceiling import search_all
from .fingerprint import fingerprint
from .inputs import ABInputError, ab_tokenizer, inputs_record, vocab_size
from .lockstep import run_in_fresh_process, run_lockstep
from .truth import gradient_directory, measure_fp32_step0

# what the tests and the benchmark scripts import from here
__all__ = [
    "ABConfig",
    "perturb_by_one_ulp",
    "prepare_bins",
    "run_ab",
    "run_arm",
    "run_in_fresh_process",
    "summarize",
]
from .stats import against_fp32, loss_parity, margin_parity, speedup


def recorded_steps(config: ABConfig, tokenizer):
    """The run's first ``ab.steps`` steps as ``slipstream train`` plans them (``train.record``: the
    objective's own rows, held-out split, bins and step order); ABInputError naming what is wrong (a
    step count the run does not reach names the config file)."""
    from ..errors import TrainError
    from ..fields import ConfigError
    from ..train.record import record_steps

    try:
        return record_steps(config.train, config.ab.steps, tokenizer)
    except ConfigError as error:
        raise ABInputError(f"{config.ab.train_config or 'the run'}: {error}") from None
    except (TrainError, ValueError) as error:  # DataError included: each names its file and line
        raise ABInputError(str(error)) from None


def prepare_pair_bins(config: ABConfig) -> tuple[list[list[list[dict]]], int, dict]:
    """A preference objective (``--objective dpo``, orpo): the pairs of every step (``[step][micro_batch]
    -> pairs``) as the run's objective packs them (best-fit by their shared length, prompt once), the same
    pairs for every arm whatever its layout."""
    tokenizer = ab_tokenizer(config)
    record = recorded_steps(config, tokenizer)
    plan, data = record.steps, config.train.data
    vocab = vocab_size(config, tokenizer)
    needed = sum(len(step) for step in plan)
    used = [p for step in plan for mb in step for p in mb]
    docs = [{"input_ids": p["prompt_ids"] + p["chosen_ids"] + p["rejected_ids"]} for p in used]
    check_ids_in_vocab(docs, vocab, data.path, error=ABInputError)
    shared_tokens = sum(len(p["prompt_ids"]) + len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in used)
    return (
        plan,
        vocab,
        {
            "efficiency": shared_tokens / (needed * data.max_seq_len),  # the bins' fill, prompt once
            **record.data.report.to_dict(),
            "pairs_trained": len(used),
            # what one trained entry is: "pairs" (chosen / rejected), "rows" (KTO: a completion, its KL one)
            "unit": objective_for(config.train.training.objective).reads,
            "bins": needed,
            "run_steps": record.run_steps,
            "mean_pairs_per_bin": len(used) / needed,
            "mean_prompt_tokens_trained": sum(len(p["prompt_ids"]) for p in used) / len(used),
            "mean_answer_tokens_trained": sum(len(p["chosen_ids"]) + len(p["rejected_ids"]) for p in used)
            / (2 * len(used)),
        },
    )


def prepare_bins(config: ABConfig) -> tuple[list[list[list[dict]]], int, dict]:
    """The packed bins of every step (``[step][micro_batch] -> docs``), the vocab size and a packing report:
    the run's own first steps (``recorded_steps``), which every arm replays."""
    data, seed = config.train.data, config.train.seed
    specs = [ARM_SPECS[arm] for arm in config.ab.arms]  # all of the run's objective (ABConfig)
    if any(spec.pairs for spec in specs):
        return prepare_pair_bins(config)
    if any(spec.engine for spec in specs):  # online RL: rollouts sampled once (grpo_arms)
        from .grpo_arms import prepare_rollouts

        return prepare_rollouts(config)
    tokenizer = ab_tokenizer(config)
    recorded = recorded_steps(config, tokenizer)
    vocab = vocab_size(config, tokenizer)
    slim = [  # every arm's rows, step by step, whole
        [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in mb] for mb in step]
        for step in recorded.steps
    ]
    rows = [row for step in slim for docs in step for row in docs]
    # the tokenizer belongs to the model
    check_ids_in_vocab(rows, vocab, data.path or "the demo rows", error=ABInputError)
    record = {**dataclasses.asdict(recorded.data.packing), "run_steps": recorded.run_steps}
    if data.share_prefixes == "off":
        record["sharing_policy"] = "shared prefixes off (--share-prefixes off): every row runs whole"
    else:  # what sharing each step's rows saves; whether an arm shares is its own policy line

        def per_step(share) -> list:  # each step's report of ``share`` (groups or trees) over its rows
            rows = ([row for docs in step for row in docs] for step in slim)
            return [share(step, data.max_seq_len, seed=seed + number)[1] for number, step in enumerate(rows)]

        record["sharing"] = combined(per_step(share_rows)).as_dict()
        record["sharing"]["tree"] = combined_tree_reports(per_step(share_rows_as_trees)).as_dict()
        record["sharing_policy"] = (
            f"--share-prefixes {data.share_prefixes}: each step's rows regrouped by the arms that share "
            "(the same rows a step as every other arm)"
        )
    return slim, vocab, record


def _median(values: list) -> float:
    return statistics.median(values) if values else 0.0


def _timed(runs: list[dict], key: str, warmup: int) -> list:
    """The per-step ``key`` of every repeat after its warm-up steps, one repeat after another ([] where
    the runs do not keep it)."""
    return [value for run in runs for value in run.get(key, [])[warmup:]]


def skipped_reason(runs: list[dict]) -> str | None:
    """Why an arm did not run (a peer that cannot run here), or None."""
    return next((run["skipped"] for run in runs if "skipped" in run), None)


def _looser(dtype: str, other: str) -> str:
    """The dtype whose loss tolerance applies to a pair of arms (a peer may pick bf16 on its defaults)."""
    return "bfloat16" if "bfloat16" in (dtype, other) else "float16" if "float16" in (dtype, other) else dtype


def utilisation(config: ABConfig, runs: list[dict], flops: list[int] | None, peak: dict | None) -> dict:
    """``model_flops_per_step`` (the mean over timed steps), ``achieved_tflops`` (model FLOPs over the
    timed steps' time, all repeats) and ``mfu`` (that over the measured peak); {} without a count."""
    if not flops:
        return {}
    warmup = config.ab.warmup
    timed_flops = sum(sum(flops[warmup : len(run["step_s"])]) for run in runs)
    seconds = sum(sum(run["step_s"][warmup:]) for run in runs)
    steps = sum(len(run["step_s"][warmup:]) for run in runs)
    achieved = timed_flops / seconds if seconds > 0 else 0.0
    found = {"model_flops_per_step": timed_flops / max(steps, 1), "achieved_tflops": achieved / 1e12}
    if peak and peak.get("flops_per_s"):
        found["mfu"] = achieved / peak["flops_per_s"]
    return found


def machine_state(config: ABConfig, runs: list[dict]) -> dict[str, Any]:
    """What the machine did around an arm's timed steps: its page faults a step (median), the memory it
    held warm between steps (``bench/host_pages.py``; the largest), and how many of its steps ran while
    other work took cores beyond those the arm left free (``hardware.OtherLoad``: then that step's time
    is not this machine's alone)."""
    faults = _timed(runs, "page_faults", config.ab.warmup)
    others = [c for c in _timed(runs, "other_cores", config.ab.warmup) if c is not None]
    threads = config.ab.threads or torch.get_num_threads()
    return {
        "median_page_faults": _median(faults) if faults else None,
        "held_bytes": max((b for run in runs for b in run.get("held_bytes", [])), default=0),
        "max_other_cores": max(others) if others else None,
        "busy_steps": sum(crowded(c, threads) for c in others),
    }


def summarize(
    config: ABConfig,
    arms: dict[str, list[dict]],
    peak: dict | None = None,
    sensitivity: list[float] | None = None,
    margin_sensitivity: list[float] | None = None,
    fp32_step: dict | None = None,
) -> dict:
    """Per-arm medians and throughput; speedups (with 95% intervals) against each baseline arm
    (stock and peers); loss parity against the first arm that ran (``stats.loss_parity``: step 0
    strictly, or, in a reduced-precision run with ``fp32_step`` (``truth.measure_fp32_step0``), by each
    arm's distance to the fp32 step next to that arm's (``step0_vs_fp32``); then the curve, then,
    beyond the tolerance, against ``sensitivity``: that arm's loss curve from weights moved by one
    ulp); model FLOPs and MFU against ``peak`` (``utilisation.matmul_peak``). Skipped arms keep their
    reason."""
    summary: dict[str, Any] = {}
    warmup, seed, beta = config.ab.warmup, config.train.seed, config.train.preference.beta
    timed: dict[str, list[float]] = {}
    timed_parts: dict[str, dict[str, list[float]]] = {}  # grpo: per arm, its generation and update times
    ran = {arm: runs for arm, runs in arms.items() if skipped_reason(runs) is None}
    # each step's model FLOPs, as the first arm that counted them counted them (None: no arm did)
    flops = next((r["model_flops"] for runs in ran.values() for r in runs if r.get("model_flops")), None)
    for arm, runs in arms.items():
        if arm not in ran:
            summary[arm] = {"skipped": skipped_reason(runs)}
            continue
        step_s, tokens = _timed(runs, "step_s", warmup), _timed(runs, "tokens", warmup)
        timed[arm] = step_s
        first = runs[0]
        summary[arm] = {
            "median_step_s": statistics.median(step_s),
            "median_forward_s": _median(_timed(runs, "forward_s", warmup)),
            "median_backward_s": _median(_timed(runs, "backward_s", warmup)),
            "tokens_per_s": sum(tokens) / sum(step_s),
            "peak_memory_mb": max(run["peak_memory_mb"] for run in runs),
            "memory_kind": first["memory_kind"],
            "activation_bytes": first.get("activation_bytes", 0),
            "host_syncs_per_step": first["host_syncs_per_step"],
            "attn_implementation": first["attn_implementation"],
            "dtype": first.get("dtype") or config.train.model.dtype,
            "final_loss": first["loss"][-1],
            "step_profile": first.get("step_profile"),  # --profile-step (first repeat); None: not profiled
            # what the warm-up steps and the activation probe's forward took beyond as many timed
            # steps (a compile's cold start shows here: its forward compiles in the probe)
            "warmup_extra_s": sum(first["step_s"][:warmup])
            + first.get("probe_forward_s", 0.0)
            - warmup * statistics.median(first["step_s"][warmup:]),
            **utilisation(config, runs, flops, peak),
            **machine_state(config, runs),
        }
        if first.get("generation_s") is not None:  # --objective grpo: sampling and the update apart
            summary[arm].update(_rollout_figures(config, runs))
            timed_parts[arm] = {half: _timed(runs, f"{half}_s", warmup) for half in ("generation", "update")}
        if first.get("pairs"):
            summary[arm]["pairs_per_s"] = sum(_timed(runs, "pairs", warmup)) / sum(step_s)
            summary[arm]["final_reward_margin"] = first["reward_margin"][-1]
            summary[arm]["reference_pass_s"] = first.get("reference_pass_s", 0.0)
    if not ran:
        return summary
    reference = next(iter(ran))
    first = ran[reference][0]
    measured = (fp32_step or {}).get("arms", {})  # none in an fp32 run, a skipped fp32 step
    for arm in ran:
        dtype = _looser(summary[reference]["dtype"], summary[arm]["dtype"])
        run = ran[arm][0]
        first_step = None  # arm's distance to the fp32 step next to the reference's, where both were measured
        if arm in measured and reference in measured:
            first_step = against_fp32(measured[arm], measured[reference], dtype)
            why = measured[arm].get("cosine_not_measured")
            summary[arm]["step0_vs_fp32"] = {
                **dataclasses.asdict(first_step),
                **({"cosine_not_measured": why} if why else {}),
            }
        parity = loss_parity(
            first["loss"],
            run["loss"],
            dtype,
            first.get("grad_norm"),
            run.get("grad_norm"),
            sensitivity,
            first_step=first_step,
        )
        summary[arm]["loss_vs_" + reference] = parity.verdict
        summary[arm]["loss_max_rel_diff"] = parity.max_rel_diff
        summary[arm]["loss_parity"] = dataclasses.asdict(parity)
        if first.get("reward_margin") and run.get("reward_margin"):
            summary[arm]["reward_margin_parity"] = dataclasses.asdict(
                margin_parity(first["reward_margin"], run["reward_margin"], dtype, beta, margin_sensitivity)
            )
    baselines = [a for a in ran if ARM_SPECS[a].stock]
    for arm in ran:
        mine = ARM_SPECS[arm]
        if mine.stock:
            continue
        # the slipstream arms that train its objective (in the run's order)
        kin = [a for a in ran if not ARM_SPECS[a].stock and ARM_SPECS[a].objective == mine.objective]
        # the prompt shared against the same packing without it: that optimization's own share
        unshared = [a for a in ran if mine.pairs == "shared" and ARM_SPECS[a].pairs == "unshared"]
        # rows' shared start run once against the same rows packed whole: that optimization's own share
        unshared += [a for a in ran if shares_prefixes(arm) and ARM_SPECS[a].prefixes == "unshared"]
        # prefix trees against one shared start a group (or, for GRPO, one prompt a group): the trees' own share
        unshared += [a for a in kin if mine.prefixes == "tree" and ARM_SPECS[a].prefixes in ("groups", "off")]
        # another rollout engine against slipstream's own sampler, the update otherwise the same
        unshared += [
            a
            for a in kin
            if mine.engine == "vllm"
            and ARM_SPECS[a].engine == "hf"
            and ARM_SPECS[a].prefixes == mine.prefixes
        ]
        for base in baselines + unshared:
            summary[arm][f"speedup_vs_{base}"] = summary[arm]["tokens_per_s"] / summary[base]["tokens_per_s"]
            interval = speedup(timed[base], timed[arm], seed=seed, repeats=config.ab.repeats)
            summary[arm][f"interval_vs_{base}"] = dataclasses.asdict(interval)
            if arm in timed_parts and base in timed_parts:  # grpo: each half against the base's
                for half, mine in timed_parts[arm].items():
                    rate = f"{half}_completions_per_s"
                    summary[arm][f"{half}_speedup_vs_{base}"] = summary[arm][rate] / summary[base][rate]
                    interval = speedup(timed_parts[base][half], mine, seed=seed, repeats=config.ab.repeats)
                    summary[arm][f"{half}_interval_vs_{base}"] = dataclasses.asdict(interval)
                # sampled tokens per second: engines whose completions differ in length compared fairly
                tokens = "generated_tokens_per_s"
                summary[arm][f"generation_tokens_speedup_vs_{base}"] = (
                    summary[arm][tokens] / summary[base][tokens]
                )
    _compile_break_even(summary, ran)
    ablation.ablation_verdicts(summary, timed, seed)
    return summary


def _rollout_figures(config: ABConfig, runs: list[dict]) -> dict[str, float]:
    """A GRPO arm's figures after warm-up: completions per second of the whole step, of its sampling
    alone and of its update alone (every arm samples and trains the same number of completions a step),
    its generated tokens per second and the mean length of what it sampled."""
    timed = functools.partial(_timed, runs, warmup=config.ab.warmup)
    completions, generated = sum(timed("completions")), sum(timed("generated_tokens"))
    generation, scoring, update = sum(timed("generation_s")), sum(timed("scoring_s")), sum(timed("update_s"))
    calls = [c for c in timed("tool_calls") if c is not None] if runs[0].get("tool_calls") else []
    ran = [t for t in timed("update_tokens") if t is not None] if runs[0].get("update_tokens") else []
    return {
        **({"tool_calls_per_trajectory": statistics.fmean(calls)} if calls else {}),
        **({"update_tokens_per_step": statistics.fmean(ran)} if ran else {}),
        "completions_per_s": completions / (generation + scoring + update),
        "generation_completions_per_s": completions / generation,
        "update_completions_per_s": completions / update,
        "generated_tokens_per_s": generated / generation,
        "sampled_mean_tokens": generated / completions,
        "median_generation_s": statistics.median(timed("generation_s")),
        "median_scoring_s": statistics.median(timed("scoring_s")),
        "median_update_s": statistics.median(timed("update_s")),
        "generation_share": generation / (generation + scoring + update),
    }


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
        **({"reward_margin": run["reward_margin"]} if run.get("reward_margin") else {}),
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
    """Run every arm ``config.ab.repeats`` times (interleaved) and return the full record."""
    plan, vocab_size, packing = prepare_bins(config)
    if config.train.training.steps is None and packing.get(
        "run_steps"
    ):  # a run of epochs: its steps now known
        training = dataclasses.replace(config.train.training, steps=packing["run_steps"], epochs=None)
        config = dataclasses.replace(config, train=dataclasses.replace(config.train, training=training))
    # the peak the arms could reach: their device, dtype and threads (measured once per machine, cached)
    ab = config.ab
    peak = matmul_peak(resolve_device(ab.device), getattr(torch, config.train.model.dtype), ab.threads)
    runs: dict[str, list[dict]] = {arm: [] for arm in ab.arms}
    schedules = []
    fp32_step = None
    # bf16 / fp16: every arm keeps its first repeat's step-0 gradient, for the fp32 step (bench/truth.py)
    with gradient_directory(config) as gradient_dir:
        for repeat in tqdm(range(ab.repeats), desc="A/B repeats", disable=not progress, unit="repeat"):
            # each repeat starts the arms in another order, so none always goes first
            order = ab.arms[repeat % len(ab.arms) :] + ab.arms[: repeat % len(ab.arms)]
            results, schedule = run_lockstep(
                dataclasses.asdict(config),
                list(order),
                plan,
                vocab_size,
                ab.interleave,
                progress=tqdm.write if progress else None,
                gradient_dir=gradient_dir if repeat == 0 else None,
            )
            schedules.append(schedule)
            for arm in ab.arms:
                runs[arm].append(results[arm])
        if gradient_dir is not None:
            fp32_step = measure_fp32_step0(config, runs, plan, vocab_size, gradient_dir)
    summary = summarize(config, runs, peak, fp32_step=fp32_step)
    sensitivity = None
    margins_differ = any(
        s.get("reward_margin_parity", {}).get("verdict") == "differs" for s in summary.values()
    )
    if needs_sensitivity(summary) or margins_differ:
        sensitivity = measure_sensitivity(config, runs, plan, vocab_size)
        if sensitivity.get("loss"):
            summary = summarize(
                config, runs, peak, sensitivity["loss"], sensitivity.get("reward_margin"), fp32_step
            )
    record = {
        "kind": "slipstream-ab",
        "config": record_config(config),  # the A/B's keys, the workload by option name, the train config
        "inputs": inputs_record(config),  # the model and data, named and fingerprinted
        "vocab_size": vocab_size,
        # The arms' own thread count (--threads), not this parent process's.
        "fingerprint": {**fingerprint(), **({"torch_threads": ab.threads} if ab.threads else {})},
        "packing": packing,
        # what each arm changes of the run's train config, as --set writes it (the rest is the file's)
        "arm_overrides": {arm: arm_overrides(config, arm) for arm in ab.arms},
        "interleaving": schedules,  # per repeat: lockstep ("steps") or one arm after another ("arms"), and why
        "summary": summary,
        **({"sensitivity": sensitivity} if sensitivity else {}),
        **({"fp32_step0": fp32_step} if fp32_step else {}),
        "matmul_peak": peak,
        "runs": runs,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if config.ab.max_tokens_within:
        record["ceiling"] = search_all(config, vocab_size, run_in_fresh_process, progress)
        for arm, found in record["ceiling"].items():
            record["summary"][arm]["max_tokens_within"] = found["max_tokens"]
    ablation.remember(record, torch.device(resolve_device(config.ab.device)))  # for slipstream doctor
    return record
