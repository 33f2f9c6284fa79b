"""The ``slipstream`` command: thin, it parses, calls the library and prints."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from pathlib import Path

from . import __version__
from . import speedups as speedups_module  # read at call time: a new field shows in the help
from .bench.command import ab_grid, add_ab_arguments, run_grid
from .bench.inputs import ABInputError
from .bench.lockstep import ArmProcessError
from .bench.report import ReportError, load_records, report_markdown, report_rows, write_report
from .data import DataError, demo_tokenizer, load_samples, pack_samples
from .doctor import first_use_hint
from .errors import TrainError
from .fields import choices, field_types, is_kind
from .models import model_names
from .noise import known_noise_hidden
from .objectives import objective_names  # read at call time: a new objective shows in the help
from .train.config import ConfigError, load_config

DESCRIPTION = """\
slipstream makes LoRA / QLoRA fine-tuning of Hugging Face causal LMs faster and proves
every gain with a same-configuration A/B benchmark.

commands:
  train  LoRA / QLoRA fine-tuning ({objectives}) from a YAML config
         (slipstream train examples/tiny.yaml)
  ab     train the same model on the same packed data under stock transformers and under
         slipstream; print step time, tokens/s, peak memory, host syncs and the per-step
         loss of each arm (with no arguments: the built-in demo, a few minutes on a CPU)
  report merge A/B records from many machines and runs into one hardware x workload table
  pack   read a dataset file (JSONL, JSON, Parquet, datasets-on-disk), tokenize and
         bin-pack it, and report skipped rows and packing efficiency
  doctor this machine's device and versions, which backend each fast path picks here and
         why, and a run of each against its stock arm on a tiny model (parity, host syncs);
         exit 1 if any is wrong (under a minute, on any machine)
  export merge a run's adapter into its base model and write a plain transformers directory
         (slipstream export runs/train --merged merged/), checked against base + adapter
  generate  text from a trained run (base model + adapter): --prompt, --file, or a prompt loop
"""


def _error(command: str, message: object, status: int = 1) -> int:
    """``message`` as one line on stderr, named by the command; the exit status to return."""
    print(f"slipstream {command}: {message}", file=sys.stderr)
    return status


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


def _cmd_ab(args) -> int:
    try:
        grid = ab_grid(args)
    except ValueError as error:
        return _error("ab", error, 2)
    first_use_hint()  # once the options are valid: a mistake stays the one line that names it
    out_root = Path(grid[0][1].ab.out_dir or f"runs/ab-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        diverged = run_grid(grid, out_root)
    except ABInputError as error:  # the model or data, found unusable before any arm ran
        return _error("ab", error, 2)
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
    try:
        records = load_records(args.paths)
        rows = report_rows(records)
    except ReportError as error:
        return _error("report", error)
    table = report_markdown(records, rows)
    print(f"{len(records)} records\n\n{table}")
    if args.out:
        md_path, png_path = write_report(Path(args.out), records, rows, table)
        print(f"wrote {md_path} and {png_path}")
    return 0


def speedups_help(prefix: str) -> str:
    """The speedup keys, generated from ``Speedups``' fields (a new field shows up here by itself)."""
    lines = ["speedups (config keys; --set speedups.KEY=VALUE):"]
    types = field_types(speedups_module.Speedups)
    for spec in dataclasses.fields(speedups_module.Speedups):
        allowed, expected = choices(types[spec.name]), types[spec.name]
        values = (
            "|".join(map(str, allowed)) if allowed else "true|false" if is_kind(expected, bool) else "VALUE"
        )
        lines.append(f"  {prefix}{spec.name}: {values}  (default {spec.default!r})")
        lines.append(f"      {spec.metadata.get('help', '')}")
    return "\n".join(lines)


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help=f"LoRA / QLoRA fine-tuning ({', '.join(objective_names())}) from a YAML config",
        description=f"Train from CONFIG.yaml, its training.objective one of {', '.join(objective_names())}; "
        "every speedup on by default, each switchable.",
        epilog=speedups_help("speedups."),
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
    from .train.loop import train  # pulls in peft / bitsandbytes: only `train` pays for them

    try:
        config = load_config(args.config, args.set)
        first_use_hint()  # once the config is valid: a mistake in it stays the one line that names it
        _, summary = train(config, resume=args.resume, overwrite=args.overwrite, force=args.force)
    except (ConfigError, DataError, TrainError) as error:
        return _error("train", error)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 speaks
        print(
            f"finished {summary['steps']} steps, final loss {_number(summary['final_loss'])}; "
            + _eval_words(summary.get("eval"))
            + f"adapter in {Path(config.output_dir) / 'adapter'}"
        )
    return 0


