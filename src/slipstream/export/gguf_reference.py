"""The export judged against llama.cpp's own path on the same model: ``convert_hf_to_gguf.py`` on the same
merged directory, then the same quantizer, then the same held prompts through llama.cpp.

A fixed top-1 floor per type cannot say whether a file is as good as the model allows. A 135M model's q8_0
agrees less often than an 8B model's, because its logits are closer together. The reference file can say
it: what llama.cpp's own converter and quantizer make of this model. The export's file must agree with the
merged model within ``MARGIN`` of the reference file's agreement, in each runtime. The absolute floors
(:data:`.gguf_check.TOP1_FLOOR`) judge only where the reference cannot run: sanity bounds, which a small
model's coarse types can miss (SmolLM2-135M's q4_k_m agrees on 83% in llama.cpp's own file too).

Compared, and reported:

- each tensor's type in the two files (the quantizer's mixture follows names and shapes, so a difference
  means the two f16 files differ in what they hold);
- the f16 base tensors byte for byte (the same layout: the same numbers, rounded once);
- each runtime's top-1 on the reference file, which sets our file's floor in that runtime.

The converter is llama.cpp's source, not something ``pip`` installs. It is looked for in a llama.cpp
checkout (a directory with ``convert_hf_to_gguf.py``) or in a llama-cpp-python source archive, which
``make test-gguf`` keeps. Give either as ``--llama-cpp-source`` or ``SLIPSTREAM_LLAMA_CPP_SOURCE``. The
converter needs its own requirements (``sentencepiece`` for the llama family). Where it is absent or fails
on the model, the report says so and the absolute floors judge alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .gguf_check import GGUFCheck
from .gguf_quantize import quantize_with_llama_cpp, tensor_types

MARGIN = 0.005  # half a point of top-1: the "within 0.5 point of the reference file's"
SOURCE_ENV = "SLIPSTREAM_LLAMA_CPP_SOURCE"
CONVERTER = "convert_hf_to_gguf.py"
# what the converter needs from llama.cpp's tree (in llama-cpp-python's sdist: under vendor/llama.cpp/)
CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/")


@dataclass
class ConverterReference:
    """llama.cpp's own converter and quantizer on the same merged model, against the export's file."""

    converter: str  # the convert_hf_to_gguf.py that ran
    file_type: str  # the reference file's type (its quantizer's ftype, or the converter's outtype)
    types_equal: bool  # every tensor's type the same in both files
    type_differences: list[str] = field(default_factory=list)  # "name: ours X, llama.cpp's Y" (first few)
    base_identical: int = 0  # base tensors (f16 / f32 / bf16) byte-identical in the two unquantized files
    base_compared: int = 0
    base_differing: list[str] = field(default_factory=list)
    quantized_identical: int | None = (
        None  # tensors byte-identical in the two quantized files (None: a plain type)
    )
    checks: list[GGUFCheck] = field(default_factory=list)  # each runtime on the reference file
    types: dict[str, str] = field(
        default_factory=dict
    )  # our file's tensor types (the reference's, where equal)
    seconds: float = 0.0

    def describe(self) -> str:
        types = (
            "per-tensor types equal"
            if self.types_equal
            else f"per-tensor types differ ({'; '.join(self.type_differences[:3])})"
        )
        base = f"{self.base_identical} of {self.base_compared} unquantized tensors byte-identical"
        if self.quantized_identical is not None:
            base += f", {self.quantized_identical} of the quantized file's {len(self.types)}"
        top1 = "".join(f"; top-1 in {check.runtime} {check.top1:.1%}" for check in self.checks)
        return f"llama.cpp's own converter + quantizer ({self.file_type}): {types}; {base}{top1}"


def find_converter(source: str | Path | None, scratch: Path) -> tuple[Path | None, str]:
    """The directory holding ``convert_hf_to_gguf.py`` from ``source`` (or ``SLIPSTREAM_LLAMA_CPP_SOURCE``):
    a llama.cpp checkout, or a llama-cpp-python source archive, unpacked under ``scratch``. Returns it and
    a line saying where it came from, or None and why there is none."""
    given = source if source is not None else os.environ.get(SOURCE_ENV) or None
    if given is None:
        return None, f"no llama.cpp source given (--llama-cpp-source DIR or {SOURCE_ENV})"
    path = Path(given)
    if path.is_dir():
        for root in (path, path / "vendor" / "llama.cpp"):
            if (root / CONVERTER).is_file():
                return root, str(root / CONVERTER)
        return None, f"{path}: no {CONVERTER} in it (nor under vendor/llama.cpp)"
    if path.is_file() and path.name.endswith((".tar.gz", ".tgz")):
        return _unpacked(path, scratch)
    return None, f"{path}: neither a llama.cpp directory nor a llama-cpp-python source archive"


def _unpacked(archive: Path, scratch: Path) -> tuple[Path | None, str]:
    """The converter's parts of a llama-cpp-python source archive (``<name>/vendor/llama.cpp/...``) unpacked
    under ``scratch``."""
    target = scratch / "llama.cpp-source"
    with tarfile.open(archive) as tar:
        members = []
        for member in tar.getmembers():
            parts = member.name.split("/", 3)  # <name>, vendor, llama.cpp, the rest
            if len(parts) == 4 and parts[1:3] == ["vendor", "llama.cpp"]:
                rest = parts[3]
                if rest == CONVERTER or rest.startswith(CONVERTER_PARTS[1:]):
                    member.name = rest
                    members.append(member)
        if not any(member.name == CONVERTER for member in members):
            return None, f"{archive}: no vendor/llama.cpp/{CONVERTER} in it"
        tar.extractall(target, members=members, filter="data")
    return target, f"{archive}:vendor/llama.cpp/{CONVERTER}"


def convert(converter_dir: Path, merged_dir: Path, out: Path, outtype: str) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py`` on ``merged_dir``, in a subprocess of this Python (it imports
    its own gguf-py, not the installed one). RuntimeError with its last line where it fails."""
    done = subprocess.run(
        # absolute paths: it runs in its own directory (where it imports its gguf-py and conversion/ from)
        [
            sys.executable,
            CONVERTER,
            str(merged_dir.resolve()),
            "--outtype",
            outtype,
            "--outfile",
            str(out.resolve()),
        ],
        cwd=converter_dir,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not out.exists():
        lines = (done.stderr or done.stdout).strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {done.returncode}")


def _byte_identical(ours: Path, theirs: Path) -> tuple[list[str], list[str]]:
    """The tensors both files hold, and those among them whose type or bytes differ: compared one tensor at
    a time through the readers' memory maps (no copy of either file: an 8B model's f16 file is 16 GB)."""
    import numpy as np
    from gguf import GGUFReader

    their = {t.name: t for t in GGUFReader(str(theirs)).tensors}
    shared, differing = [], []
    for tensor in GGUFReader(str(ours)).tensors:
        other = their.get(tensor.name)
        if other is None:
            continue
        shared.append(tensor.name)
        if tensor.tensor_type != other.tensor_type or not np.array_equal(
            tensor.data.view(np.uint8), other.data.view(np.uint8)
        ):
            differing.append(tensor.name)
    return shared, differing


def compare_with_converter(
    converter_dir: Path,
    converter_name: str,
    merged_dir: Path,
    ours: Path,
    ours_base: Path,
    quant: str,
    quantizer: str,
    scratch: Path,
    judge: Callable[[Path], list[GGUFCheck]],
) -> ConverterReference:
    """Convert ``merged_dir`` with llama.cpp's converter, quantize as ``ours`` was, and compare (see the module
    doc); ``judge`` runs every runtime on the reference file as on ours. ``ours_base``: our unquantized file
    (``ours`` itself for a plain type). RuntimeError where the converter fails."""
    started = time.perf_counter()
    plain = quantizer == ""
    base = scratch / f"reference-{quant if plain else 'f16'}.gguf"
    convert(converter_dir, merged_dir, base, quant if plain else "f16")
    final = base
    if not plain:
        final = scratch / f"reference-{quant}.gguf"
        quantize_with_llama_cpp(base, final, quant)
    theirs, mine = tensor_types(final), tensor_types(ours)
    differences = [
        f"{name}: ours {mine.get(name, 'absent')}, llama.cpp's {theirs.get(name, 'absent')}"
        for name in dict.fromkeys([*mine, *theirs])
        if mine.get(name) != theirs.get(name)
    ]
    shared, differing = _byte_identical(ours_base, base)
    found = ConverterReference(
        converter=converter_name,
        file_type=quant,
        types_equal=not differences,
        type_differences=differences,
        base_identical=len(shared) - len(differing),
        base_compared=len(shared),
        base_differing=differing,
    )
    found.types = mine
    if not plain:
        quantized_shared, quantized_differing = _byte_identical(ours, final)
        found.quantized_identical = len(quantized_shared) - len(quantized_differing)
    found.checks = judge(final)
    found.seconds = time.perf_counter() - started
    return found
