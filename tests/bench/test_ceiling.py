"""The memory-ceiling search: doubling then bisection, over-budget probes, sizes, one real probe."""

import dataclasses

import pytest

from slipstream.bench.ab_config import parse_bytes
from slipstream.bench.ceiling import ceiling_docs, fresh_probe, max_tokens_within
from slipstream.bench.command import ab_config
from slipstream.bench.runner import run_in_fresh_process


def test_sizes_parse_and_bad_ones_are_named():
    assert parse_bytes("8GB") == 8 * 10**9
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("1.5 gb") == 1_500_000_000
    assert parse_bytes("512MiB") == 512 * 2**20
    for bad in ("eight", "8TB", "-1GB", "0GB"):
        with pytest.raises(ValueError, match="max_tokens_within"):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="not a memory size"):
        ab_config(max_tokens_within="lots")


def _linear_memory(per_token: int, fixed: int, budget: int):
    """A fake probe: memory grows linearly with tokens."""
    calls = []

    def run_probe(tokens):
        calls.append(tokens)
        peak = fixed + per_token * tokens
        return {"fits": peak <= budget, "peak_bytes": peak, "seconds": 0.0}

    return run_probe, calls


def test_doubling_then_bisection_lands_within_the_resolution():
    config = ab_config(max_seq_len=1024, max_tokens_within="8GB")
    run_probe, calls = _linear_memory(per_token=300_000, fixed=500_000_000, budget=8 * 10**9)
    found = max_tokens_within(config, "slipstream", 1000, run_probe)
    true_ceiling = (8 * 10**9 - 500_000_000) // 300_000  # 25,000 tokens
    assert calls[:5] == [1024, 2048, 4096, 8192, 16384] and calls[5] == 32768
    assert true_ceiling - 16384 // 16 <= found["max_tokens"] <= true_ceiling
    assert not found["capped"] and len(found["probes"]) == len(calls)


def test_a_first_probe_over_budget_halves_and_a_never_failing_arm_is_capped():
    config = ab_config(max_seq_len=4096, max_tokens_within="1GB")
    run_probe, _ = _linear_memory(per_token=1_000_000, fixed=0, budget=10**9)  # ceiling 1000
    found = max_tokens_within(config, "stock-packed", 1000, run_probe)
    assert 1000 - 128 <= found["max_tokens"] <= 1000
    run_probe, calls = _linear_memory(per_token=1, fixed=0, budget=10**9)
    capped = max_tokens_within(config, "slipstream", 1000, run_probe)
    assert capped["capped"] and capped["max_tokens"] == calls[-1] == 64 * 4096


def test_ceiling_docs_fill_exactly_and_label_every_token():
    docs = ceiling_docs(3000, seed=0)
    assert sum(len(d["input_ids"]) for d in docs) == 3000
    assert all(d["labels"] == d["input_ids"] for d in docs)


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_real_probes_in_fresh_processes_and_the_watchdog():
    config = ab_config(model="qwen3", max_seq_len=256, threads=1, max_tokens_within="6GB")
    fits = fresh_probe(run_in_fresh_process, dataclasses.asdict(config), "slipstream", 256, 2048)
    assert fits["fits"] and 10**8 < fits["peak_bytes"] < 6 * 10**9
    tight = dataclasses.replace(config, ab=dataclasses.replace(config.ab, max_tokens_within="1MB"))
    # less than any process: the watchdog ends it
    ended = fresh_probe(run_in_fresh_process, dataclasses.asdict(tight), "stock-packed", 256, 2048)
    assert not ended["fits"] and "over budget" in ended["ended"]
