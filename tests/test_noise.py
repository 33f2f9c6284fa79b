"""The known third-party noise (slipstream.noise): hidden while a command runs, each line matched by its
origin and message only, everything as before afterwards, and hidden in an A/B arm's process too."""

import logging
import re
import warnings

import pytest

from slipstream.bench.runner import run_in_fresh_process
from slipstream.noise import KNOWN_NOISE, known_noise_hidden

OURS = "slipstream: a warning of our own, never hidden"


def issue(origin: str, message: str, category: type[Warning] | None) -> None:
    """``message`` as ``origin`` issues it: a record of its logger, or a warning from its module."""
    if category is None:
        logging.getLogger(origin).warning(message)
    else:
        warnings.warn_explicit(
            message, category, filename=f"{origin}.py", lineno=1, module=origin, registry={}
        )


def issue_known_noise() -> None:
    for noise in KNOWN_NOISE:
        issue(noise.origin, noise.example, noise.category)


def issue_in_a_child() -> str:
    issue_known_noise()
    logging.getLogger("slipstream").warning(OURS)
    return "done"


def seen(run, caplog) -> list[str]:
    """The messages ``run()`` logs or warns that would reach the terminal."""
    caplog.clear()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        run()
    return [record.getMessage() for record in caplog.records] + [str(w.message) for w in warned]


def test_every_entry_says_what_and_why_and_matches_its_example():
    for noise in KNOWN_NOISE:
        assert re.match(noise.message, noise.example), noise
        assert noise.why and noise.origin.split(".")[0] in {"bitsandbytes", "transformers", "trl"}


def test_each_known_line_is_hidden_inside_only(caplog):
    examples = sorted(noise.example for noise in KNOWN_NOISE)
    assert sorted(seen(issue_known_noise, caplog)) == examples

    def hidden():
        with known_noise_hidden():
            issue_known_noise()

    assert seen(hidden, caplog) == []
    assert sorted(seen(issue_known_noise, caplog)) == examples  # undone after the block

    def debug():
        with known_noise_hidden(hide=False):  # slipstream --debug
            issue_known_noise()

    assert sorted(seen(debug, caplog)) == examples


def test_only_the_known_lines_are_hidden(caplog):
    """Another message from the same origin, the same message from elsewhere, our own: all shown."""
    others = [
        ("bitsandbytes.backends.cpu.ops", "something bitsandbytes means", None),
        ("bitsandbytes", KNOWN_NOISE[0].example, None),  # a parent logger: not the line's origin
        ("transformers.modeling_utils", "`use_cache=True` is incompatible", FutureWarning),
        ("transformers.modeling_utils", KNOWN_NOISE[1].example, UserWarning),  # another category
        ("slipstream.optimize", KNOWN_NOISE[1].example, FutureWarning),  # our own module
        ("trl.trainer.sft_trainer", "You passed a dataset that is already processed", None),
        ("slipstream", OURS, None),
    ]

    def run():
        with known_noise_hidden():
            for origin, message, category in others:
                issue(origin, message, category)

    assert sorted(seen(run, caplog)) == sorted(message for _, message, _ in others)


def test_an_arm_process_hides_them_when_its_parent_does(capfd):
    with known_noise_hidden():
        assert run_in_fresh_process(issue_in_a_child) == "done"
    err = capfd.readouterr().err
    assert OURS in err  # the child's stderr is seen here
    for noise in KNOWN_NOISE:
        assert noise.example not in err


@pytest.mark.parametrize("origin", ["bitsandbytes.backends.cpu.ops", "trl.trainer.sft_trainer"])
def test_the_filters_leave_no_trace_on_the_loggers(origin):
    before = list(logging.getLogger(origin).filters)
    with known_noise_hidden():
        assert len(logging.getLogger(origin).filters) == len(before) + 1
    assert logging.getLogger(origin).filters == before
