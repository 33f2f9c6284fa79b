"""``slipstream export SOURCE --gguf OUT.gguf``: from a run (merged first, :func:`.merged.export_merged`) or an
already merged directory to a GGUF file and an Ollama Modelfile beside it, both kept only once the file,
loaded back, agrees with the merged model (:mod:`.gguf_check`).

Nothing is left at OUT unless everything passed: a refusal (another family, a type the export does not
write, a tokenizer llama.cpp would split differently) comes before anything is written; the file and the
Modelfile are written under temporary names beside their destinations and renamed once verified; an
existing OUT is replaced only with ``overwrite`` and only where it is a GGUF file.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_file
from ..train.output_dir import MARKER
from .gguf import plan_gguf, plan_gguf_type, write_gguf
from .gguf_check import GGUFCheck, check_llama_cpp, check_transformers, reference
from .gguf_quantize import (
    INSTALL,
    higher_than_nominal,
    llama_cpp_available,
    mixture,
    quantize_with_llama_cpp,
    tensor_types,
)
from .gguf_reference import MARGIN, ConverterReference, compare_with_converter, find_converter
from .merged import ExportError, export_merged

GGUF_MAGIC = b"GGUF"
QUANTIZERS = {
    "": "none (a plain type, written directly)",
    "llama.cpp": "llama.cpp's own (llama_model_quantize, from the f16 file)",
    "gguf": "the gguf package's, in Python (llama-cpp-python is not installed)",
}


@dataclass
class GGUFReport:
    out: str
    modelfile: str
    source: str  # the run or merged directory exported
    quant: str
    written: dict[str, Any]
    checks: list[GGUFCheck] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # runtimes not checked, and why
    reference: ConverterReference | None = None  # llama.cpp's own converter + quantizer, where it ran
    no_reference: str = ""  # why not, where it did not (the sanity floors judged)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "checks": [asdict(c) | {"ok": c.ok} for c in self.checks]}

    def lines(self) -> list[str]:
        """What ``slipstream export --gguf`` prints: each check, the comparison with llama.cpp's own file (or
        why there was none), what went unchecked, and what was written."""
        found = [f"checked {check.describe()}" for check in self.checks]
        if self.reference is not None:
            found.append(f"compared with {self.reference.describe()}")
        elif self.no_reference:
            found.append(f"not compared with llama.cpp's own converter: {self.no_reference}")
        found += [f"not checked: {skipped}" for skipped in self.skipped]
        written = self.written
        tensors = ", ".join(f"{count} {kind}" for kind, count in written["tensors"].items())
        finer = "; ".join(f"{kind}: {len(names)}" for kind, names in written.get("kept_finer", {}).items())
        found.append(
            f"wrote {self.out} ({self.quant}, quantizer {written['quantizer']}: {tensors}"
            f"{f' (not {self.quant}: {finer})' if finer else ''}; {written['bytes'] / 2**20:,.1f} MiB; "
            f"{written['tokens']:,} tokens, pre-tokenizer {written['pre_tokenizer']}) and {self.modelfile} in "
            f"{self.seconds:.1f} s"
        )
        return found


def modelfile(
    gguf_name: str,
    chat_template: str | None,
    eos_token: str | None,
    *,
    bos_token: str | None = None,
    add_bos: bool = False,
) -> str:
    """An Ollama Modelfile for ``gguf_name``: a TEMPLATE in Ollama's Go syntax where the chat template renders
    exactly as one of the formats :mod:`.ollama` knows (ChatML, Llama 3, Gemma, Mistral), its end-of-turn
    and EOS tokens as stops; else a comment saying why, and Ollama takes the GGUF's own template.
    ``bos_token``: the tokenizer's BOS text; ``add_bos``: whether the GGUF adds BOS (``add_bos_token``)."""
    from .ollama import modelfile_lines

    return "\n".join(modelfile_lines(gguf_name, chat_template, eos_token, bos_token, add_bos)) + "\n"


