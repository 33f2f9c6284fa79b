"""The preference objective on what the SFT path has: MoE experts with expert LoRA, QLoRA, the
non-finite-step policy, and torchrun DDP (every rank the same loss as one process)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from slipstream.objectives import answers as objective
from slipstream.train.errors import TrainError

from ..ports import free_port
from .test_pairs import LN2, dpo_config, losses, records, run, write_pairs


def test_moe_experts_with_expert_lora_train_dpo(tmp_path):
    pairs = write_pairs(tmp_path)
    config = dpo_config(
        tmp_path,
        pairs,
        model={"preset": "qwen3-moe", "dtype": "float32"},
        lora={"experts": True, "target_modules": ["q_proj", "v_proj"]},
        training={"steps": 2},
    )
    _, summary = run(config)
    found = losses(tmp_path / "out")
    assert abs(found[0] - LN2) < 1e-5 and math.isfinite(found[1]) and found[1] != found[0]
    assert any(p.startswith("moe routing") or "sorted" in p for p in summary["policies"]), summary["policies"]


def test_qlora_trains_dpo_on_a_saved_model(tmp_path):
    pytest.importorskip("bitsandbytes")
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    model_dir = tmp_path / "model"
    tokenizer = demo_tokenizer()
    build_model("llama", vocab_size=len(tokenizer), seed=0, dtype=torch.float32).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    pairs = write_pairs(tmp_path)
    config = dpo_config(
        tmp_path,
        pairs,
        model={"path": str(model_dir), "preset": None, "dtype": "float32"},
        quantization={"four_bit": True},
        training={"steps": 2},
    )
    run(config)
    found = losses(tmp_path / "out")
    assert abs(found[0] - LN2) < 1e-5 and math.isfinite(found[1])


def test_a_nonfinite_step_stops_the_run_and_names_it(tmp_path, monkeypatch):
    pairs = write_pairs(tmp_path)
    config = dpo_config(tmp_path, pairs, training={"steps": 3})
    real = objective.answer_sums
    calls = {"n": 0}

    def poisoned(model, batch, chunked):
        sums = real(model, batch, chunked)
        if torch.is_grad_enabled():  # the policy's forwards (the reference pass is no_grad)
            calls["n"] += 1
            if calls["n"] == 2:  # step 2
                return sums * float("inf")
        return sums

    monkeypatch.setattr(objective, "answer_sums", poisoned)
    with pytest.raises(TrainError, match="step 2"):
        run(config)
    assert [r["step"] for r in records(tmp_path / "out") if "nonfinite" not in r] == [1]


@pytest.mark.multiprocess
@pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize(
    "strategy, reference", [("ddp", "precomputed"), ("fsdp2", "precomputed"), ("fsdp2", "per_step")]
)
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path, strategy, reference):
    pairs = write_pairs(tmp_path)
    config = dpo_config(
        tmp_path,
        pairs,
        training={"steps": 3, "distributed": strategy},
        data={"eval_fraction": 0.25},
        preference={"reference": reference},
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

    single = ["-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'single'}"]
    launch([*single, "--set", "training.grad_accum=2"])
    port = free_port()
    ranks = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", port]
    launch([*ranks, "-m", "slipstream", "train", str(config), "--set", f"output_dir={tmp_path / 'ranks'}"])
    one, two = losses(tmp_path / "single"), losses(tmp_path / "ranks")
    assert abs(one[0] - LN2) < 1e-5 and len(one) == len(two) == 3
    assert max(abs(a - b) / abs(a) for a, b in zip(one, two, strict=True)) <= 1e-5
    run_json = json.loads((tmp_path / "ranks" / "run.json").read_text())
    assert run_json["world_size"] == 2 and run_json["eval"]["metrics"]
    single_eval = json.loads((tmp_path / "single" / "run.json").read_text())["eval"]["metrics"][-1]
    assert abs(single_eval["loss"] - run_json["eval"]["metrics"][-1]["loss"]) <= 1e-5 * abs(
        single_eval["loss"]
    )
