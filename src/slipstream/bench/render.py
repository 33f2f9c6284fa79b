"""An A/B record as people read it: the Markdown report, the terminal tables, the files on disk."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..atomic import write_text_atomically
from ..packing.grouping import describe_counts
from ..utilisation.step_profile import CATEGORIES
from .arms import ARM_SPECS
from .fingerprint import describe
from .inputs import short_name
from .stats import format_speedup, interval_words

CATEGORY_COLUMNS = " | ".join(name.replace("_", " ") for name in CATEGORIES)  # a profiled step's headers


def _speedup_cells(s: dict) -> list[str]:
    """'1.44x [1.39, 1.50] faster vs stock-packed' for every stock arm an arm was compared with."""
    cells = []
    for key, value in s.items():
        if key.startswith("speedup_vs_"):
            base = key.removeprefix("speedup_vs_")
            cells.append(f"{format_speedup(value, s.get(f'interval_vs_{base}'))} vs {base}")
    return cells


def _parity(s: dict) -> str:
    return s[next(k for k in s if k.startswith("loss_vs_"))]


def _count(value) -> str:
    """A counter's cell: '-' where it was not measured (a peer run outside our counters)."""
    return "-" if value is None else f"{value:,}"


def _ran(run: dict) -> list[str]:
    """An arm's policies, then what its packed attention's grouping did over its steps."""
    ran = list(run.get("policies") or ["-"])
    counts = run.get("attention_grouping_counts")
    if counts and counts["batches_grouped"] + counts["batches_per_document"]:
        ran.append(f"attention grouping ran: {describe_counts(counts)}")
    return ran


def mfu_cell(s: dict) -> str:
    """'12.3% (0.45 TFLOP/s)': an arm's MFU and achieved model FLOP/s; '-' in a record without them."""
    if "achieved_tflops" not in s:
        return "-"
    mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "-"
    return f"{mfu} ({s['achieved_tflops']:.3g} TFLOP/s)"


def utilisation_line(record: dict) -> str | None:
    """How MFU was computed: the model FLOPs per step and the measured peak (None in older records)."""
    flops = next(
        (s["model_flops_per_step"] for s in record["summary"].values() if "model_flops_per_step" in s), None
    )
    if flops is None:
        return None
    peak = record.get("matmul_peak") or {}
    measured = (
        f"matmul peak {peak['tflops']:.3g} TFLOP/s ({peak['dtype']}, {peak['threads']} threads; {peak['how']})"
        if peak
        else "no matmul peak measured"
    )
    return (
        f"Utilisation: {flops / 1e9:.4g} GFLOP of model FLOPs per step (forward + backward matmuls of the real "
        "tokens: linears, LoRA, routed experts, causal per-document attention, the LM head on labelled rows; "
        f"the same for every arm, padding and recompute not counted); MFU = those FLOPs / step time / {measured}"
    )


def ran_arms(record: dict) -> list[str]:
    """The arms that trained (a skipped peer has only its reason)."""
    return [arm for arm, s in record["summary"].items() if "skipped" not in s]


def lora_words(config: dict) -> str:
    """'LoRA rank 8 (alpha 16, on q_proj,v_proj)' or 'LoRA rank - (full fine-tune)'."""
    rank = config.get("lora_rank", 0)
    if not rank:
        return "LoRA rank - (full fine-tune)"
    alpha = config.get("lora_alpha") or 2 * rank
    targets = ",".join(config.get("lora_targets") or ("q_proj", "k_proj", "v_proj", "o_proj"))
    saved = config.get("lora_modules_to_save") or ()
    return (
        f"LoRA rank {rank} (alpha {alpha:g}, on {targets}"
        + (f"; in full: {','.join(saved)}" if saved else "")
        + ")"
    )


def lr_words(config: dict) -> str:
    """'lr 0.0002, cosine schedule' (an older record: a constant learning rate)."""
    schedule = config.get("schedule") or "constant"
    warmup = config.get("lr_warmup_steps") or 0
    return f"lr {config.get('lr'):g}, {schedule} schedule" + (f" ({warmup} warm-up steps)" if warmup else "")


