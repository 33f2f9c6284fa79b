"""``slipstream train`` with ``training.objective: kto``: a short run writes its run with finite losses and
TRL's metrics; the packed row (prompt once for completion and KL completion) gives every sequence's
log-probs and LoRA gradients as each run alone; what cannot be exact is refused by key."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import yaml

from slipstream.errors import TrainError
from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train
from tests.objectives.test_pairs import WORDS
from tests.ports import free_port


def kto_rows(count: int = 16, seed: int = 0) -> list[dict]:
    """TRL's unpaired rows: plain strings, both labels, prompts longer than completions."""
    rng = random.Random(seed)

    def words(low, high):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    return [
        {"prompt": f"Question {n}: {words(8, 16)}?", "completion": words(2, 8), "label": n % 3 != 0}
        for n in range(count)
    ]


def write_rows(folder: Path, rows: list[dict] | None = None, name: str = "kto.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in (rows if rows is not None else kto_rows())))
    return path


def kto_config(folder: Path, rows: Path, out: str = "out", **sections) -> Path:
    """A tiny KTO config (the qwen3 preset, LoRA, fp32); ``sections`` merge into it."""
    data = {
        "model": {"preset": "qwen3", "dtype": "float32"},
        "data": {"path": str(rows), "max_seq_len": 128},
        "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
        "optimizer": {"lr": 1e-2, "schedule": "constant"},
        "training": {"objective": "kto", "steps": 3},
        "seed": 0,
        "output_dir": str(folder / out),
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path = folder / f"{out}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_a_kto_run_writes_its_run_with_finite_losses_and_trl_metrics(tmp_path, loss_type):
    config = kto_config(
        tmp_path, write_rows(tmp_path), kto={"loss_type": loss_type, "undesirable_weight": 1.5}
    )
    train(load_config(config), progress=False)
    out = tmp_path / "out"
    steps = records(out)
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in steps)
    first = steps[0]
    # the adapter starts at zero: the policy is the reference, so every reward and the KL baseline are 0
    assert first["chosen_reward"] == pytest.approx(0.0, abs=1e-5)
    assert first["kl"] == pytest.approx(0.0, abs=1e-5)
    # and each row's loss is 1 - sigmoid(0) = 0.5, weighted by its label's weight
    share = first["desirable"]
    assert first["loss"] == pytest.approx(0.5 * (share + 1.5 * (1 - share)), abs=1e-5)
    assert steps[-1]["loss"] != first["loss"]
    summary = json.loads((out / "run.json").read_text())
    assert summary["kto"]["loss_type"] == loss_type and summary["kto"]["rows"] > 0


def test_the_shared_prompt_changes_nothing_but_the_work(tmp_path):
    path = write_rows(tmp_path)
    runs = {}
    for sharing in (True, False):
        out = f"out_{sharing}"
        train(
            load_config(kto_config(tmp_path, path, out, preference={"prefix_sharing": sharing})),
            progress=False,
        )
        runs[sharing] = [r["loss"] for r in records(tmp_path / out)]
    assert runs[True] == pytest.approx(runs[False], abs=1e-5)


def test_a_per_step_reference_gives_the_precomputed_losses(tmp_path):
    path = write_rows(tmp_path)
    runs = {}
    for reference in ("precomputed", "per_step"):
        config = kto_config(tmp_path, path, reference, preference={"reference": reference})
        train(load_config(config), progress=False)
        runs[reference] = [value for r in records(tmp_path / reference) for value in (r["loss"], r["kl"])]
    assert runs["per_step"] == pytest.approx(runs["precomputed"], abs=1e-5)
    assert any(kl > 0 for kl in runs["per_step"][3::2])  # the baseline moved off zero after step 1


def test_held_out_rows_are_evaluated_with_the_trained_metrics(tmp_path):
    config = kto_config(
        tmp_path,
        write_rows(tmp_path, kto_rows(count=24)),
        data={"eval_fraction": 0.25, "max_seq_len": 256},  # 6 held-out rows of ~70 tokens: 2+ a bin
        training={"objective": "kto", "steps": 2, "eval_at_start": True},
    )
    train(load_config(config), progress=False)
    steps = records(tmp_path / "out")
    start = next(r for r in steps if r["step"] == 0)
    assert start["eval_loss"] == pytest.approx(0.5, abs=1e-5) and start["eval_kl"] == pytest.approx(
        0, abs=1e-5
    )
    last = [r for r in steps if "eval_loss" in r][-1]
    assert last["step"] == 2 and math.isfinite(last["eval_loss"]) and last["eval_loss"] != start["eval_loss"]


REFUSALS = [
    ({"data": {"share_prefixes": "tree"}}, "data.share_prefixes"),
    ({"data": {"step_order": "histories"}}, "data.step_order"),
    ({"kto": {"loss_type": "sigmoid"}}, "kto.loss_type"),
    ({"kto": {"desirable_weight": 0}}, "kto.desirable_weight"),
]


@pytest.mark.parametrize("sections, key", REFUSALS, ids=[key for _, key in REFUSALS])
def test_what_kto_cannot_do_is_refused_by_key(tmp_path, sections, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(kto_config(tmp_path, write_rows(tmp_path), **sections))


def test_a_bin_of_one_row_is_refused_as_trl_refuses_a_batch_of_one(tmp_path):
    # two rows each longer than half of max_seq_len: two bins of one row, no third row to move
    rows = [
        {"prompt": "Question: " + " ".join(WORDS[:14]), "completion": "wheat", "label": label}
        for label in (True, False)
    ]
    config = kto_config(tmp_path, write_rows(tmp_path, rows), data={"max_seq_len": 40})
    with pytest.raises(TrainError, match="2 of 2 bins hold a single row"):
        train(load_config(config), progress=False)


@pytest.mark.multiprocess
@pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_two_ranks_train_the_rows_of_one_process_with_the_same_global_batch(tmp_path, loss_type):
    """Under DDP each rank's micro-batch takes the ranks' mean KL baseline (TRL's gather): without a KL
    baseline every step equals one process's with the same bins; with one, step 1 does (policy =
    reference, KL 0), and the ranks' collective in every micro-batch runs to the end without a hang
    (one process with two micro-batches takes each micro-batch's own baseline instead)."""
    config = kto_config(
        tmp_path,
        write_rows(tmp_path),
        training={"objective": "kto", "steps": 3},
        kto={"loss_type": loss_type},
    )

    def launch(args):
        done = subprocess.run(
            [sys.executable, *args],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert done.returncode == 0, done.stderr[-3000:]

    launch(
        [
            "-m",
            "slipstream",
            "train",
            str(config),
            "--set",
            f"output_dir={tmp_path / 'single'}",
            "--set",
            "training.grad_accum=2",
        ]
    )
    ranks = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port()]
    launch([*ranks, "-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'ranks'}"])
    one = [r["loss"] for r in records(tmp_path / "single")]
    two = [r["loss"] for r in records(tmp_path / "ranks")]
    assert len(one) == len(two) == 3 and all(math.isfinite(loss) for loss in two)
    compared = two if loss_type == "apo_zero_unpaired" else two[:1]
    assert max(abs(a - b) / abs(a) for a, b in zip(one[: len(compared)], compared, strict=True)) <= 1e-5
    assert json.loads((tmp_path / "ranks" / "run.json").read_text())["world_size"] == 2
