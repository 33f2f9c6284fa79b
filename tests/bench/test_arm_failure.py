"""An arm whose process fails: `slipstream ab` says so in one line (the arm, its error), `--debug` shows
where in the arm's process it failed."""

import traceback

import pytest

from slipstream.bench.lockstep import ArmProcessError
from slipstream.cli import main

FAILURE = "device_activation_bytes: the probe's forward\nhas no backward"  # (a message of two lines)


def _serve_opening_fails(connection, hide_noise, config_dict, arm, *rest):
    """The arm process (``lockstep._serve``) with its arm failing to open; runs in the spawned process,
    which imports it from here."""
    from slipstream.bench import lockstep

    def open_arm(*args, **kwargs):
        raise RuntimeError(FAILURE)

    lockstep.open_arm = open_arm
    lockstep._serve(connection, hide_noise, config_dict, arm, *rest)


def test_an_arms_failure_is_one_line_and_debug_shows_the_arms_traceback(monkeypatch, capsys):
    from slipstream.bench import command, lockstep

    monkeypatch.setattr(lockstep, "_serve", _serve_opening_fails)
    with pytest.raises(ArmProcessError) as raised:  # a real arm process, failing as it opens
        lockstep.run_lockstep({}, ["stock-packed", "slipstream"], [], 0, "auto")
    failure = raised.value

    def run_ab(config):
        raise failure

    monkeypatch.setattr(command, "run_ab", run_ab)  # slipstream ab, its arms failing so
    ab = ["ab", "--model", "qwen3", "--steps", "2", "--warmup", "1"]
    assert main(ab) == 1
    assert capsys.readouterr().err.strip() == (
        "slipstream ab: arm stock-packed failed: RuntimeError: device_activation_bytes: the probe's forward has "
        "no backward (run with --debug for the traceback)"
    )
    with pytest.raises(ArmProcessError):
        main(["--debug", *ab])
    printed = "".join(traceback.format_exception(failure))  # what Python prints on stderr
    arms_part, _, ours = printed.partition("The above exception was the direct cause")
    assert "Traceback (most recent call last)" in arms_part and ", in open_arm" in arms_part
    assert f"RuntimeError: {FAILURE}" in arms_part
    assert "ArmProcessError: arm stock-packed failed" in ours
