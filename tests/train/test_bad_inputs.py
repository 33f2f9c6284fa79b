"""The bad-input matrix of `slipstream train`: every mistake a user makes ends in one line and a non-zero exit.

Each case runs the real CLI in-process and checks: exit status non-zero, stderr exactly one line
naming the key / file / line at fault, no traceback, and nothing written that looks like a
finished run (no adapter, no run.json). The recoverable cases (a damaged newest checkpoint, a
resume of a run stopped after its last checkpoint) are tested in test_checkpoints.py, the output
directory's rules in test_output_dir.py; a few of them are repeated here end to end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main

BASE = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 60, "max_seq_len": 256},
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 2},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen3 saved like a downloaded model, with the demo tokenizer (and its chat template)."""
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    folder = tmp_path_factory.mktemp("model")
    tokenizer = demo_tokenizer()
    build_model("qwen3", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def run(tmp_path: Path, capsys, data: dict, *args: str) -> tuple[int, str]:
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **data}))
    capsys.readouterr()  # what the set-up printed is not the run's
    code = main(["train", str(config), *args])
    return code, capsys.readouterr().err


def assert_one_line_refusal(code: int, err: str, expected: str, out: Path, existed: bool = False) -> None:
    """... and a run refused before its first step leaves nothing behind: no output directory where
    there was none (``existed``: one that was there is checked by the test)."""
    lines = [  # without transformers' progress bars and the dtype line a run prints first
        line
        for line in err.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("slipstream train: dtype") and "%|" not in line
    ]
    assert code != 0
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]
    assert existed or not out.exists(), sorted(p.name for p in out.iterdir())
    assert not (out / "adapter").exists() and not (out / "run.json").exists()


def chat_file(tmp_path: Path, rows: list[dict]) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def chat(prompt: str, answer: str) -> dict:
    return {"messages": [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]}


CONFIG_CASES = [
    (["--set", "optimizer.lr=-0.1"], "'optimizer.lr' must be > 0, got -0.1"),
    (["--set", "lora.dropout=1.5"], "'lora.dropout' must be < 1, got 1.5"),
    (["--set", "training.log_every=0"], "'training.log_every' must be >= 1, got 0"),
    (["--set", "optimizer.betas=[0.9]"], "'optimizer.betas' must hold 2 numbers, got 1"),
    (["--set", "training.checkpoint_every=-2"], "'training.checkpoint_every' must be >= 0, got -2"),
    (["--set", "lora.target_modules=[qproj]"], "lora.target_modules: 'qproj' matches no module"),
]


@pytest.mark.parametrize("args, expected", CONFIG_CASES, ids=[c[1].split("'")[1] for c in CONFIG_CASES])
def test_config_mistakes(tmp_path, capsys, args, expected):
    code, err = run(tmp_path, capsys, BASE, *args)
    assert_one_line_refusal(code, err, expected, tmp_path / "out")


def test_output_dir_that_is_a_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("not a folder")
    code, err = run(tmp_path, capsys, {**BASE, "output_dir": str(tmp_path / "taken")})
    assert_one_line_refusal(code, err, str(tmp_path / "taken"), tmp_path / "taken", existed=True)


