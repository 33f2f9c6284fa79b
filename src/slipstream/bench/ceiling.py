"""The memory ceiling: the most packed tokens one training step fits within a memory budget.

For long-context fine-tuning this is the figure that matters: not how fast a step is, but how
long a step can be at all. For each arm, ``max_tokens_within`` doubles the tokens of one
packed micro-batch until a step no longer fits, then bisects. Each probe runs one optimizer
step in a fresh process (a fresh allocator: nothing of a bigger probe lingers):

- CUDA: the process may use only the budget (``set_per_process_memory_fraction``); an
  out-of-memory error means "does not fit"; the figure is ``max_memory_allocated``.
- CPU: the figure is the process's peak RSS during the step (VmHWM, reset before it). A
  watchdog thread ends the probe as soon as RSS passes the budget, so an arm that needs
  far more than the machine has is stopped early instead of taking the machine down.
"""

from __future__ import annotations

import dataclasses
import os
import re
import threading
import time
from concurrent.futures.process import BrokenProcessPool

import torch
from tqdm import tqdm

from ..data import demo_samples, demo_tokenizer
from ..train.step import train_step
from .ab_config import ABConfig, parse_bytes, resolve_device
from .arms import ARM_SPECS, build_arm_model, micro_batch_inputs

_OVER_BUDGET_EXIT = 86  # the watchdog's exit status
_MIN_TOKENS = 128


def proc_status_kib(field: str, pid: int | None = None, path: str | None = None) -> int:
    """A /proc status figure in KiB: VmRSS (now), VmHWM (peak since the last reset) of this process
    (or of ``pid``); ``path``: another such file (``/proc/meminfo``'s MemAvailable). OSError where absent."""
    with open(path or f"/proc/{pid or 'self'}/status") as status:
        found = re.search(rf"{field}:\s+(\d+)", status.read())
    if found is None:
        raise OSError(f"no {field} in {path or 'the process status'}")
    return int(found.group(1))


def _watch_rss(budget: int, stop: threading.Event) -> None:
    while not stop.wait(0.005):
        if proc_status_kib("VmRSS") * 1024 > budget:
            os._exit(_OVER_BUDGET_EXIT)


def probe_step(config_dict: dict, arm: str, docs: list[dict], vocab_size: int, budget: int) -> dict:
    """One optimizer step of ``arm`` on ``docs`` packed into one row; its peak memory and whether it fit."""
    config = ABConfig.from_dict(config_dict)
    device = resolve_device(config.ab.device)
    model = build_arm_model(config, arm, vocab_size, device)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=config.train.optimizer.lr
    )
    micro = [micro_batch_inputs(arm, docs, device)]
    start = time.perf_counter()
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / torch.cuda.mem_get_info()[1]))
        torch.cuda.reset_peak_memory_stats()
        try:
            train_step(model, micro, optimizer)
            torch.cuda.synchronize()
        except torch.OutOfMemoryError:
            return {"fits": False, "peak_bytes": None, "seconds": time.perf_counter() - start}
        peak = torch.cuda.max_memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM: the peak below is the step's
        stop = threading.Event()
        watchdog = threading.Thread(target=_watch_rss, args=(budget, stop), daemon=True)
        watchdog.start()
        train_step(model, micro, optimizer)
        stop.set()
        peak = proc_status_kib("VmHWM") * 1024
    return {"fits": peak <= budget, "peak_bytes": peak, "seconds": time.perf_counter() - start}


def ceiling_docs(tokens: int, seed: int) -> list[dict]:
    """Built-in demo documents (every token labelled) filling exactly ``tokens`` tokens."""
    tokenizer = demo_tokenizer()
    docs, total, rows = [], 0, 0
    while total < tokens:
        for sample in demo_samples(tokenizer, num_rows=512, seed=seed + rows):
            take = min(len(sample["input_ids"]), tokens - total)
            docs.append({"input_ids": sample["input_ids"][:take], "labels": sample["input_ids"][:take]})
            total += take
            if total == tokens:
                break
        rows += 512
    return docs


def max_tokens_within(config, arm: str, vocab_size: int, run_probe) -> dict:
    """Search the largest tokens-per-step of ``arm`` within ``config.ab.max_tokens_within``.

    ``run_probe(tokens) -> probe result`` runs one probe (in a fresh process). Doubling from
    ``config.train.data.max_seq_len`` up to 64x that, then bisection to 1/16 of the bracket.
    """
    budget = parse_bytes(config.ab.max_tokens_within)
    probes: list[dict] = []

    def fits(tokens: int) -> bool:
        result = run_probe(tokens)
        probes.append({"tokens": tokens, **result})
        return result["fits"]

    cap = 64 * config.train.data.max_seq_len
    low, high, tokens = None, None, config.train.data.max_seq_len
    while high is None and tokens <= cap:
        if fits(tokens):
            low, tokens = tokens, tokens * 2
        else:
            high = tokens
    while low is None and high > _MIN_TOKENS:  # even the first probe did not fit: halve
        if fits(high // 2):
            low = high // 2
        else:
            high //= 2
    if low is not None and high is not None:
        resolution = max(_MIN_TOKENS, (high - low) // 16)
        while high - low > resolution:
            middle = (low + high) // 2 // 64 * 64 or (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
    return {
        "arm": arm,
        "budget_bytes": budget,
        "max_tokens": low or 0,
        "capped": high is None,  # never failed up to the cap: the ceiling is higher still
        "vocab_size": vocab_size,
        "probes": probes,
    }


def fresh_probe(run_in_fresh_process, config_dict: dict, arm: str, tokens: int, vocab_size: int) -> dict:
    """``probe_step`` in a fresh process; a process that ended (the watchdog, the OS) did not fit."""
    budget = parse_bytes(config_dict["ab"]["max_tokens_within"])
    docs = ceiling_docs(tokens, config_dict["train"]["seed"])
    try:
        return run_in_fresh_process(probe_step, config_dict, arm, docs, vocab_size, budget)
    except BrokenProcessPool:
        return {"fits": False, "peak_bytes": None, "seconds": 0.0, "ended": "over budget (process ended)"}


def search_all(config, vocab_size: int, run_in_fresh_process, progress: bool = True) -> dict[str, dict]:
    """The ceiling of every arm of ``config``, each probe in a fresh process (one line per probe)."""
    config_dict = dataclasses.asdict(config)

    def probe(arm: str, tokens: int) -> dict:
        result = fresh_probe(run_in_fresh_process, config_dict, arm, tokens, vocab_size)
        peak = f"{result['peak_bytes'] / 1e9:.2f} GB" if result["peak_bytes"] else "over budget"
        if progress:
            tqdm.write(
                f"ceiling {arm}: {tokens:,} tokens -> {peak} ({'fits' if result['fits'] else 'does not fit'})"
            )
        return result

    # A peer's step is its own tool's (TRL's trainer, Unsloth's venv): the probe step is ours, so
    # peers are left out of the search rather than measured as something they are not.
    return {
        arm: max_tokens_within(config, arm, vocab_size, lambda tokens, arm=arm: probe(arm, tokens))
        for arm in config.ab.arms
        if not ARM_SPECS[arm].peer
    }
