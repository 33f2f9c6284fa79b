"""The A/B harness: the same model, data, batch and seed under each arm; time, memory, loss.

Each arm runs in its own process (fresh allocator, no state leaking between arms), arms
interleave over repeats, warm-up steps are excluded from timing, and every arm trains on
the very same packed bins from the same initial weights. The loss curves must agree: if they
move, something other than scheduling changed.

Arms:
- ``stock-padded``: stock transformers (sdpa), one right-padded row per document.
- ``stock-packed``: stock transformers (sdpa), the packed row with restarting position_ids
  (transformers detects packing and builds a dense [1, 1, T, T] mask).
- ``slipstream``: ``slipstream.optimize`` and the PackedBatch.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import multiprocessing
import resource
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..atomic import write_text_atomically
from ..optimize import state_of

# Each arm: the batch layout, the toggles it runs with and its loss ("stock": transformers'
# full logits; "chunked": slipstream's chunked LM head + loss; "trl-fused": TRL 1.16's fused LM
# head, as its SFTTrainer computes the loss). Stock arms are the model as users run it today
# (transformers' own attention and experts); "trl-fused-head" is the peer users would pick for
# memory; "slipstream-no-*" are leave-one-out ablations, so every optimization's share shows.
_SLIPSTREAM = {
    "layout": "packed",
    "packed_attention": True,
    "moe_routing": None,
    "stock": False,
    "loss": "chunked",
}
ARM_SPECS: dict[str, dict] = {
    "stock-padded": {
        "layout": "padded",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "stock",
    },
    "stock-packed": {
        "layout": "packed",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "stock",
    },
    "trl-fused-head": {
        "layout": "packed",
        "packed_attention": False,
        "moe_routing": "stock",
        "stock": True,
        "loss": "trl-fused",
    },
    "slipstream": _SLIPSTREAM,
    "slipstream-offload": {**_SLIPSTREAM, "checkpointing": "auto"},
    "slipstream-no-packed-attention": {**_SLIPSTREAM, "packed_attention": False},
    "slipstream-no-moe-routing": {**_SLIPSTREAM, "moe_routing": "stock"},
    "slipstream-no-offload": {**_SLIPSTREAM, "checkpointing": "recompute"},
    "slipstream-no-chunked-loss": {**_SLIPSTREAM, "loss": "stock"},
}
ARMS = tuple(ARM_SPECS)
ARM_PRESETS = {
    "default": ("stock-padded", "stock-packed", "slipstream"),
    "ablation": (
        "stock-packed",
        "slipstream",
        "slipstream-no-packed-attention",
        "slipstream-no-moe-routing",
        "slipstream-no-chunked-loss",
    ),
    # --max-tokens-within: the memory ceiling of stock, TRL's fused head and slipstream (+ offload)
    "ceiling": ("stock-packed", "trl-fused-head", "slipstream", "slipstream-offload"),
}


@dataclass
class ABConfig:
    """One A/B workload. Every arm sees exactly this."""

    model: str = "demo"
    layers: int | None = None
    max_seq_len: int = 1024
    steps: int = 40
    warmup: int = 2
    grad_accum: int = 1
    lr: float = 2e-3
    seed: int = 0
    num_rows: int = 1500
    # How documents are grouped into micro-batches (every arm gets the same groups):
    # "bfd" = slipstream's best-fit-decreasing bins, which gather similar lengths and so also
    # spare the padded arm most of its padding; "sequential" = documents in shuffled order up
    # to the token budget, the batches padded training usually sees.
    batching: str = "bfd"
    dtype: str = "float32"
    device: str = "auto"
    arms: tuple[str, ...] = ARM_PRESETS["default"]
    checkpointing: str = "off"  # for slipstream arms; stock arms use plain recompute when this is not "off"
    lora_rank: int = 0  # > 0: every arm trains a PEFT LoRA on q/k/v/o (the base frozen), as users fine-tune
    repeats: int = 1
    threads: int | None = None
    out_dir: str | None = None
    # The memory ceiling: for each arm, the most packed tokens one step trains within this
    # budget (e.g. "8GB"; peak RSS on a CPU, max_memory_allocated on CUDA). None: not searched.
    max_tokens_within: str | None = None

    def __post_init__(self):
        unknown = [arm for arm in self.arms if arm not in ARMS]
        if unknown:
            raise ValueError(f"unknown arm(s) {unknown}; choose from {ARMS}")
        if self.steps <= self.warmup:
            raise ValueError(f"steps ({self.steps}) must exceed warmup ({self.warmup})")
        if self.batching not in ("bfd", "sequential"):
            raise ValueError(f"batching must be 'bfd' or 'sequential', got {self.batching!r}")
        if self.checkpointing not in ("off", "recompute", "offload", "offload-double", "auto"):
            raise ValueError(
                f"checkpointing must be off, recompute, offload, offload-double or auto, "
                f"got {self.checkpointing!r}"
            )
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but this torch sees no CUDA device")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.max_tokens_within is not None:
            from .ceiling import parse_bytes

            parse_bytes(self.max_tokens_within)  # raises ValueError naming the value


@dataclass
class ArmResult:
    arm: str
    step_s: list[float]
    forward_s: list[float]
    backward_s: list[float]
    tokens: list[int]
    loss: list[float]
    grad_norm: list[float]
    host_syncs_per_step: int
    host_syncs_by_op: dict[str, int]
    peak_memory_mb: float
    memory_kind: str
    attn_implementation: str
    policies: list[str] = field(default_factory=list)
    activation_bytes: int = 0  # kept on the device at the end of forward (hardware-independent)


def _resolve_device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def model_vocab_size(config: ABConfig, tokenizer) -> int:
    """A preset's real vocabulary (the demo tokenizer's ids are valid ids of it); tiny models take the tokenizer's."""
    from ..models import preset_vocab_size

    return preset_vocab_size(config.model) or len(tokenizer)