def test_overwrite_of_a_folder_slipstream_did_not_make_leaves_it_untouched(tmp_path, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text('{"text": "precious"}\n')
    code, err = run(tmp_path, capsys, {**BASE, "output_dir": str(folder)}, "--overwrite")
    assert_one_line_refusal(code, err, "--overwrite refused", folder, existed=True)
    assert (folder / "train.jsonl").read_text() == '{"text": "precious"}\n'


def test_missing_model_directory_is_not_blamed_on_the_network(tmp_path, capsys):
    data = {**BASE, "model": {"path": str(tmp_path / "no-such-model")}}
    code, err = run(tmp_path, capsys, data)
    assert_one_line_refusal(code, err, "model.path", tmp_path / "out")
    assert "no such directory" in err and "connect" not in err.lower()


def test_a_bad_data_line_names_its_line_and_leaves_no_output_directory(tmp_path, capsys):
    data = tmp_path / "chats.jsonl"
    data.write_text(json.dumps(chat("hi", "yo")) + "\n" + '{"messages": [\n')
    out = tmp_path / "runs" / "first"  # its parent is created too, and removed with it
    code, err = run(tmp_path, capsys, {**BASE, "data": {"path": str(data)}, "output_dir": str(out)})
    assert_one_line_refusal(code, err, f"{data}:2", out)
    assert not (tmp_path / "runs").exists()


def test_a_failed_set_up_leaves_an_empty_output_directory_empty(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    code, err = run(tmp_path, capsys, {**BASE, "model": {"path": str(tmp_path / "no-such-model")}})
    assert_one_line_refusal(code, err, "model.path", tmp_path / "out", existed=True)
    assert list((tmp_path / "out").iterdir()) == []


def test_damaged_weights_name_the_file(tmp_path, capsys, model_dir):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for file in model_dir.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:4096])
    code, err = run(tmp_path, capsys, {**BASE, "model": {"path": str(broken), "dtype": "float32"}})
    assert_one_line_refusal(code, err, f"{weights}: damaged weight file", tmp_path / "out")


def test_chat_rows_for_a_tokenizer_without_a_template(tmp_path, capsys, model_dir):
    plain = tmp_path / "plain-model"
    plain.mkdir()
    for file in model_dir.iterdir():
        (plain / file.name).write_bytes(file.read_bytes())
    settings = json.loads((plain / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(settings))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    data = {
        **BASE,
        "model": {"path": str(plain), "dtype": "float32"},
        "data": {"path": chat_file(tmp_path, [chat("hi", "yo")] * 4)},
    }
    code, err = run(tmp_path, capsys, data)
    assert_one_line_refusal(code, err, "chat template", tmp_path / "out")
    assert "chats.jsonl" in err and str(plain) in err


def test_token_ids_beyond_the_models_vocabulary(tmp_path, capsys):
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    small = tmp_path / "small-vocab"
    build_model("qwen3", vocab_size=300).save_pretrained(small)  # the tokenizer has 2,048 tokens
    demo_tokenizer().save_pretrained(small)
    code, err = run(tmp_path, capsys, {**BASE, "model": {"path": str(small), "dtype": "float32"}})
    assert_one_line_refusal(code, err, "beyond the model's 300 embeddings", tmp_path / "out")


def test_max_seq_len_shorter_than_the_prompts(tmp_path, capsys):
    rows = [chat("a long question " * 30, "short") for _ in range(4)]
    data = {**BASE, "data": {"path": chat_file(tmp_path, rows), "response_only": True, "max_seq_len": 32}}
    code, err = run(tmp_path, capsys, data)
    assert_one_line_refusal(
        code, err, "data.max_seq_len 32: 4 sample(s) would keep no label", tmp_path / "out"
    )


def test_resume_with_another_lora_rank_or_another_data_file(tmp_path, capsys):
    rows = [chat(f"add {i} and 1", str(i + 1)) for i in range(40)]
    data = {
        **BASE,
        "data": {"path": chat_file(tmp_path, rows)},
        "training": {"steps": 3, "checkpoint_every": 1},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"output_dir": str(tmp_path / "out"), **data}))
    assert main(["train", str(config), "--set", "training.steps=2"]) == 0  # a finished 2-step run...
    (tmp_path / "out" / "run.json").unlink()  # ...stopped before recording its end
    capsys.readouterr()
    assert main(["train", str(config), "--resume", "--set", "lora.rank=8"]) != 0
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "lora.rank 4 -> 8" in err and "Traceback" not in err
    chat_file(tmp_path, rows[:-1])  # the data file changes
    assert main(["train", str(config), "--resume"]) != 0
    err = capsys.readouterr().err
    assert "data file changed" in err and "--force" in err


def test_the_readme_learning_rate_override_works(tmp_path, capsys):
    code, err = run(tmp_path, capsys, BASE, "--set", "optimizer.lr=1e-4")
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "config.json").read_text())["optimizer"]["lr"] == 1e-4
