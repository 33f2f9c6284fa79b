"""Every ``TrainConfig`` key is A/B'd as written or refused by name (issue 62): set to another valid
value, the A/B's slipstream arm trains it unchanged, or the A/B refuses it naming the key, or the arm
changes it and ``arm_overrides`` (what ``ab.md`` lists) says so."""

from __future__ import annotations

import dataclasses
import json

import pytest

from slipstream.bench.arms import _flat, arm_overrides, train_config_of
from slipstream.bench.command import ab_config
from slipstream.fields import choices, field_types, is_kind
from slipstream.train.config import TrainConfig

# what an arm may change of the file, on purpose (ab.md lists each change): no dropout, the read cache,
# and what makes it that arm (its layout of shared prompts, its rollout engine, its speedups)
NAMED = {
    "lora.dropout",
    "data.cache",
    "data.share_prefixes",
    "preference.prefix_sharing",
    "grpo.prefix_sharing",
    "grpo.engine",
}


def _leaves(cls, prefix: str = ""):
    """(dotted key, annotation, default) of every leaf field of a config dataclass."""
    for f in dataclasses.fields(cls):
        kind = field_types(cls)[f.name]
        if dataclasses.is_dataclass(kind):
            yield from _leaves(kind, f"{prefix}{f.name}.")
        else:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            yield f"{prefix}{f.name}", kind, default


def _another(kind, default):
    """A value of ``kind`` other than ``default`` (None: none made here)."""
    if isinstance(default, list):
        return None
    options = choices(kind)
    if options:
        return next((o for o in options if o != default), None)
    if is_kind(kind, bool):
        return not default
    if is_kind(kind, int):
        return (default or 0) + 1
    if is_kind(kind, float):
        return (default or 0.25) / 2
    return None


CASES = [
    (key, value)
    for key, kind, default in _leaves(TrainConfig)
    if (value := _another(kind, default)) is not None
]


def test_the_walk_covers_most_keys():
    assert len(CASES) > 40, len(CASES)


@pytest.mark.parametrize(("key", "value"), CASES, ids=[key for key, _ in CASES])
def test_every_key_is_ab_d_as_written_or_refused_by_name(key, value):
    try:
        config = ab_config(
            [f"{key}={json.dumps(value)}"], model="demo", arms=("slipstream",), steps=3, warmup=1
        )
    except ValueError as error:  # refused: the message names the key (or its section's rule)
        assert key in str(error) or key.split(".")[-1] in str(error), (key, str(error))
        return
    run = _flat(config.train)
    assert run[key] == value or key.startswith("model."), (key, run[key])  # the run holds what was set
    for arm in ("slipstream", "stock-packed"):
        changed = arm_overrides(config, arm)
        assert set(changed) <= NAMED | {k for k in changed if k.startswith("speedups.")}, (arm, changed)
        assert _flat(train_config_of(config, arm))[key] == run[key] or key in changed, (arm, key)