def _eval_words(evals: dict | None) -> str:
    """``eval loss 1.23 (best 1.20 at step 40); `` for a run with an eval set, else nothing."""
    if not evals or evals["last"] is None:
        return ""
    best = evals["best"]
    best_words = f" (best {_number(best['loss'])} at step {best['step']})" if best else ""
    return f"eval loss {_number(evals['last']['loss'])}{best_words}; "


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _add_pack(sub) -> None:
    p = sub.add_parser("pack", help="tokenize and bin-pack a dataset file; report skips and efficiency")
    p.add_argument("path", help="a .jsonl, .json or .parquet file, or a datasets save_to_disk directory")
    p.add_argument(
        "--tokenizer", default=None, help="a local tokenizer directory (default: the built-in demo tokenizer)"
    )
    p.add_argument("--max-seq-len", type=int, default=2048, help="tokens per bin (default: %(default)s)")
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the order of equal lengths (default: %(default)s)"
    )
    p.add_argument(
        "--overflow",
        choices=("truncate", "split"),
        default="truncate",
        help="what to do with a sample longer than --max-seq-len (default: %(default)s)",
    )
    p.add_argument("--response-only", action="store_true", help="train on assistant / response tokens only")
    p.add_argument(
        "--skip-bad-rows", action="store_true", help="skip and report bad rows instead of stopping"
    )
    p.set_defaults(func=_cmd_pack)


def _cmd_pack(args) -> int:
    if args.tokenizer:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, local_files_only=True)
        except (OSError, ValueError) as error:
            return _error("pack", f"{args.tokenizer}: no usable tokenizer ({error})")
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
        return _error("pack", error)
    print(report.summary())  # (a file with no usable row raised DataError above)
    _, packing = pack_samples(samples, args.max_seq_len, seed=args.seed, overflow=args.overflow)
    print(packing.summary())
    return 0


def _add_doctor(sub) -> None:
    p = sub.add_parser(
        "doctor",
        help="check this machine: device, versions, and every fast path against its stock arm",
        description="Report the device and versions, the backend each fast path picks here and why, then run "
        "each fast path against its stock arm on a tiny random model of the family (parity of the loss and "
        "every gradient, host syncs). Exit status 1 if any path is WRONG.",
    )
    p.add_argument(
        "--model",
        default=None,
        metavar="PRESET_OR_PATH",
        help="a model preset (" + ", ".join(model_names()) + ") or a local directory with a config.json "
        "(checked as a tiny random model of its family; default: the demo model)",
    )
    p.add_argument("--json", default=None, metavar="PATH", help="also write the whole report as JSON")
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16"),
        default="auto",
        help="dtype of the checks (default auto: what model.dtype: auto trains in on this device)",
    )
    p.add_argument(
        "--remeasure-peak",
        action="store_true",
        help="measure the matmul peak (what MFU in ab and train is against) again and keep the higher of "
        "it and the cached figure (one taken while the machine was busy is replaced)",
    )
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="time the packed attention's cost figures again (what attention grouping and the short-document "
        "kernel decide by, measured once per device, dtype and thread count) and replace the cached ones",
    )
    p.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args) -> int:
    from .doctor import DoctorError, run_doctor

    try:
        _, status = run_doctor(
            args.model,
            json_path=args.json,
            dtype=args.dtype,
            remeasure_peak=args.remeasure_peak,
            recalibrate=args.recalibrate,
        )
    except DoctorError as error:
        return _error("doctor", error, 2)
    return status


