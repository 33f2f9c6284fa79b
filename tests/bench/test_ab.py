"""The A/B harness: verdicts, summaries, the report, and one short real run of every arm."""

import json

import pytest

from slipstream.bench.ab import ABConfig, loss_parity, markdown_report, run_ab, summarize, write_record


def test_loss_parity_verdicts():
    assert loss_parity([2.0, 1.5], [2.0, 1.5], "float32")[0] == "identical"
    assert loss_parity([2.0, 1.5], [2.0, 1.5002], "float32")[0] == "within tolerance"
    assert loss_parity([2.0, 1.5], [2.0, 1.6], "float32")[0] == "diverged"
    assert loss_parity([2.0, 1.5], [2.0, 1.52], "bfloat16")[0] == "within tolerance"


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
    config = ABConfig(steps=3, warmup=1, arms=("stock-packed", "slipstream"))
    runs = {
        "stock-packed": [_run("stock-packed", [9.0, 2.0, 2.0], [100, 100, 100], [3.0, 2.0, 1.0])],
        "slipstream": [_run("slipstream", [9.0, 1.0, 1.0], [100, 100, 100], [3.0, 2.0, 1.0])],
    }
    summary = summarize(config, runs)
    assert summary["slipstream"]["speedup_vs_stock-packed"] == pytest.approx(2.0)
    assert summary["stock-packed"]["tokens_per_s"] == pytest.approx(50.0)
    assert summary["slipstream"]["loss_vs_stock-packed"] == "identical"


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="unknown arm"):
        ABConfig(arms=("stock", "fast"))
    with pytest.raises(ValueError, match="warmup"):
        ABConfig(steps=2, warmup=2)
    with pytest.raises(ValueError, match="batching"):
        ABConfig(batching="greedy")


def test_a_short_real_run_of_every_arm(tmp_path):
    config = ABConfig(model="qwen3", max_seq_len=256, steps=3, warmup=1, num_rows=200, threads=1)
    record = run_ab(config, progress=False)
    summary = record["summary"]
    assert set(summary) == {"stock-padded", "stock-packed", "slipstream"}
    # same data, same weights: the loss curves agree, and only slipstream is sync-free
    for arm in summary:
        assert summary[arm]["loss_vs_stock-padded"] in ("identical", "within tolerance"), arm
    assert summary["slipstream"]["host_syncs_per_step"] == 0
    assert summary["stock-packed"]["host_syncs_per_step"] >= 1
    assert summary["slipstream"]["attn_implementation"] == "slipstream_docwise"
    json_path, md_path = write_record(record, tmp_path)
    assert json.loads(json_path.read_text())["config"]["model"] == "qwen3"
    assert md_path.read_text() == markdown_report(record)
    assert "Per-step loss" in md_path.read_text()
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically, nothing left behind
