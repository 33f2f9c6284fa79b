"""Checks before the first step: each a one-line TrainError naming the key or file."""

from __future__ import annotations

import pytest

from slipstream.models import build_model
from slipstream.train.config import TrainConfig
from slipstream.train.errors import TrainError
from slipstream.train.preflight import (
    check_labels_left,
    check_lora_targets,
    check_model_dir,
    check_token_ids,
    weights_error,
)


def test_model_directory_missing_a_file_or_not_a_model(tmp_path):
    with pytest.raises(TrainError, match="no such directory .*never downloaded"):
        check_model_dir(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainError, match="is a file"):
        check_model_dir(tmp_path / "file")
    with pytest.raises(TrainError, match=r"not a model directory \(no config.json\)"):
        check_model_dir(tmp_path)


def test_a_damaged_weight_file_is_named(tmp_path):
    model = build_model("llama")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # cut short
    error = weights_error(tmp_path, RuntimeError("deserializing header"))
    assert str(error).startswith(f"{weights}: damaged weight file")


def test_lora_targets_that_match_nothing_name_the_closest_module():
    config = TrainConfig()
    model = build_model("qwen3")
    check_lora_targets(model, config)  # q/k/v/o exist
    config.lora.target_modules = ["q_proj", "qproj"]
    with pytest.raises(
        TrainError, match=r"lora.target_modules: 'qproj' matches no module .*did you mean 'q_proj'"
    ):
        check_lora_targets(model, config)
    config.lora.target_modules = [r".*\.mlp\.(up|down)_proj"]  # a regex, as PEFT allows
    config.lora.modules_to_save = ["lm_heed"]
    with pytest.raises(TrainError, match="lora.modules_to_save: 'lm_heed' .*'lm_head'"):
        check_lora_targets(model, config)


def test_token_ids_beyond_the_vocabulary_and_samples_without_labels():
    model = build_model("qwen3", vocab_size=100)
    check_token_ids([{"input_ids": [1, 99]}], model, "data.jsonl")
    with pytest.raises(
        TrainError, match="data.jsonl: sample 1 has token id 100, beyond the model's 100 embeddings"
    ):
        check_token_ids([{"input_ids": [1]}, {"input_ids": [5, 100]}], model, "data.jsonl")
    config = TrainConfig()
    check_labels_left(0, config)
    with pytest.raises(TrainError, match="data.max_seq_len 1024: 3 sample"):
        check_labels_left(3, config)
    config.data.skip_bad_rows = True
    check_labels_left(3, config)


def test_a_refusal_is_said_in_config_terms():
    from slipstream.train.loop import config_advice

    message = "X does not route attention ... Train this model unpacked: slipstream.optimize(model, packed_attention=False)"
    assert config_advice(message) == " (in the config: speedups.packed_attention: false)"
    assert (
        config_advice("Use slipstream.optimize(model, moe_routing='stock').")
        == " (in the config: speedups.moe_routing: stock)"
    )
    assert config_advice("no advice") == ""
