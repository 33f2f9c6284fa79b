"""The one step driver (``train/driver.py``): train's order of bins, and a planned run's the same steps."""

import math

import torch
import yaml

from slipstream.data.steps import step_order
from slipstream.train.config import load_config
from slipstream.train.driver import driver_for
from slipstream.train.inputs import DriverInputs, load_tokenizer, objective_of

TINY = {
    "model": {"preset": "qwen3", "dtype": "float32", "layers": 1},
    "data": {"demo_rows": 60, "max_seq_len": 128, "share_prefixes": "off"},
    "lora": {"enabled": True, "rank": 2, "alpha": 4, "target_modules": ["q_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 2, "grad_accum": 2},
    "seed": 3,
}


def _config(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path / "out")}))
    return load_config(path, [])


def test_a_step_trains_the_bins_of_the_shared_order_and_says_what_it_did(tmp_path):
    driver = driver_for(_config(tmp_path))
    assert driver.prepare() is None  # sft with sharing off runs nothing before step 0
    order = step_order(len(driver.bins), 2, 3)
    done = driver.step(0)
    assert done.plan.documents == [driver.bins[i] for i in order(0)]
    assert done.tokens == sum(len(row["input_ids"]) for i in order(0) for row in driver.bins[i])
    assert math.isfinite(done.loss) and done.finite and done.grad_norm > 0
    assert done.lr == 1e-2 and done.pairs == 0 and done.metrics["forward_s"] > 0


def test_a_planned_driver_steps_the_same_rows_to_the_same_loss(tmp_path):
    config = _config(tmp_path)
    read = driver_for(config)
    order = step_order(len(read.bins), 2, 3)
    plan = [[read.bins[i] for i in order(step)] for step in range(2)]
    inputs = DriverInputs(
        load_tokenizer(config), objective_of(config), torch.device("cpu"), torch.float32, plan=plan
    )
    planned = driver_for(config, inputs=inputs)
    for step in range(2):
        assert planned.step(step).loss == read.step(step).loss
