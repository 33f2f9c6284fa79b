"""The A/B harness: verdicts, summaries, the report, and one short real run of every arm."""

import argparse
import dataclasses
import json

import pytest

from slipstream import Speedups
from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS, preset_arms
from slipstream.bench.command import ab_config
from slipstream.bench.render import markdown_report, write_record
from slipstream.bench.runner import ABConfig, parity_failures, run_ab, summarize


def _run(arm, step_s, tokens, loss):
    return {
        "arm": arm,
        "step_s": step_s,
        "tokens": tokens,
        "loss": loss,
        "peak_memory_mb": 1.0,
        "memory_kind": "cpu peak RSS",
        "host_syncs_per_step": 0,
        "attn_implementation": "x",
    }


def test_summary_speedup_is_a_tokens_per_second_ratio_without_warmup():
    config = ab_config(steps=3, warmup=1, arms=("stock-packed", "slipstream"))
    # (two timed steps per arm: too few for an interval)
    runs = {
        "stock-packed": [_run("stock-packed", [9.0, 2.0, 2.0], [100, 100, 100], [3.0, 2.0, 1.0])],
        "slipstream": [_run("slipstream", [9.0, 1.0, 1.0], [100, 100, 100], [3.0, 2.0, 1.0])],
    }
    summary = summarize(config, runs)
    assert summary["slipstream"]["speedup_vs_stock-packed"] == pytest.approx(2.0)
    assert summary["stock-packed"]["tokens_per_s"] == pytest.approx(50.0)
    assert summary["slipstream"]["loss_vs_stock-packed"] == "identical"
    assert "mfu" not in summary["slipstream"]  # runs without a FLOP count (an older record's) have no MFU


def test_a_run_of_one_timed_step_shows_its_speedup_without_an_interval(monkeypatch, capsys):
    """`ab --steps 2 --warmup 1` times one step an arm: its tables and ab.md give the ratio alone and
    say why, and the record claims no interval (nor does an ablation verdict rest on one)."""
    import slipstream.bench.runner as runner
    from slipstream.bench.ablation import ablation_verdicts
    from slipstream.bench.render import print_tables

    runs = {
        "stock-packed": _run("stock-packed", [9.0, 1.92], [100, 100], [3.0, 2.0]),
        "slipstream": _run("slipstream", [9.0, 1.0], [100, 100], [3.0, 2.0]),
    }

    def lockstep(config_dict, arms, *args, **kwargs):
        return {arm: runs[arm] for arm in arms}, {"mode": "steps", "why": "test"}

    monkeypatch.setattr(runner, "run_lockstep", lockstep)
    monkeypatch.setattr(runner, "matmul_peak", lambda *args: {})
    config = ab_config(steps=2, warmup=1, arms=("stock-packed", "slipstream"), num_rows=40, max_seq_len=256)
    record = json.loads(json.dumps(runner.run_ab(config, progress=False)))  # as ab.json keeps it
    interval = record["summary"]["slipstream"]["interval_vs_stock-packed"]
    assert interval["low"] is None and interval["high"] is None and interval["verdict"] == "no interval"
    said = "1.92x (1 timed step: no interval) vs stock-packed"
    assert said in markdown_report(record) and "[1.92, 1.92]" not in markdown_report(record)
    print_tables(record)
    printed = " ".join(capsys.readouterr().out.split())  # (the table wraps its cells)
    assert "1.92x (1 timed step: no interval)" in printed and "[1.92" not in printed
    summary = {arm: {} for arm in ("slipstream", "slipstream-again", "slipstream-no-compile")}
    ablation_verdicts(summary, {arm: [1.0] for arm in summary})
    assert summary["slipstream-no-compile"]["ablation_verdict"] == "not judged (no interval)"
    assert summary["slipstream"]["ablation"]["beats_auto"] == []


