"""The ``slipstream`` command: thin, it parses, calls the library and prints."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__

DESCRIPTION = """\
slipstream makes LoRA / QLoRA fine-tuning of Hugging Face causal LMs faster and proves
every gain with a same-configuration A/B benchmark.

commands:
  train  LoRA / QLoRA SFT from a YAML config (slipstream train examples/tiny.yaml)
  ab     train the same model on the same packed data under stock transformers and under
         slipstream; print step time, tokens/s, peak memory, host syncs and the per-step
         loss of each arm (with no arguments: the built-in demo, a few minutes on a CPU)
  report merge A/B records from many machines and runs into one hardware x workload table
  pack   read a dataset file (JSONL, JSON, Parquet, datasets-on-disk), tokenize and
         bin-pack it, and report skipped rows and packing efficiency
"""


def add_ab_arguments(p: argparse.ArgumentParser, defaults=None) -> None:
    """The A/B workload options (shared by ``slipstream ab`` and the benchmark scripts)."""
    from .bench.arms import ARMS
    from .bench.runner import ABConfig

    defaults = defaults or ABConfig()
    p.add_argument(
        "--model", default=defaults.model, help="model shape (tiny config or real-model preset, random init)"
    )
    p.add_argument("--layers", type=int, default=defaults.layers, help="shorten the model to N layers")
    p.add_argument(
        "--max-seq-len", type=int, default=defaults.max_seq_len, help="tokens per packed micro-batch"
    )
    p.add_argument(
        "--steps", type=int, default=defaults.steps, help="optimizer steps per arm (warm-up included)"
    )
    p.add_argument("--warmup", type=int, default=defaults.warmup, help="untimed warm-up steps")
    p.add_argument("--grad-accum", type=int, default=defaults.grad_accum, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--rows", type=int, default=defaults.num_rows, help="built-in demo rows to draw from")
    p.add_argument(
        "--batching",
        choices=("bfd", "sequential"),
        default=defaults.batching,
        help="documents per micro-batch: best-fit-decreasing bins, or shuffled order up to the budget "
        "(sequential: the batches padded training usually sees)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=defaults.dtype)
    p.add_argument("--device", default=defaults.device, help="auto, cpu or cuda")
    p.add_argument("--arms", default=",".join(defaults.arms), help=f"comma-separated, from {','.join(ARMS)}")
    p.add_argument(
        "--repeats", type=int, default=defaults.repeats, help="run every arm this many times, interleaved"
    )
    p.add_argument("--threads", type=int, default=defaults.threads, help="torch CPU threads per arm")
    p.add_argument("--out", default=defaults.out_dir, help="output directory (default: runs/ab-<time>)")
    p.add_argument(
        "--lora-rank",
        type=int,
        default=defaults.lora_rank,
        help="train a PEFT LoRA of this rank on q/k/v/o in every arm (0: full fine-tune)",
    )
    p.add_argument(
        "--preset",
        choices=("default", "ablation", "ceiling"),
        default=None,
        help="arms preset: default (stock-padded, stock-packed, slipstream), ablation (leave-one-out) or "
        "ceiling (stock-packed, trl-fused-head, slipstream, slipstream-offload)",
    )
    p.add_argument(
        "--max-tokens-within",
        default=defaults.max_tokens_within,
        metavar="SIZE",
        help="also find each arm's memory ceiling: the most packed tokens one step trains within SIZE "
        "(e.g. 8GB; peak RSS on a CPU, max_memory_allocated on CUDA)",
    )
    p.add_argument(
        "--checkpointing",
        default=defaults.checkpointing,
        help="off, recompute, offload, offload-double or auto (slipstream arms; stock arms recompute)",
    )


def ab_config_from_args(args: argparse.Namespace):
    """An ABConfig from parsed ``add_ab_arguments`` options (raises ValueError on a bad one)."""
    from .bench.arms import ARM_PRESETS
    from .bench.runner import ABConfig

    arms = (
        ARM_PRESETS[args.preset]
        if args.preset
        else tuple(a.strip() for a in args.arms.split(",") if a.strip())
    )
    return ABConfig(
        model=args.model,
        layers=args.layers,
        max_seq_len=args.max_seq_len,
        steps=args.steps,
        warmup=args.warmup,
        grad_accum=args.grad_accum,
        lr=args.lr,
        seed=args.seed,
        num_rows=args.rows,
        batching=args.batching,
        dtype=args.dtype,
        device=args.device,
        arms=arms,
        checkpointing=args.checkpointing,
        lora_rank=args.lora_rank,
        repeats=args.repeats,
        threads=args.threads,
        out_dir=args.out,
        max_tokens_within=args.max_tokens_within,
    )


def _add_ab(sub) -> None:
    p = sub.add_parser(
        "ab",
        help="A/B: stock transformers vs slipstream on the same workload",
        description="Run each arm in its own process on the same model, data, batch and seed.",
    )
    add_ab_arguments(p)
    p.add_argument("--require-parity", action="store_true", help="exit 3 if any arm's loss curve diverged")
    p.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="run the grid over ab options, e.g. --sweep max_seq_len=1024,2048 (repeatable; "
        "batch_tokens is an alias of max_seq_len)",
    )
    p.set_defaults(func=_cmd_ab)


SWEEP_ALIASES = {"batch_tokens": "max_seq_len", "tokens": "max_seq_len"}


def _sweep_grid(sweeps: list[str]) -> list[dict]:
    """[{field: value, ...}, ...] for every combination of the --sweep options."""
    import dataclasses
    import itertools

    from .bench.runner import ABConfig

    fields = {f.name: f for f in dataclasses.fields(ABConfig)}
    axes = []
    for sweep in sweeps:
        key, _, values = sweep.partition("=")
        key = SWEEP_ALIASES.get(key.strip(), key.strip())
        if key not in fields or not values:
            raise ValueError(f"--sweep {sweep!r}: expected KEY=V1,V2 with KEY one of {', '.join(fields)}")
        kind = type(getattr(ABConfig(), key))
        cast = int if kind is int or key in ("layers", "threads") else float if kind is float else str
        axes.append([(key, cast(v.strip())) for v in values.split(",")])
    return [dict(combo) for combo in itertools.product(*axes)] if axes else [{}]


def _cmd_ab(args) -> int:
    import dataclasses

    from .bench.render import print_tables, write_record
    from .bench.runner import parity_failures, run_ab

    try:
        base = ab_config_from_args(args)
        grid = [dataclasses.replace(base, **point) for point in _sweep_grid(args.sweep)]
    except ValueError as error:
        print(f"slipstream ab: {error}", file=sys.stderr)
        return 2
    out_root = Path(args.out or f"runs/ab-{time.strftime('%Y%m%d-%H%M%S')}")
    diverged = []
    for point, config in zip(_sweep_grid(args.sweep), grid, strict=True):
        out_dir = out_root / "-".join(f"{k}={v}" for k, v in point.items()) if point else out_root
        record = run_ab(config)
        print_tables(record)
        json_path, md_path = write_record(record, out_dir)
        print(f"wrote {json_path}, {md_path} and the plots in {out_dir}")
        diverged += [f"{out_dir}: {arm}" for arm in parity_failures(record)]
    if len(grid) > 1:
        print(f"sweep of {len(grid)} workloads done; merge them with: slipstream report {out_root}")
    if diverged:
        print("loss curves diverged: " + "; ".join(diverged), file=sys.stderr)
        if args.require_parity:
            return 3
    return 0


def _add_report(sub) -> None:
    p = sub.add_parser(
        "report",
        help="merge A/B records from many machines into one hardware x workload table",
        description="Read every ab.json under the given paths; a row per workload, a column per "
        "machine. Different workloads are never compared.",
    )
    p.add_argument("paths", nargs="+", help="ab.json files or directories holding them")
    p.add_argument("--out", default=None, help="write report.md and report.png here")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:
    from .atomic import write_text_atomically
    from .bench.plots import report_plot
    from .bench.report import ReportError, ceiling_table, cross_table, load_records, report_rows

    try:
        records = load_records(args.paths)
        rows = report_rows(records)
    except ReportError as error:
        print(f"slipstream report: {error}", file=sys.stderr)
        return 1
    table = cross_table(rows)
    ceilings = ceiling_table(records)
    if ceilings:
        table += f"\nMemory ceiling (max packed tokens per step within the budget):\n\n{ceilings}"
    print(f"{len(records)} records\n\n{table}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_text_atomically(
            out / "report.md",
            f"# slipstream report\n\n{len(records)} records.\n\n{table}\n![speedups](report.png)\n",
        )
        report_plot(rows, out / "report.png")
        print(f"wrote {out / 'report.md'} and {out / 'report.png'}")
    return 0


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="LoRA / QLoRA SFT from a YAML config",
        description="Train from CONFIG.yaml; every speedup on by default, each switchable.",
    )
    p.add_argument("config", help="a YAML training config (see examples/)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set optimizer.lr=1e-4 (repeatable)",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest usable checkpoint (checked against it)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: continue even though the data, tokenizer or training config changed since the "
        "checkpoint (never a different adapter shape)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a directory slipstream marked as its run (deletes only what slipstream wrote there)",
    )
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    from .data import DataError
    from .train.config import ConfigError, load_config
    from .train.loop import TrainError, train

    try:
        config = load_config(args.config, args.set)
        _, summary = train(config, resume=args.resume, overwrite=args.overwrite, force=args.force)
    except (ConfigError, DataError, TrainError) as error:
        print(f"slipstream train: {error}", file=sys.stderr)
        return 1
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 speaks
        print(
            f"finished {summary['steps']} steps, final loss {summary['final_loss']:.4f}; "
            f"adapter in {Path(config.output_dir) / 'adapter'}"
        )
    return 0


def _add_pack(sub) -> None:
    p = sub.add_parser("pack", help="tokenize and bin-pack a dataset file; report skips and efficiency")
    p.add_argument("path", help="a .jsonl, .json or .parquet file, or a datasets save_to_disk directory")
    p.add_argument(
        "--tokenizer", default=None, help="a local tokenizer directory (default: the built-in demo tokenizer)"
    )
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--overflow",
        choices=("truncate", "split"),
        default="truncate",
        help="what to do with a sample longer than --max-seq-len",
    )
    p.add_argument("--response-only", action="store_true", help="train on assistant / response tokens only")
    p.add_argument(
        "--skip-bad-rows", action="store_true", help="skip and report bad rows instead of stopping"
    )
    p.set_defaults(func=_cmd_pack)


def _cmd_pack(args) -> int:
    from .data import DataError, demo_tokenizer, load_samples, pack_samples

    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except (OSError, ValueError) as error:
            print(f"slipstream pack: {args.tokenizer}: no usable tokenizer ({error})", file=sys.stderr)
            return 1
    else:
        tokenizer = demo_tokenizer()
    try:
        samples, report = load_samples(
            args.path,
            tokenizer,
            response_only=args.response_only,
            on_bad_row="skip" if args.skip_bad_rows else "error",
        )
    except (DataError, FileNotFoundError) as error:
        print(f"slipstream pack: {error}", file=sys.stderr)
        return 1
    print(report.summary())
    if not samples:
        print("slipstream pack: no usable rows", file=sys.stderr)
        return 1
    _, packing = pack_samples(samples, args.max_seq_len, seed=args.seed, overflow=args.overflow)
    print(packing.summary())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each policy decision")
    parser.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an unexpected error"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_ab(sub)
    _add_report(sub)
    _add_pack(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"slipstream {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # anything a command did not turn into its own message: one line
        if args.debug:
            raise
        text = " ".join(str(error).split()) or "no message"
        print(
            f"slipstream {args.command}: {type(error).__name__}: {text} (run with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
