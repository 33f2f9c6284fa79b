"""Arms in processes of their own, run one after another or in lockstep, a step at a time.

Every arm runs in its own spawned process (a fresh allocator, nothing shared). A machine's speed
is not constant: a shared VM measured the same step 2x slower for minutes at a time, and a
cloud GPU's clocks move with its temperature. Arms run one after another then meet different
phases: three processes of the same computation, one after another, measured 1.08x, 1.25x and
1.44x the stock arm's throughput in one run here (BENCHMARKS.md).
In lockstep every arm's process is started first, and the parent then asks each in turn for its
step k before any is asked for step k + 1, the order rotating every step: each arm's step k is
timed within a few seconds of the others', so a slow phase slows every arm of the pair alike and
the paired interval (``stats.speedup``) measures the arms, not the machine's mood. Only one arm
computes at a time; the others wait on a pipe.

Waiting must not change what an arm measures. On a CPU each arm holds, between two of its steps,
the memory its steps churn, and lets it go just before its next step (``host_pages.py``, on in every
mode, ``--no-keep-pages-warm`` to measure without it): on a VM the host takes a waiting process's
freed pages back, and an arm that waited would fault its next step's memory in cold. Each arm's
steps also record their page faults and the other load beside them (``hardware.OtherLoad``), so a
step that shared the machine is counted and said in the report.

The price is memory: every arm's model lives at once. ``interleave="auto"`` opens the arms one by
one, each running its first (untimed) step, and admits the next while the largest peak seen so far
fits in what the machine still has available; where they do not all fit it says why and runs them
one after another. ``"steps"`` insists, ``"arms"`` runs arms one after another. A peer in a process
of its own (Unsloth's worker) runs its steps at once, when its turn to open comes.
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

# One more arm is opened while the largest peak of the arms alive, times this, fits in what is available.
MEMORY_MARGIN = 1.2


def run_in_fresh_process(fn, *args):
    """``fn(*args)`` in a new process (spawned: fresh allocator, no state shared between arms).

    It hides the known third-party noise (``slipstream.noise``) when this process does."""
    context = multiprocessing.get_context("spawn")
    initializer = hide_known_noise if known_noise_hidden_here() else None
    with concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=context, initializer=initializer
    ) as pool:
        return pool.submit(fn, *args).result()


class ArmTraceback(Exception):
    """An arm process's traceback, as text: the cause of its :class:`ArmProcessError`, so a traceback
    of that error (``slipstream --debug``) shows where the arm failed, as ``concurrent.futures`` shows a
    worker's."""

    def __str__(self) -> str:
        return f'\n"""\n{self.args[0]}"""'


class ArmProcessError(RuntimeError):
    """An arm's process failed: one line, the arm and its error's type and message; the process's
    traceback is the cause (an :class:`ArmTraceback`), kept out of the line a person reads."""

    def __init__(self, arm: str, error: str, arm_traceback: str | None = None):
        super().__init__(f"arm {arm} failed: {error}")
        self.arm = arm
        if arm_traceback:
            self.__cause__ = ArmTraceback(arm_traceback)


def _serve(
    connection,
    hide_noise: bool,
    config_dict: dict,
    arm: str,
    plan: list,
    vocab_size: int,
    gradient_dir: str | None = None,
) -> None:
    """The arm process: open the arm, then train each step it is asked for; send back its result."""
    if hide_noise:
        hide_known_noise()
    try:
        session = open_arm(config_dict, arm, plan, vocab_size, gradient_dir=gradient_dir)
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
        connection.send(("error", (f"{type(error).__name__}: {error}", traceback.format_exc())))


