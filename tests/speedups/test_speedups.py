"""Speedups: every toggle typed and validated once; the environment override applied in one place."""

from __future__ import annotations

import pytest

import slipstream
from slipstream import Speedups
from slipstream.fields import ConfigError
from slipstream.models import build_model
from slipstream.speedups import Option, ParityCase, Speedup


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
    assert config.train.speedups.toy_fusion is True
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


# --------------------------------------------------------------------------- a toy speedup, added here alone


class ToyScale(Speedup):
    """A toy speedup, defined and registered in this test file alone: it multiplies nothing (a
    forward pre-hook that counts calls), so its parity case holds exactly."""

    name = "toy scale"
    stage = 55
    options = (Option("toy_scale", bool, True, "count the toy's forwards", stock=False),)
    ablation = {"toy_scale": False}
    ablation_name = "toy-scale"
    doctor_label = "toy scale (auto)"
    sweep_column = "toy scale"

    def apply(self, run) -> None:
        hook = run.state.extras.pop("toy_scale", None)
        if hook is not None:
            hook.remove()
        if run.speedups.toy_scale:
            run.state.extras["toy_scale"] = run.base.register_forward_pre_hook(lambda module, args: None)
            run.state.say("toy scale: on (a hook that changes nothing)")
        elif hook is not None:
            run.state.say("toy scale: off (stock)")

    def decide(self, context) -> tuple[str, str]:
        return "on", f"exact on {context.device.type}"

    def parity_cases(self) -> tuple[ParityCase, ...]:
        return (
            ParityCase(
                "toy parity", fast={"toy_scale": True}, stock={"toy_scale": False}, arms="toy vs none"
            ),
        )


@pytest.fixture
def toy(monkeypatch):
    """ToyScale registered, and Speedups rebuilt with its option where the CLI, config and optimize read it."""
    import slipstream.speedups
    import slipstream.train.config
    from slipstream.speedups import build_speedups_class, registry

    speedup = registry.register(ToyScale())
    with_toy = build_speedups_class()
    monkeypatch.setattr(slipstream.speedups, "Speedups", with_toy)
    monkeypatch.setattr(slipstream.train.config, "Speedups", with_toy)
    yield with_toy
    registry.unregister(speedup)


def test_a_toy_speedup_in_a_test_file_is_an_option_a_stock_value_and_an_optimize_step(toy, tmp_path):
    from slipstream.bench.command import ab_config_from_args
    from slipstream.cli import build_parser
    from slipstream.models import build_model

    assert toy().toy_scale is True and toy.stock().toy_scale is False
    parser = build_parser()
    ab = parser._subparsers._group_actions[0].choices["ab"]
    assert "--toy-scale" in ab.format_help()
    assert (
        ab_config_from_args(parser.parse_args(["ab", "--toy-scale", "false"])).train.speedups.toy_scale
        is False
    )
    train = parser._subparsers._group_actions[0].choices["train"]
    assert "speedups.toy_scale: true|false" in train.format_help()

    model = build_model("qwen3", vocab_size=64, seed=0)
    slipstream.optimize(model)
    assert "toy scale: on (a hook that changes nothing)" in model.slipstream.policies
    said = len(model.slipstream.policies)
    slipstream.optimize(model, toy_scale=False)
    assert "toy scale: off (stock)" in model.slipstream.policies[said:] and not model.slipstream.extras
    model.slipstream.undo()


def test_a_toy_speedup_has_its_leave_one_out_arm_in_the_ablation_preset(toy):
    from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS, ARMS, arm_speedups, preset_arms
    from slipstream.bench.command import ab_config

    assert ARM_PRESETS["ablation"][-1] == "slipstream-no-toy-scale" and "slipstream-no-toy-scale" in ARMS
    assert ARM_SPECS["slipstream-no-toy-scale"].speedups.toy_scale is False
    config = ab_config(steps=4, warmup=1, threads=1)
    assert "slipstream-no-toy-scale" in preset_arms("ablation", config, "cpu")
    assert arm_speedups(config, "slipstream-no-toy-scale").toy_scale is False


def test_a_toy_speedup_has_its_doctor_row_and_check(toy, monkeypatch):
    """Doctor's decision rows and checks come from the registry: the toy's row says its decision, and
    its parity case runs as a check (beside the packed attention's, which sets the layout)."""
    import torch

    from slipstream.doctor.checks import check_paths
    from slipstream.doctor.decisions import decisions
    from slipstream.doctor.models import resolve_model
    from slipstream.speedups import registry
    from slipstream.speedups.packed_attention import PackedAttention

    checked = resolve_model("demo")
    model = checked.build(0)
    rows = decisions(checked, model, model, torch.device("cpu"), torch.float32, "requested")
    assert {"path": "toy scale (auto)", "choice": "on", "why": "exact on cpu"} in rows
    # the checks of the packed attention and the toy only (the others are doctor's own tests')
    only = (PackedAttention(), registry.registered()[-1])
    monkeypatch.setattr(registry, "registered", lambda: only)
    checks, _ = check_paths(checked, torch.device("cpu"), torch.float32)
    assert [check.path for check in checks] == ["packed attention", "toy parity", "ablation"]
    toy_check = checks[1]
    assert toy_check.verdict == "ok", toy_check.reason
    assert toy_check.arms == "toy vs none" and toy_check.layout == "packed"


def test_a_toy_speedup_has_its_sweep_columns(toy):
    """The compatibility sweep's columns come from the registry: the toy's policy column and its parity
    case's column, checked against the stock reference, and both in docs/compatibility.md's table."""
    from slipstream.compat import check_architecture, render_markdown

    verdict = check_architecture("llama")
    assert verdict.status == "pass", verdict.detail
    assert verdict.speedups["toy scale"] == "on" and verdict.speedups["toy parity"] == "on"
    assert verdict.ablations["toy parity"].status == "pass"
    header = next(
        line for line in render_markdown([verdict.to_dict()]).splitlines() if line.startswith("| model type")
    )
    assert "| toy scale |" in header and "| toy parity |" in header
