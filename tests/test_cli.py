"""The command line: version, help, errors that name the file and line, exit codes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import slipstream
from slipstream.cli import main


def test_version_and_help(capsys):
    try:
        main(["--version"])
    except SystemExit as done:
        assert done.code == 0
    assert slipstream.__version__ in capsys.readouterr().out
    assert main([]) == 2
    assert "ab" in capsys.readouterr().out


def test_console_entry_point_runs():
    out = subprocess.run(
        [sys.executable, "-m", "slipstream", "--help"], capture_output=True, text=True, check=True
    )
    assert "A/B" in out.stdout


def test_pack_reports_efficiency(tmp_path, capsys):
    path = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"add {i} and {i}"},
                {"role": "assistant", "content": str(2 * i)},
            ]
        }
        for i in range(20)
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["pack", str(path), "--max-seq-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "packed 20 samples" in out


def test_pack_names_the_file_and_line_of_a_bad_row(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "also fine"}\n{"text": \n')
    assert main(["pack", str(path)]) == 1
    assert "bad.jsonl:3" in capsys.readouterr().err
    assert main(["pack", str(path), "--skip-bad-rows"]) == 0
    assert "bad.jsonl:3" in capsys.readouterr().out


def test_public_api_is_documented():
    for name in ("collate_packed", "optimize", "PackedBatch"):
        assert getattr(slipstream, name).__doc__
    assert "collate_packed" in slipstream.__doc__


def test_unknown_preset_missing_tokenizer_and_absent_cuda_fail_cleanly(tmp_path, capsys):
    import torch
    import yaml

    config = tmp_path / "c.yaml"
    config.write_text(
        yaml.safe_dump(
            {"model": {"preset": "qwen9"}, "training": {"steps": 1}, "output_dir": str(tmp_path / "out")}
        )
    )
    assert main(["train", str(config)]) == 1
    assert "model.preset: unknown model shape 'qwen9'" in capsys.readouterr().err
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "hello"}\n')
    assert main(["pack", str(rows), "--tokenizer", str(tmp_path / "no-tokenizer")]) == 1
    assert "no usable tokenizer" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["ab", "--device", "cuda"]) == 2
        assert "no CUDA device" in capsys.readouterr().err


def train_tiny(tmp_path, *flags) -> str:
    """`slipstream [flags] train examples/tiny.yaml`, one step on a few rows, in a subprocess; its stderr."""
    root = Path(__file__).resolve().parents[1]
    sets = ["training.steps=1", "data.demo_rows=40", "data.max_seq_len=128", f"output_dir={tmp_path / 'out'}"]
    command = [sys.executable, "-m", "slipstream", *flags, "train", str(root / "examples" / "tiny.yaml")]
    done = subprocess.run(
        [*command, *(arg for item in sets for arg in ("--set", item))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "finished 1 steps" in done.stdout
    return done.stderr


def test_train_prints_none_of_the_known_third_party_noise(tmp_path):
    """On this CPU (AVX512-BF16, transformers 5.24) it printed bitsandbytes' kernels line and transformers'
    is_gradient_checkpointing FutureWarning (from PEFT) before anything of ours."""
    from slipstream.noise import KNOWN_NOISE

    stderr = train_tiny(tmp_path)
    for noise in KNOWN_NOISE:
        assert not re.search(noise.message, stderr), noise.example


@pytest.mark.slow
def test_debug_shows_the_known_third_party_noise(tmp_path):
    """With --debug the lines are back: those this machine prints (the test above is not vacuous here)."""
    from slipstream.noise import KNOWN_NOISE

    stderr = train_tiny(tmp_path, "--debug")
    if not any(re.search(noise.message, stderr) for noise in KNOWN_NOISE):
        pytest.skip("none of the known third-party lines is printed on this machine")
