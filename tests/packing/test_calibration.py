"""The packed attention's cost figures: measured on this device, cached, and what "auto" then does."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

import slipstream
from slipstream import hardware
from slipstream.models import build_model
from slipstream.packing import calibration
from slipstream.packing import short_attention as short_module
from slipstream.packing.costs import ATTENTION_COSTS, BUILTIN
from tests.conftest import random_docs

CPU = torch.device("cpu")


@pytest.mark.empty_cache  # measures for real, into an empty cache
def test_the_figures_are_measured_once_per_device_dtype_and_threads_then_read_back(machine_load, monkeypatch):
    # on a quiet machine (the load probe's fake, tests/conftest.py; the busy one: below)
    costs = calibration.attention_costs(CPU, torch.bfloat16, threads=1)
    assert machine_load.probes == 1  # the measurement asked the probe, once
    assert costs.call_seconds > 0 and costs.score_seconds > 0 and costs.gather_seconds > 0
    assert costs.source == "measured on this device, bfloat16, 1 threads"
    ratios = {int(k): v for k, v in costs.figures["short_kernel_speedup_by_length"].items()}
    assert sorted(ratios) == list(calibration.SHORT_LENGTHS)
    # the crossover: the longest length up to which the short kernel was faster by the margin at every length
    expected = 0
    for length in calibration.SHORT_LENGTHS:
        if ratios[length] < 1 + calibration.SHORT_MARGIN:
            break
        expected = length
    assert costs.short_limit(torch.bfloat16) == expected and costs.short_limit(torch.float32) == 0

    def no_measuring(dtype):
        raise AssertionError("measured again")

    monkeypatch.setattr(calibration, "measure", no_measuring)
    assert calibration.attention_costs(CPU, torch.bfloat16, threads=1) == costs  # the cached figures
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda dtype: measured.append(dtype) or BUILTIN)
    calibration.attention_costs(CPU, torch.float32, threads=1)  # another dtype: its own measurement
    calibration.attention_costs(CPU, torch.bfloat16, threads=2)  # another thread count
    # another CPU class (make test-avx2 already overrides the probe to avx2): not this one's figures
    monkeypatch.setenv("SLIPSTREAM_CPU_CLASS", "amx" if hardware.cpu_class().name != "amx" else "avx2")
    calibration.attention_costs(CPU, torch.bfloat16, threads=1)
    calibration.attention_costs(CPU, torch.bfloat16, threads=1, remeasure=True)  # asked to measure again
    assert measured == [torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16]
    assert calibration.attention_costs("meta", torch.bfloat16) is BUILTIN  # only a CPU is measured


def _short_kernel_calls(model, docs, monkeypatch) -> int:
    calls = []
    original = short_module.ShortCausalAttention.apply
    monkeypatch.setattr(
        short_module.ShortCausalAttention, "apply", lambda *a: calls.append(1) or original(*a), raising=False
    )
    batch = slipstream.collate_packed(docs)
    model(**batch.model_inputs()).loss.backward()
    return len(calls)


@pytest.mark.parametrize("limit", [0, 64, 256])
def test_auto_takes_the_short_kernel_up_to_the_measured_crossover_of_the_models_dtype(limit, monkeypatch):
    measured = dataclasses.replace(
        BUILTIN, short_max_len=(("bfloat16", limit),) if limit else (), source="measured (test)"
    )
    monkeypatch.setattr(calibration, "attention_costs", lambda *args, **kwargs: measured)
    model = build_model("qwen3").to(torch.bfloat16)
    model = slipstream.optimize(model, chunked_loss=False, attention_grouping="per_document")
    state = slipstream.state_of(model)
    assert state.attention_costs is measured
    assert all(ATTENTION_COSTS[m] is measured for m in model.modules())
    policy = next(p for p in state.policies if p.startswith("short-document kernel"))
    assert "measured (test)" in policy and (
        f"up to {limit} tokens" in policy if limit else "no faster" in policy
    )
    docs = random_docs([40, 100, 200])  # one call each (per document), by length
    calls = _short_kernel_calls(model, docs, monkeypatch)  # one a layer per short document (forward)
    assert calls == model.config.num_hidden_layers * sum(length <= limit for length in (40, 100, 200))


def test_figures_are_not_measured_where_no_auto_reads_them(monkeypatch):
    monkeypatch.setattr(calibration, "attention_costs", lambda *a, **k: pytest.fail("measured"))
    model = slipstream.optimize(
        build_model("qwen3"), attention_grouping="grouped", short_document_kernel="off"
    )
    assert slipstream.state_of(model).attention_costs is BUILTIN


@pytest.mark.empty_cache
def test_a_machine_busy_while_measuring_keeps_the_built_in_rule_and_says_so(machine_load, monkeypatch):
    """Crowded twice: the built-in figures (the same decisions as BUILTIN), a source that says why,
    nothing cached, and this process does not measure again (until asked); crowded once, then quiet:
    the second measurement is kept and cached."""
    measured = []
    monkeypatch.setattr(calibration, "PAUSE_S", 0.0)
    monkeypatch.setattr(
        calibration,
        "measure",
        lambda dtype: measured.append(dtype) or dataclasses.replace(BUILTIN, source="timed"),
    )
    machine_load.script(
        True, True
    )  # the load probe's fake (tests/conftest.py): every spare core and one more
    costs = calibration.attention_costs(CPU, torch.bfloat16, threads=1)
    assert len(measured) == machine_load.probes == calibration.QUIET_TRIES == 2
    decisions = ("call_seconds", "score_seconds", "gather_seconds", "short_max_len")
    assert all(getattr(costs, name) == getattr(BUILTIN, name) for name in decisions)
    cores, spare = hardware.usable_cores(), hardware.usable_cores() - 1
    assert (
        f"not measured here: the machine was busy (other work took {spare + 1:.2f} of {cores} cores while "
        f"measuring at 1 threads ({spare} spare), 2 tries)" in costs.source
    )
    assert not list((calibration.cache_root() / "calibration").glob("*.json"))  # nothing cached
    assert calibration.attention_costs(CPU, torch.bfloat16, threads=1) is costs and len(measured) == 2
    model = slipstream.optimize(build_model("qwen3"), attention_grouping="auto")
    policy = next(p for p in slipstream.state_of(model).policies if p.startswith("packed attention grouping"))
    assert "the machine was busy" in policy  # the policy line says why the built-in rule stands

    machine_load.script(True, False)  # asked again: crowded, then quiet
    measured.clear()
    costs = calibration.attention_costs(CPU, torch.bfloat16, threads=1, remeasure=True)
    assert costs.source == "timed" and len(measured) == machine_load.probes == 2
    assert len(list((calibration.cache_root() / "calibration").glob("*.json"))) == 1
    assert calibration.attention_costs(CPU, torch.bfloat16, threads=1) == costs  # read back


@pytest.mark.slow  # busy-loops every core for ~30 s: make test-slow
@pytest.mark.empty_cache
@pytest.mark.real_load  # the machine's own load probe, not the quiet fake
def test_a_calibration_beside_a_competing_process_does_not_decide():
    """For real: busy loops beside the measurement, two per core and one more (so a one-thread
    measurement gets about a third of a core on 2 cores, half of one on 64). The load probe sees them
    and the calibration keeps the built-in rule, saying so, instead of caching figures timed under them."""
    import subprocess
    import sys

    from slipstream.hardware import other_load, usable_cores

    # each loop ends by itself after two minutes, whatever happens to this test
    spin = [
        sys.executable,
        "-c",
        "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end: pass",
    ]
    spinners = [subprocess.Popen(spin) for _ in range(2 * usable_cores() + 1)]
    try:
        time.sleep(1.0)  # the loops started
        with other_load(1) as load:
            sum(range(10**7))
        assert load.known and load.busy, load.describe()
        costs = calibration.attention_costs(CPU, torch.float32, threads=1, remeasure=True)
    finally:
        for process in spinners:
            process.kill()
            process.wait()
    assert "the machine was busy" in costs.source and costs.call_seconds == BUILTIN.call_seconds
    assert not list((calibration.cache_root() / "calibration").glob("*.json"))