def prepare_bins(config: ABConfig) -> tuple[list[list[list[dict]]], int, dict]:
    """The packed bins of every step (``[step][micro_batch] -> docs``), the vocab size and a packing report."""
    from ..data import demo_samples, demo_tokenizer, pack_samples

    tokenizer = demo_tokenizer()
    samples = demo_samples(tokenizer, num_rows=config.num_rows, seed=config.seed)
    bins, report = pack_samples(
        samples, config.max_seq_len, seed=config.seed, overflow="truncate", strategy=config.batching
    )
    needed = config.steps * config.grad_accum
    if len(bins) < needed:
        raise ValueError(f"the data packs into {len(bins)} bins, fewer than steps x grad_accum = {needed}")
    bins = bins[:needed]
    plan = [bins[i * config.grad_accum : (i + 1) * config.grad_accum] for i in range(config.steps)]
    slim = [
        [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in mb] for mb in step] for step in plan
    ]
    return slim, model_vocab_size(config, tokenizer), dataclasses.asdict(report)


def _micro_batch_inputs(arm: str, docs: list[dict], device: str):
    from ..packing import collate_packed, collate_padded
    from ..train.step import count_label_tokens

    spec = ARM_SPECS[arm]
    if spec["layout"] == "padded":
        inputs = {k: (v.to(device) if hasattr(v, "to") else v) for k, v in collate_padded(docs).items()}
        return inputs, count_label_tokens(inputs["labels"])
    batch = collate_packed(docs, device=device)
    inputs = batch.model_inputs() if spec["packed_attention"] else batch.stock_inputs()
    if spec["loss"] == "trl-fused":
        inputs["fused_lm_head"] = True  # TRL's fused LM head computes the loss (see build_arm_model)
    return inputs, batch.num_label_tokens


