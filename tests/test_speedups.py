"""Speedups: every toggle typed and validated once; the environment override applied in one place."""

from __future__ import annotations

import pytest

import slipstream
from slipstream import Speedups
from slipstream.fields import ConfigError
from slipstream.models import build_model


def test_every_field_is_validated_at_construction():
    with pytest.raises(ConfigError, match="'moe_routing' must be one of sorted, stock, got 'fast'"):
        Speedups(moe_routing="fast")
    with pytest.raises(ConfigError, match="'checkpointing' must be one of off, recompute"):
        Speedups(checkpointing="sometimes")
    with pytest.raises(ConfigError, match="'loss_chunk_tokens' must be >= 1"):
        Speedups(loss_chunk_tokens=0)
    with pytest.raises(ConfigError, match="'packed_attention' must be true or false"):
        Speedups(packed_attention="yes")


def test_optimize_takes_speedups_or_their_fields_by_name():
    model = build_model("llama")
    slipstream.optimize(model, Speedups(packed_attention=False, chunked_loss=False))
    assert model.slipstream.packed_attention is None and model.slipstream.chunked_loss is None
    slipstream.optimize(model, Speedups(packed_attention=False), packed_attention=True)  # options win
    assert model.slipstream.packed_attention == "slipstream_docwise"
    with pytest.raises(TypeError, match="unknown option.*packd_attention"):
        slipstream.optimize(model, packd_attention=True)


def test_the_checkpointing_environment_override_is_applied_once_and_said(monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CHECKPOINTING", "recompute")
    speedups, note = Speedups(checkpointing="off").with_environment()
    assert speedups.checkpointing == "recompute" and "from SLIPSTREAM_CHECKPOINTING" in note
    model = build_model("llama")
    slipstream.optimize(model, checkpointing="off")
    assert model.slipstream.checkpointing == "recompute"
    assert any("from SLIPSTREAM_CHECKPOINTING" in p for p in model.slipstream.policies)
    monkeypatch.setenv("SLIPSTREAM_CHECKPOINTING", "sometimes")
    with pytest.raises(ValueError, match="SLIPSTREAM_CHECKPOINTING='sometimes'"):
        Speedups().with_environment()
    monkeypatch.delenv("SLIPSTREAM_CHECKPOINTING")
    assert Speedups().with_environment() == (Speedups(), None)


def test_a_new_speedup_is_one_field(monkeypatch, tmp_path):
    """A field added to Speedups (here in a subclass) is an `ab` option, a validated `train` config
    key and a line of `train --help`, with no other edit."""
    import dataclasses
    from dataclasses import dataclass, field

    import slipstream.speedups
    import slipstream.train.config
    from slipstream.bench.command import ab_config_from_args
    from slipstream.cli import build_parser
    from slipstream.train.config import load_config

    @dataclass(frozen=True)
    class WithToy(Speedups):
        toy_fusion: bool = field(default=False, metadata={"help": "fuse the toy kernels"})

    monkeypatch.setattr(slipstream.speedups, "Speedups", WithToy)
    monkeypatch.setattr(slipstream.train.config, "Speedups", WithToy)

    parser = build_parser()
    ab = parser._subparsers._group_actions[0].choices["ab"]
    assert "--toy-fusion" in ab.format_help() and "fuse the toy kernels" in ab.format_help()
    config = ab_config_from_args(parser.parse_args(["ab", "--toy-fusion", "true"]))
    assert config.speedups == {"toy_fusion": True}
    train = parser._subparsers._group_actions[0].choices["train"]
    assert "speedups.toy_fusion: true|false" in train.format_help()

    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("model: {preset: demo}\ntraining: {steps: 1}\nspeedups: {toy_fusion: true}\n")
    assert load_config(yaml_path).speedups.toy_fusion is True
    yaml_path.write_text("model: {preset: demo}\ntraining: {steps: 1}\nspeedups: {toy_fusion: 3}\n")
    with pytest.raises(ConfigError, match="run.yaml:3: 'speedups.toy_fusion' must be true or false"):
        load_config(yaml_path)
    assert [f.name for f in dataclasses.fields(WithToy)][-1] == "toy_fusion"


def test_the_training_dtypes_are_the_run_precisions_and_auto():
    import typing

    from slipstream.fields import Dtype, Precision

    assert typing.get_args(Dtype) == ("auto", *typing.get_args(Precision))
