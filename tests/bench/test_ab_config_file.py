"""``slipstream ab --config RUN.yaml`` reads the file ``slipstream train`` reads, with its ``ab:`` section;
``--set`` changes either, as ``train --set`` does; the command line's flags still win."""

import pytest
import yaml

from slipstream.bench.command import ab_config_from_args
from slipstream.cli import build_parser
from slipstream.train.config import load_config

RUN = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 60, "max_seq_len": 128},
    "lora": {"enabled": True, "rank": 2, "alpha": 4},
    "optimizer": {"lr": 1e-3, "schedule": "constant"},
    "training": {"steps": 100},
    "seed": 5,
    "ab": {"arms": ["stock-packed", "slipstream"], "steps": 6, "warmup": 2, "repeats": 2, "out": "runs/x"},
}


def _run(tmp_path, data=None):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data or RUN))
    return path


def _ab(*argv):
    return ab_config_from_args(build_parser().parse_args(["ab", *argv]))


def test_train_reads_the_file_with_its_ab_section(tmp_path):
    config = load_config(_run(tmp_path), [])
    assert config.training.steps == 100 and config.optimizer.lr == 1e-3


def test_ab_takes_the_workload_and_its_own_section_from_the_one_file(tmp_path):
    config = _ab("--config", str(_run(tmp_path)))
    assert (config.model, config.train.optimizer.lr, config.train.seed, config.train.data.max_seq_len) == (
        "qwen3",
        1e-3,
        5,
        128,
    )
    assert config.ab.arms == ("stock-packed", "slipstream")
    assert (config.ab.steps, config.ab.warmup, config.ab.repeats, config.ab.out_dir) == (6, 2, 2, "runs/x")


def test_set_changes_a_train_key_or_an_ab_key_and_flags_win(tmp_path):
    path = str(_run(tmp_path))
    config = _ab("--config", path, "--set", "optimizer.lr=0.05", "--set", "ab.steps=9")
    assert (config.train.optimizer.lr, config.ab.steps) == (0.05, 9)
    config = _ab("--config", path, "--set", "ab.steps=9", "--steps", "4", "--lr", "0.2")
    assert (config.train.optimizer.lr, config.ab.steps) == (0.2, 4)


def test_a_preset_in_the_section_picks_the_arms(tmp_path):
    config = _ab("--config", str(_run(tmp_path, {**RUN, "ab": {"preset": "default", "steps": 4}})))
    assert config.ab.arms == ("stock-padded", "stock-packed", "slipstream") and config.ab.steps == 4


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"lr": 0.1}, r"'ab.lr': the train config's 'optimizer.lr' sets it"),
        ({"stepz": 3}, r"unknown key 'ab.stepz'"),
    ],
)
def test_the_section_refuses_what_is_not_its_own_naming_the_key(tmp_path, section, message):
    with pytest.raises(ValueError, match=message):
        _ab("--config", str(_run(tmp_path, {**RUN, "ab": section})))


def test_set_without_a_config_file_changes_the_built_in_defaults():
    config = _ab("--set", "ab.steps=3", "--set", "optimizer.lr=0.01", "--set", "data.max_seq_len=256")
    assert (config.ab.steps, config.train.optimizer.lr, config.train.data.max_seq_len) == (3, 0.01, 256)
    assert "lr" not in config.defaults["fields"]  # set, not defaulted
    assert _ab("--max-seq-len", "256").train == _ab("--set", "data.max_seq_len=256").train  # one path
    with pytest.raises(ValueError, match=r"'ab.lr': the train config's 'optimizer.lr' sets it"):
        _ab("--set", "ab.lr=0.1")