class ArmProcess:
    """One arm's process, driven a step at a time over a pipe (``gradient_dir``: where it keeps its
    step-0 gradient, ``step_gradient.HeldGradient``)."""

    def __init__(
        self, config_dict: dict, arm: str, plan: list, vocab_size: int, gradient_dir: str | None = None
    ):
        context = multiprocessing.get_context("spawn")
        self.arm = arm
        self.connection, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, known_noise_hidden_here(), config_dict, arm, plan, vocab_size, gradient_dir),
            daemon=True,
        )
        self.process.start()
        child.close()
        self.result: dict | None = None
        self.steps_done = 0

    def _receive(self):
        try:
            kind, value = self.connection.recv()
        except EOFError:
            self.process.join()
            raise ArmProcessError(self.arm, f"its process ended (exit {self.process.exitcode})") from None
        if kind == "error":
            self.process.join()
            raise ArmProcessError(self.arm, *value)
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
        seconds = self._receive()[1]
        self.steps_done += 1
        return seconds

    def finish(self, steps: int) -> dict:
        """Train the steps left of ``steps``, then the arm's result (at once where it already finished:
        skipped, or ran in full)."""
        if self.result is None:
            for step in range(self.steps_done, steps):
                self.step(step)
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
    gradient_dir: str | None = None,
) -> tuple[dict[str, dict], dict]:
    """Every arm of one repeat, scheduled as the module says: its result, and how they were scheduled
    (``{"mode", "why"}``). ``gradient_dir``: every arm keeps its step-0 gradient there
    (``step_gradient.HeldGradient``, for ``bench/truth.py``)."""
    results: dict[str, dict] = {}
    live: list[ArmProcess] = []
    why = "asked for (--interleave arms)" if mode == "arms" else None
    pending = list(arms)
    try:
        while pending and why is None:
            if live and mode == "auto":
                why = _no_room(live, len(arms) - len(results))
                if why:
                    break
            process = ArmProcess(config_dict, pending.pop(0), plan, vocab_size, gradient_dir)
            if process.wait_ready():
                process.step(0)
                live.append(process)
            else:  # skipped, or a peer that ran every step in its own process
                results[process.arm] = process.finish(len(plan))
        lockstep = why is None and len(live) > 1
        if lockstep:
            why = ("asked for (--interleave steps); " if mode == "steps" else "") + _room(live)
        elif why is None:
            why = "one arm trains here"
        if progress:
            progress(f"arms {'in lockstep' if lockstep else 'one after another'} ({why})")
        for step in range(1, len(plan) if lockstep else 1):
            turn = step % len(live)
            for process in live[turn:] + live[:turn]:
                process.step(step)
        for process in live:  # (one after another: each open arm's remaining steps in turn)
            results[process.arm] = process.finish(len(plan))
        for arm in pending:
            process = ArmProcess(config_dict, arm, plan, vocab_size, gradient_dir)
            live.append(process)
            process.wait_ready()  # (False: it finished already)
            results[arm] = process.finish(len(plan))
    finally:
        for process in live:
            if process.result is None:
                process.kill()
    ordered = {arm: results[arm] for arm in arms if arm in results}
    return ordered, {"mode": "steps" if lockstep else "arms", "why": why}


def _no_room(live: list[ArmProcess], arms_left: int) -> str | None:
    """Why one more arm would not fit beside the live ones (None: it fits)."""
    peaks = [process.peak_rss_bytes() for process in live]
    free = available_memory_bytes()
    if None in peaks or free is None:
        return "the arms' memory cannot be read on this system"
    needed = max(peaks) * MEMORY_MARGIN
    if needed <= free:
        return None
    gib = 2**30
    return (
        f"{len(live)} arms alive (up to {max(peaks) / gib:.1f} GiB each) leave {free / gib:.1f} GiB, too little "
        f"for {arms_left - len(live)} more beside them; a slow phase of the machine may favour one arm: use --repeats"
    )


def _room(live: list[ArmProcess]) -> str:
    peaks = [process.peak_rss_bytes() or 0 for process in live]
    free = available_memory_bytes() or 0
    return (
        f"{len(live)} arms of up to {max(peaks) / 2**30:.1f} GiB each alive at once, {free / 2**30:.1f} GiB "
        "left; each step timed next to the others'"
    )