def _check_out(out: Path, overwrite: bool) -> None:
    if out.suffix.lower() != ".gguf":
        raise ExportError(f"{out}: the GGUF file's name must end in .gguf")
    if out.is_dir():
        raise ExportError(f"{out} is a directory: name the .gguf file to write")
    if out.exists():
        with out.open("rb") as handle:
            is_gguf = handle.read(4) == GGUF_MAGIC
        if not is_gguf:
            raise ExportError(f"{out} exists and is not a GGUF file: not replaced")
        if not overwrite:
            raise ExportError(f"{out} exists: pass --overwrite to replace it")


def _refuse_a_classifier(source: Path, is_run: bool) -> None:
    """A reward model (a sequence classifier) has no LM head for llama.cpp to generate with: refused by name."""
    import json

    if is_run:
        from ..train.config import ConfigError, run_config
        from ..train.driver import model_head

        try:
            config = run_config(source / "config.json")
        except ConfigError:
            return  # said, by name, where the merge reads it
        classifier = model_head(config) != "causal-lm"
        what = f"a reward model's run (training.objective {config.training.objective})"
    else:
        architectures = json.loads((source / "config.json").read_text()).get("architectures") or []
        classifier = any(name.endswith("ForSequenceClassification") for name in architectures)
        what = f"a sequence classifier ({', '.join(architectures)})"
    if classifier:
        raise ExportError(
            f"{source}: {what}: --gguf writes a causal LM for llama.cpp and Ollama to generate with; a reward "
            "model is scored through transformers (export --merged, then grpo.rewards or TRL)"
        )


def export_gguf(
    source: str | Path,
    out: str | Path,
    *,
    quant: str = "f16",
    checkpoint: int | None = None,
    verify: bool = True,
    overwrite: bool = False,
    llama_cpp_source: str | Path | None = None,
) -> GGUFReport:
    """Write ``source`` (a run directory, merged first, or a merged transformers directory) to ``out`` as GGUF
    of type ``quant``, with an Ollama Modelfile beside it; with ``verify``, both kept only where every
    installed runtime agrees with the merged model (:mod:`.gguf_check`), judged against llama.cpp's own
    converter where its source is at hand (``llama_cpp_source``, :mod:`.gguf_reference`)."""
    import importlib.util

    started = time.perf_counter()
    if importlib.util.find_spec("gguf") is None:
        raise ExportError("--gguf needs the gguf package: pip install 'slipstream[gguf]'")
    source, out = Path(source), Path(out)
    _check_out(out, overwrite)
    is_run = (source / MARKER).exists()
    if not is_run and not (source / "config.json").exists():
        raise ExportError(
            f"{source}: neither a slipstream run directory nor a merged model directory (config.json)"
        )
    _refuse_a_classifier(source, is_run)
    plan_gguf_type(quant)  # a type it cannot write, or a quantizer that is not installed: before the merge
    with tempfile.TemporaryDirectory(
        prefix=".gguf-merge-", dir=out.parent if out.parent.exists() else None
    ) as scratch_name:
        scratch = Path(scratch_name)
        if (
            is_run
        ):  # its adapter merged into the base first (checked there), in fp32: one rounding, at the end
            merged_dir = scratch / "merged"
            export_merged(source, merged_dir, dtype="float32", checkpoint=checkpoint)
        else:
            if checkpoint is not None:
                raise ExportError(f"{source}: --checkpoint is for a run directory, not a merged model")
            merged_dir = source
        plan = plan_gguf(merged_dir, quant)  # every refusal before anything is written
        if verify and plan.family.transformers_misreads and not llama_cpp_available():
            raise ExportError(
                f"{merged_dir}: only llama.cpp reads a {plan.model_type} GGUF back as it is (transformers' GGUF "
                f"loader: {plan.family.transformers_misreads}): pip install 'slipstream[gguf]' to verify it, "
                "or --no-verify to write it unchecked"
            )
        tokenizer = plan.hf_tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
        report = GGUFReport(str(out), str(out.with_suffix(".Modelfile")), str(source), plan.quant, {})
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(out.with_suffix(".Modelfile")) as model_tmp, atomic_file(out) as tmp:
            base = _write(merged_dir, tmp, plan, template, scratch, report)
            if verify:
                _verify(merged_dir, tmp, base, plan, scratch, report, llama_cpp_source)
            else:
                report.skipped.append("every runtime: --no-verify")
            model_tmp.write_text(
                modelfile(
                    out.name,
                    template,
                    tokenizer.eos_token,
                    bos_token=tokenizer.bos_token,
                    add_bos=bool(report.written["add_bos"]),
                )  # fmt: skip
            )
            _check_out(out, overwrite)  # again, just before the rename: what is there now may go
    report.seconds = time.perf_counter() - started
    return report