def test_every_arm_gets_the_reference_arms_model_flops_over_its_own_time():
    config = ab_config(steps=3, warmup=1, arms=("stock-packed", "slipstream"))
    runs = {
        "stock-packed": [
            {**_run("stock-packed", [9.0, 2.0, 2.0], [100] * 3, [3.0] * 3), "model_flops": [5, 4e9, 2e9]}
        ],
        "slipstream": [
            _run("slipstream", [9.0, 1.0, 1.0], [100] * 3, [3.0] * 3)
        ],  # (a peer that counted none)
    }
    summary = summarize(config, runs, peak={"flops_per_s": 1e10})
    assert summary["stock-packed"]["model_flops_per_step"] == pytest.approx(3e9)  # the timed steps' mean
    assert summary["stock-packed"]["achieved_tflops"] == pytest.approx(6e9 / 4.0 / 1e12)
    assert summary["stock-packed"]["mfu"] == pytest.approx(0.15)
    assert summary["slipstream"]["mfu"] == pytest.approx(0.30)  # the same FLOPs in half the time


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown arm"):
        ab_config(arms=("stock", "fast"))
    with pytest.raises(ValueError, match="warmup"):
        ab_config(steps=2, warmup=2)
    with pytest.raises(ValueError, match="batching"):
        ab_config(batching="greedy")


def test_a_short_real_run_of_every_arm(tmp_path, monkeypatch):
    import slipstream.bench.runner as runner

    # as when an arm's later steps went past the tolerance after a clean step 0: the run then measures
    # its own sensitivity (the reference arm again, its weights moved by one ulp), judged against it
    monkeypatch.setattr(runner, "needs_sensitivity", lambda summary: True)
    config = ab_config(model="qwen3", max_seq_len=256, steps=3, warmup=1, num_rows=200, threads=1)
    record = run_ab(config, progress=False)
    sensitivity = record["sensitivity"]
    reference = record["runs"]["stock-padded"][0]
    assert sensitivity["arm"] == "stock-padded" and len(sensitivity["loss"]) == config.ab.steps
    assert sensitivity["loss"][0] == pytest.approx(
        reference["loss"][0], rel=1e-4
    )  # (a tiny model barely moves)
    assert sensitivity["weights_moved"] > 0 and reference["perturbed_weights"] == 0
    assert "sensitivity: stock-padded rerun with every weight moved by one ulp" in markdown_report(record)
    assert [found["mode"] for found in record["interleaving"]] == [
        "steps"
    ]  # three tiny arms fit side by side
    summary = record["summary"]
    assert set(summary) == {"stock-padded", "stock-packed", "slipstream"}
    # same data, same weights: the loss curves agree, and only slipstream is sync-free
    for arm in summary:
        assert summary[arm]["loss_vs_stock-padded"] in ("identical", "within tolerance"), arm
    assert summary["slipstream"]["host_syncs_per_step"] == 0
    assert summary["stock-packed"]["host_syncs_per_step"] >= 1
    assert summary["slipstream"]["attn_implementation"] == "slipstream_docwise"
    # every step's batch counted once, grouped or per document (the activation probe's is not)
    grouping = record["runs"]["slipstream"][0]["attention_grouping_counts"]
    assert grouping["batches_grouped"] + grouping["batches_per_document"] == config.ab.steps
    layers = 2  # the tiny qwen3's
    assert grouping["calls_grouped"] + grouping["calls_per_document"] == config.ab.steps * layers
    assert record["runs"]["stock-packed"][0]["attention_grouping_counts"] is None
    # the same documents, model and LoRA: every arm counts the same model FLOPs, and each has an MFU
    counts = {arm: tuple(record["runs"][arm][0]["model_flops"]) for arm in summary}
    assert len(set(counts.values())) == 1 and min(counts["slipstream"]) > 0
    peak = record["matmul_peak"]
    assert (
        peak["flops_per_s"] > 0
        and peak["dtype"] == config.train.model.dtype
        and peak["threads"] == 1
        and peak["how"]
    )
    for arm in summary:
        assert 0 < summary[arm]["mfu"] < 1.5, arm  # (a noisy 2-core probe: not strictly under 1)
        assert summary[arm]["achieved_tflops"] * 1e12 == pytest.approx(
            summary[arm]["mfu"] * peak["flops_per_s"]
        )
    json_path, md_path = write_record(record, tmp_path)
    assert json.loads(json_path.read_text())["config"]["model"] == "qwen3"
    assert md_path.read_text() == markdown_report(json.loads(json_path.read_text()))  # the record read back
    assert "Per-step loss" in md_path.read_text()
    assert f"attention grouping ran: grouped {grouping['batches_grouped']} of {config.ab.steps} batches" in (
        md_path.read_text()
    )
    assert (
        "| MFU (model FLOP/s) |" in md_path.read_text()
        and "GFLOP of model FLOPs per step" in md_path.read_text()
    )
    assert f"{summary['slipstream']['mfu']:.1%}" in md_path.read_text()
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind
    from PIL import Image

    for name in ("loss.png", "step_time.png", "memory.png", "mfu.png"):
        with Image.open(tmp_path / name) as image:
            assert image.size[0] > 300 and image.size[1] > 200
    assert parity_failures(record) == []
    interval = summary["slipstream"]["interval_vs_stock-packed"]  # 3 steps, 1 warm-up: too few for one
    assert interval["low"] is None and interval["timed_steps"] == 2
    assert "(2 timed steps: no interval) vs stock-packed" in md_path.read_text()


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_leave_one_out_on_the_tiny_moe_model_shows_each_share():
    config = ab_config(model="qwen3-moe", max_seq_len=256, steps=3, warmup=1, num_rows=200, threads=1)
    # the preset as the CLI runs it here: less the arms whose lever this run would not pull
    config = dataclasses.replace(
        config, ab=dataclasses.replace(config.ab, arms=preset_arms("ablation", config, "cpu"))
    )
    assert (
        "slipstream-no-compile" not in config.ab.arms and "slipstream-no-fused-kernels" not in config.ab.arms
    )
    record = run_ab(config, progress=False)
    summary = record["summary"]
    assert summary["slipstream-no-packed-attention"]["attn_implementation"] == "sdpa"
    assert summary["slipstream-no-moe-routing"]["attn_implementation"] == "slipstream_docwise"
    assert summary["slipstream-no-attention-grouping"]["attn_implementation"] == "slipstream_docwise"
    for arm in config.ab.arms:
        assert summary[arm]["loss_vs_stock-packed"] in ("identical", "within tolerance"), arm
        if arm != "stock-packed":
            assert "interval_vs_stock-packed" in summary[arm]
    # sorted or stock routing, the same top-k experts per token: the same model FLOPs in every arm
    assert len({tuple(record["runs"][arm][0]["model_flops"]) for arm in config.ab.arms}) == 1
    # only the packed attention removes the stock path's sync (MoE routing here is grouped_mm: 0 either way)
    assert summary["slipstream"]["host_syncs_per_step"] == 0
    assert summary["slipstream-no-packed-attention"]["host_syncs_per_step"] >= 1