def _cmd_export_gguf(args) -> int:
    from .export import ExportError
    from .export.gguf_export import export_gguf  # the gguf package itself only where it writes

    try:
        report = export_gguf(
            args.run_dir,
            args.gguf,
            quant=args.quant,
            checkpoint=args.checkpoint,
            verify=args.verify,
            overwrite=args.overwrite,
            llama_cpp_source=args.llama_cpp_source,
        )
    except ExportError as error:
        return _error("export", error)
    for line in report.lines():
        print(line)
    return 0


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="merge a run's adapter into its base model: a plain transformers directory",
        description="Merge RUN_DIR's final adapter (or checkpoint N) into the base weights the run trained "
        "on (4-bit bases dequantized, per-expert LoRA included) and write a transformers directory that "
        "AutoModelForCausalLM.from_pretrained loads alone (a reward model's run: "
        "AutoModelForSequenceClassification, what grpo.rewards and TRL load); checked against base + adapter on "
        "a probe batch before anything is written.",
    )
    p.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="a slipstream train output directory (or, with --gguf, a merged model directory)",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--merged", metavar="OUT", help="the directory to write (outside RUN_DIR)")
    target.add_argument(
        "--gguf",
        metavar="OUT.gguf",
        help="write the merged model as GGUF (llama.cpp, Ollama, LM Studio) with an Ollama Modelfile beside "
        "it, kept only once loaded back and checked against the merged model (docs/export.md)",
    )
    p.add_argument(
        "--quant",
        default="f16",
        metavar="TYPE",
        help="with --gguf: f16 (default), bf16, f32; q8_0, q5_1, q5_0, q4_1, q4_0; the k-quants q6_k, q5_k_m, "
        "q5_k_s, q4_k_m (Ollama's default), q4_k_s, q3_k_l, q3_k_m, q3_k_s, q2_k. Block types are made by "
        "llama.cpp's own quantizer where llama-cpp-python is installed (k-quants: only there)",
    )
    p.add_argument(
        "--llama-cpp-source",
        metavar="PATH",
        default=None,
        help="with --gguf: a llama.cpp checkout or a llama-cpp-python source archive; its "
        "convert_hf_to_gguf.py + the same quantizer make a reference file that the export must match "
        "within half a point of top-1 (default: $SLIPSTREAM_LLAMA_CPP_SOURCE; without it, sanity floors)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="with --gguf: write without loading the file back (not recommended)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default=None,
        help="dtype of the written weights (default: the dtype the run trained in)",
    )
    p.add_argument(
        "--checkpoint",
        type=int,
        default=None,
        metavar="N",
        help="export checkpoints/step-N instead of adapter/",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it holds a previous export (never anything else)",
    )
    p.set_defaults(func=_cmd_export)


def _cmd_export(args) -> int:
    from .export import ExportError, export_merged  # pulls in peft / bitsandbytes: only `export` pays

    if args.gguf is not None:
        return _cmd_export_gguf(args)
    try:
        report = export_merged(
            args.run_dir, args.merged, dtype=args.dtype, checkpoint=args.checkpoint, overwrite=args.overwrite
        )
    except ExportError as error:
        return _error("export", error)
    print(
        f"merged {report.source} into its base model ({report.dtype}); probe of {report.check.probed}: "
        f"max |{report.check.kind} difference| {report.check.max_abs:.3g}, relative {report.check.relative:.3g} "
        f"(tolerance {report.check.tolerance:g}); wrote {report.out}"
    )
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="text from a trained run (its base model + adapter), streamed to the terminal",
        description="Load a run's base model (model.path, or model.preset rebuilt as training built it) and "
        "its adapter, put each prompt through the tokenizer's chat template (when it has one) and stream the "
        "answer. Greedy unless --sample. With neither --prompt nor --file: a prompt loop on a terminal "
        "(an empty line or Ctrl-D ends it), else one prompt per line of stdin.",
    )
    p.add_argument(
        "path",
        metavar="RUN_DIR_OR_ADAPTER",
        help="a slipstream run directory, a PEFT adapter directory, or a model directory (the base alone)",
    )
    given = p.add_mutually_exclusive_group()
    given.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    given.add_argument("--file", default=None, metavar="PROMPTS.txt", help="prompts, one per line")
    p.add_argument(
        "--max-new-tokens", type=int, default=256, metavar="N", help="per answer (default: %(default)s)"
    )
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=None, help="with --sample (default 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="with --sample (default 1.0)")
    p.add_argument(
        "--seed", type=int, default=0, help="the sampling seed, set before each prompt (default: %(default)s)"
    )
    p.add_argument(
        "--dtype",
        choices=("auto", "float32", "bfloat16", "float16"),
        default=None,
        help="default: the run's model.dtype (auto for an adapter or model directory)",
    )
    p.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="hf: transformers' generate, streamed (default); vllm: the model (adapter merged) in vLLM's "
        "own process, every prompt in one batched call (worth its start, ~1.5 min on 2 CPU cores, for "
        "many prompts; installed on first use as grpo.engine vllm's is)",
    )
    p.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=0.3,
        metavar="SHARE",
        help="with --engine vllm: the share of GPU memory (host memory on its CPU build) vLLM reserves "
        "(default: %(default)s)",
    )
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from transformers.utils import logging as transformers_logging

    from .generation import (
        EngineAnswers,
        GenerateError,
        check_engine,
        check_options,
        load_generator,
        prompt_lines,
        read_prompt_file,
    )

    transformers_logging.disable_progress_bar()  # no loading bars between the streamed answers
    engine = None
    try:
        if not args.sample and (args.temperature is not None or args.top_p is not None):
            raise GenerateError("--temperature and --top-p apply to sampling: add --sample")
        options = {
            "max_new_tokens": args.max_new_tokens,
            "temperature": 1.0 if args.temperature is None else args.temperature,
            "top_p": 1.0 if args.top_p is None else args.top_p,
        }
        check_options(**options)
        check_engine(args.engine, args.vllm_gpu_memory_utilization)
        prompts = read_prompt_file(args.file) if args.file else list(args.prompt)
        generator = load_generator(args.path, dtype=args.dtype)  # a bad path is said before stdin is read
        interactive = not prompts and sys.stdin.isatty()
        if not prompts and not interactive:
            prompts = prompt_lines(sys.stdin)
            if not prompts:
                raise GenerateError("no prompt: give --prompt, --file, or prompts on stdin (one per line)")
        if args.engine == "vllm":
            engine = EngineAnswers.start(
                generator, prompts, args.max_new_tokens, args.vllm_gpu_memory_utilization
            )
        return _answer_all(generator, engine, prompts, interactive, args, options)
    except GenerateError as error:
        return _error("generate", error)
    finally:
        if engine is not None:
            engine.close()


