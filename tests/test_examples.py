"""The TRL and HF Trainer example scripts run: on a preset (random init, the demo chats) and on the
real SmolLM2 directory with the walk-through's chat file (a LoRA adapter), a few steps each: the
loss is finite, and on the real model it falls."""

from __future__ import annotations

import importlib.util
import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHATS = ROOT / "examples" / "data" / "chats.jsonl"


def run_example(name: str, argv: list[str], capsys) -> list[float]:
    """Run ``examples/<name>.py`` in this process with ``argv``; the losses it printed."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    (line,) = re.findall(r"^losses every \d+ steps: (.*)$", out, flags=re.M)
    return [float(loss) for loss in line.split(", ")]


def saved_adapter(folder: Path) -> bool:
    return (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()


def test_the_trl_example_runs_on_a_preset(tmp_path, capsys):
    out = tmp_path / "trl"
    losses = run_example(
        "trl_sft", ["--steps", "2", "--rows", "16", "--log-every", "1", "--output-dir", str(out)], capsys
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert saved_adapter(out)


def test_the_hf_trainer_example_runs_on_a_preset(tmp_path, capsys):
    out = tmp_path / "hf"
    argv = [
        "--steps",
        "2",
        "--rows",
        "16",
        "--max-seq-len",
        "256",
        "--log-every",
        "1",
        "--output-dir",
        str(out),
    ]
    losses = run_example("hf_trainer", argv, capsys)
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert (out / "model.safetensors").is_file()  # a preset is trained in full


@pytest.mark.realmodel
def test_the_trl_example_trains_lora_on_the_real_model(smollm2, tmp_path, capsys):
    out = tmp_path / "trl"
    argv = ["--model", str(smollm2), "--data", str(CHATS), "--steps", "6", "--docs-per-row", "4"]
    losses = run_example(
        "trl_sft", [*argv, "--lr", "5e-4", "--log-every", "3", "--output-dir", str(out)], capsys
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses[1] < losses[0]  # the mean loss of steps 4-6 is below that of steps 1-3
    assert saved_adapter(out)


@pytest.mark.realmodel
def test_the_hf_trainer_example_trains_lora_on_the_real_model(smollm2, tmp_path, capsys):
    out = tmp_path / "hf"
    argv = ["--model", str(smollm2), "--data", str(CHATS), "--steps", "6", "--max-seq-len", "512"]
    losses = run_example(
        "hf_trainer", [*argv, "--lr", "5e-4", "--log-every", "3", "--output-dir", str(out)], capsys
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    assert losses[1] < losses[0]  # the mean loss of steps 4-6 is below that of steps 1-3
    assert saved_adapter(out)


@pytest.mark.parametrize("name", ["grpo_lookup.yaml", "grpo_ab.yaml"])
def test_the_grpo_benchmark_configs_load_with_their_rewards(name):
    """BENCHMARKS.md's GRPO commands: each config loads (its reward files found next to it) with the
    shape the figures state (G = 8, LoRA r16 on the 7 projections)."""
    from slipstream.rewards import load_rewards
    from slipstream.train.config import load_config

    config = load_config(ROOT / "benchmarks" / name, ["model.path=MODEL_DIR"])
    assert config.training.objective == "grpo" and config.grpo.num_generations == 8
    assert config.lora.rank == 16 and len(config.lora.target_modules) == 7
    assert [fn.name for fn in load_rewards(config.grpo.rewards)] == [
        "answer_tag",
        "has_answer_tag",
        "mentions_answer",
    ]
