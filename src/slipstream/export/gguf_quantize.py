"""llama.cpp's own quantizer, in process: the k-quants (``q4_k_m`` ...) and, where llama-cpp-python is
installed, every block type, made from the export's f16 file exactly as ``llama-quantize`` makes them.

Why llama.cpp's and not a quantizer of our own: the type of each tensor is llama.cpp's decision and changes
with its versions. ``Q4_K_M`` keeps some tensors at a higher type: ``attn_v`` and ``ffn_down`` in part of the
layers, and the head or the tied embedding at ``Q6_K``. A row whose width a k-quant block cannot hold falls
back to a legacy type. The file people run is the one llama.cpp's quantizer writes. llama-cpp-python
exposes that quantizer as ``llama_model_quantize(fname_inp, fname_out, params)``, with
``llama_model_quantize_default_params()``.

The i-quants and ``q2_k_s`` are refused: llama.cpp makes them from an importance matrix (``llama-imatrix``
over calibration text), which this export does not compute.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path

from .merged import ExportError

# the k-quants offered: llama.cpp's LLAMA_FTYPE_MOSTLY_<NAME> for each, no importance matrix needed
K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")
# made from an importance matrix (llama.cpp requires one for some, and builds the others around one)
IMATRIX_TYPES = (
    "q2_k_s", "iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m",
    "iq4_nl", "iq4_xs",
)  # fmt: skip
INSTALL = "pip install 'slipstream[gguf]' (llama-cpp-python, built from source once)"


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


@contextlib.contextmanager
def _captured_output():
    """The process's stdout and stderr (file descriptors 1 and 2, where llama.cpp's C code writes its
    per-tensor log) sent to a temporary file for the block's duration; yields a function that reads it."""
    with tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            for fd in (1, 2):
                os.dup2(sink.fileno(), fd)
            yield lambda: (sink.seek(0), sink.read().decode("utf-8", "replace"))[1]
        finally:
            for fd, copy in zip((1, 2), saved, strict=True):
                os.dup2(copy, fd)
                os.close(copy)


def quantize_with_llama_cpp(source: Path, out: Path, quant: str, threads: int | None = None) -> str:
    """``source`` (an f16 GGUF) quantized to ``quant`` at ``out`` by llama.cpp's ``llama_model_quantize``;
    returns llama.cpp's log. A failure is an ExportError with the log's last lines."""
    if not llama_cpp_available():
        raise ExportError(f"--quant {quant}: llama.cpp's own quantizer makes it: {INSTALL}")
    import llama_cpp

    name = f"LLAMA_FTYPE_MOSTLY_{quant.upper()}"
    if not hasattr(llama_cpp, name):
        raise ExportError(f"--quant {quant}: this llama-cpp-python ({llama_cpp.__version__}) has no {name}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = threads or os.cpu_count() or 1
    with _captured_output() as log:
        status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
        text = log()
    if status != 0:
        tail = " | ".join(line.strip() for line in text.strip().splitlines()[-3:])
        raise ExportError(f"{out}: llama.cpp's quantizer failed on {quant} (status {status}): {tail}")
    return text


def tensor_types(path: Path) -> dict[str, str]:
    """Each tensor's GGML type in the file at ``path`` (``{"blk.0.attn_v.weight": "Q6_K", ...}``), in order."""
    from gguf import GGUFReader

    return {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors}


def mixture(types: dict[str, str]) -> dict[str, int]:
    """How many tensors each type holds, the most common first."""
    return dict(Counter(types.values()).most_common())


def higher_than_nominal(types: dict[str, str], quant: str) -> dict[str, list[str]]:
    """The 2-D tensors llama.cpp kept at another type than ``quant``'s own, by type: what a ``_M`` mixture
    or a row a block cannot hold changed (1-D tensors, f32 by rule, left out)."""
    nominal = quant.upper().removesuffix("_M").removesuffix("_S").removesuffix("_L")
    found: dict[str, list[str]] = {}
    for name, kind in types.items():
        if kind not in ("F32", nominal):
            found.setdefault(kind, []).append(name)
    return found
