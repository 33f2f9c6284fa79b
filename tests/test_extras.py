"""An optional extra that is missing is named, with the command that installs it."""

import pytest

from slipstream import extras


def test_a_missing_extra_names_the_feature_and_the_install_command(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda module: module != "bitsandbytes")
    with pytest.raises(
        extras.MissingExtra, match=r"quantization.four_bit needs bitsandbytes.*slipstream\[qlora\]"
    ):
        extras.require("bitsandbytes.functional", "quantization.four_bit")
    assert extras.require("json", "anything").dumps([]) == "[]"  # present: imported and returned


def test_qlora_loading_without_bitsandbytes_says_which_extra(monkeypatch, tmp_path):
    from slipstream.models.qlora import load_for_qlora

    monkeypatch.setattr(extras, "installed", lambda module: module != "bitsandbytes")
    with pytest.raises(extras.MissingExtra, match=r"pip install 'slipstream\[qlora\]'"):
        load_for_qlora(str(tmp_path))


def test_train_with_four_bit_and_no_bitsandbytes_is_one_line_and_writes_nothing(
    monkeypatch, tmp_path, capsys
):
    from slipstream.cli import main

    monkeypatch.setattr(extras, "installed", lambda module: module != "bitsandbytes")
    (tmp_path / "model").mkdir()
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "examples/tiny.yaml",
            "--set",
            "quantization.four_bit=true",
            "--set",
            "model.preset=null",
            "--set",
            f"model.path={tmp_path / 'model'}",
            "--set",
            f"output_dir={out}",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert err[-1].startswith(
        "slipstream train: MissingExtra: quantization.four_bit (QLoRA) needs bitsandbytes"
    )
    assert "pip install 'slipstream[qlora]'" in err[-1]
    assert not out.exists()
