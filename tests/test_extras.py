"""An optional extra that is missing is named, with the command that installs it."""

import pytest

from slipstream import extras


def test_a_missing_extra_names_the_feature_and_the_install_command(monkeypatch):
    monkeypatch.setattr(extras, "installed", lambda module: module != "bitsandbytes")
    with pytest.raises(extras.MissingExtra, match=r"quantization.four_bit needs bitsandbytes.*slipstream\[qlora\]"):
        extras.require("bitsandbytes.functional", "quantization.four_bit")
    assert extras.require("json", "anything").dumps([]) == "[]"  # present: imported and returned


def test_qlora_loading_without_bitsandbytes_says_which_extra(monkeypatch, tmp_path):
    from slipstream.models.qlora import load_for_qlora

    monkeypatch.setattr(extras, "installed", lambda module: module != "bitsandbytes")
    with pytest.raises(extras.MissingExtra, match=r"pip install 'slipstream\[qlora\]'"):
        load_for_qlora(str(tmp_path))
