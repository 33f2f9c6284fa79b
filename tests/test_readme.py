"""The README's commands work: every `slipstream` command it shows parses and builds its config, the
quick ones run (shortened where they would take minutes), and the one pointing at a model the
reader has not downloaded fails with the one-line error a user would get, not a config error."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from slipstream.bench.command import ab_config_from_args
from slipstream.cli import build_parser, main
from slipstream.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("slipstream ", "torchrun "))]


COMMANDS = readme_commands()


def test_the_readme_shows_the_commands_we_test():
    assert any(c.startswith("slipstream train examples/tiny.yaml") for c in COMMANDS)
    assert any(c.startswith("slipstream ab") for c in COMMANDS)
    assert any("optimizer.lr=1e-4" in c for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_parses_and_builds_its_config(command, tmp_path):
    words = shlex.split(command)
    if words[0] == "torchrun":  # run end to end by tests/train/test_distributed.py
        words = words[words.index("slipstream") :]
    args = build_parser().parse_args(words[1:])
    if args.command == "train":
        if args.config == "CONFIG.yaml":  # the reader's own config: a minimal one
            config_path = tmp_path / "CONFIG.yaml"
            config_path.write_text("model:\n  preset: demo\ntraining:\n  steps: 2\n")
        else:
            config_path = ROOT / args.config
        load_config(config_path, args.set)
    elif args.command == "ab":
        ab_config_from_args(args)


def test_the_tiny_example_trains(tmp_path, capsys):
    overrides = [
        "--set",
        f"output_dir={tmp_path / 'tiny'}",
        "--set",
        "training.steps=3",
        "--set",
        "data.demo_rows=100",
    ]
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), *overrides]) == 0
    assert (tmp_path / "tiny" / "adapter" / "adapter_model.safetensors").exists()
    # `slipstream train CONFIG.yaml --resume` on the same config: a finished run has nothing left to do
    code = main(["train", str(ROOT / "examples" / "tiny.yaml"), *overrides, "--resume"])
    assert code in (0, 1)
    assert "Traceback" not in capsys.readouterr().err


def test_the_qwen3_8b_command_fails_only_on_the_missing_model(tmp_path, capsys):
    command = next(c for c in COMMANDS if "optimizer.lr=1e-4" in c)
    words = shlex.split(command)[1:]
    words[1] = str(ROOT / words[1])
    code = main([*words, "--set", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert (
        err[-1]
        == "slipstream train: model.path /models/Qwen3-8B: no such directory (models are read from disk, never downloaded)"
    )


def test_the_default_ab_runs_shortened(tmp_path, capsys):
    assert (
        main(
            [
                "ab",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--rows",
                "120",
                "--max-seq-len",
                "256",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "ab"),
            ]
        )
        == 0
    )
    assert (tmp_path / "ab" / "ab.json").exists()


def test_the_export_commands_run_on_the_tiny_example(tmp_path, monkeypatch, capsys):
    """Each README `slipstream export` line, in order, on a shortened run of examples/tiny.yaml."""
    exports = [shlex.split(c)[1:] for c in COMMANDS if c.startswith("slipstream export ")]
    assert exports and all(words[1] == "runs/tiny" for words in exports)
    monkeypatch.chdir(tmp_path)
    shortened = [  # the smallest preset, short rows: the export lines are what is tested here
        "model.preset=qwen3",
        "model.dtype=float32",
        "lora.rank=4",
        "training.steps=20",
        "data.demo_rows=20",
        "data.max_seq_len=32",
        "output_dir=runs/tiny",
    ]
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), *(f"--set={s}" for s in shortened)]) == 0
    for words in exports:
        assert main(words) == 0, capsys.readouterr().err
        out = tmp_path / words[words.index("--merged") + 1]
        assert (out / "config.json").exists() and (out / ".slipstream-export").exists()
