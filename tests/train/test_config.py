"""The training config: every value's rules, declared on its field, with one-line errors naming file and line."""

from __future__ import annotations

import pytest
import yaml

from slipstream.train.config import ConfigError, load_config

BASE = {"model": {"preset": "qwen3"}, "training": {"steps": 2}}


def write(tmp_path, data):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def with_(section, **values):
    return {**BASE, section: {**BASE.get(section, {}), **values}}


@pytest.mark.parametrize(
    "data, message",
    [
        (with_("optimizer", lr=-0.1), "'optimizer.lr' must be > 0, got -0.1"),
        (with_("optimizer", lr="fast"), "'optimizer.lr' must be a number, got 'fast'"),
        (with_("optimizer", betas=[0.9]), "'optimizer.betas' must hold 2 numbers, got 1"),
        (with_("optimizer", betas=[0.9, 1.5]), "'optimizer.betas' must be < 1, got 1.5"),
        (
            with_("optimizer", schedule="cosin"),
            "'optimizer.schedule' must be one of cosine, linear, constant",
        ),
        (
            with_("optimizer", warmup_steps=-1),
            "'optimizer.warmup_steps' must be >= 0, got -1",
        ),
        (with_("lora", dropout=1.5), "'lora.dropout' must be < 1, got 1.5"),
        (with_("lora", dropout=-0.1), "'lora.dropout' must be >= 0, got -0.1"),
        (with_("lora", rank=0), "'lora.rank' must be >= 1, got 0"),
        (with_("lora", target_modules=[]), "'lora.target_modules' is empty"),
        (with_("training", log_every=0), "'training.log_every' must be >= 1, got 0"),
        (with_("training", checkpoint_every=-2), "'training.checkpoint_every' must be >= 0, got -2"),
        (with_("training", keep_checkpoints=-1), "'training.keep_checkpoints' must be >= 0, got -1"),
        (with_("data", max_seq_len=1), "'data.max_seq_len' must be >= 2, got 1"),
        (with_("model", dtype="fp8"), "'model.dtype' must be one of auto, float32, bfloat16, float16"),
        (with_("speedups", checkpointing="sometimes"), "'speedups.checkpointing' must be one of"),
        (with_("speedups", loss_chunk_tokens=0), "'speedups.loss_chunk_tokens' must be >= 1, got 0"),
        ({**BASE, "seed": -3}, "'seed' must be >= 0, got -3"),
        ({**BASE, "output_dir": " "}, "'output_dir' is empty"),
        (with_("data", chat_template=" "), "'data.chat_template' is empty"),
        (with_("data", chat_template=3), "'data.chat_template' must be a string, got 3"),
        (with_("training", sample_prompts=3), "'training.sample_prompts' must be a list, got int"),
        (
            with_("training", sample_prompts=["hi", 7]),
            "'training.sample_prompts\\[1\\]' must be a string, got 7",
        ),
        (with_("training", sample_prompts=["hi", " "]), "'training.sample_prompts\\[1\\]' is empty"),
        (with_("training", sample_max_new_tokens=0), "'training.sample_max_new_tokens' must be >= 1, got 0"),
    ],
)
def test_each_bad_value_is_one_line_naming_file_line_and_key(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(ConfigError, match=message) as raised:
        load_config(path)
    text = str(raised.value)
    assert "\n" not in text
    assert text.startswith(f"{path}:") and text.split(":")[1].strip().isdigit()  # the YAML line


def test_numbers_like_1e_4_parse_from_yaml_and_from_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: qwen3\ntraining:\n  steps: 2\noptimizer:\n  lr: 1e-4\n")
    assert load_config(path).optimizer.lr == 1e-4
    assert load_config(path, ["optimizer.lr=3e-5"]).optimizer.lr == 3e-5
    with pytest.raises(ConfigError, match=r"^.*c\.yaml: 'optimizer.lr' must be > 0, got -1e-05$"):
        load_config(path, ["optimizer.lr=-1e-5"])  # a --set value has no line: the file is named


def test_the_line_of_the_offending_key_is_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: qwen3\ntraining:\n  steps: 2\n  log_every: 0\n")
    with pytest.raises(ConfigError, match=rf"^{path}:5: 'training.log_every'"):
        load_config(path)
    path.write_text("model:\n  preset: qwen3\ntraining:\n  stepz: 2\n")
    with pytest.raises(
        ConfigError, match=rf"^{path}:4: unknown key 'training.stepz' \(did you mean 'training.steps'\?\)"
    ):
        load_config(path)


def test_a_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_a_bare_off_or_on_in_yaml_is_the_choice_not_a_boolean(tmp_path):
    """YAML 1.1 reads ``off`` / ``on`` as booleans; a choice field that has the word takes it."""
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  preset: qwen3\ntraining:\n  steps: 2\nspeedups:\n  compile: on\n  fused_kernels: off\n"
    )
    speedups = load_config(path).speedups
    assert speedups.compile == "on" and speedups.fused_kernels == "off"
    assert load_config(path, ["speedups.fused_kernels=off", "speedups.compile=off"]).speedups.compile == "off"
    with pytest.raises(ConfigError, match=r"'speedups.attention_grouping' must be one of .*, got False"):
        load_config(path, ["speedups.attention_grouping=off"])  # no "off" among its choices: refused