def defaults_line(config: dict) -> str | None:
    """Which fields the workload took from its defaults, and whose defaults they were."""
    found = config.get("defaults") or {}
    if not found.get("fields"):
        return None
    fields = ", ".join(f"{name} {value}" for name, value in found["fields"].items())
    return f"Defaults applied ({found['source']}): {fields}"


def inputs_title(record: dict) -> str:
    """'SmolLM2-135M@1a2b3c4d on chats.jsonl@5e6f7a8b' (a preset on the demo rows: just its name)."""
    inputs = record.get("inputs")
    if not inputs:
        return record["config"]["model"]
    model, data = short_name(inputs["model"]), inputs["data"]
    return model if data["kind"] == "demo" else f"{model} on {short_name(data)}"


def inputs_lines(record: dict) -> list[str]:
    """The model directory and data file the arms trained, with their fingerprints."""
    lines = []
    for key, found in record.get("inputs", {}).items():
        if found["kind"] in ("model directory", "data file"):
            lines.append(f"{key.capitalize()}: {found['path']} (sha256 {found['sha256'][:16]}…)")
    config = record["config"]
    if config.get("data") or config.get("response_only"):
        lines.append(
            f"Data: response_only {config.get('response_only', False)}, overflow {config.get('overflow', 'truncate')}"
        )
    if config.get("train_config"):
        lines.append(f"Read from: {config['train_config']}")
    if sharing := record.get("packing", {}).get("sharing"):
        decisions = [
            f"{arm}: {line}"
            for arm, runs in record.get("runs", {}).items()
            for line in ((runs[0].get("policies") or []) if runs else [])
            if line.startswith("shared prefixes")
        ]
        lines.append(
            f"Rows sharing a start: {sharing['saved_fraction']:.1%} of the tokens shared within each step "
            f"({sharing['shared_tokens']} run instead of {sharing['unshared_tokens']}); every arm trains the "
            "same rows a step, and tokens/s counts every row whole (its start included), so tokens/s ratios "
            "are rows/s ratios" + (". " + "; ".join(decisions) if decisions else "")
        )
    return lines


def step_profile_lines(summary: dict) -> list[str]:
    """``--profile-step``'s table: each arm's profiled step by category, and its GEMM rate."""
    profiled = {arm: s["step_profile"] for arm, s in summary.items() if s.get("step_profile")}
    if not profiled:
        return []
    timer = next(iter(profiled.values()))["timer"]
    lines = [
        "",
        f"Where a step goes (`--profile-step`: one more step per arm under torch.profiler, {timer}; "
        "an op inside attention or a compiled graph counts there; GEMM rate = the linear layers' model "
        "FLOPs / the matmuls' time):",
        "",
        f"| arm | {CATEGORY_COLUMNS} | profiled (s) | GEMM rate |",
        "|---|" + "---:|" * (len(CATEGORIES) + 2),
    ]
    for arm, found in profiled.items():
        shares, rate = step_profile_cells(found)
        lines.append(f"| {arm} | {shares} | {found['total_s']:.3f} | {rate} |")
    return lines


def step_profile_cells(found: dict) -> tuple[str, str]:
    """A profiled step's category shares (table cells joined by " | ") and its GEMM rate cell."""
    shares = " | ".join(f"{found['shares'][name]:.0%}" for name in CATEGORIES)
    rate = "-"
    if found.get("gemm_tflops") is not None:
        rate = f"{found['gemm_tflops']:.3g} TFLOP/s"
        if found.get("gemm_fraction_of_peak") is not None:
            rate += f" ({found['gemm_fraction_of_peak']:.0%} of peak)"
    return shares, rate


