"""``Speedups`` is written out in source; these tests keep it and the registry in step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from slipstream.fields import ConfigError, field_types
from slipstream.speedups import Option, Speedup, Speedups, build_speedups_class, registry

SRC = Path(__file__).resolve().parents[2] / "src" / "slipstream"


def test_every_registered_option_is_a_field_of_the_same_type_default_and_help_in_registry_order():
    options = [option for speedup in registry.registered() for option in speedup.options]
    fields = dataclasses.fields(Speedups)
    assert [f.name for f in fields] == [option.name for option in options]
    types = field_types(Speedups)
    for f, option in zip(fields, options, strict=True):
        assert types[f.name] == option.annotation, f.name
        assert f.default == option.default, f.name
        assert f.metadata["help"] == option.help, f.name


def test_speedups_is_a_plain_dataclass_in_source_with_no_class_built_at_run_time():
    assert Speedups.__qualname__ == "Speedups" and Speedups.__bases__ == (object,)
    assert build_speedups_class() is Speedups  # nothing registered beyond the built-ins
    built = [path.name for path in SRC.rglob("*.py") if "make_" + "dataclass" in path.read_text()]
    assert built == []


class _Toy(Speedup):
    name = "toy fields"
    options = (Option("toy_level", int, 3, "the toy's level", stock=0),)


def test_a_plug_in_option_becomes_a_validated_field_of_a_subclass():
    cls = build_speedups_class((*registry.registered(), _Toy()))
    assert issubclass(cls, Speedups) and cls is not Speedups
    assert [f.name for f in dataclasses.fields(cls)][-1] == "toy_level"
    assert cls().toy_level == 3 and cls(packed_attention=False).packed_attention is False
    with pytest.raises(ConfigError, match="'toy_level'"):
        cls(toy_level="high")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cls().toy_level = 4  # type: ignore[misc]
