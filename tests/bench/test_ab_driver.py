"""The A/B's slipstream arm runs the step ``slipstream train`` runs: the same YAML trained by ``train``
and run as ``ab``'s slipstream arm gives the very same step-0 loss and gradient norm (fp32, tiny)."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from slipstream.bench.command import ab_config
from slipstream.bench.runner import prepare_bins, run_arm
from slipstream.train.config import load_config
from slipstream.train.loop import train

TINY = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 120, "max_seq_len": 256, "share_prefixes": "off"},
    "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 2, "grad_accum": 2},
    "seed": 0,
}
PAIRS = [
    {
        "prompt": f"question {i} about the number {i * 7} and its neighbours {i + 1} {i + 2} {i + 3}",
        "chosen": f"the answer is {i * 7} thank you",
        "rejected": f"no idea {i}",
    }
    for i in range(40)
]


def _train_and_ab(tmp_path: Path, workload: dict, arm: str) -> tuple[dict, dict]:
    """Step 0 as ``train`` logged it, and as the arm ``arm`` of ``ab --config`` on the same file ran it."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({**workload, "output_dir": str(tmp_path / "out")}))
    train(load_config(path, []), progress=False)
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    config = ab_config(train_config=str(path), arms=(arm,), steps=2, warmup=1)
    plan, vocab, _ = prepare_bins(config)
    result = run_arm(dataclasses.asdict(config), arm, plan, vocab)
    return logged, {"loss": result["loss"][0], "grad_norm": result["grad_norm"][0]}


def test_the_sft_arm_steps_as_train_does(tmp_path):
    logged, arm = _train_and_ab(tmp_path, TINY, "slipstream")
    assert arm["loss"] == logged["loss"]
    assert arm["grad_norm"] == logged["grad_norm"]


@pytest.mark.parametrize("arm", ["slipstream-dpo"])
def test_a_pair_arm_steps_as_train_does(tmp_path, arm):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in PAIRS))
    workload = {
        **TINY,
        "data": {"path": str(data), "max_seq_len": 256},
        "training": {"steps": 2, "objective": "dpo"},
    }
    logged, arm_step = _train_and_ab(tmp_path, workload, arm)
    assert arm_step["loss"] == logged["loss"]
    assert arm_step["grad_norm"] == logged["grad_norm"]


def test_the_grpo_arm_steps_as_train_does(tmp_path):
    """The arm updates on rollouts sampled once for every arm, from train's prompts in train's order on
    the same starting weights and seed: train's own step 0."""
    from tests.objectives.test_grpo import grpo_config

    path = grpo_config(tmp_path, training={"steps": 2})
    train(load_config(path, []), progress=False)
    logged = json.loads((tmp_path / "out" / "metrics.jsonl").read_text().splitlines()[0])
    config = ab_config(train_config=str(path), arms=("slipstream-grpo",), steps=2, warmup=1)
    plan, vocab, _ = prepare_bins(config)
    result = run_arm(dataclasses.asdict(config), "slipstream-grpo", plan, vocab)
    assert (result["loss"][0], result["grad_norm"][0]) == (logged["loss"], logged["grad_norm"])
