"""``grpo.engine: vllm`` without vLLM: the policy's merged weights, the engine's process (a stand-in
that speaks the worker's protocol, ``fake_vllm_worker.py``), its failures, and what a run records.
The real engine's tests are ``test_vllm_real.py`` (``make test-vllm``)."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from slipstream.cli import main
from slipstream.engines import vllm_engine
from slipstream.engines.vllm_engine import (
    EngineError,
    VLLMEngine,
    policy_weights,
    refuse_inexact,
    refuse_unsyncable,
    vllm_python,
)
from slipstream.models import build_model
from slipstream.rollouts import Sampling
from slipstream.train.config import ConfigError, load_config
from slipstream.train.errors import TrainError
from slipstream.train.loop import train

from ..objectives.test_grpo import grpo_config, records

FAKE = Path(__file__).with_name("fake_vllm_worker.py")


def lora_model(targets="all-linear", tie=False, preset="llama"):
    from peft import LoraConfig, get_peft_model

    base = build_model(preset, vocab_size=96)
    if tie:
        base.config.tie_word_embeddings = True
        base.lm_head.weight = base.model.embed_tokens.weight
    torch.manual_seed(0)
    model = get_peft_model(
        base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
    )
    return model


def test_the_merged_weights_are_peft_merge_and_unload_and_leave_the_model_alone():
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    every = policy_weights(model, changed_only=False)
    merged = copy.deepcopy(model).merge_and_unload().state_dict()
    assert every.keys() == merged.keys()
    for name, tensor in merged.items():
        torch.testing.assert_close(every[name], tensor, rtol=0, atol=1e-6, msg=name)
    for name, param in model.named_parameters():  # nothing merged into the trainer's model
        assert torch.equal(param, before[name]), name
    assert not any("lora_" in n or "base_layer" in n for n in every)


def test_a_sync_sends_the_changed_weights_with_their_fused_siblings_only():
    """q_proj alone is trained, but vLLM fuses q/k/v into one layer rebuilt from all three: the
    sync sends each changed module's siblings, never the embeddings or the norms outside them."""
    model = lora_model(targets=["q_proj"])
    changed = policy_weights(model, changed_only=True)
    layers = model.get_base_model().config.num_hidden_layers
    for layer in range(layers):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert f"model.layers.{layer}.self_attn.{part}.weight" in changed
    assert not any("embed" in n or "mlp" in n or n == "model.norm.weight" for n in changed)
    untrained = lora_model(targets=["q_proj"])
    for param in untrained.parameters():
        param.requires_grad_(False)
    assert policy_weights(untrained, changed_only=True).keys() == changed.keys()  # LoRA-wrapped: changed


def test_a_tied_head_is_left_to_the_engine_to_tie():
    weights = policy_weights(lora_model(tie=True), changed_only=False)
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights


def test_a_missing_engine_is_one_line_naming_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("SLIPSTREAM_VLLM_VENV", str(tmp_path / "no-venv"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None if name == "vllm" else object())
    with pytest.raises(EngineError) as caught:
        vllm_python(create=False)
    message = str(caught.value)
    assert "\n" not in message and "make_vllm_venv.sh" in message and "pip install vllm" in message


@pytest.fixture
def fake_engine(monkeypatch, tmp_path):
    """The engine's process is the stand-in; returns the file its requests are logged to."""
    return use_fake_engine(monkeypatch, tmp_path)


def use_fake_engine(monkeypatch, tmp_path) -> Path:
    monkeypatch.setattr(vllm_engine, "WORKER", FAKE)
    monkeypatch.setenv("SLIPSTREAM_VLLM_PYTHON", sys.executable)
    calls = tmp_path / "engine-calls.txt"
    monkeypatch.setenv("FAKE_VLLM_CALLS", str(calls))
    return calls


def fake_workers() -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(FAKE) in " ".join(p.info["cmdline"] or [])]


def test_the_engine_answers_in_its_own_process_and_stops_with_close(fake_engine):
    model = lora_model()
    engine = VLLMEngine(stop_ids=(1,), max_model_len=64)
    line = engine.start(model)
    assert "in its own process" in line and "merged weights" in line
    engine.sync(model)
    rollouts = engine.generate(model, [[3, 4, 5], [6]], 3, Sampling(max_new_tokens=5), seed=11)
    again = engine.generate(model, [[3, 4, 5], [6]], 3, Sampling(max_new_tokens=5), seed=11)
    assert [[c.ids for c in g] for g in rollouts.completions] == [
        [c.ids for c in g] for g in again.completions
    ]
    assert len(rollouts.completions) == 2 and all(len(g) == 3 for g in rollouts.completions)
    assert all(len(c.logprobs) == len(c.ids) for g in rollouts.completions for c in g)
    assert engine.sync_bytes > 0 and len(engine.sync_s) == 1
    engine.close()
    engine.close()  # twice is fine
    assert not fake_workers()
    assert fake_engine.read_text().split() == ["load", "generate", "generate", "close"]


