"""The command line: version, help, errors that name the file and line, exit codes."""

import json
import subprocess
import sys

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
