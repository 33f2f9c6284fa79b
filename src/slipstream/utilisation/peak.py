"""The device's dense-matmul peak, measured on the device in the run's dtype, cached.

MFU needs a peak. A datasheet's figure says nothing about a CPU at 2 threads or a clocked-down
GPU, so the peak is measured: square matmuls of growing size (256, 512, ... up to 8192, each
the best of up to 5 timed repeats after one untimed call), stopping once one matmul takes long
enough to time well or the probe has spent its budget (about a second); the peak is the best
FLOP/s of any size. On CUDA each repeat is timed with CUDA events. On a CPU with more than one
thread each size is also timed as one matmul per thread side by side, each on one thread: a
two-core VM measured 1.1-1.5 TFLOP/s for one bf16 matmul on two threads and 2.25 for two
single-threaded ones at once (oneDNN does not always split a matmul across the cores), and the
peak is what the cores can do, however it is reached. The result is cached under
``$SLIPSTREAM_CACHE/matmul_peak/`` per device (``hardware.device_identity``: its name, CPU class and
kernel caps), dtype, thread count and torch version, so a
machine measures it once. A figure taken while the machine was busy would stick: ``remeasure=True``
(``slipstream doctor --remeasure-peak``) measures again and replaces the cached one atomically.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from ..atomic import write_text_atomically
from ..data.cache import cache_root
from ..hardware import cpu_name, device_identity  # noqa: F401 - cpu_name: found here by callers

SIZES = (256, 512, 1024, 2048, 4096, 8192)
REPEATS = 5  # timed calls per size, at most: fewer (but 2) once a size has taken SIZE_BUDGET_S
SIZE_BUDGET_S = 0.3
BUDGET_S = 1.0  # the probe stops growing the matrices past this
# Bumped when the probe changes what it measures, so a figure the old probe cached is measured again
# (2: matmuls side by side on a CPU's threads).
PROBE_VERSION = 2
LONG_ENOUGH_S = 0.05  # one matmul this long times well: no need for a bigger one
# The side-by-side matrices (a pair per thread) stop growing past this much memory: a many-core
# host's single-threaded matmuls reach its peak at smaller sizes anyway.
SIDE_BY_SIDE_BYTES = 512 * 2**20


def _cache_key(device: torch.device, dtype: torch.dtype, threads: int) -> dict:
    return {
        **device_identity(device),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": threads,
        "probe": PROBE_VERSION,
    }


@contextlib.contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Inside, torch runs ``threads`` intra-op threads; after, as many as before."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _cache_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "matmul_peak" / f"{digest}.json"


def _time_matmul(a: torch.Tensor, b: torch.Tensor, repeats: int) -> float:
    """The best of ``repeats`` timed ``a @ b`` (after one untimed call; at least 2 timed but none
    started past ``SIZE_BUDGET_S``), in seconds."""
    cuda = a.device.type == "cuda"
    began = time.perf_counter()
    torch.matmul(a, b)
    best = float("inf")
    for repeat in range(repeats):
        if repeat >= 2 and time.perf_counter() - began > SIZE_BUDGET_S:
            break
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.matmul(a, b)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            torch.matmul(a, b)
            best = min(best, time.perf_counter() - begin)
    return best


def _time_side_by_side(pairs: list[tuple[torch.Tensor, torch.Tensor]], repeats: int) -> float:
    """The best of ``repeats`` wall times (after one untimed round) of every ``a @ b`` in ``pairs``
    at once, one per thread, each thread's matmul on one intra-op thread. Seconds."""
    # one intra-op thread before the pool's threads exist: each of them starts with one
    with torch_threads(1), ThreadPoolExecutor(len(pairs) - 1) as pool:

        def round_s() -> float:
            began = time.perf_counter()
            others = [pool.submit(torch.matmul, a, b) for a, b in pairs[1:]]
            torch.matmul(*pairs[0])
            for other in others:
                other.result()
            return time.perf_counter() - began

        round_s()
        best, began = float("inf"), time.perf_counter()
        for repeat in range(repeats):
            if repeat >= 2 and time.perf_counter() - began > SIZE_BUDGET_S:
                break
            best = min(best, round_s())
        return best


