"""The real vLLM engine (``make test-vllm``: vLLM's CPU build in its own venv, made once and cached).

Skipped where vLLM is not installed. A tiny fp32 model: the engine's log-probs of what it sampled
match the trainer's, before and after a sync of changed LoRA weights; the same seed samples the same
completions; a GRPO run trains on its rollouts and stops it at the end; a model the engine has no
kernel for fails the start, naming it; ``generate --engine vllm`` answers as the hf engine, greedily."""

from __future__ import annotations

import pytest
import torch

from slipstream.engines.vllm_engine import EngineError, VLLMEngine, vllm_python
from slipstream.rollouts import Sampling
from slipstream.train.config import load_config
from slipstream.train.loop import train

from ..objectives.test_grpo import grpo_config, records
from .test_vllm_engine import fake_workers, lora_model

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine_cache(tmp_path_factory):
    """One vLLM compile cache for the module's engines (each test has a home of its own)."""
    return tmp_path_factory.mktemp("vllm-cache")


@pytest.fixture
def engine_python(engine_cache, monkeypatch):
    try:
        python = vllm_python(create=False)
    except EngineError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(engine_cache))
    return python


def trainer_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(ids)])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_the_engine_samples_the_trainers_policy_after_each_sync(engine_python, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    model = lora_model(preset="demo").eval()  # head_dim 32: vLLM's CPU attention has no kernel for 16
    engine = VLLMEngine(stop_ids=(1,), max_model_len=64, memory_share=0.05)
    try:
        engine.start(model)
        prompts = [[5, 6, 7, 8], [9, 10]]
        sampling = Sampling(temperature=1.0, max_new_tokens=12)
        for round_ in range(2):
            engine.sync(model)
            rollouts = engine.generate(model, prompts, 3, sampling, seed=7)
            again = engine.generate(model, prompts, 3, sampling, seed=7)
            assert [[c.ids for c in g] for g in rollouts.completions] == [
                [c.ids for c in g] for g in again.completions
            ]
            for prompt, group in zip(prompts, rollouts.completions, strict=True):
                for completion in group:
                    mine = trainer_logprobs(model, prompt, completion.ids)
                    theirs = torch.tensor(completion.logprobs)
                    assert (mine - theirs).abs().max() < 1e-3, (round_, mine, theirs)
            with torch.no_grad():  # the next round's policy: every LoRA B moved
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.add_(torch.randn_like(param) * 0.2)
    finally:
        engine.close()


def test_a_grpo_run_trains_on_vllms_rollouts(engine_python, monkeypatch, tmp_path):
    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    config = grpo_config(
        tmp_path,
        model={"preset": "demo", "dtype": "float32"},
        grpo={"engine": "vllm", "vllm_gpu_memory_utilization": 0.05},
    )
    train(load_config(config), progress=False)
    found = records(tmp_path / "out")
    assert [r["step"] for r in found] == [1, 2, 3]
    # fp32 on both sides: the sampler's numbers are the trainer's to float rounding
    assert all(r["sampling_logp_difference"] < 1e-3 for r in found)
    assert all(r["importance_sampling_clipped_share"] == 0.0 for r in found)
    assert not fake_workers()


def test_the_ab_vllm_arm_updates_on_the_shared_rollouts_and_counts_the_engine(
    engine_python, monkeypatch, tmp_path
):
    """``ab --preset grpo``'s vLLM arm: the same update as slipstream's own (the same rollouts), its
    sampling on vLLM, its peak memory with the engine's process, the sync's cost in its policies."""
    from slipstream.bench.runner import run_ab

    from ..bench.test_ab_grpo import _parse

    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    config = grpo_config(
        tmp_path, model={"preset": "demo", "dtype": "float32"}, grpo={"vllm_gpu_memory_utilization": 0.05}
    )
    arms = "slipstream-grpo,slipstream-grpo-vllm"
    argv = [
        "--config",
        str(config),
        "--steps",
        "2",
        "--warmup",
        "1",
        "--arms",
        arms,
        "--out",
        str(tmp_path / "ab"),
    ]
    record = run_ab(_parse(argv), progress=False)
    mine, theirs = (record["runs"][arm][0] for arm in arms.split(","))
    assert theirs["loss"] == pytest.approx(mine["loss"], abs=1e-6)
    assert theirs["grad_norm"] == pytest.approx(mine["grad_norm"], rel=1e-5)
    assert "the vLLM engine's process" in theirs["memory_kind"]
    assert any(p.startswith("vLLM sync (merged)") for p in theirs["policies"])
    assert record["summary"]["slipstream-grpo-vllm"]["generation_tokens_speedup_vs_slipstream-grpo"] > 0
    assert not fake_workers()


def test_a_model_the_engine_cannot_run_fails_its_start_naming_why(engine_python, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("vLLM's GPU attention may have a kernel for head_dim 16")
    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    engine = VLLMEngine(stop_ids=(1,), max_model_len=64, memory_share=0.05)
    with pytest.raises(EngineError, match="failed start: .*head_dim=16"):
        engine.start(lora_model())  # head_dim 16
    engine.close()


def test_generate_on_the_engine_answers_as_the_hf_engine_greedily(engine_python, monkeypatch, tmp_path):
    """``slipstream generate --engine vllm``: a finished run's model (adapter merged) in vLLM, greedy,
    gives the tokens transformers' greedy generate gives (fp32 both sides)."""
    import yaml

    import slipstream

    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    run = {
        "model": {"preset": "demo", "dtype": "float32"},  # head_dim 32 (vLLM's CPU attention)
        "data": {"demo_rows": 40, "max_seq_len": 128},
        "lora": {"rank": 4, "alpha": 8},
        "optimizer": {"lr": 5e-2, "schedule": "constant"},
        "training": {"steps": 4},
        "seed": 0,
        "output_dir": str(tmp_path / "out"),
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run))
    train(load_config(tmp_path / "config.yaml"), progress=False)
    prompts = ["What is the capital of France?", "Write a line about the sea.", "hi"]
    hf = slipstream.generate(tmp_path / "out", prompts, max_new_tokens=16)
    engine = slipstream.generate(
        tmp_path / "out", prompts, max_new_tokens=16, engine="vllm", vllm_gpu_memory_utilization=0.05
    )
    assert sum(len(text) for text in hf) > 10  # the model says something: the comparison is not of empties
    assert engine == hf
    assert not fake_workers()
