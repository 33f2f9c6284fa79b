"""Checks before the first step: each a one-line TrainError naming the key or file."""

from __future__ import annotations

import pytest

from slipstream.models import build_model
from slipstream.train.config import DataConfig, ModelConfig, TrainConfig
from slipstream.train.errors import TrainError
from slipstream.train.preflight import (
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


def test_token_ids_beyond_the_vocabulary():
    model = build_model("qwen3", vocab_size=100)
    check_token_ids([{"input_ids": [1, 99]}], model, "data.jsonl")
    with pytest.raises(
        TrainError, match="data.jsonl: sample 1 has token id 100, beyond the model's 100 embeddings"
    ):
        check_token_ids([{"input_ids": [1]}, {"input_ids": [5, 100]}], model, "data.jsonl")


def test_a_refusal_is_said_in_config_terms():
    from slipstream.loss.chunked_loss import UnsupportedLoss
    from slipstream.packing.guards import UnsupportedArchitecture
    from slipstream.train.driver import config_advice

    # read from the exception (its class's avoid, or the raise site's), never from its text
    assert config_advice(UnsupportedArchitecture("X")) == " (in the config: speedups.packed_attention: false)"
    assert (
        config_advice(UnsupportedLoss("X", avoid={"moe_routing": "stock", "checkpointing": None}))
        == " (in the config: speedups.moe_routing: stock, speedups.checkpointing: null)"
    )
    wrapped = TrainError("set-up failed")
    wrapped.__cause__ = UnsupportedLoss("X")
    assert config_advice(wrapped) == " (in the config: speedups.chunked_loss: false)"
    assert config_advice(UnsupportedArchitecture("X", avoid=None)) == ""  # no option avoids it
    text_only = NotImplementedError("Use slipstream.optimize(model, packed_attention=False)")
    assert config_advice(text_only) == ""  # not a refusal: its text is not parsed


def test_a_refusal_in_optimize_stops_the_run_with_its_config_line(tmp_path):
    import yaml

    from slipstream.train.config import load_config
    from slipstream.train.loop import train

    settings = {
        "model": {"preset": "qwen3", "dtype": "float32"},
        "data": {"demo_rows": 16, "max_seq_len": 128},
        "training": {"steps": 1},
        "speedups": {"fused_kernels": "liger"},  # Liger runs on CUDA only: refused on a CPU
        "output_dir": str(tmp_path / "out"),
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(settings))
    with pytest.raises(
        TrainError, match=r"fused_kernels='liger'.* \(in the config: speedups.fused_kernels: auto\)$"
    ):
        train(load_config(path, []), progress=False)


# ---- data.chat_template: another template than the tokenizer's ----

# The demo tokenizer's ChatML with the roles in capitals: the same special tokens, other ids.
SHOUTED = (
    "{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>ASSISTANT\n{% endif %}"
)
CHAT = {
    "messages": [
        {"role": "user", "content": "Which lantern glows teal?"},
        {"role": "assistant", "content": "Lantern four glows teal."},
    ]
}


def _templated_config(source):
    return TrainConfig(model=ModelConfig(preset="demo"), data=DataConfig(chat_template=str(source)))


def test_the_chat_template_option_renders_every_row_with_the_given_template(tmp_path):
    """A .jinja file, or a tokenizer directory: its template replaces the tokenizer's, so the rows
    render (and tokenize) differently; the labels are still the assistant's tokens only."""
    from slipstream.data import tokenize_row
    from slipstream.train.inputs import load_tokenizer

    stock = load_tokenizer(TrainConfig(model=ModelConfig(preset="demo")))
    (tmp_path / "shouted.jinja").write_text(SHOUTED)
    from_file = load_tokenizer(_templated_config(tmp_path / "shouted.jinja"))
    assert from_file.chat_template == SHOUTED != stock.chat_template
    own, other = (tokenize_row(CHAT, t, response_only=True) for t in (stock, from_file))
    assert own["input_ids"] != other["input_ids"]
    assert "<|im_start|>USER\n" in from_file.decode(other["input_ids"])
    answer = [t for t, label in zip(other["input_ids"], other["labels"], strict=True) if label != -100]
    assert from_file.decode(answer).startswith("Lantern four glows teal.")
    from_file.save_pretrained(tmp_path / "tokenizer")  # a directory: its tokenizer's template
    assert load_tokenizer(_templated_config(tmp_path / "tokenizer")).chat_template == SHOUTED


@pytest.mark.parametrize(
    "write, message",
    [
        (None, "no such file or directory"),
        (lambda p: p.write_bytes(b"\xff\xfe\x00binary"), "not a text file"),
        (lambda p: p.write_text("model:\n  preset: demo\n"), "not a chat template"),
        (lambda p: p.write_text("{% for m in messages %}{{ m['content'] }"), "not a valid Jinja template"),
        (lambda p: p.mkdir(), "a directory without a chat template"),
    ],
)
def test_a_chat_template_that_cannot_be_used_is_one_line_naming_the_key(tmp_path, write, message):
    from slipstream.train.inputs import load_tokenizer

    path = tmp_path / "template.jinja"
    if write is not None:
        write(path)
    with pytest.raises(TrainError, match=f"^data.chat_template {path}: {message}") as raised:
        load_tokenizer(_templated_config(path))
    assert "\n" not in str(raised.value)