def test_an_arm_is_a_layout_plus_speedups_and_the_run_options_reach_only_what_it_leaves_open():
    from slipstream import Speedups
    from slipstream.bench.arms import ARM_SPECS, arm_speedups
    from slipstream.bench.runner import ABConfig

    assert all(isinstance(arm.speedups, Speedups) for arm in ARM_SPECS.values())
    config = ab_config(checkpointing="offload", speedups={"moe_compute": "loop", "moe_routing": "sorted"})
    slipstream_arm = arm_speedups(config, "slipstream")
    assert (slipstream_arm.moe_compute, slipstream_arm.moe_routing, slipstream_arm.checkpointing) == (
        "loop",
        "sorted",
        "offload",
    )
    ablated = arm_speedups(config, "slipstream-no-moe-routing")
    assert ablated.moe_routing == "stock" and ablated.moe_compute == "loop"  # its own ablation wins
    assert arm_speedups(config, "slipstream-no-offload").checkpointing == "recompute"
    stock = arm_speedups(config, "stock-packed")
    assert stock == Speedups(
        packed_attention=False,
        short_document_kernel="off",
        moe_routing="stock",
        chunked_loss=False,
        lora_in_compute_dtype=False,
        compile="off",
        fused_kernels="off",
        checkpointing="recompute",
    )
    assert arm_speedups(ABConfig(), "stock-padded").checkpointing == "off"


