"""The way a config takes from ``train()`` to the first optimizer step: which files it enters, how often.

Runs ``slipstream.train.loop.train`` in this process on ``examples/tiny.yaml`` cut to one step (output
in a temporary directory, no evaluation, no checkpoints) under ``sys.setprofile``, from the call of
``train`` to the first call of a ``torch.optim`` optimizer's ``step``, where tracing stops.

Following the config: a call counts when the called function is slipstream's (``src/slipstream``)
and one of its arguments (its frame's locals named by the code's positional and keyword-only
parameters, at the call) *is* the run's ``TrainConfig`` or one of its sections (``config.data``,
``config.model``, ...). The way enters a file each time a counted call is in another file than the
counted call before it; a file entered again is a climb back.

    python benchmarks/first_step_way.py            # the summary
    python benchmarks/first_step_way.py --calls    # and every entry, (file, function) in order
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

import slipstream
from slipstream.train.config import load_config
from slipstream.train.loop import train

SRC = Path(slipstream.__file__).parent
TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny.yaml"


def way(config) -> list[tuple[str, str]]:
    """The counted calls from ``train(config)`` to the first optimizer step: (file, function), in order."""
    followed = {id(config)} | {
        id(getattr(config, f.name))
        for f in dataclasses.fields(config)
        if dataclasses.is_dataclass(getattr(config, f.name))
    }
    calls: list[tuple[str, str]] = []

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_name == "step" and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            sys.setprofile(None)  # the first optimizer step: the way ends here
            return
        if not code.co_filename.startswith(str(SRC)):
            return
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if any(id(frame.f_locals.get(name)) in followed for name in names):
            calls.append((str(Path(code.co_filename).relative_to(SRC)), code.co_qualname))

    sys.setprofile(profile)
    try:
        train(config, progress=False)
    finally:
        sys.setprofile(None)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", action="store_true", help="print every entry's counted calls")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        sets = [
            "training.steps=1",
            "training.checkpoint_every=0",
            "training.eval_every=0",
            "data.eval_fraction=null",
        ]
        config = load_config(TINY, [*sets, f"output_dir={out}/run"])
        calls = way(config)
    entries: list[tuple[str, list[str]]] = []  # (file, its counted calls) per entry
    for file, function in calls:
        if not entries or entries[-1][0] != file:
            entries.append((file, []))
        entries[-1][1].append(function)
    per_file = Counter(file for file, _ in entries)
    for number, (file, functions) in enumerate(entries, 1):
        print(f"{number:3d} {file}: {functions[0]}")
        for function in functions[1:] if args.calls else ():
            print(f"      {function}")
    print(
        f"\n{len(per_file)} files entered, {len(entries)} entries, {len(entries) - len(per_file)} climbs back"
    )
    print("entries per file: " + ", ".join(f"{file} {n}" for file, n in per_file.most_common()))


if __name__ == "__main__":
    main()
