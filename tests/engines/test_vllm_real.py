"""The real vLLM engine (``make test-vllm``: vLLM's CPU build in its own venv, made once and cached).

Skipped where vLLM is not installed. A tiny fp32 model: the engine's log-probs of what it sampled
match the trainer's, before and after a sync of changed LoRA weights; the same seed samples the same
completions; a GRPO run trains on its rollouts and stops it at the end."""

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
def engine_python():
    try:
        return vllm_python(create=False)
    except EngineError as error:
        pytest.skip(str(error))


def trainer_logprobs(model, prompt, ids):
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(ids)])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]


def test_the_engine_samples_the_trainers_policy_after_each_sync(engine_python, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", engine_python)
    model = lora_model().eval()
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
    config = grpo_config(tmp_path, grpo={"engine": "vllm", "vllm_gpu_memory_utilization": 0.05})
    train(load_config(config), progress=False)
    found = records(tmp_path / "out")
    assert [r["step"] for r in found] == [1, 2, 3]
    # fp32 on both sides: the sampler's numbers are the trainer's to float rounding
    assert all(r["sampling_logp_difference"] < 1e-3 for r in found)
    assert all(r["importance_sampling_clipped_share"] == 0.0 for r in found)
    assert not fake_workers()