def _write(merged_dir: Path, tmp: Path, plan, template, scratch: Path, report: GGUFReport) -> Path:
    """The file at ``tmp``: written directly (a plain type, or the gguf package's blocks), or written in f16
    and quantized by llama.cpp's own quantizer. Returns the unquantized file (``tmp`` itself for a plain
    type) and fills ``report.written`` with every tensor's type."""
    base = tmp
    if plan.quantizer == "llama.cpp":
        base = scratch / "base-f16.gguf"
        report.written = write_gguf(
            merged_dir, base, dataclasses.replace(plan, quant="f16", quantizer=""), template
        )
        quantizing = time.perf_counter()
        quantize_with_llama_cpp(base, tmp, plan.quant)
        report.written["quantize_seconds"] = round(time.perf_counter() - quantizing, 2)
    else:
        report.written = write_gguf(merged_dir, tmp, plan, template)
    types = tensor_types(tmp)
    report.written |= {
        "quantizer": QUANTIZERS[plan.quantizer],
        "tensors": mixture(types),
        "tensor_types": types,
        "kept_finer": higher_than_nominal(types, plan.quant) if plan.quantizer else {},
        "bytes": tmp.stat().st_size,
    }
    return base


def _verify(merged_dir: Path, tmp: Path, base: Path, plan, scratch: Path, report: GGUFReport, source) -> None:
    """Load ``tmp`` back in every installed runtime and compare it with the merged model; with llama.cpp's
    converter at hand, each runtime's agreement is judged against the reference file's in the same runtime
    (:mod:`.gguf_reference`), else against the sanity floors. An ExportError (nothing kept) where a runtime
    falls short."""
    ref = reference(merged_dir)
    add_bos = bool(report.written["add_bos"])
    misreads = plan.family.transformers_misreads
    if misreads is not None:
        report.skipped.append(f"transformers' GGUF loader: {misreads}")
    if not llama_cpp_available():
        report.skipped.append(f"llama.cpp: llama-cpp-python is not installed ({INSTALL})")

    def judge(path: Path) -> list[GGUFCheck]:
        checks = [] if misreads is not None else [check_transformers(path, ref, plan.quant)]
        if llama_cpp_available():
            checks.append(check_llama_cpp(path, ref, plan.quant, add_bos))
        return checks

    report.checks = judge(tmp)
    converter, where = find_converter(source, scratch) if llama_cpp_available() else (None, "")
    if converter is None:
        if where:
            report.no_reference = f"{where}: judged by the sanity floors"
    else:
        try:
            report.reference = compare_with_converter(
                converter, where, merged_dir, tmp, base, plan.quant, plan.quantizer, scratch, judge
            )
        except (RuntimeError, ExportError) as error:
            report.no_reference = f"{where} failed on this model ({error}): judged by the sanity floors"
        else:
            theirs = {check.runtime: check for check in report.reference.checks}
            for check in report.checks:
                found = theirs[check.runtime].top1
                check.floor = found - MARGIN
                check.floor_reason = (
                    f": llama.cpp's own converter + quantizer's file {found:.1%}, less {MARGIN:.1%}"
                )
    failed = [check for check in report.checks if not check.ok]
    if failed:
        hint = (
            ""
            if report.reference is not None or not llama_cpp_available()
            else " (the floors are sanity bounds; --llama-cpp-source judges against llama.cpp's own file instead)"
        )
        raise ExportError(
            f"{report.out}: not written: " + "; ".join(check.describe() for check in failed) + hint
        )
