"""docs/rlhf.md's walk-through, command by command, on the real SmolLM2-135M-Instruct (fewer steps): SFT,
a reward model whose held-out accuracy rises from the untrained head's, GRPO scored by that reward model
whose held-out reward rises, and the exports."""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path

import pytest

from slipstream.cli import main

ROOT = Path(__file__).resolve().parents[1]
# what the test changes of each stage: fp32 (the same numbers on every CPU class; the docs' runs take
# dtype auto), and fewer SFT and reward steps (GRPO keeps its 10: the reward model's signal needs them)
FEWER = {
    "examples/from-data-to-model.yaml": ["training.steps=3", "training.eval_every=3", "model.dtype=float32"],
    "examples/reward.yaml": ["training.steps=8", "training.eval_every=8", "model.dtype=float32"],
    "examples/rlhf-grpo.yaml": ["model.dtype=float32"],
}


def walkthrough_commands() -> list[list[str]]:
    """The ``slipstream`` lines of docs/rlhf.md's first bash block, as argv lists."""
    text = (ROOT / "docs" / "rlhf.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    lines = [line.split("#", 1)[0].strip() for line in block.splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("slipstream ")]


def evals(run: Path) -> list[dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [record for record in records if "eval_loss" in record or "eval_reward" in record]


def test_the_commands_are_sft_reward_grpo_and_exports():
    commands = walkthrough_commands()
    assert [argv[0] for argv in commands] == ["train", "export", "train", "export", "train", "export"]
    assert [argv[1] for argv in commands if argv[0] == "train"] == list(FEWER)


@pytest.mark.realmodel
def test_the_rlhf_walkthrough_runs_on_the_real_model(smollm2, tmp_path, monkeypatch, capsys):
    from transformers import AutoConfig

    shutil.copytree(ROOT / "examples", tmp_path / "examples")  # the configs and data, as a clone has them
    monkeypatch.chdir(tmp_path)
    for argv in walkthrough_commands():
        argv = [str(smollm2) if arg == "MODEL_DIR" else arg for arg in argv]
        argv = [arg.replace("model.path=MODEL_DIR", f"model.path={smollm2}") for arg in argv]
        if argv[0] == "train":
            argv += [item for override in FEWER[argv[1]] for item in ("--set", override)]
        assert main(argv) == 0, argv
    capsys.readouterr()
    runs = tmp_path / "runs" / "rlhf"
    # the reward model: the untrained head near chance on the held-out pairs, then better
    start, *_, end = evals(runs / "reward")
    assert start["step"] == 0 and end["step"] == 8
    assert end["eval_reward_accuracy"] > start["eval_reward_accuracy"] and end["eval_reward_accuracy"] >= 0.9
    assert end["eval_loss"] < start["eval_loss"]
    assert AutoConfig.from_pretrained(runs / "reward-merged").architectures == [
        "LlamaForSequenceClassification"
    ]
    # GRPO scored by that reward model: the held-out reward rises from the SFT model's
    start, *_, end = evals(runs / "grpo")
    assert start["step"] == 0 and end["step"] == 10
    assert end["eval_reward"] > start["eval_reward"], (start, end)
    assert AutoConfig.from_pretrained(runs / "grpo-merged").architectures == ["LlamaForCausalLM"]
