"""The compatibility sweep: is packed training exact, or refused, on every causal-LM architecture?

For one ``model_type`` of transformers' causal-LM registry, :func:`check_architecture` builds a
tiny random model with its special features on (:mod:`slipstream.models.tiny_any`) and runs:

* the **reference**: each document alone through the stock model (training mode, no
  dropout): its logits, its loss, and every parameter gradient of the token-weighted loss
  over all documents (what a padded batch trains);
* the **slipstream arm**: a copy of the same weights under ``slipstream.optimize`` with every
  speedup on (packed attention, sorted MoE routing where it applies, the chunked loss, the
  double-buffered offload engine driven synchronously on the CPU), on the documents packed in
  one row: logits (a forward without labels), loss and every gradient (a forward with labels);
* when slipstream refuses, the **advised fallback** the error names (``packed_attention=False``
  runs the documents as a right-padded batch; another option runs packed) must itself match;
* a packed arm that passes runs again with its documents grouped by length into batched SDPA
  calls (``attention_grouping="grouped"``), which must match too;
* a verdict that passed runs again with the compiled fused RMSNorm / SwiGLU kernels on every
  module class their probe passes (``fused_kernels="compiled"``; dynamo's eager backend unless
  ``compile=True``), which must match too;
* a packed verdict that passed runs the **shared-prefix checks** under the passing arm's options
  (:mod:`.prefix_parity`, which says what each compares): preference pairs packed ``prompt |
  chosen | rejected`` (:func:`check_prefix_sharing`) and prefix groups packed by ``collate_groups``
  (:func:`check_prefix_groups`), each against its rows run alone through the stock model;
* opt-in (``compile=True``, the sweep's ``--compile``: a cold inductor compile costs 45-55 s per
  architecture on a 2-core CPU, hours for the registry), the passing arm runs again with its
  decoder layers compiled (``compile="on"``), which must match too;
* when the arm is wrong or crashes, ablations (one speedup at a time) name the culprit.

Outcomes: ``pass`` (within :data:`slipstream.parity.TOLERANCE`), ``refused`` (a slipstream error naming the
feature, with a verified fallback), ``WRONG`` (a silent difference), ``CRASH`` (any other
exception), ``unbuilt`` (the tiny model could not be made: a gap in the sweep, not a verdict).
``benchmarks/compat_sweep.py`` runs every architecture, each in a worker process, and writes
``docs/compatibility.md``. ``unchecked``: an entry :data:`NOT_CHECKABLE` names, with the reason.

Where the pieces live: :mod:`slipstream.compat`'s docstring; this module: one architecture's verdict
(:func:`check_architecture`) and the sweep over the registry in worker processes (:func:`sweep`).
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import sys
import threading
import time
import warnings
from typing import Any

import torch
import transformers

from ..models.tiny_any import causal_lm_class, tiny_model
from ..moe.experts import is_moe_model
from ..parity import SEED, documents, reference
from .arm import Verdict, advice_of, run_arm, run_with_offload_fallback, short, where
from .columns import Subject, base_columns, check_columns

# Registry entries a plain token-ids training step cannot exercise, and why: the sweep reports
# them as "not checked" rather than pretending a verdict.
NOT_CHECKABLE = {
    "gemma3n": "its vision tower is a timm model (timm is not a dependency); gemma3n_text is checked",
    "gemma4_assistant": "a speculative-decoding drafter: runs on the target model's embeddings and shared KV, no loss",
    "gemma4_unified_assistant": "a speculative-decoding drafter: runs on the target model's embeddings and "
    "shared KV, no loss",
    "musicgen": "audio codebooks: its ids and labels are [batch, length, codebooks], not text tokens",
    "musicgen_melody": "audio codebooks: its ids and labels are [batch, length, codebooks], not text tokens",
}

ABLATIONS: dict[str, tuple[dict[str, Any], bool, bool]] = {
    # name -> (optimize options, packed batch?, offload?)
    "packed attention only": ({"chunked_loss": False, "moe_routing": "stock"}, True, False),
    "chunked loss only (unpacked)": ({"packed_attention": False, "moe_routing": "stock"}, False, False),
    "sorted routing only (unpacked)": ({"packed_attention": False, "chunked_loss": False}, False, False),
    "offload only (unpacked)": (
        {"packed_attention": False, "chunked_loss": False, "moe_routing": "stock"},
        False,
        True,
    ),
}


def check_architecture(model_type: str, seed: int = SEED, compile: bool = False) -> Verdict:
    """The verdict for one registry ``model_type`` (never raises); ``compile``: also the compiled
    arm (see the module docstring)."""

    started = time.perf_counter()
    verdict = Verdict(model_type)
    if model_type in NOT_CHECKABLE:
        verdict.status, verdict.detail = "unchecked", NOT_CHECKABLE[model_type]
        return verdict
    try:
        verdict.class_name = causal_lm_class(model_type).__name__
        stock = tiny_model(model_type, seed=seed)
        docs = documents(stock, seed=seed)
        ref = reference(stock, docs)
        again = reference(stock, docs)
        if abs(again.loss - ref.loss) > 1e-6 * max(1.0, abs(ref.loss)):
            raise RuntimeError("the stock model is not deterministic in training mode")
    except Exception as error:  # noqa: BLE001
        verdict.status, verdict.detail = "unbuilt", short(error) + " @ " + where(error)
        verdict.seconds = time.perf_counter() - started
        return verdict

    verdict.moe = is_moe_model(stock)
    arm, offload_note = run_with_offload_fallback(stock, docs, ref, {})
    verdict.arm = arm
    verdict.status, verdict.detail = arm.status, arm.detail
    if arm.status == "pass":
        verdict.speedups = base_columns(verdict, arm, offload_note)
    elif arm.status == "refused":
        # Follow the advice, and the advice of a refusal on the way, as a user would.
        options: dict[str, Any] = {}
        result, detail = arm, arm.detail
        while result.status == "refused" and len(options) < 4:
            option = advice_of(result)
            if option is None or option.items() <= options.items():
                break
            options.update(option)
            packed = options.get("packed_attention", True) is not False
            result, offload_note = run_with_offload_fallback(stock, docs, ref, dict(options), packed=packed)
        verdict.fallback = {"advice": options or None, "result": result}
        if not options:
            verdict.status = "CRASH"
            verdict.detail = f"refused without naming a way out: {detail}"
        elif result.status == "pass":
            verdict.speedups = base_columns(verdict, result, offload_note)
        else:
            verdict.status = "WRONG" if result.status == "WRONG" else "CRASH"
            verdict.detail = (
                f"refused ({detail}); the advised fallback {options} is {result.status}: {result.detail}"
            )
    if verdict.status in ("pass", "refused") and verdict.speedups:
        advised = (verdict.fallback or {}).get("advice") or {}
        check_columns(
            verdict, Subject(stock, docs, ref, dict(advised), seed, inductor=compile), compile=compile
        )
    if verdict.status in ("WRONG", "CRASH"):
        for name, (options, packed, offload) in ABLATIONS.items():
            verdict.ablations[name] = run_arm(stock, docs, ref, options, packed=packed, offload=offload)
    verdict.seconds = time.perf_counter() - started
    return verdict


def causal_lm_model_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


# --------------------------------------------------------------------------- the sweep, in worker processes


def _worker(model_types: list[str], compile: bool = False) -> None:
    """Worker process: one ``START`` line, then one ``RESULT`` JSON line, per model type."""

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    for model_type in model_types:
        print("START " + model_type, flush=True)
        verdict = check_architecture(model_type, compile=compile)
        print("RESULT " + json.dumps(verdict.to_dict(), default=str), flush=True)


def sweep(
    model_types: list[str], workers: int = 2, timeout_s: float = 300.0, progress=None, compile: bool = False
) -> list[dict[str, Any]]:
    """Check every model type, ``workers`` processes at a time; a worker that dies (an abort in
    a native kernel) or hangs costs only the model type it was on, which is recorded as CRASH.
    ``compile``: also the compiled arm of each (slow: see the module docstring)."""

    pending = list(model_types)
    results: dict[str, dict[str, Any]] = {}
    lock = threading.Lock()

    def take(n: int) -> list[str]:
        with lock:
            batch, pending[:] = pending[:n], pending[n:]
            return batch

    def run_worker() -> None:
        while True:
            batch = take(max(1, min(12, len(pending) // max(1, workers) or 1)))
            if not batch:
                return
            command = [
                sys.executable,
                "-c",
                f"from slipstream.compat.architectures import _worker; _worker({batch!r}, compile={compile!r})",
            ]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            lines: queue.Queue[str | None] = queue.Queue()

            def pump(stream=process.stdout, lines=lines) -> None:
                for line in stream:
                    lines.put(line)
                lines.put(None)

            threading.Thread(target=pump, daemon=True).start()
            current, done = None, []
            while True:
                try:
                    line = lines.get(timeout=timeout_s)
                except queue.Empty:
                    process.kill()
                    line = None
                    reason = f"no result within {timeout_s:.0f} s"
                else:
                    reason = "the worker process died"
                if line is None:
                    break
                if line.startswith("START "):
                    current = line[6:].strip()
                elif line.startswith("RESULT "):
                    verdict = json.loads(line[7:])
                    with lock:
                        results[verdict["model_type"]] = verdict
                    done.append(verdict["model_type"])
                    if progress:
                        progress(verdict)
                    current = None
            process.wait()
            if current is not None:  # died or hung on `current`: record it, requeue the rest
                verdict = Verdict(
                    current, status="CRASH", detail=f"{reason} (exit {process.returncode})"
                ).to_dict()
                with lock:
                    results[current] = verdict
                if progress:
                    progress(verdict)
                rest = [t for t in batch if t not in done and t != current]
                with lock:
                    pending[:0] = rest

    threads = [threading.Thread(target=run_worker) for _ in range(max(1, workers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[t] for t in model_types if t in results]


__all__ = ["ABLATIONS", "NOT_CHECKABLE", "causal_lm_model_types", "check_architecture", "sweep"]