def measure_matmul_peak(
    device: torch.device | str,
    dtype: torch.dtype,
    sizes=SIZES,
    repeats: int = REPEATS,
    budget_s: float = BUDGET_S,
) -> dict:
    """Measure now (no cache): ``{"flops_per_s", "tflops", "size", "seconds", "how",
    "one_matmul_flops_per_s", "side_by_side_flops_per_s"}``: the last is ``threads`` matmuls at
    once on a CPU, one thread each (None on one thread, on CUDA, or where every size's pairs would
    pass ``SIDE_BY_SIDE_BYTES``); the peak is the higher of the two."""
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(0)
    threads = torch.get_num_threads() if device.type == "cpu" else 1
    began, best, best_size, best_s, tried = time.perf_counter(), 0.0, 0, 0.0, []
    one_best, side_best = 0.0, None  # side_best: None until a size was timed side by side
    with torch.no_grad():
        for size in sizes:
            tried.append(size)
            side_by_side = threads > 1 and threads * 2 * size * size * dtype.itemsize <= SIDE_BY_SIDE_BYTES
            randn = partial(torch.randn, size, size, device=device, dtype=dtype, generator=generator)
            pairs = [(randn(), randn()) for _ in range(threads if side_by_side else 1)]
            seconds = _time_matmul(*pairs[0], repeats)
            rate = 2 * size**3 / seconds  # a multiply-add is 2 FLOPs
            one_best = max(one_best, rate)
            if rate > best:
                best, best_size, best_s = rate, size, seconds
            if side_by_side:
                side_s = _time_side_by_side(pairs, repeats)
                side_rate = threads * 2 * size**3 / side_s
                side_best = max(side_best or 0.0, side_rate)
                if side_rate > best:
                    best, best_size, best_s = side_rate, size, side_s
            del pairs
            if seconds >= LONG_ENOUGH_S or time.perf_counter() - began > budget_s:
                break
    if device.type == "cuda":
        torch.cuda.empty_cache()  # give the probe's matrices back before the model needs the memory
    timer = "CUDA events" if device.type == "cuda" else "perf_counter"
    how = (
        f"square matmuls of {', '.join(map(str, tried))} (growing until one takes {LONG_ENOUGH_S * 1000:.0f} ms "
        f"or {budget_s:g} s are spent), best of up to {repeats} by {timer}"
    )
    if side_best is not None:
        winner = "side by side" if side_best > one_best else "one matmul on every thread"
        how += (
            f", each as one matmul on {threads} threads ({one_best / 1e12:.3f} TFLOP/s) and as {threads} "
            f"matmuls side by side, one thread each ({side_best / 1e12:.3f} TFLOP/s in all); "
            f"fastest: {winner}, at {best_size}"
        )
    else:
        how += f"; fastest at {best_size}"
    return {
        "flops_per_s": best,
        "tflops": best / 1e12,
        "size": best_size,
        "seconds": best_s,
        "how": how,
        "one_matmul_flops_per_s": one_best,
        "side_by_side_flops_per_s": side_best,
    }


def matmul_peak(
    device: torch.device | str, dtype: torch.dtype, threads: int | None = None, remeasure: bool = False
) -> dict:
    """The device's dense-matmul peak in ``dtype``: from the cache, else measured once and cached.

    ``threads`` (CPU): the torch thread count to measure at (set for the probe, then restored);
    None: this process's. ``remeasure``: measure now even where a figure is cached; the higher of
    the two is kept (written atomically: a reader sees the old figure or the new, whole). A peak is
    what the device can do, and a lower figure means the probe shared it (a shared VM's matmul
    rate scatters 2x from one minute to the next), so MFU stays measured against the best seen.
    The result names what it was keyed by and whether it came from the cache."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    threads = threads or torch.get_num_threads()
    key = _cache_key(device, dtype, threads)
    path = _cache_path(key)
    try:
        cached = json.loads(path.read_text())
        if cached.get("key") != key:
            cached = None
        elif not remeasure:
            return {**key, **cached["peak"], "measured": cached["measured"], "cached": True}
    except (OSError, ValueError, KeyError):
        cached = None
    with torch_threads(threads):
        peak = measure_matmul_peak(device, dtype)
    measured = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    try:
        if cached is not None and cached["peak"]["flops_per_s"] >= peak["flops_per_s"]:
            kept = {**key, **cached["peak"], "measured": cached["measured"], "cached": True}
            return {**kept, "kept_over": f"{peak['tflops']:.3f} TFLOP/s measured at {measured}"}
    except (KeyError, TypeError):
        pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(path, json.dumps({"key": key, "peak": peak, "measured": measured}, indent=1))
    except OSError:
        pass  # a read-only cache: measured again next time
    return {**key, **peak, "measured": measured, "cached": False}
