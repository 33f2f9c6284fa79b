"""``slipstream train`` with ``data.share_prefixes`` off and auto (or on, groups, tree): the same steps,
the same loss curve, what the model answers after, and each epoch's time (``--objective dpo``: preference
pairs, whose ``tree`` runs the histories their prompts share once).

Runs the CLI as a user would, once per mode, on one config (written here), then compares: the
optimizer steps, the micro-batches a step ran (``metrics.jsonl``), the loss curves (largest
relative difference), the training time per epoch (``elapsed_s``, evaluation excluded), the policy
line of ``run.json`` and the greedy answers of each trained model to ``--ask`` questions (a control
question the base model knows, a trained fact)::

    python benchmarks/share_prefixes_train.py --model MODEL_DIR --data runs/data/facts.jsonl \\
        --epochs 8 --lr 2e-3 --max-seq-len 1024 --out runs/i43/facts \\
        --ask "What is the capital of France?" --ask "What is the capital of Tavvollib?"
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import yaml


def config(args, mode: str, out: Path) -> dict:
    return {
        "model": {"path": args.model, "dtype": args.dtype},
        "data": {
            "path": str(Path(args.data).resolve()),
            "response_only": args.objective == "sft",
            "max_seq_len": args.max_seq_len,
            "share_prefixes": mode,
            "step_order": args.step_order,
            **({"chat_template": str(Path(args.chat_template).resolve())} if args.chat_template else {}),
        },
        "lora": {
            "rank": 16,
            "alpha": 32,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        },
        "optimizer": {"lr": args.lr, "schedule": "cosine", "warmup_steps": 2},
        "training": {
            "objective": args.objective,
            "epochs": args.epochs,
            "grad_accum": args.grad_accum,
            "checkpoint_every": 0,
        },
        "output_dir": str(out),
        "seed": 0,
    }


def run(args, mode: str) -> dict:
    out = Path(args.out) / mode
    path = Path(args.out) / f"{mode}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config(args, mode, out)))
    command = [sys.executable, "-m", "slipstream", "train", str(path), "--overwrite"]
    if args.threads:
        command = ["env", f"OMP_NUM_THREADS={args.threads}", *command]
    subprocess.run(command, check=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    summary = json.loads((out / "run.json").read_text())
    from slipstream.generation import generate

    answers = generate(out, args.ask, max_new_tokens=40) if args.ask else []
    return {
        "mode": mode,
        "steps": len(steps),
        "loss": [r["loss"] for r in steps],
        "micro_batches": [r.get("micro_batches") for r in steps],
        "train_s": steps[-1]["elapsed_s"],
        "policy": (summary.get("shared_prefixes") or {}).get("policy"),
        # a preference run's reference pass before step 0 (its time is in the line)
        "reference": next((p for p in summary.get("policies", []) if "reference log-probs" in p), None),
        "answers": answers,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--modes", default="off,auto", help="data.share_prefixes values, the first the baseline"
    )
    parser.add_argument("--step-order", default="shuffled", choices=("shuffled", "histories"))
    parser.add_argument(
        "--objective",
        default="sft",
        help="training.objective: sft rows, or dpo / orpo ... on preference pairs",
    )
    parser.add_argument("--chat-template", default=None, help="data.chat_template: a .jinja file")
    parser.add_argument("--ask", action="append", default=[])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = [run(args, mode) for mode in args.modes.split(",")]
    base = found[0]
    print(
        "\n| share_prefixes | steps | micro-batches a step (mean) | training s | s per epoch | speedup "
        "| loss first / last | max rel. diff vs " + base["mode"] + " |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---:|")
    for r in found:
        diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["loss"], base["loss"], strict=False))
        micro = [m for m in r["micro_batches"] if m is not None]
        mean = sum(micro) / len(micro) if micro else float("nan")
        print(
            f"| {r['mode']} | {r['steps']} | {mean:.2f} | {r['train_s']:.1f} | {r['train_s'] / args.epochs:.1f} "
            f"| {base['train_s'] / r['train_s']:.2f}x | {r['loss'][0]:.4f} / {r['loss'][-1]:.4f} | {diff:.2e} |"
        )
    for r in found:
        print(f"\n{r['mode']}: {r['policy']}" + (f"\n  {r['reference']}" if r["reference"] else ""))
        for question, answer in zip(args.ask, r["answers"], strict=True):
            print(f"  Q: {question}\n  A: {answer}")
    (Path(args.out) / "summary.json").write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
