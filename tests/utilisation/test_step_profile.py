"""Where a profiled step's time goes: each op's category, and a real step through ``run_arm``."""

import dataclasses

import pytest
import torch

from slipstream.bench.command import ab_config
from slipstream.bench.render import step_profile_lines
from slipstream.bench.runner import prepare_bins, run_arm
from slipstream.utilisation import CATEGORIES, profile_step
from slipstream.utilisation.step_profile import categorize, category_of


@pytest.mark.parametrize(
    "name, ancestors, expected",
    [
        ("aten::mm", ["aten::linear", "autograd::engine::evaluate_function: MmBackward0"], "matmul"),
        ("aten::addmm", [], "matmul"),
        ("aten::_grouped_mm", [], "matmul"),
        ("aten::copy_", ["aten::_to_copy", "aten::to"], "dtype_copies"),
        ("aten::mul", ["aten::rms_norm"], "other"),
        # inside a region, the region decides: the short kernel's GEMMs and softmax are attention work
        ("aten::bmm", ["aten::matmul", "ShortCausalAttention"], "attention"),
        (
            "aten::_softmax",
            ["autograd::engine::evaluate_function: ShortCausalAttentionBackward"],
            "attention",
        ),
        ("aten::_scaled_dot_product_flash_attention_for_cpu_backward", [], "attention"),
        ("aten::add", ["## Call CompiledFxGraph fabc ##", "CompiledFunction"], "compiled"),
        ("aten::_foreach_mul_", ["Optimizer.step#AdamW.step"], "optimizer"),
    ],
)
def test_each_op_goes_to_one_category(name, ancestors, expected):
    assert category_of(name, ancestors) == expected


def _event(name, self_us, parent=None):
    """The parts of a profiler FunctionEvent that ``categorize`` reads."""

    class Event:
        pass

    event = Event()
    event.name, event.self_cpu_time_total, event.cpu_parent = name, self_us, parent
    return event


def test_self_times_add_up_per_category_and_nested_ops_follow_their_region():
    attention = _event("ShortCausalAttention", 10)
    events = [
        attention,
        _event("aten::bmm", 30, attention),
        _event("aten::mm", 100),
        _event("aten::copy_", 5),
        _event("aten::mul", 7),
    ]
    seconds = categorize(events)
    assert seconds["attention"] == pytest.approx(40e-6)
    assert seconds["matmul"] == pytest.approx(100e-6)
    assert seconds["dtype_copies"] == pytest.approx(5e-6) and seconds["other"] == pytest.approx(7e-6)
    assert sum(seconds.values()) == pytest.approx(152e-6)


def test_a_profiled_matmul_is_a_matmul_and_its_rate_is_its_flops_over_its_time():
    a, b = torch.randn(256, 512), torch.randn(512, 384)
    found = profile_step(lambda: a @ b, "cpu", linear_flops=2 * 256 * 512 * 384, peak_flops_per_s=1e12)
    assert found["seconds"]["matmul"] > 0
    assert found["shares"]["matmul"] > 0.5
    assert sum(found["seconds"].values()) == pytest.approx(found["total_s"])
    assert found["gemm_tflops"] == pytest.approx(2 * 256 * 512 * 384 / found["seconds"]["matmul"] / 1e12)
    assert found["gemm_fraction_of_peak"] == pytest.approx(found["gemm_tflops"])  # a 1 TFLOP/s peak


def test_profile_step_puts_a_profiled_step_in_the_arm_record_after_the_timed_ones():
    config = ab_config(
        model="qwen3", max_seq_len=256, steps=2, warmup=1, num_rows=100, threads=1, profile_step=True
    )
    plan, vocab, _ = prepare_bins(config)
    result = run_arm(dataclasses.asdict(config), "slipstream", plan, vocab)
    found = result["step_profile"]
    assert set(found["seconds"]) == set(CATEGORIES)
    assert found["seconds"]["matmul"] > 0 and found["seconds"]["attention"] > 0
    assert found["gemm_tflops"] > 0 and found["gemm_fraction_of_peak"] > 0
    assert len(result["step_s"]) == config.ab.steps  # the profiled step is not one of the timed steps
    lines = "\n".join(step_profile_lines({"slipstream": {"step_profile": found}}))
    assert "| slipstream |" in lines and "Where a step goes" in lines and "of peak" in lines
    unprofiled = run_arm(
        dataclasses.asdict(
            ab_config(model="qwen3", max_seq_len=256, steps=2, warmup=1, num_rows=100, threads=1)
        )
        | {"arms": list(config.ab.arms)},
        "slipstream",
        plan,
        vocab,
    )
    assert unprofiled["step_profile"] is None
    assert step_profile_lines({"slipstream": {"step_profile": None}}) == []
