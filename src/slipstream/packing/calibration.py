"""The per-document SDPA path's cost figures, measured on this device (a few seconds, once, cached).

What :class:`.costs.AttentionCosts` holds, timed here, forward + backward, each figure the best of
its repeats with the kernels it compares taking turns (so a slow phase of the machine touches both):

- the short-document kernel against SDPA, on a 1,024-token row of documents of L tokens as one
  batched call (L = 32 ... 256, 8 query / 4 KV heads of 64): the crossover is the longest L up to
  which the short kernel is at least :data:`SHORT_MARGIN` faster at every L measured (0: never);
- a call's fixed cost: 64 documents of 8 tokens (4 / 2 heads of 32), one SDPA call each against one
  batched call, the difference over 63 calls;
- a score element's cost: 4 documents of 256 tokens (8 / 4 heads of 64), one call each, less their
  calls' fixed cost, over their score elements x heads x head dim;
- the gather and scatter: grouping's own copies of a 1,024-token row's queries into the groups and
  back out (8 heads of 64), over the elements moved.

Cached under ``$SLIPSTREAM_CACHE/calibration/`` per device (``hardware.device_identity``: its name,
CPU class and kernel caps, torch's version), dtype and thread count; ``slipstream doctor
--recalibrate`` measures again (a figure taken while the machine was busy would otherwise stay).
Only a CPU is measured: on CUDA the rules do not apply (varlen flash attends a row in one call,
and the short kernel is a CPU kernel), so :data:`.costs.BUILTIN` stands there.

A machine busy with other work while it measures (another training run, a test worker, a
neighbour VM's steal) times every call slower, and those figures would decide the grouping and
the short kernel for every later run. So the measurement watches the machine's other load
(:func:`slipstream.hardware.other_load`: the cores other processes took beyond those the
measurement left free); when it was crowded it measures once more after a pause, and if it is
crowded again it does not decide: the built-in figures stand, the policy line says why, nothing is
cached (the next process measures again) and this process does not try again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import hardware
from ..atomic import write_text_atomically
from ..data.cache import cache_root
from ..hardware import device_identity
from ..utilisation.peak import torch_threads
from .collator import collate_packed
from .costs import BUILTIN, AttentionCosts
from .grouping import _FromSlots, _ToSlots, document_groups
from .short_attention import short_causal_attention

# Bumped when what is measured changes, so a figure the old calibration cached is measured again.
VERSION = 1
SHORT_LENGTHS = (32, 64, 96, 128, 160, 192, 256)
SHORT_MARGIN = 0.05  # the short kernel must be this much faster to be taken
ROW = 1024
REPEATS = 5
QUIET_TRIES = 2  # measurements tried before a crowded machine leaves the built-in figures standing
PAUSE_S = 2.0  # between two tries


def _forward_backward(fn, inputs: list[torch.Tensor], grad: torch.Tensor) -> float:
    for tensor in inputs:
        tensor.grad = None
    started = time.perf_counter()
    fn(*inputs).backward(grad)
    return time.perf_counter() - started


def _best_in_turns(arms: dict[str, tuple], repeats: int = REPEATS) -> dict[str, float]:
    """The best forward + backward time of each ``name: (fn, inputs, grad)``, the arms taking turns
    after one untimed call each."""
    for fn, inputs, grad in arms.values():
        _forward_backward(fn, inputs, grad)
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(repeats):
        for name, (fn, inputs, grad) in arms.items():
            best[name] = min(best[name], _forward_backward(fn, inputs, grad))
    return best


def _tensors(shape_q, shape_kv, dtype, generator):
    def make(shape):
        return torch.randn(shape, dtype=torch.float32, generator=generator).to(dtype).requires_grad_()

    inputs = [make(shape_q), make(shape_kv), make(shape_kv)]
    return inputs, torch.randn(shape_q, generator=generator).to(dtype)


def _short_kernel_ratios(dtype: torch.dtype, generator) -> dict[int, float]:
    """SDPA's time over the short kernel's, per document length (> 1: the short kernel is faster)."""
    heads, kv_heads, dim = 8, 4, 64

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def short(q, k, v):
        return short_causal_attention(q, k, v, dim**-0.5, None)

    ratios = {}
    for length in SHORT_LENGTHS:
        n = max(1, ROW // length)
        inputs, grad = _tensors((n, heads, length, dim), (n, kv_heads, length, dim), dtype, generator)
        best = _best_in_turns({"sdpa": (sdpa, inputs, grad), "short": (short, inputs, grad)})
        ratios[length] = best["sdpa"] / best["short"]
    return ratios


def _row(lengths: list[int], heads: int, kv_heads: int, dim: int, dtype: torch.dtype, generator):
    """A packed row of documents: its batch, q / k / v in the model's layout, and an output gradient."""
    batch = collate_packed([{"input_ids": [1] * n} for n in lengths])
    tokens = batch.num_tokens

    def make(h):
        x = torch.randn(1, tokens, h, dim, generator=generator).to(dtype)
        return x.transpose(1, 2).requires_grad_()

    return batch, [make(heads), make(kv_heads), make(kv_heads)], torch.randn(1, heads, tokens, dim).to(dtype)


