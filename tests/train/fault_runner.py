"""Test-only faults for ``train``: its ``after_step`` callbacks, and the CLI run with one.

In-process tests pass ``after_step=interrupt_after(n)`` (or another callback below) to
``train``; tests that need a real process (SIGKILL, torchrun) run this file as the CLI::

    python tests/train/fault_runner.py --kill-after 6 train config.yaml
    torchrun --nproc_per_node 2 tests/train/fault_runner.py --interrupt-after 2 --rank 1 train c.yaml
    torchrun --nproc_per_node 2 tests/train/fault_runner.py --nonfinite-at 2 --rank 1 train c.yaml

which is ``slipstream ...`` with the fault added to every ``train`` the CLI starts.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import sys
from collections.abc import Callable, Iterator

from slipstream.cli import main as cli_main
from slipstream.train import loop

AfterStep = Callable[[int], None]


def signal_after(step: int, *signals: signal.Signals, rank: int | None = None) -> AfterStep:
    """Raise ``signals`` in this process once ``step`` is complete (on rank ``rank`` only, if given)."""

    def after_step(done: int) -> None:
        if done == step and (rank is None or int(os.environ.get("RANK", "0")) == rank):
            for sig in signals:
                signal.raise_signal(sig)

    return after_step


def interrupt_after(step: int, rank: int | None = None) -> AfterStep:
    """What Ctrl-C after ``step`` does: a SIGINT to this process."""
    return signal_after(step, signal.SIGINT, rank=rank)


def kill_after(step: int) -> AfterStep:
    """SIGKILL this process once ``step`` is complete: nothing after it runs, not even a ``finally``."""

    def after_step(done: int) -> None:
        if done == step:
            os.kill(os.getpid(), signal.SIGKILL)

    return after_step


@contextlib.contextmanager
def nonfinite_at(steps: set[int], rank: int | None = None) -> Iterator[None]:
    """Make the loss of ``steps`` (1-based) infinite (on rank ``rank`` only, if given): a bad batch.

    The weights are left alone; only that step's loss (and so its gradients) is poisoned."""
    real = loop._train_step

    def poisoned(run, step: int):
        here = rank is None or int(os.environ.get("RANK", "0")) == rank
        if step + 1 not in steps or not here:
            return real(run, step)

        def hook(module, args, output):
            output.loss = output.loss * float("inf")
            return output

        handle = run.driver.model.register_forward_hook(hook)
        try:
            return real(run, step)
        finally:
            handle.remove()

    loop._train_step = poisoned
    try:
        yield
    finally:
        loop._train_step = real


@contextlib.contextmanager
def faulty_train(after_step: AfterStep) -> Iterator[None]:
    """Every ``train`` the CLI starts inside this gets ``after_step``."""
    real = loop.train
    loop.train = functools.partial(real, after_step=after_step)
    try:
        yield
    finally:
        loop.train = real


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--kill-after", type=int, metavar="STEP")
    fault.add_argument("--interrupt-after", type=int, metavar="STEP")
    fault.add_argument("--nonfinite-at", type=int, metavar="STEP")
    parser.add_argument("--rank", type=int, help="interrupt this rank only")
    args, cli_args = parser.parse_known_args(argv)
    print(f"fault_runner pid {os.getpid()}", flush=True)
    if args.nonfinite_at is not None:
        with nonfinite_at({args.nonfinite_at}, rank=args.rank):
            return cli_main(cli_args)
    if args.kill_after is not None:
        after_step = kill_after(args.kill_after)
    else:
        after_step = interrupt_after(args.interrupt_after, rank=args.rank)
    with faulty_train(after_step):
        return cli_main(cli_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