def test_the_ablation_preset_leaves_compile_out_unless_the_slipstream_arm_compiles(monkeypatch):
    from slipstream.bench.arms import preset_arms
    from slipstream.bench.command import ab_config_from_args, add_ab_arguments
    from slipstream.compile import regional

    def arms(*argv):
        parser = argparse.ArgumentParser()
        add_ab_arguments(parser)
        return ab_config_from_args(parser.parse_args(["--device", "cpu", *argv])).ab.arms

    assert "slipstream-no-compile" in ARM_PRESETS["ablation"]
    monkeypatch.setitem(regional.BREAK_EVEN_STEPS, "cpu", 100)
    assert "slipstream-no-compile" not in arms("--preset", "ablation", "--steps", "99")
    assert "slipstream-no-compile" in arms("--preset", "ablation", "--steps", "100")
    assert "slipstream-no-compile" in arms("--preset", "ablation", "--steps", "5", "--compile", "on")
    assert "slipstream-no-compile" not in arms("--preset", "ablation", "--steps", "500", "--compile", "off")
    assert preset_arms("default", ABConfig(), "cpu") == ARM_PRESETS["default"]


def test_the_ablation_preset_keeps_the_short_kernel_where_this_cpus_calibration_has_it_run():
    import torch

    from slipstream.bench.arms import preset_arms
    from slipstream.packing.calibration import attention_costs

    for dtype in ("float32", "bfloat16"):
        torch_dtype = getattr(torch, dtype)
        takes = attention_costs("cpu", torch_dtype).short_limit(torch_dtype) > 0  # the same measured figures
        kept = "slipstream-no-short-kernel" in preset_arms("ablation", ab_config(dtype=dtype), "cpu")
        assert kept == takes, dtype
    on = ab_config(speedups={"short_document_kernel": "on"})
    assert "slipstream-no-short-kernel" in preset_arms("ablation", on, "cpu")
    assert "slipstream-no-short-kernel" not in preset_arms("ablation", ABConfig(), "cuda")  # a CPU kernel


def test_the_ablation_preset_leaves_fused_kernels_out_where_liger_cannot_run(monkeypatch):
    from slipstream.bench.arms import preset_arms
    from slipstream.fused import liger

    assert "slipstream-no-fused-kernels" in ARM_PRESETS["ablation"]
    assert ARM_SPECS["slipstream-no-fused-kernels"].speedups == Speedups(fused_kernels="off")
    assert "slipstream-no-fused-kernels" not in preset_arms("ablation", ABConfig(), "cpu")  # CPU
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    assert "slipstream-no-fused-kernels" not in preset_arms("ablation", ABConfig(), "cuda")  # not installed
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: object())
    assert "slipstream-no-fused-kernels" in preset_arms("ablation", ABConfig(), "cuda")
    off = ab_config(speedups={"fused_kernels": "off"})
    assert "slipstream-no-fused-kernels" not in preset_arms("ablation", off, "cuda")


def test_a_compiled_arm_gets_its_cold_start_and_break_even_step_against_the_eager_one():
    config = ab_config(steps=5, warmup=2, arms=("slipstream-no-compile", "slipstream"))
    compiled = _run("slipstream", [3.0, 40.0, 1.5, 1.5, 1.5], [100] * 5, [3.0, 2.0, 1.0, 1.0, 1.0])
    compiled["policies"] = ["compile: decoder layers (2 LlamaDecoderLayer), ... (requested)"]
    compiled["probe_forward_s"] = 10.0  # the activation probe's forward: where the forward compiles
    eager = _run("slipstream-no-compile", [3.0, 2.0, 2.0, 2.0, 2.0], [100] * 5, [3.0] * 5)
    eager["probe_forward_s"] = 1.0
    runs = {"slipstream-no-compile": [eager], "slipstream": [compiled]}
    summary = summarize(config, runs)
    assert summary["slipstream"]["warmup_extra_s"] == pytest.approx(50.0)  # 43 + 10 - 2 x 1.5
    assert summary["slipstream-no-compile"]["warmup_extra_s"] == pytest.approx(2.0)  # 5 + 1 - 2 x 2
    assert summary["slipstream"]["compile_cold_start_s"] == pytest.approx(48.0)
    assert summary["slipstream"]["compile_break_even_step"] == 96  # 48 s / 0.5 s saved a step
    compiled["step_s"] = [3.0, 40.0, 2.5, 2.5, 2.5]  # slower once compiled: never pays back
    assert summarize(config, runs)["slipstream"]["compile_break_even_step"] is None