def _grouping_costs(dtype: torch.dtype, generator) -> dict[str, float]:
    """The cost model's three timings (seconds), from SDPA one call per document, one batched call,
    and grouping's own copies."""
    from .grouping import run_grouped

    def sdpa(q, k, v, **_):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])

    def one_call_each(batch):
        lengths = list(batch.seq_lens)

        def run(q, k, v):
            parts = [
                sdpa(a, b, c)
                for a, b, c in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2), strict=True)
            ]
            return torch.cat(parts, dim=2)

        return run

    def grouped(batch, heads, kv_heads, dim):
        groups = document_groups(batch, "grouped", heads, kv_heads, dim)

        def run(q, k, v):
            return run_grouped(sdpa, groups, q, k, v).transpose(1, 2)

        return run

    # calls: 64 documents of 8 tokens, one call each against one batched call
    batch, inputs, grad = _row([8] * 64, 4, 2, 32, dtype, generator)
    best = _best_in_turns(
        {"each": (one_call_each(batch), inputs, grad), "grouped": (grouped(batch, 4, 2, 32), inputs, grad)}
    )
    # a difference lost in the noise of a busy machine (the batched call timed no faster) floors at 0.1 us
    # a call, less than any call costs (as the score's floor below): a cost model never holds a free call
    call = max((best["each"] - best["grouped"]) / 63, 1e-7)
    # scores: 4 documents of 256 tokens, one call each, less their calls
    batch, inputs, grad = _row([256] * 4, 8, 4, 64, dtype, generator)
    best_scores = _best_in_turns({"each": (one_call_each(batch), inputs, grad)})
    score = max(best_scores["each"] - 4 * call, 1e-12) / (4 * 256 * 256 * 8 * 64)
    # the gather and scatter: grouping's copies (and their backwards) of a 1,024-token row's queries,
    # in and back out, per element moved
    batch, inputs, grad = _row([96] * 10 + [64], 8, 4, 64, dtype, generator)
    groups = document_groups(batch, "grouped", 8, 4, 64)

    def move(q, k, v):
        return _FromSlots.apply(_ToSlots.apply(q[0].transpose(0, 1), groups), groups).transpose(1, 2)

    best_move = _best_in_turns({"move": (move, inputs, grad)})
    gather = best_move["move"] / (batch.num_tokens * 2 * 8 * 64)
    return {"call_seconds": call, "score_seconds": score, "gather_seconds": gather}


def measure(dtype: torch.dtype) -> AttentionCosts:
    """Time the figures on this CPU, now, at torch's current thread count (see the module)."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    ratios = _short_kernel_ratios(dtype, generator)
    # the longest length of the unbroken run, from the shortest, where the short kernel is faster
    faster = itertools.takewhile(lambda length: ratios[length] >= 1 + SHORT_MARGIN, SHORT_LENGTHS)
    limit = max(faster, default=0)
    grouping = _grouping_costs(dtype, generator)
    seconds = time.perf_counter() - started
    name = str(dtype).removeprefix("torch.")
    return AttentionCosts(
        **grouping,
        short_max_len=((name, limit),) if limit else (),
        source=f"measured on this device, {name}, {torch.get_num_threads()} threads",
        figures={
            "short_kernel_speedup_by_length": {str(k): round(v, 3) for k, v in ratios.items()},
            "seconds": round(seconds, 2),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
    )


def _cache_path(device: torch.device, dtype: torch.dtype, threads: int) -> Path:
    key = {**device_identity(device), "dtype": str(dtype), "threads": threads, "version": VERSION}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "calibration" / f"attention-{digest}.json"


def attention_costs(
    device: torch.device | str, dtype: torch.dtype, threads: int | None = None, remeasure: bool = False
) -> AttentionCosts:
    """This device's :class:`AttentionCosts` in ``dtype`` at ``threads`` (default: torch's now):
    measured once and cached (``remeasure``: measure again and replace it); :data:`BUILTIN` on
    anything but a CPU."""
    device = torch.device(device)
    if device.type != "cpu":
        return BUILTIN
    threads = threads or torch.get_num_threads()
    path = _cache_path(device, dtype, threads)
    if not remeasure and path.is_file():
        try:
            found = json.loads(path.read_text())
            found["short_max_len"] = tuple(tuple(pair) for pair in found["short_max_len"])
            return AttentionCosts(**found)
        except (OSError, ValueError, TypeError, KeyError):
            pass  # unreadable: measured again below
    if not remeasure and path.name in _UNDECIDED:
        return _UNDECIDED[path.name]
    with torch_threads(threads):
        costs, load = _measure_quietly(dtype, threads)
    if load.busy:
        _UNDECIDED[path.name] = costs
        return costs
    _UNDECIDED.pop(path.name, None)
    with contextlib.suppress(OSError):  # an unwritable cache measures again next time; these still serve
        write_text_atomically(path, json.dumps(dataclasses.asdict(costs), indent=1) + "\n")
    return costs


# What this process could not decide (the machine was crowded both times), by cache file name (the
# device, dtype and threads it is for): not measured again here, never written to the cache.
_UNDECIDED: dict[str, AttentionCosts] = {}


def _measure_quietly(dtype: torch.dtype, threads: int) -> tuple[AttentionCosts, hardware.OtherLoad]:
    """:func:`measure`, watched for other load; tried again after a pause when the machine was
    crowded. Returns the figures and the last try's load: where that was still busy, the built-in
    figures with a source saying why they stand."""
    for attempt in range(QUIET_TRIES):
        if attempt:
            time.sleep(PAUSE_S)
        with hardware.other_load(threads) as load:
            costs = measure(dtype)
        if not load.busy:
            return costs, load
    undecided = dataclasses.replace(
        BUILTIN,
        source=f"{BUILTIN.source}; not measured here: the machine was busy ({load.describe()}, "
        f"{QUIET_TRIES} tries), so the next run measures again",
        figures={
            "busy": {"other_cores": round(load.other_cores, 2), "threads": threads, "tries": QUIET_TRIES}
        },
    )
    return undecided, load
