"""Arms in processes of their own, run one after another or in lockstep, a step at a time.

Every arm runs in its own spawned process (a fresh allocator, nothing shared). A machine's speed
is not constant: a shared VM measured the same step 2x slower for minutes at a time, and a
cloud GPU's clocks move with its temperature. Arms run one after another then meet different
phases, and the same computation measured 1.08-1.44x "faster" than itself here (BENCHMARKS.md).
In lockstep every arm's process is started first, and the parent then asks each in turn for its
step k before any is asked for step k + 1, the order rotating every step: each arm's step k is
timed within a few seconds of the others', so a slow phase slows every arm of the pair alike and
the paired interval (``stats.speedup``) measures the arms, not the machine's mood. Only one arm
computes at a time; the others wait on a pipe.

The price is memory: every arm's model lives at once. ``interleave="auto"`` takes lockstep when the
first arm's peak (measured on its first step) times the arm count fits in what the machine has
available, and says why not otherwise; ``"steps"`` insists, ``"arms"`` runs arms one after another.
A peer in a process of its own (Unsloth's worker) runs its steps at once, before the lockstep.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import traceback
from collections.abc import Callable

from ..noise import hide_known_noise, known_noise_hidden_here
from .ab_config import Interleave
from .arm_run import open_arm
from .ceiling import proc_status_kib

# Lockstep needs (arms - 1) x the first arm's peak x this much of the machine's available memory.
MEMORY_MARGIN = 1.3


def run_in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process (spawned: fresh allocator, no state shared between arms).

    It hides the known third-party noise (``slipstream.noise``) when this process does."""
    context = multiprocessing.get_context("spawn")
    initializer = hide_known_noise if known_noise_hidden_here() else None
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=initializer
    ) as pool:
        return pool.submit(fn, *args).result()


class ArmProcessError(RuntimeError):
    """An arm's process failed; the message carries its traceback."""


def _serve(connection, hide_noise: bool, config_dict: dict, arm: str, plan: list, vocab_size: int) -> None:
    """The arm process: open the arm, then train each step it is asked for; send back its result."""
    if hide_noise:
        hide_known_noise()
    try:
        session = open_arm(config_dict, arm, plan, vocab_size)
        if isinstance(session, dict):  # skipped, or a peer that ran every step in its own process
            connection.send(("result", session))
            return
        connection.send(("ready", None))
        while True:
            command, step = connection.recv()
            if command == "step":
                connection.send(("stepped", session.step(step)))
            else:
                connection.send(("result", session.finish()))
                return
    except BaseException as error:  # noqa: BLE001 - handed to the parent, which raises it
        connection.send(("error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


class ArmProcess:
    """One arm's process, driven a step at a time over a pipe."""

    def __init__(self, config_dict: dict, arm: str, plan: list, vocab_size: int):
        context = multiprocessing.get_context("spawn")
        self.arm = arm
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, known_noise_hidden_here(), config_dict, arm, plan, vocab_size),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.result: dict | None = None

    def _receive(self):
        try:
            kind, value = self.connection.recv()
        except EOFError:
            self.process.join()
            raise ArmProcessError(f"{self.arm}: its process ended (exit {self.process.exitcode})") from None
        if kind == "error":
            self.process.join()
            raise ArmProcessError(f"{self.arm}: {value}")
        if kind == "result":
            self.result = value
            self.process.join()
        return kind, value

    def wait_ready(self) -> bool:
        """Wait until the arm is set up; False when it already finished (skipped, or ran in full)."""
        kind, _ = self._receive()
        return kind == "ready"

    def step(self, step: int) -> float:
        self.connection.send(("step", step))
        return self._receive()[1]

    def finish(self) -> dict:
        if self.result is None:
            self.connection.send(("finish", None))
            self._receive()
        return self.result

    def peak_rss_bytes(self) -> int | None:
        """The process's peak resident memory so far (Linux), or None where it cannot be read."""
        try:
            return proc_status_kib("VmHWM", pid=self.process.pid) * 1024
        except OSError:
            return None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join()


def available_memory_bytes() -> int | None:
    """What the machine can still give (MemAvailable, Linux), or None where it is not known."""
    try:
        return proc_status_kib("MemAvailable", path="/proc/meminfo") * 1024
    except OSError:
        return None


def run_lockstep(
    config_dict: dict,
    arms: list[str],
    plan: list,
    vocab_size: int,
    mode: Interleave,
    progress: Callable[[str], None] | None = None,
) -> tuple[dict[str, dict], dict]:
    """Every arm of one repeat: its result, and how they were scheduled (``{"mode", "why"}``).

    The first arm is opened and runs its first step alone; then, in lockstep, the others are opened
    (all at once), run their first step, and every later step goes round the arms, the order rotated
    by one each step. Where lockstep does not fit (or ``mode="arms"``) each arm runs all its steps
    in turn, as before."""
    results: dict[str, dict] = {}
    steps = len(plan)
    pending = list(arms)
    first: ArmProcess | None = None
    while pending and first is None:  # the first arm that trains here (a skipped peer has no steps)
        candidate = ArmProcess(config_dict, pending.pop(0), plan, vocab_size)
        if candidate.wait_ready():
            first = candidate
        else:
            results[candidate.arm] = candidate.finish()
    if first is None:
        return results, {"mode": "arms", "why": "no arm trained here"}
    first.step(0)
    decided, why = _decide(mode, first, len(pending))
    if progress:
        progress(f"{first.arm}: arms {'in lockstep' if decided == 'steps' else 'one after another'} ({why})")
    if decided == "arms":
        for step in range(1, steps):
            first.step(step)
        results[first.arm] = first.finish()
        for arm in pending:
            process = ArmProcess(config_dict, arm, plan, vocab_size)
            if process.wait_ready():
                for step in range(steps):
                    process.step(step)
            results[arm] = process.finish()
        return results, {"mode": "arms", "why": why}
    processes = {arm: ArmProcess(config_dict, arm, plan, vocab_size) for arm in pending}
    live = [first]
    try:
        for arm, process in processes.items():
            if process.wait_ready():
                process.step(0)
                live.append(process)
            else:
                results[arm] = process.finish()
        for step in range(1, steps):
            turn = step % len(live)
            for process in live[turn:] + live[:turn]:
                process.step(step)
        for process in live:
            results[process.arm] = process.finish()
    finally:
        for process in [first, *processes.values()]:
            if process.result is None:
                process.kill()
    return {arm: results[arm] for arm in arms if arm in results}, {"mode": "steps", "why": why}


def _decide(mode: Interleave, first: ArmProcess, others: int) -> tuple[str, str]:
    """("steps" | "arms", why): lockstep where every arm's model fits beside the others."""
    if mode == "arms":
        return "arms", "asked for (--interleave arms)"
    if others == 0:
        return "arms", "one arm trains here"
    if mode == "steps":
        return "steps", "asked for (--interleave steps)"
    peak, free = first.peak_rss_bytes(), available_memory_bytes()
    if peak is None or free is None:
        return "arms", "the arms' memory cannot be read on this system"
    needed = others * peak * MEMORY_MARGIN
    gib = 2**30
    if needed > free:
        return "arms", (
            f"{others + 1} arms of ~{peak / gib:.1f} GiB each would not fit beside each other in the "
            f"{free / gib:.1f} GiB available; a slow phase of the machine may favour one arm: use --repeats"
        )
    return "steps", (
        f"{others + 1} arms of ~{peak / gib:.1f} GiB each fit in the {free / gib:.1f} GiB available; "
        "each step timed next to the others'"
    )