def _in_process_runs(config, arms, breakage=None, gradient_dir=None):
    """Each arm run in this process (``run_arm``, what the harness spawns), so a test can break one."""
    from slipstream.bench.runner import prepare_bins, run_arm

    plan, vocab, _ = prepare_bins(config)
    runs = {}
    for arm in arms:
        if breakage is not None and arm == "slipstream":
            breakage()
        runs[arm] = [run_arm(dataclasses.asdict(config), arm, plan, vocab, gradient_dir=gradient_dir)]
    return runs, plan, vocab


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_step_zero_catches_a_deliberately_wrong_attention(dtype, monkeypatch, tmp_path):
    """Attention that leaks across the packed documents: the first step, on the same weights and
    batch, already differs beyond the strict step-0 tolerance, and the verdict says so; in bf16 also
    against the same step in fp32 (``bench/truth.py``), where the right arm stays as near it as stock."""
    import slipstream.bench.truth as truth
    import slipstream.packing.attention.sdpa as attention_module

    config = ab_config(
        model="qwen3",
        max_seq_len=1024,
        steps=2,
        warmup=1,
        num_rows=120,
        threads=1,
        dtype=dtype,
        speedups={"attention_grouping": "per_document"},  # the path broken
    )

    def leak():
        monkeypatch.setattr(
            attention_module, "_per_document", lambda fn, batch, q, k, v, **kw: fn(q, k, v, batch=batch, **kw)
        )

    def fp32_step(runs, plan, vocab, directory):  # bf16: the reference's step 0 once more in fp32
        if dtype == "float32":
            return None
        monkeypatch.setattr(truth, "run_in_fresh_process", lambda fn, *args: fn(*args))
        return truth.measure_fp32_step0(config, runs, plan, vocab, str(directory))

    kept = {"gradient_dir": str(tmp_path)} if dtype == "bfloat16" else {}
    right, plan, vocab = _in_process_runs(config, ("stock-packed", "slipstream"), **kept)
    assert summarize(config, right)["slipstream"]["loss_vs_stock-packed"] in ("identical", "within tolerance")
    judged = summarize(config, right, fp32_step=fp32_step(right, plan, vocab, tmp_path))["slipstream"]
    assert judged["loss_vs_stock-packed"] in ("identical", "within tolerance")
    (tmp_path / "wrong").mkdir()
    kept = {"gradient_dir": str(tmp_path / "wrong")} if dtype == "bfloat16" else {}
    wrong, _, _ = _in_process_runs(config, ("stock-packed", "slipstream"), breakage=leak, **kept)
    parity = summarize(config, wrong)["slipstream"]["loss_parity"]
    assert parity["verdict"] == "diverged" and not parity["needs_sensitivity"]
    assert (
        parity["detail"].startswith("step 0 loss") and "the arms compute different steps" in parity["detail"]
    )
    if dtype == "bfloat16":  # against fp32: further from it than stock, in the gradient's norm and direction
        judged = summarize(config, wrong, fp32_step=fp32_step(wrong, plan, vocab, tmp_path / "wrong"))
        assert judged["slipstream"]["loss_parity"]["verdict"] == "diverged"
        found = judged["slipstream"]["step0_vs_fp32"]
        assert {"gradient norm", "gradient direction"} <= set(found["further"]), found