def build_arm_model(config: ABConfig, arm: str, vocab_size: int, device: str):
    """The model an arm trains, set up as the arm says; returns ``(model, slipstream state)``.

    Every arm starts from the same weights (``config.seed``) and, with ``lora_rank``, the same
    adapter initialisation.
    """
    import torch

    from .. import optimize
    from ..models import build_model

    if config.threads:
        torch.set_num_threads(config.threads)
    dtype = getattr(torch, config.dtype)
    model = build_model(
        config.model, vocab_size=vocab_size, layers=config.layers, seed=config.seed, dtype=dtype
    )
    model.to(device).train()
    spec = ARM_SPECS[arm]
    checkpointing = spec.get("checkpointing", config.checkpointing)
    if spec["stock"] and checkpointing != "off":
        checkpointing = "recompute"  # what stock transformers offers
    optimize(
        model,
        packed_attention=spec["packed_attention"],
        moe_routing=spec["moe_routing"],
        checkpointing=checkpointing,
        chunked_loss=None if spec["loss"] == "chunked" else False,
    )
    state = state_of(model)
    if spec["loss"] == "trl-fused":
        from trl.trainer.utils import add_fused_lm_head  # what SFTTrainer 1.16 installs (before PEFT)

        add_fused_lm_head(model)
        state.policies.append("loss: TRL's fused LM head (trl.trainer.utils.add_fused_lm_head)")
    if config.lora_rank:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(config.seed)  # the same adapter initialisation in every arm
        model = get_peft_model(
            model,
            LoraConfig(
                r=config.lora_rank,
                lora_alpha=2 * config.lora_rank,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            ),
        )
    return model, state


def run_arm(config_dict: dict, arm: str, plan: list, vocab_size: int) -> dict:
    """Train ``config.steps`` steps under ``arm`` in this process; returns an ArmResult as a dict."""
    import torch

    from ..offload import device_activation_bytes
    from ..train.step import train_step
    from .counters import HostSyncCounter

    config = ABConfig(**{**config_dict, "arms": tuple(config_dict["arms"])})
    device = _resolve_device(config.device)
    model, state = build_arm_model(config, arm, vocab_size, device)

    first_inputs, _ = _micro_batch_inputs(arm, plan[0][0], device)
    activation_bytes = device_activation_bytes(model, first_inputs, state.offload_manager if state else None)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.lr, weight_decay=0.0
    )

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
        attn_implementation=(
            model.get_base_model() if config.lora_rank else model
        ).config._attn_implementation,
        policies=state.policies if state else [],  # the model's own list: first-step decisions join it
        activation_bytes=activation_bytes,
    )
    for step, micro_docs in enumerate(plan):
        micro = [_micro_batch_inputs(arm, docs, device) for docs in micro_docs]
        tokens = sum(len(d["input_ids"]) for docs in micro_docs for d in docs)
        sync()
        start = time.perf_counter()
        if step == 0:  # a warm-up step: count the model's host syncs where the counter's cost is untimed
            syncs = HostSyncCounter()
            metrics = train_step(model, micro, optimizer, model_context=lambda counter=syncs: counter)
            result.host_syncs_by_op = dict(syncs.by_op)
            result.host_syncs_per_step = syncs.total
        else:
            metrics = train_step(model, micro, optimizer)
        sync()
        result.step_s.append(time.perf_counter() - start)
        result.forward_s.append(metrics["forward_s"])
        result.backward_s.append(metrics["backward_s"])
        result.tokens.append(tokens)
        result.loss.append(metrics["loss"])
        result.grad_norm.append(metrics["grad_norm"])
    if device == "cuda":
        result.peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20
    else:
        result.peak_memory_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dataclasses.asdict(result)


def run_in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process (spawned: fresh allocator, no state shared between arms)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(fn, *args).result()


def _median(values) -> float:
    values = list(values)
    return statistics.median(values) if values else 0.0


def summarize(config: ABConfig, arms: dict[str, list[dict]]) -> dict:
    """Per-arm medians and throughput; speedups (with 95% intervals) against each stock arm; loss parity."""
    from .stats import loss_parity, speedup

    summary: dict[str, Any] = {}
    timed: dict[str, list[float]] = {}
    for arm, runs in arms.items():
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
            "final_loss": first["loss"][-1],
        }
    reference = next(iter(arms))
    for arm in arms:
        parity = loss_parity(arms[reference][0]["loss"], arms[arm][0]["loss"], config.dtype)
        summary[arm]["loss_vs_" + reference] = parity.verdict
        summary[arm]["loss_max_rel_diff"] = parity.max_rel_diff
    stock_arms = [a for a in arms if ARM_SPECS[a]["stock"]]
    for arm in arms:
        if ARM_SPECS[arm]["stock"]:
            continue
        for base in stock_arms:
            summary[arm][f"speedup_vs_{base}"] = summary[arm]["tokens_per_s"] / summary[base]["tokens_per_s"]
            interval = speedup(timed[base], timed[arm], seed=config.seed)
            summary[arm][f"interval_vs_{base}"] = dataclasses.asdict(interval)
    return summary


