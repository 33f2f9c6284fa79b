"""The help a person reads: every option's default shown, every objective and every arms preset named."""

import argparse
import dataclasses
import re
from functools import reduce

from slipstream import speedups as speedups_module
from slipstream.bench.ab_config import TRAIN_FLAGS, ABSection, default_train
from slipstream.bench.arms import ARM_PRESETS
from slipstream.cli import build_parser
from slipstream.objectives import base, objective_names
from slipstream.objectives.sft import SFT

# a flag whose default is its absence needs no word on it: a switch, and a repeatable option left empty
SWITCHES = (
    argparse._StoreTrueAction,
    argparse._StoreFalseAction,
    argparse._HelpAction,
    argparse._VersionAction,
)


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"slipstream": parser, **commands.choices}


def _help_of(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    """``action``'s help as --help prints it (``%(default)s`` filled in), on one line."""
    return " ".join(parser._get_formatter()._expand_help(action).split()) if action.help else ""


def test_every_option_with_a_default_shows_it():
    unshown = []
    for command, parser in _commands(build_parser()).items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, SWITCHES) or action.help == argparse.SUPPRESS:
                continue
            if action.default in (None, argparse.SUPPRESS) or action.default == []:
                continue
            shown = _help_of(parser, action)
            if "default" not in shown or str(action.default) not in shown:
                unshown.append(
                    f"{command} {action.option_strings[0]} (default {action.default!r}): {shown!r}"
                )
    assert unshown == [], "\n".join(unshown)


def test_every_ab_option_shows_what_it_is_when_not_given():
    """ab's options parse to None (``--config RUN.yaml`` fills what the command line leaves out): each
    says the value the run takes without it, a speedup's, an ab: key's or the built-in run's train key
    (a help that says its default itself, because it depends on the model, is taken at its word)."""
    built_in = default_train("demo", ABSection.steps)
    expected = {f"speedup_{spec.name}": spec.default for spec in dataclasses.fields(speedups_module.Speedups)}
    expected |= {spec.name: spec.default for spec in dataclasses.fields(ABSection)}
    expected |= {
        name: reduce(getattr, key.split("."), built_in)
        for name, (key, words) in TRAIN_FLAGS.items()
        if "default" not in words
    }
    parser = _commands(build_parser())["ab"]
    unshown = []
    for action in parser._actions:
        value = expected.get(action.dest)
        if value is None:
            continue
        text = ",".join(value) if isinstance(value, (list, tuple)) else str(value)
        if f"default: {text})" not in _help_of(parser, action):
            unshown.append(f"{action.option_strings[0]} (default {text}): {_help_of(parser, action)!r}")
    assert unshown == [], "\n".join(unshown)


def test_train_names_every_objective_and_ab_every_preset(monkeypatch):
    class KTO(SFT):  # an objective registered after the fact shows too
        name = "kto"

    monkeypatch.setitem(base._REGISTRY, KTO.name, KTO)
    commands = _commands(build_parser())
    top, train = commands["slipstream"].format_help(), " ".join(commands["train"].format_help().split())
    summary = next(a for a in commands["slipstream"]._actions if isinstance(a, argparse._SubParsersAction))
    train_line = " ".join(next(c.help for c in summary._choices_actions if c.dest == "train").split())
    assert "kto" in objective_names()
    for name in objective_names():
        for text in (top, train, train_line):
            assert re.search(rf"\b{name}\b", text), (name, text)
    (preset,) = [a for a in commands["ab"]._actions if a.dest == "preset"]
    said = _help_of(commands["ab"], preset)
    for name, arms in ARM_PRESETS.items():
        assert f"{name} ({arms[0]}" in said, name