def markdown_report(record: dict) -> str:
    config, summary = record["config"], record["summary"]
    lines = [
        f"# slipstream A/B: {inputs_title(record)} @ max_seq_len {config['max_seq_len']}",
        "",
        f"Machine: {describe(record['fingerprint'])}",
        *inputs_lines(record),
        f"Workload: {config['steps']} steps ({config['warmup']} warm-up, untimed), grad_accum {config['grad_accum']}, "
        f"{config['dtype']}, seed {config['seed']}, repeats {config['repeats']}; batching {config['batching']}, "
        f"{packing_words(record)}; checkpointing {config.get('checkpointing', 'off')}; "
        f"vocabulary {record.get('vocab_size', '?')}; {lora_words(config)}; {lr_words(config)}",
        *([line] if (line := defaults_line(config)) else []),
        *([line] if (line := utilisation_line(record)) else []),
        "",
        "| arm | attention | dtype | median step (s) | forward / backward (s) | tokens/s | MFU (model FLOP/s) "
        "| peak memory (MB) | activation bytes | host syncs/step | speedup (tokens/s, 95% interval) | loss parity |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for arm, s in summary.items():
        if "skipped" in s:
            lines.append(f"| {arm} | skipped: {s['skipped']} |" + " - |" * 10)
            continue
        lines.append(
            f"| {arm} | {s['attn_implementation']} | {s.get('dtype', config['dtype'])} | {s['median_step_s']:.4f} | "
            f"{s.get('median_forward_s', 0):.4f} / {s.get('median_backward_s', 0):.4f} | {s['tokens_per_s']:.0f} | "
            f"{mfu_cell(s)} | {s['peak_memory_mb']:.0f} | {_count(s.get('activation_bytes', 0))} | {_count(s['host_syncs_per_step'])} | "
            f"{'<br>'.join(_speedup_cells(s)) or '-'} | {_parity(s)} ({s['loss_max_rel_diff']:.1e}) |"
        )
    sections = (loss_verdict_lines, fp32_step_lines, preference_lines, rollout_lines, ablation_lines)
    for section in (*sections, ceiling_lines, machine_state_lines):
        lines += section(record)
    lines += step_profile_lines(summary)
    arms = ran_arms(record)
    lines += ["", "What each arm ran (its policies and settings, first repeat):", ""]
    lines += [f"- **{arm}**: " + "; ".join(_ran(record["runs"][arm][0])) for arm in arms]
    lines += overrides_lines(record)
    lines += [
        "",
        "![loss](loss.png) ![step time](step_time.png) ![memory](memory.png)"
        + (" ![MFU](mfu.png)" if any(s.get("mfu") is not None for s in summary.values()) else ""),
        "",
        "Per-step loss (first repeat):",
        "",
        *_per_step_table(record, arms, "loss", config["steps"]),
    ]
    return "\n".join(lines) + "\n"


def overrides_lines(record: dict) -> list[str]:
    """What each arm changes of the run's train config, key by key (an older record has none)."""
    found = record.get("arm_overrides")
    if not found:
        return []
    lines = [
        "",
        "What each arm changes of the run's config (as `--set` writes it; every other key is the file's):",
        "",
    ]
    for arm, overrides in found.items():
        said = ", ".join(f"`{key}={json.dumps(value)}`" for key, value in overrides.items()) or "nothing"
        lines.append(f"- **{arm}**: {said}")
    return lines


def _per_step_table(record: dict, arms: list[str], key: str, steps: int) -> list[str]:
    """A Markdown table of each arm's ``key`` (a per-step curve of its first repeat), a row per step."""
    rows = [
        f"| {step} | " + " | ".join(f"{record['runs'][arm][0][key][step]:.6f}" for arm in arms) + " |"
        for step in range(steps)
    ]
    return ["| step | " + " | ".join(arms) + " |", "|---:|" + "---:|" * len(arms), *rows]


def ablation_lines(record: dict) -> list[str]:
    """The leave-one-out arms against ``slipstream`` (its ``auto`` choices), judged beyond the A/A noise."""
    summary = record["summary"]
    ablation = summary.get("slipstream", {}).get("ablation")
    if not ablation:
        return []
    control = (
        f"the A/A pair (slipstream-again) differs by up to {ablation['noise_margin']:.1%}"
        if ablation["a_a_control"]
        else "no A/A control ran (slipstream-again): noise margin 0"
    )
    lines = [
        "",
        f"Ablation: each arm against slipstream's own choices ({control}; an arm beats auto only "
        "beyond that):",
        "",
        "| arm | its speedup over slipstream (95% interval) | verdict |",
        "|---|---|---|",
    ]
    for arm, s in summary.items():
        if "vs_slipstream" in s:
            found = s["vs_slipstream"]
            lines.append(
                f"| {arm} | {format_speedup(found['ratio'], found)} | {s.get('ablation_verdict', 'A/A control')} |"
            )
    if ablation["beats_auto"]:
        lines += ["", f"**auto is beaten on this device by: {', '.join(ablation['beats_auto'])}**"]
    return lines


def loss_verdict_lines(record: dict) -> list[str]:
    """How each arm's loss curve was judged against the reference arm's (``stats.loss_parity``):
    step 0 strictly, then the curve, and, past the tolerance, the run's own sensitivity."""
    judged = {
        arm: s["loss_parity"]
        for arm, s in record["summary"].items()
        if s.get("loss_parity") and s["loss_max_rel_diff"] > 0
    }
    if not judged:
        return []
    reference = next(k for k in next(iter(record["summary"].values())) if k.startswith("loss_vs_"))
    lines = ["", f"Loss against {reference.removeprefix('loss_vs_')} (step 0: same weights, same batch):", ""]
    lines += [f"- **{arm}**: {parity['verdict']}: {parity['detail']}" for arm, parity in judged.items()]
    sensitivity = record.get("sensitivity")
    if sensitivity:
        lines.append(
            f"- sensitivity: {sensitivity['arm']} rerun with {sensitivity['perturbation']}"
            + (f": skipped ({sensitivity['skipped']})" if sensitivity.get("skipped") else "")
        )
    return lines


def _cosine_cell(found: dict) -> str:
    if found.get("cosine") is not None:
        return f"{found['cosine']:.6f}"
    return f"not measured ({found['cosine_not_measured']})" if found.get("cosine_not_measured") else "-"


def fp32_step_lines(record: dict) -> list[str]:
    """A reduced-precision run's step 0 against the same step in fp32 (``bench/truth.py``): each arm's
    distance to it (loss, gradient norm, gradient cosine) next to the reference arm's, and the verdict."""
    truth = record.get("fp32_step0")
    if not truth:
        return []
    if truth.get("skipped"):
        return [
            "",
            f"Step 0 against fp32: not measured ({truth['skipped']}); step 0 judged strictly against the reference arm",
        ]
    reference = truth["arm"]
    judged = {arm: s["step0_vs_fp32"] for arm, s in record["summary"].items() if "step0_vs_fp32" in s}
    margins = next(iter(judged.values()))["margins"] if judged else None
    lines = [
        "",
        f"Step 0 against fp32 ({reference}'s step 0 once more in fp32, same weights, same batch: loss "
        f"{truth['loss']:.6f}, gradient norm {truth['grad_norm']:.6g}): each arm's distance to it"
        + (
            f"; an arm diverges where it is further from it than {reference} by more than "
            f"{margins[0]:g} / {margins[1]:g} / {margins[2]:g} (loss / gradient norm / 1 - cosine)"
            if margins
            else ""
        )
        + ":",
        "",
        "| arm | loss (relative) | gradient norm (relative) | gradient cosine | verdict |",
        "|---|---:|---:|---:|---|",
    ]
    for arm, found in truth.get("arms", {}).items():
        verdict = "reference" if arm == reference else judged.get(arm, {}).get("judgement", "-")
        lines.append(
            f"| {arm} | {found['loss']:.1e} | {found['grad_norm']:.1e} | {_cosine_cell(found)} | {verdict} |"
        )
    return lines


def preference_lines(record: dict) -> list[str]:
    """``--objective dpo``: pairs per second, the reward-margin curve against the reference arm's,
    and the reference pass each slipstream arm ran once before step 0 (outside its steps)."""
    judged = {arm: s for arm, s in record["summary"].items() if "pairs_per_s" in s}
    if not judged:
        return []
    packing = record.get("packing", {})
    unit = packing.get("unit", "pairs")  # KTO: rows, each a completion and its KL completion
    entries, answers = (
        ("Preference pairs", "prompt + chosen + prompt + rejected")
        if unit == "pairs"
        else ("Rows (each with its KL completion)", "prompt + completion + prompt + KL completion")
    )
    lines = [
        "",
        f"{entries}: {packing.get('pairs_trained', '?')} trained, prompt "
        f"{packing.get('mean_prompt_tokens_trained', 0):.0f} tokens on average, each answer "
        f"{packing.get('mean_answer_tokens_trained', 0):.0f}; tokens/s counts {answers} for every arm, so its "
        f"ratios are the {unit}/s ratios.",
        "",
        f"| arm | {unit}/s | final reward margin | reward margin vs the first arm | reference pass before step 0 (s) |",
        "|---|---:|---:|---|---:|",
    ]
    for arm, s in judged.items():
        margin = s.get("reward_margin_parity")
        shown = f"{margin['verdict']} ({margin['max_scaled_diff']:.1e})" if margin else "-"
        reference = f"{s['reference_pass_s']:.1f}" if s.get("reference_pass_s") else "- (in its steps)"
        lines.append(
            f"| {arm} | {s['pairs_per_s']:.3f} | {s['final_reward_margin']:.4f} | {shown} | {reference} |"
        )
    return lines


def packing_words(record: dict) -> str:
    """The workload's packing in words: the bins' fill, or (grpo) the rollouts' shape."""
    packing = record.get("packing", {})
    if "efficiency" in packing:
        return f"packing efficiency {packing['efficiency']:.1%}"
    if "completions_per_prompt" in packing:
        return (
            f"{packing['prompts_trained']} prompts x G = {packing['completions_per_prompt']} completions "
            f"(prompts {packing['min_prompt_tokens']}-{packing['max_prompt_tokens']} tokens)"
        )
    return "packing -"


def rollout_lines(record: dict) -> list[str]:
    """``--objective grpo``: each arm's whole step, its sampling and its update in completions per
    second and against every baseline, what it sampled, and the update's gradient norm per step (on
    the shared rollouts: the loss can be equal whatever the model, the gradient cannot)."""
    judged = {arm: s for arm, s in record["summary"].items() if "completions_per_s" in s}
    if not judged:
        return []
    packing = record.get("packing", {})
    lines = [
        "",
        f"GRPO rollouts: {packing.get('prompts_trained', '?')} prompts (mean {packing.get('mean_prompt_tokens', 0):.0f} "
        f"tokens), G = {packing.get('completions_per_prompt', '?')}, up to {packing.get('max_new_tokens', '?')} new "
        f"tokens. The update trains every arm on the same rollouts, sampled once by {packing.get('sampled_by', '?')}: "
        f"completions {packing.get('mean_completion_tokens', 0):.1f} tokens on average, "
        f"{packing.get('truncated_share', 0):.0%} cut at the limit, mean reward {packing.get('mean_reward', 0):.3f}, "
        f"{packing.get('equal_rewards_share', 0):.0%} of the groups with equal rewards. Each arm samples the step's "
        "prompts with its own engine (the same G, limit and settings; its completions are its own, their mean "
        "length is shown).",
        "",
        "| arm | whole step (completions/s) | vs baselines [95%] | generation (s) | generation (completions/s) "
        "| vs baselines [95%] | sampled tokens (mean) | generated tokens/s | scoring (s) | update (s) "
        "| vs baselines [95%] | share generating |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---|---:|",
    ]

    def cells(s: dict, prefix: str, interval: str) -> str:
        bases = [k.removeprefix("speedup_vs_") for k in s if k.startswith("speedup_vs_")]
        shown = [f"{s[f'{prefix}{b}']:.2f}x{interval_words(s.get(f'{interval}{b}'))} vs {b}" for b in bases]
        return "<br>".join(shown) or "-"

    for arm, s in judged.items():
        lines.append(
            f"| {arm} | {s['completions_per_s']:.3f} | {cells(s, 'speedup_vs_', 'interval_vs_')} | "
            f"{s['median_generation_s']:.2f} | {s['generation_completions_per_s']:.3f} | "
            f"{cells(s, 'generation_speedup_vs_', 'generation_interval_vs_')} | {s['sampled_mean_tokens']:.1f} | "
            f"{s['generated_tokens_per_s']:.1f} | {s['median_scoring_s']:.3f} | {s['median_update_s']:.2f} | "
            f"{cells(s, 'update_speedup_vs_', 'update_interval_vs_')} | {s['generation_share']:.0%} |"
        )
    ran = {arm: s["update_tokens_per_step"] for arm, s in judged.items() if "update_tokens_per_step" in s}
    if ran:  # what each slipstream arm's update ran: the same rollouts, in its layout
        lines += [
            "",
            "Update tokens a step (the same rollouts in each arm's layout: the prompt once a group, once a "
            "completion, or as prefix trees): "
            + ", ".join(f"{arm} {tokens:,.0f}" for arm, tokens in ran.items())
            + ".",
        ]
    if "tool_calls_per_trajectory" in packing:  # grpo.tools: multi-turn trajectories
        own = ", ".join(
            f"{arm} {s['tool_calls_per_trajectory']:.2f}"
            for arm, s in judged.items()
            if "tool_calls_per_trajectory" in s
        )
        lines += [
            "",
            f"Tools: the shared trajectories made {packing['tool_calls_per_trajectory']:.2f} tool calls each "
            f"({packing['tool_calling_share']:.0%} called at least once, {packing['turns_per_trajectory']:.2f} turns, "
            f"{packing['tool_failure_rate']:.0%} of calls failed, {packing['malformed_call_share']:.0%} malformed); "
            f"{packing['tool_token_share']:.0%} of their tokens are tool results (context, masked out of every arm's "
            f"loss; the sampled tokens columns count the model's own). Each arm's own sampling, tool calls per "
            f"trajectory: {own or '-'}.",
        ]
    arms = list(judged)
    lines += ["", "Update gradient norm per step (the same rollouts for every arm):", ""]
    return lines + _per_step_table(record, arms, "grad_norm", len(record["runs"][arms[0]][0]["grad_norm"]))


def machine_state_lines(record: dict) -> list[str]:
    """The page faults each arm's steps took, the memory it held warm between them, and any step that
    ran beside other work (its time then is not this machine's alone)."""
    ran = {arm: s for arm, s in record["summary"].items() if "skipped" not in s and "busy_steps" in s}
    if not ran:
        return []
    faults = ", ".join(
        f"{arm} {_count(round(s['median_page_faults']))}"
        for arm, s in ran.items()
        if s["median_page_faults"] is not None
    )
    held = max(s["held_bytes"] for s in ran.values())
    lines = [
        "",
        f"Page faults a timed step (median): {faults or 'not counted here'}. Between steps each arm held "
        + (f"up to {held / 2**30:.2f} GiB warm (--keep-pages-warm)" if held else "no memory warm")
        + ", so a step after a wait starts as one straight after another would.",
    ]
    repeats = record.get("config", {}).get("repeats", 1)
    lines.append(
        f"Intervals resample the {repeats} repeats (a fresh process of each arm), then their steps."
        if repeats > 1
        else "Intervals resample the steps of one process per arm: two processes of one arm, or one run and "
        "the next, can differ by more (this machine's speed drifts); --repeats N resamples processes too."
    )
    for arm, s in ran.items():
        if s["busy_steps"]:
            lines.append(
                f"**Busy machine:** {s['busy_steps']} timed step(s) of {arm} ran while other work took up to "
                f"{s['max_other_cores']:.2f} cores beyond those the arm left free: those times are not this "
                "machine's alone (stop the other work, or use --repeats)."
            )
    return lines


def ceiling_lines(record: dict) -> list[str]:
    """The memory-ceiling table of a record (none when it was not searched)."""
    ceiling = record.get("ceiling")
    if not ceiling:
        return []
    budget = next(iter(ceiling.values()))["budget_bytes"]
    stock = [arm for arm in ceiling if ARM_SPECS[arm].stock]
    lines = [
        "",
        f"Memory ceiling: the most packed tokens one optimizer step trains within {budget / 1e9:.1f} GB "
        f"({record['summary'][next(iter(ceiling))]['memory_kind']}; doubling then bisection, each probe a fresh process):",
        "",
        "| arm | max tokens per step | vs " + " | vs ".join(stock) + " | probes (tokens: peak GB) |",
        "|---|---:|" + "---:|" * len(stock) + "---|",
    ]
    for arm, found in ceiling.items():
        ratios = [
            f"{found['max_tokens'] / ceiling[base]['max_tokens']:.1f}x"
            if ceiling[base]["max_tokens"]
            else "-"
            for base in stock
        ]
        probes = ", ".join(
            f"{p['tokens']}: {p['peak_bytes'] / 1e9:.2f}" if p["peak_bytes"] else f"{p['tokens']}: over"
            for p in found["probes"]
        )
        most = f"{'>= ' if found['capped'] else ''}{found['max_tokens']:,}"
        lines.append(f"| {arm} | {most} | " + " | ".join(ratios) + f" | {probes} |")
    return lines


def write_record(record: dict, out_dir: Path) -> tuple[Path, Path]:
    """ab.json, ab.md and the PNG plots, each written atomically."""
    from .plots import ab_plots  # matplotlib is slow to import: only when plots are drawn

    json_path, md_path = out_dir / "ab.json", out_dir / "ab.md"
    write_text_atomically(json_path, json.dumps(record, indent=1))
    write_text_atomically(md_path, markdown_report(record))
    ab_plots(record, out_dir)
    return json_path, md_path


def print_tables(record: dict) -> None:
    console = Console(width=max(Console().width, 140))
    config, summary = record["config"], record["summary"]
    table = Table(
        title=f"slipstream ab: {inputs_title(record)}, max_seq_len {config['max_seq_len']}, {config['dtype']}, "
        f"batching {config['batching']}"
    )
    for column in ("arm", "median step (s)", "tokens/s", "MFU", "peak mem (MB)", "host syncs/step"):
        table.add_column(column, justify="left" if column == "arm" else "right")
    table.add_column("speedup [95%]")
    table.add_column("loss")
    for arm, s in summary.items():
        if "skipped" in s:
            table.add_row(arm, "-", "-", "-", "-", "-", "skipped", s["skipped"])
            continue
        table.add_row(
            arm,
            f"{s['median_step_s']:.4f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['mfu']:.1%}" if s.get("mfu") is not None else "-",
            f"{s['peak_memory_mb']:.0f}",
            _count(s["host_syncs_per_step"]),
            "\n".join(_speedup_cells(s)) or "-",
            _parity(s),
        )
    console.print(table)
    arms = ran_arms(record)
    losses = Table(title="per-step loss (same data, same seed: the curves must agree)")
    losses.add_column("step", justify="right")
    for arm in arms:
        losses.add_column(arm, justify="right")
    for step in range(config["steps"]):
        losses.add_row(str(step), *(f"{record['runs'][arm][0]['loss'][step]:.5f}" for arm in arms))
    console.print(losses)
    sections = (loss_verdict_lines, fp32_step_lines, preference_lines, rollout_lines, ceiling_lines)
    for section in (*sections, machine_state_lines):
        if lines := section(record):  # less the bold, and the leading blank line but the ceiling's
            shown = lines if section is ceiling_lines else lines[1:]
            console.print("\n".join(line.replace("**", "") for line in shown))
    console.print(f"measured on {describe(record['fingerprint'])}")
    if line := utilisation_line(record):
        console.print(line)