def parity_failures(record: dict) -> list[str]:
    """Arms whose loss curve diverged from the reference arm's."""
    return [
        arm
        for arm, s in record["summary"].items()
        if any(v == "diverged" for k, v in s.items() if k.startswith("loss_vs_"))
    ]


def run_ab(config: ABConfig, progress: bool = True) -> dict:
    """Run every arm ``config.repeats`` times (interleaved) and return the full record."""
    from tqdm import tqdm

    from .fingerprint import fingerprint

    plan, vocab_size, packing = prepare_bins(config)
    runs: dict[str, list[dict]] = {arm: [] for arm in config.arms}
    jobs = [(repeat, arm) for repeat in range(config.repeats) for arm in config.arms]
    for _, arm in tqdm(jobs, desc="A/B arms", disable=not progress, unit="arm"):
        runs[arm].append(run_in_fresh_process(run_arm, dataclasses.asdict(config), arm, plan, vocab_size))
    record = {
        "kind": "slipstream-ab",
        "config": dataclasses.asdict(config),
        "vocab_size": vocab_size,
        # The arms' own thread count (--threads), not this parent process's.
        "fingerprint": {**fingerprint(), **({"torch_threads": config.threads} if config.threads else {})},
        "packing": packing,
        "summary": summarize(config, runs),
        "runs": runs,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    if config.max_tokens_within:
        from .ceiling import search_all

        record["ceiling"] = search_all(config, vocab_size, run_in_fresh_process, progress)
        for arm, found in record["ceiling"].items():
            record["summary"][arm]["max_tokens_within"] = found["max_tokens"]
    return record


write_atomically = write_text_atomically  # the name the benchmark scripts import


def _speedup_cells(s: dict) -> list[str]:
    """'1.44x [1.39, 1.50] faster vs stock-packed' for every stock arm an arm was compared with."""
    cells = []
    for key, value in s.items():
        if key.startswith("speedup_vs_"):
            base = key.removeprefix("speedup_vs_")
            interval = s.get(f"interval_vs_{base}")
            detail = (
                f" [{interval['low']:.2f}, {interval['high']:.2f}] {interval['verdict']}" if interval else ""
            )
            cells.append(f"{value:.2f}x{detail} vs {base}")
    return cells


def _parity(s: dict) -> str:
    return s[next(k for k in s if k.startswith("loss_vs_"))]


def markdown_report(record: dict) -> str:
    from .fingerprint import describe

    config, summary = record["config"], record["summary"]
    lines = [
        f"# slipstream A/B: {config['model']} @ max_seq_len {config['max_seq_len']}",
        "",
        f"Machine: {describe(record['fingerprint'])}",
        f"Workload: {config['steps']} steps ({config['warmup']} warm-up, untimed), grad_accum {config['grad_accum']}, "
        f"{config['dtype']}, seed {config['seed']}, repeats {config['repeats']}; batching {config['batching']}, "
        f"packing efficiency {record['packing']['efficiency']:.1%}; checkpointing {config.get('checkpointing', 'off')}; "
        f"vocabulary {record.get('vocab_size', '?')}; LoRA rank {config.get('lora_rank', 0) or '- (full fine-tune)'}",
        "",
        "| arm | attention | median step (s) | forward / backward (s) | tokens/s | peak memory (MB) | activation bytes "
        "| host syncs/step | speedup (tokens/s, 95% interval) | loss parity |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for arm, s in summary.items():
        lines.append(
            f"| {arm} | {s['attn_implementation']} | {s['median_step_s']:.4f} | "
            f"{s.get('median_forward_s', 0):.4f} / {s.get('median_backward_s', 0):.4f} | {s['tokens_per_s']:.0f} | "
            f"{s['peak_memory_mb']:.0f} | {s.get('activation_bytes', 0):,} | {s['host_syncs_per_step']} | "
            f"{'<br>'.join(_speedup_cells(s)) or '-'} | {_parity(s)} ({s['loss_max_rel_diff']:.1e}) |"
        )
    lines += ceiling_lines(record)
    arms = list(record["runs"])
    lines += [
        "",
        "![loss](loss.png) ![step time](step_time.png) ![memory](memory.png)",
        "",
        "Per-step loss (first repeat):",
        "",
        "| step | " + " | ".join(arms) + " |",
        "|---:|" + "---:|" * len(arms),
    ]
    for step in range(config["steps"]):
        lines.append(
            f"| {step} | " + " | ".join(f"{record['runs'][arm][0]['loss'][step]:.6f}" for arm in arms) + " |"
        )
    return "\n".join(lines) + "\n"


def ceiling_lines(record: dict) -> list[str]:
    """The memory-ceiling table of a record (none when it was not searched)."""
    ceiling = record.get("ceiling")
    if not ceiling:
        return []
    budget = next(iter(ceiling.values()))["budget_bytes"]
    lines = [
        "",
        f"Memory ceiling: the most packed tokens one optimizer step trains within {budget / 1e9:.1f} GB "
        f"({record['summary'][next(iter(ceiling))]['memory_kind']}; doubling then bisection, each probe a fresh process):",
        "",
        "| arm | max tokens per step | vs "
        + " | vs ".join(a for a in ceiling if ARM_SPECS[a]["stock"])
        + " | probes (tokens: peak GB) |",
        "|---|---:|" + "---:|" * sum(1 for a in ceiling if ARM_SPECS[a]["stock"]) + "---|",
    ]
    for arm, found in ceiling.items():
        ratios = [
            f"{found['max_tokens'] / ceiling[base]['max_tokens']:.1f}x"
            if ceiling[base]["max_tokens"]
            else "-"
            for base in ceiling
            if ARM_SPECS[base]["stock"]
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
    from .plots import ab_plots

    json_path, md_path = out_dir / "ab.json", out_dir / "ab.md"
    write_atomically(json_path, json.dumps(record, indent=1))
    write_atomically(md_path, markdown_report(record))
    ab_plots(record, out_dir)
    return json_path, md_path


def print_tables(record: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from .fingerprint import describe

    console = Console(width=max(Console().width, 140))
    config, summary = record["config"], record["summary"]
    table = Table(
        title=f"slipstream ab: {config['model']}, max_seq_len {config['max_seq_len']}, {config['dtype']}, "
        f"batching {config['batching']}"
    )
    for column in (
        "arm",
        "median step (s)",
        "tokens/s",
        "peak mem (MB)",
        "host syncs/step",
        "speedup [95%]",
        "loss",
    ):
        table.add_column(column, justify="left" if column in ("arm", "loss", "speedup [95%]") else "right")
    for arm, s in summary.items():
        table.add_row(
            arm,
            f"{s['median_step_s']:.4f}",
            f"{s['tokens_per_s']:.0f}",
            f"{s['peak_memory_mb']:.0f}",
            str(s["host_syncs_per_step"]),
            "\n".join(_speedup_cells(s)) or "-",
            _parity(s),
        )
    console.print(table)
    arms = list(record["runs"])
    losses = Table(title="per-step loss (same data, same seed: the curves must agree)")
    losses.add_column("step", justify="right")
    for arm in arms:
        losses.add_column(arm, justify="right")
    for step in range(config["steps"]):
        losses.add_row(str(step), *(f"{record['runs'][arm][0]['loss'][step]:.5f}" for arm in arms))
    console.print(losses)
    if record.get("ceiling"):
        console.print("\n".join(ceiling_lines(record)))
    console.print(f"measured on {describe(record['fingerprint'])}")