def _answer_all(generator, engine, prompts, interactive, args, options) -> int:
    """Each prompt's answer on stdout: streamed by the hf engine; with vLLM, all of them from one call."""
    from transformers import TextStreamer

    print(f"slipstream generate: {generator.source}", file=sys.stderr)
    streamer = TextStreamer(generator.tokenizer, skip_prompt=True, skip_special_tokens=True)

    def answers(batch: list[str]) -> None:
        if engine is None:
            for index, prompt in enumerate(batch):
                if len(batch) > 1:
                    print(f"{'' if index == 0 else chr(10)}> {prompt}", flush=True)
                generator.generate(prompt, sample=args.sample, seed=args.seed, streamer=streamer, **options)
            return
        began = time.perf_counter()
        found = engine.answers(batch, sample=args.sample, seed=args.seed, **options)
        seconds = time.perf_counter() - began
        for index, (prompt, answer) in enumerate(zip(batch, found, strict=True)):
            if len(batch) > 1:
                print(f"{'' if index == 0 else chr(10)}> {prompt}")
            print(answer.text, flush=True)
        tokens = sum(a.new_tokens for a in found)
        print(
            f"slipstream generate: vllm: {len(batch)} answers, {tokens} tokens in {seconds:.1f} s "
            f"({tokens / max(seconds, 1e-9):.0f} tokens/s)",
            file=sys.stderr,
        )

    if not interactive:
        answers(prompts)
        return 0
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print()
            return 0
        if not prompt.strip():
            return 0
        answers([prompt])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slipstream",
        description=DESCRIPTION.format(objectives=", ".join(objective_names())),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log each policy decision")
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback of an unexpected error, and the known third-party warnings "
        "slipstream hides (listed in slipstream/noise.py)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_train(sub)
    _add_ab(sub)
    _add_report(sub)
    _add_pack(sub)
    _add_doctor(sub)
    _add_export(sub)
    _add_generate(sub)
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
        with known_noise_hidden(not args.debug):  # before the commands import bitsandbytes, PEFT, TRL
            return args.func(args)
    except KeyboardInterrupt:
        return _error(args.command, "interrupted", 130)
    except Exception as error:  # anything a command did not turn into its own message: one line
        if args.debug:  # (an arm's own traceback shows as the cause)
            raise
        text = " ".join(str(error).split()) or "no message"
        if not isinstance(error, ArmProcessError):  # (which names the arm's own error's type)
            text = f"{type(error).__name__}: {text}"
        return _error(args.command, f"{text} (run with --debug for the traceback)")


if __name__ == "__main__":
    sys.exit(main())
