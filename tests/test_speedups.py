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