def test_an_engine_that_fails_to_start_is_one_line(fake_engine, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_START", "1")
    engine = VLLMEngine(stop_ids=(1,), max_model_len=64)
    with pytest.raises(EngineError) as caught:
        engine.start(lora_model())
    engine.close()
    message = str(caught.value)
    assert "no such model type 'fake'" in message and "\n" not in message
    assert "rebuild it: rm -rf" in message and "make_vllm_venv.sh" in message


def test_grpo_trains_on_the_engines_rollouts_with_trls_correction_and_records_it(fake_engine, tmp_path):
    config = grpo_config(tmp_path, grpo={"engine": "vllm"}, data={"eval_fraction": 0.25})
    train(load_config(config), progress=False)
    out = tmp_path / "out"
    found = records(out)
    assert [r["step"] for r in found] == [1, 2, 3]
    for record in found:
        # the fake engine's log-probs are -log(V) + 0.01: the trainer's differ from them
        assert record["sampling_logp_difference"] > 0
        assert record["sampling_logp_difference_max"] >= record["sampling_logp_difference"]
        assert 0.0 <= record["importance_sampling_clipped_share"] <= 1.0
        assert record["engine_sync_s"] >= 0 and record["completion_max_tokens"] <= 6
    run = json.loads((out / "run.json").read_text())
    line = next(p for p in run["policies"] if p.startswith("grpo:"))
    assert "vllm fake in its own process" in line and "sequence_mask, clip [none, 3]" in line
    # a sync before every round's sampling and before the evaluation after the last step
    calls = fake_engine.read_text().split()
    assert calls.count("load") == 4 and calls.count("generate") == 4 and calls[-1] == "close"
    assert (out / "vllm.log").exists() and not fake_workers()


def test_the_correction_off_trains_as_the_hf_engines_update_does(fake_engine, tmp_path):
    config = grpo_config(tmp_path, grpo={"engine": "vllm", "vllm_importance_sampling_correction": False})
    train(load_config(config), progress=False)
    record = records(tmp_path / "out")[0]
    assert "sampling_logp_difference" not in record and "importance_sampling_clipped_share" not in record


def test_an_engine_that_dies_stops_the_run_non_zero_keeping_its_checkpoints(
    fake_engine, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("FAKE_VLLM_DIE_AT", "3")
    config = grpo_config(tmp_path, grpo={"engine": "vllm"}, training={"steps": 4, "checkpoint_every": 1})
    assert main(["train", str(config)]) != 0
    err = capsys.readouterr().err
    assert "the vLLM engine exited (code 3) during generating" in err and "dying as asked" in err
    checkpoints = sorted(p.name for p in (tmp_path / "out" / "checkpoints").iterdir())
    assert checkpoints and checkpoints[-1].endswith("2"), checkpoints
    assert not fake_workers()


def test_an_engine_that_fails_at_start_stops_the_run_before_step_one(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FAIL_START", "1")
    with pytest.raises(TrainError, match="no such model type 'fake'"):
        train(load_config(grpo_config(tmp_path, grpo={"engine": "vllm"})), progress=False)
    assert not (tmp_path / "out" / "metrics.jsonl").exists() or not records(tmp_path / "out")


@pytest.mark.parametrize(
    "sections, key",
    [
        ({"grpo": {"engine": "vllm", "vllm_sync": "lora"}, "lora": {"enabled": False}}, "grpo.vllm_sync"),
        (
            {"grpo": {"engine": "vllm", "vllm_importance_sampling_mode": "token"}},
            "grpo.vllm_importance_sampling_mode",
        ),
        ({"grpo": {"engine": "sglang"}}, "grpo.engine"),
    ],
)
def test_what_the_engine_cannot_do_is_refused_by_key(tmp_path, sections, key):
    with pytest.raises(ConfigError) as caught:
        load_config(grpo_config(tmp_path, **sections))
    assert key in str(caught.value) and "\n" not in str(caught.value)


def test_a_policy_the_engine_cannot_hold_exactly_is_refused_by_name():
    def config(four_bit=False, experts=False):
        return SimpleNamespace(
            quantization=SimpleNamespace(four_bit=four_bit),
            lora=SimpleNamespace(enabled=True, experts=experts),
        )

    refuse_unsyncable(lora_model(), config())  # a plain LoRA: fine
    with pytest.raises(EngineError, match="tied embeddings"):
        refuse_unsyncable(lora_model(targets=["q_proj", "embed_tokens"], tie=True), config())
    with pytest.raises(EngineError, match="quantization.four_bit"):
        refuse_unsyncable(lora_model(), config(four_bit=True))
    with pytest.raises(EngineError, match="lora.experts"):
        refuse_unsyncable(lora_model(), config(experts=True))


def test_what_a_model_holds_is_refused_by_name_without_a_config():
    from slipstream.moe.lora import ExpertLoRA, ExpertLoRAConfig

    class Linear4bit(torch.nn.Linear):  # bitsandbytes' class, by name
        pass

    where = dict(where="generate --engine vllm", instead="use --engine hf")
    refuse_inexact(lora_model(), **where)  # a plain LoRA: fine
    quantized = lora_model()
    quantized.base_model.model.model.layers[0].add_module("q4", Linear4bit(2, 2))
    with pytest.raises(EngineError, match="generate --engine vllm: a 4-bit base.*use --engine hf"):
        refuse_inexact(quantized, **where)
    experts = lora_model()
    experts.base_model.model.model.layers[0].add_module("experts_lora", ExpertLoRA({}, ExpertLoRAConfig()))
    with pytest.raises(EngineError, match="expert LoRA"):
        refuse_inexact(experts, **where)
    with pytest.raises(EngineError, match="tied embeddings"):
        refuse_inexact(lora_model(targets=["q_proj", "embed_tokens"], tie=True), **where)
