"""torchrun with 2 processes (gloo): DDP and FSDP2 follow the single-process run with the same global batch.

The ranks train with slipstream's chunked loss (the default), the single process with the
stock loss: the comparison covers the distributed split and the chunked loss at once, for the
training loss and the eval loss.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
import torch.distributed as dist
import yaml

from ..ports import free_port

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed"),
]

CONFIG = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 120, "max_seq_len": 256, "eval_fraction": 0.1},
    "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 4, "eval_every": 2},
    "seed": 0,
}


def losses(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def eval_losses(out):
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]


def run(args, timeout=300, **env):
    """Run to the end; a run still going after ``timeout`` fails with every process's Python stacks
    (SIGABRT under PYTHONFAULTHANDLER), so that a hang names where it hangs."""
    process = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **env},
    )
    try:
        _, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        launcher = psutil.Process(process.pid)
        for each in [*launcher.children(recursive=True), launcher]:  # the ranks have sessions of their own
            with contextlib.suppress(psutil.NoSuchProcess):
                each.send_signal(signal.SIGABRT)
        _, stderr = process.communicate()
        pytest.fail(f"still running after {timeout} s; the processes' stacks:\n{stderr[-8000:]}")
    assert process.returncode == 0, stderr[-3000:]
    # the ranks' wrappers went before their process group (a wrapper freed last can hang the exit)
    assert "outlived the run" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path, strategy):
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    run(
        [
            "-m",
            "slipstream",
            "train",
            str(config),
            "--set",
            f"output_dir={tmp_path / 'single'}",
            "--set",
            "training.grad_accum=2",
            "--set",
            "speedups.chunked_loss=false",
        ]
    )
    run(
        [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            free_port(),
            "-m",
            "slipstream",
            "train",
            str(config),
            "--set",
            f"output_dir={tmp_path / 'ranks'}",
            "--set",
            f"training.distributed={strategy}",
        ]
    )
    single, ranks = losses(tmp_path / "single"), losses(tmp_path / "ranks")
    assert len(single) == len(ranks) == 4
    assert max(abs(a - b) / abs(a) for a, b in zip(single, ranks, strict=True)) <= 1e-5
    assert single[1] != single[0]  # it trained
    # the eval loss: each rank evaluates its share of the bins (FSDP2: as many forwards on each), summed
    single_eval, ranks_eval = eval_losses(tmp_path / "single"), eval_losses(tmp_path / "ranks")
    assert [step for step, _ in ranks_eval] == [step for step, _ in single_eval] == [2, 4]
    assert max(abs(a - b) / a for (_, a), (_, b) in zip(single_eval, ranks_eval, strict=True)) <= 1e-5
    assert (tmp_path / "ranks" / "adapter" / "adapter_model.safetensors").exists()
    ranks_run = json.loads((tmp_path / "ranks" / "run.json").read_text())
    assert ranks_run["world_size"] == 2
    assert any(p.startswith("chunked loss: on") for p in ranks_run["policies"])
    single_run = json.loads((tmp_path / "single" / "run.json").read_text())
    assert not any(p.startswith("chunked loss: on") for p in single_run["policies"])


def test_ddp_answers_the_sample_prompts_once_from_rank_0_without_changing_the_losses(tmp_path):
    """The answers come from the model under DDP's wrapper, on rank 0 alone (no collective), once per prompt."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    common = [str(config), "--set", "speedups.chunked_loss=false"]
    single_run = ["--set", f"output_dir={tmp_path / 'single'}", "--set", "training.grad_accum=2"]
    run(["-m", "slipstream", "train", *common, *single_run])
    run(
        [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            free_port(),
            "-m",
            "slipstream",
            "train",
            *common,
            "--set",
            f"output_dir={tmp_path / 'ranks'}",
            "--set",
            "training.sample_prompts=[Hello, Tell me a story]",
            "--set",
            "training.sample_max_new_tokens=4",
        ]
    )
    records = [json.loads(line) for line in (tmp_path / "ranks" / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["prompt"]) for r in records] == [
        (step, prompt) for step in (2, 4) for prompt in ("Hello", "Tell me a story")
    ]
    assert all(1 <= r["new_tokens"] <= 4 for r in records)
    single, ranks = losses(tmp_path / "single"), losses(tmp_path / "ranks")
    assert max(abs(a - b) / abs(a) for a, b in zip(single, ranks, strict=True)) <= 1e-5


def test_grpo_trains_under_ddp_each_rank_sampling_its_prompts(tmp_path):
    """Two ranks, each sampling its own prompts' groups (seeded by rank), the step's completion and
    token counts summed over the ranks: the run ends, rank 0 logs every step's rewards, the ranks'
    adapters stayed one (DDP) and a resumed rank samples what it sampled before (the seeds)."""
    from ..objectives.test_grpo import grpo_config

    config = grpo_config(tmp_path, training={"steps": 2, "checkpoint_every": 1}, data={"eval_fraction": 0.25})
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    run([*command, "-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'ranks'}"])
    records = [json.loads(line) for line in (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert all("reward_even_tokens" in r and "completion_mean_tokens" in r for r in records)
    assert "eval_reward" in records[-1]
    summary = json.loads((tmp_path / "ranks" / "run.json").read_text())
    assert summary["world_size"] == 2 and summary["grpo"]["num_generations"] == 4
    # resumed from step 1: step 2 samples and trains as it did (sampling seeded by seed, step and rank)
    import shutil

    # as if killed after step 2's record, before its checkpoint: no step-2 checkpoint, no run.json
    shutil.rmtree(tmp_path / "ranks" / "checkpoints" / "step-000002")
    shutil.rmtree(tmp_path / "ranks" / "adapter")
    (tmp_path / "ranks" / "run.json").unlink()
    command[-1] = free_port()
    run(
        [
            *command,
            "-m",
            "slipstream",
            "train",
            str(config),
            "--set",
            f"output_dir={tmp_path / 'ranks'}",
            "--resume",
        ]
    )
    again = [json.loads(line) for line in (tmp_path / "ranks" / "metrics.jsonl").read_text().splitlines()]
    assert again[-1]["step"] == 2 and again[-1]["reward"] == records[-1]["reward"]
    assert again[-1]["loss"] == pytest.approx(records[-1]["loss"], rel=1e-5, abs=1e-7)
