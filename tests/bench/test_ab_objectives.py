"""``slipstream ab --config RUN.yaml`` carries the run's objective and its settings: a DPO config runs
the DPO arms on its pairs, an ORPO config the ORPO arms (instead of reading the pairs as SFT rows)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
import yaml

from slipstream.bench.ab_config import ABConfig
from slipstream.bench.arms import ARM_PRESETS
from slipstream.bench.command import ab_config, ab_config_from_args, add_ab_arguments
from slipstream.bench.runner import run_ab
from slipstream.data import demo_tokenizer
from slipstream.models import build_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "dpo.yaml"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model saved as a user's directory, its tokenizer with a chat template."""
    out = tmp_path_factory.mktemp("my-model")
    tokenizer = demo_tokenizer()
    build_model("llama", vocab_size=len(tokenizer), seed=3, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def parse(argv: list[str]) -> ABConfig:
    parser = argparse.ArgumentParser()
    add_ab_arguments(parser)
    return ab_config_from_args(parser.parse_args(argv))


def test_the_workload_of_a_preference_config_holds_its_objective_beta_and_arms(model_dir):
    found = ab_config(train_config=str(EXAMPLE), model=str(model_dir), device="cpu")
    assert found.train.training.objective == "dpo" and found.train.preference.beta == 0.1
    assert found.ab.arms == ARM_PRESETS["dpo"]
    assert Path(found.train.data.path).name == "pairs.jsonl"
    orpo = ab_config(train_config=str(ROOT / "examples" / "orpo.yaml"), model=str(model_dir), device="cpu")
    assert orpo.train.training.objective == "orpo" and orpo.ab.arms == ARM_PRESETS["orpo"]


def test_an_objective_without_arms_is_refused_naming_the_key(tmp_path):
    config = yaml.safe_load(EXAMPLE.read_text())
    config["training"]["objective"] = "ipo"
    config["data"]["path"] = str(ROOT / "examples" / "data" / "pairs.jsonl")
    path = tmp_path / "ipo.yaml"
    path.write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="'training.objective' 'ipo': slipstream ab has no arms for it yet"):
        ab_config(train_config=str(path))


@pytest.mark.parametrize(
    "config, arms",
    [
        (EXAMPLE, ("slipstream-dpo-no-prefix-sharing", "slipstream-dpo")),
        (ROOT / "examples" / "orpo.yaml", ARM_PRESETS["orpo"]),
    ],
)
def test_ab_with_a_preference_config_runs_its_objectives_arms(config, arms, model_dir, tmp_path):
    argv = ["--config", str(config), "--model", str(model_dir), "--steps", "3", "--warmup", "1"]
    argv += ["--max-seq-len", "512", "--dtype", "float32", "--out", str(tmp_path / "ab")]
    argv += ["--arms", ",".join(arms), "--interleave", "arms"]
    ab = parse(argv)
    assert ab.train.training.objective == yaml.safe_load(config.read_text())["training"]["objective"]
    assert ab.ab.arms == arms
    record = run_ab(ab, progress=False)
    for arm in arms:
        (run,) = record["runs"][arm]
        assert len(run["loss"]) == 3 and all(math.isfinite(loss) for loss in run["loss"])
        assert len(run["reward_margin"]) == 3 and run["pairs"][0] > 0
    if ab.train.training.objective == "dpo":  # at the reference: ln 2
        assert record["runs"][arms[0]][0]["loss"][0] == pytest.approx(math.log(2), abs=1e-5)
    # the prompt shared or not, the same pairs and the same loss
    first = [record["runs"][arm][0]["loss"][0] for arm in arms]
    assert first[0] == pytest.approx(first[1], rel=1e-4)