def test_one_ulp_moves_every_weight_to_its_neighbour():
    import torch

    from slipstream.bench.runner import perturb_by_one_ulp

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4).to(torch.bfloat16))
    before = [p.detach().clone() for p in model.parameters()]
    assert perturb_by_one_ulp(model, seed=1) == sum(p.numel() for p in before)
    for old, new in zip(before, model.parameters(), strict=True):
        up = torch.nextafter(old, torch.full_like(old, float("inf")))
        down = torch.nextafter(old, torch.full_like(old, float("-inf")))
        assert bool(((new == up) | (new == down)).all()) and 0 < int((new == up).sum()) < old.numel()


def test_an_ablation_arm_beats_auto_only_beyond_the_a_a_noise():
    """The leave-one-out arms against slipstream, judged beyond how far slipstream differs from itself."""
    import random

    from slipstream.bench.ablation import ablation_verdicts

    rng = random.Random(0)
    base = [1.0 + rng.uniform(-0.01, 0.01) for _ in range(40)]

    def scaled(factor):  # the same steps, each `factor` as long, a little noise of their own
        return [t * factor * (1 + rng.uniform(-0.005, 0.005)) for t in base]

    timed = {
        "slipstream": base,
        "slipstream-again": scaled(1.03),  # the A/A pair: 3% apart
        "slipstream-no-chunked-loss": scaled(1 / 1.02),  # 2% faster: inside the A/A noise
        "slipstream-no-short-kernel": scaled(1 / 1.10),  # 10% faster: beyond it
        "slipstream-no-attention-grouping": scaled(1.15),  # 15% slower: auto is right
    }
    summary = {arm: {} for arm in timed}
    result = ablation_verdicts(summary, timed)
    assert 0.03 <= result["noise_margin"] < 0.05 and result["beats_auto"] == ["slipstream-no-short-kernel"]
    assert summary["slipstream-no-chunked-loss"]["ablation_verdict"] == "within noise"
    assert summary["slipstream-no-attention-grouping"]["ablation_verdict"] == "slower than auto"
    assert summary["slipstream-no-short-kernel"]["vs_slipstream"]["ratio"] == pytest.approx(1.10, rel=0.01)
    assert (
        "ablation_verdict" not in summary["slipstream-again"] and summary["slipstream"]["ablation"] is result
    )
    assert (
        ablation_verdicts({"slipstream": {}}, {"slipstream": base}) is None
    )  # no ablation arm: nothing judged


def test_the_ablation_preset_leaves_out_arms_that_would_rerun_slipstream():
    full = ab_config(model="demo")  # a full fine-tune of a dense model
    arms = preset_arms("ablation", full, "cpu")
    assert "slipstream-again" in arms  # the A/A control stays
    assert "slipstream-no-lora-compute" not in arms and "slipstream-no-moe-routing" not in arms
    lora_moe = ab_config(model="qwen3-moe", lora_rank=4)
    assert {"slipstream-no-lora-compute", "slipstream-no-moe-routing"} <= set(
        preset_arms("ablation", lora_moe, "cpu")
    )


def test_arms_that_would_not_fit_side_by_side_run_one_after_another_and_say_why(monkeypatch):
    from slipstream.bench import lockstep

    monkeypatch.setattr(lockstep, "available_memory_bytes", lambda: 2**20)  # a machine with 1 MiB to spare
    config = ab_config(model="qwen3", max_seq_len=128, steps=2, warmup=1, num_rows=60, threads=1)
    config = dataclasses.replace(
        config, ab=dataclasses.replace(config.ab, arms=("stock-packed", "slipstream"))
    )
    record = run_ab(config, progress=False)
    (schedule,) = record["interleaving"]
    assert schedule["mode"] == "arms" and "too little for 1 more beside them" in schedule["why"]
    assert all(len(record["runs"][arm][0]["step_s"]) == config.ab.steps for arm in config.ab.arms)
    assert record["summary"]["slipstream"]["loss_vs_stock-packed"] in ("identical", "within tolerance")
