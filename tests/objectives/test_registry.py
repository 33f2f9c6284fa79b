"""The objectives' registry: the loop never asks an objective's name, an unknown name is refused by
key, and a new objective is one class registered in one place (here: this test file alone)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import slipstream
from slipstream.objectives import base, objective_for, objective_names
from slipstream.objectives.sft import SFT
from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train
from tests.train.test_train import TINY, losses, write_config

ROOT = Path(slipstream.__file__).parent
# a comparison of an objective's name: `objective == "dpo"`, `... != 'sft'`, `x == "simpo"`
NAME_COMPARISON = re.compile(
    r"""objective *[!=]= *['"]|[!=]= *['"](sft|dpo|ipo|simpo|orpo|kto|reward|grpo|dapo|dr_grpo)['"]"""
)


def test_the_registered_objectives():
    assert {"sft", "dpo", "ipo", "simpo", "orpo", "kto", "reward", "grpo"} <= set(objective_names())
    assert objective_for("orpo").reads == "pairs" and objective_for("sft").reads == "samples"
    with pytest.raises(KeyError, match="registered: dpo, grpo, ipo, kto, orpo, reward, sft, simpo"):
        objective_for("ppo")


def test_no_code_outside_an_objectives_own_module_compares_an_objective_name():
    """Every objective is a plug-in: the loop, the step, the config, eval and ``ab`` call it. Its own
    modules are its rooms: ``objectives/<name>.py``, ``objectives/<name>_*.py`` and ``loss/<name>.py``
    (GRPO's loss names its aggregations "dapo", "grpo")."""
    own = {
        path
        for name in objective_names()
        for path in [
            ROOT / "objectives" / f"{name}.py",
            ROOT / "loss" / f"{name}.py",
            *(ROOT / "objectives").glob(f"{name}_*.py"),
        ]
    }
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path in own:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if NAME_COMPARISON.search(line.split("#", 1)[0]):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)


def test_an_unknown_objective_is_refused_by_key_with_the_registered_names(tmp_path):
    data = {**TINY, "training": {"steps": 2, "objective": "ppo"}}
    with pytest.raises(ConfigError) as error:
        load_config(write_config(tmp_path, data))
    message = str(error.value)
    assert re.match(r".*config\.yaml:\d+: ", message), message  # file:line
    assert (
        "'training.objective'" in message
        and "dpo, grpo, ipo, kto, orpo, reward, sft, simpo" in message
        and "'ppo'" in message
    )


class HalfSFT(SFT):
    """A toy objective: half the SFT loss (and half its gradient)."""

    name = "toy-half-sft"

    def micro_batch(self, model, micro, weight):
        loss, sums = super().micro_batch(model, micro, weight)
        return loss * 0.5, sums * 0.5


def test_a_toy_objective_registered_in_a_test_trains_through_slipstream_train(tmp_path, monkeypatch):
    monkeypatch.setitem(base._REGISTRY, HalfSFT.name, HalfSFT)
    steps = {"steps": 2, "checkpoint_every": 0}
    sft = tmp_path / "sft"
    sft.mkdir()
    train(load_config(write_config(sft, {**TINY, "training": steps})), progress=False)
    toy = tmp_path / "toy"
    toy.mkdir()
    _, summary = train(
        load_config(write_config(toy, {**TINY, "training": {**steps, "objective": HalfSFT.name}})),
        progress=False,
    )
    half, full = losses(toy / "out"), losses(sft / "out")
    assert len(half) == 2 and summary["steps"] == 2
    assert half[0] == pytest.approx(full[0] / 2, rel=1e-5)  # the same first batch, half its loss
