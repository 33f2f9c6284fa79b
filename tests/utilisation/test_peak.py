"""The matmul peak: measured once per device, dtype, threads and torch version, then read from the cache."""

import json

import pytest
import torch

from slipstream.utilisation import peak

pytestmark = pytest.mark.empty_cache  # these measure the probe itself


def test_the_peak_is_measured_once_and_a_fresh_cache_measures_again(tmp_path, monkeypatch):
    calls = []
    real = peak.measure_matmul_peak

    def quick(device, dtype):
        calls.append((device, dtype))
        return real(device, dtype, sizes=(64, 128), repeats=2)

    monkeypatch.setattr(peak, "measure_matmul_peak", quick)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "a"))
    first = peak.matmul_peak("cpu", torch.float32, threads=1)
    assert first["cached"] is False and first["tflops"] > 0 and first["threads"] == 1
    assert (
        first["dtype"] == "float32"
        and first["torch"] == torch.__version__
        and "best of up to 2" in first["how"]
    )
    again = peak.matmul_peak("cpu", torch.float32, threads=1)
    assert again["cached"] is True and again["flops_per_s"] == first["flops_per_s"]
    assert len(calls) == 1
    peak.matmul_peak("cpu", torch.bfloat16, threads=1)  # another dtype: its own measurement
    assert len(calls) == 2
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path / "b"))
    assert peak.matmul_peak("cpu", torch.float32, threads=1)["cached"] is False
    assert len(calls) == 3
    assert torch.get_num_threads() >= 1  # the probe's thread count was restored


def test_a_measurement_stops_growing_past_its_budget():
    found = peak.measure_matmul_peak("cpu", torch.float32, sizes=(32, 64, 4096), repeats=1, budget_s=0.0)
    assert found["size"] == 32  # the budget was spent after the first size


def test_remeasure_replaces_a_cached_figure_atomically(tmp_path, monkeypatch):
    """A figure taken under load sticks in the cache until ``remeasure=True`` (doctor --remeasure-peak)
    finds a higher one; a lower one (the device shared again) never replaces it."""
    figures = iter([1.0e9, 5.0e9, 2.0e9])

    def fake(device, dtype):
        rate = next(figures)
        return {"flops_per_s": rate, "tflops": rate / 1e12, "size": 64, "seconds": 0.1, "how": "fake"}

    monkeypatch.setattr(peak, "measure_matmul_peak", fake)
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    loaded = peak.matmul_peak("cpu", torch.float32, threads=1)
    assert loaded["flops_per_s"] == 1.0e9
    assert peak.matmul_peak("cpu", torch.float32, threads=1)["cached"] is True  # the busy figure sticks
    fresh = peak.matmul_peak("cpu", torch.float32, threads=1, remeasure=True)
    assert fresh["cached"] is False and fresh["flops_per_s"] == 5.0e9
    again = peak.matmul_peak("cpu", torch.float32, threads=1)
    assert again["cached"] is True and again["flops_per_s"] == 5.0e9  # the new figure replaced it
    files = list((tmp_path / "matmul_peak").iterdir())
    assert len(files) == 1  # written in place of the old one, no temporary left behind
    busy = peak.matmul_peak("cpu", torch.float32, threads=1, remeasure=True)  # measures 2e9: kept 5e9
    assert busy["flops_per_s"] == 5.0e9 and busy["kept_over"].startswith("0.002 TFLOP/s measured at")
    assert peak.matmul_peak("cpu", torch.float32, threads=1)["flops_per_s"] == 5.0e9


def test_doctor_has_a_remeasure_peak_option(monkeypatch):
    from slipstream import cli

    seen = {}

    def fake_doctor(model, json_path=None, dtype="auto", remeasure_peak=False, recalibrate=False):
        seen.update(remeasure_peak=remeasure_peak, recalibrate=recalibrate)
        return {}, 0

    monkeypatch.setattr("slipstream.doctor.run_doctor", fake_doctor)
    assert cli.main(["doctor", "--remeasure-peak"]) == 0
    assert seen == {"remeasure_peak": True, "recalibrate": False}
    assert cli.main(["doctor", "--recalibrate"]) == 0
    assert seen == {"remeasure_peak": False, "recalibrate": True}
    assert cli.main(["doctor"]) == 0
    assert seen == {"remeasure_peak": False, "recalibrate": False}


def test_on_several_cpu_threads_the_peak_is_the_better_of_one_matmul_and_one_per_thread_side_by_side():
    """oneDNN does not always spread one matmul over every core; the cores' peak is what they do
    however it is reached, so each size is also timed as one single-threaded matmul per thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        found = peak.measure_matmul_peak("cpu", torch.float32, sizes=(64, 128), repeats=2)
    finally:
        torch.set_num_threads(previous)
    assert torch.get_num_threads() == previous
    assert found["one_matmul_flops_per_s"] > 0 and found["side_by_side_flops_per_s"] > 0
    assert found["flops_per_s"] == max(found["one_matmul_flops_per_s"], found["side_by_side_flops_per_s"])
    assert "2 matmuls side by side, one thread each" in found["how"]
    torch.set_num_threads(1)
    try:
        alone = peak.measure_matmul_peak("cpu", torch.float32, sizes=(64,), repeats=2)
    finally:
        torch.set_num_threads(previous)
    assert (
        alone["side_by_side_flops_per_s"] is None and alone["flops_per_s"] == alone["one_matmul_flops_per_s"]
    )
    assert "side by side" not in alone["how"]


def test_a_figure_the_old_probe_cached_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(tmp_path))
    key = peak._cache_key(torch.device("cpu"), torch.float32, 1)
    assert key["probe"] == peak.PROBE_VERSION
    old_key = {name: value for name, value in key.items() if name != "probe"}
    old_path = peak._cache_path(old_key)
    old_path.parent.mkdir(parents=True)
    old_path.write_text(json.dumps({"key": old_key, "peak": {"flops_per_s": 1.0}, "measured": "then"}))
    monkeypatch.setattr(
        peak,
        "measure_matmul_peak",
        lambda device, dtype: {
            "flops_per_s": 5.0,
            "tflops": 5e-12,
            "size": 64,
            "seconds": 1.0,
            "how": "fake",
        },
    )
    assert peak.matmul_peak("cpu", torch.float32, threads=1)["flops_per_s"] == 5.0


def test_side_by_side_stops_growing_past_its_memory_cap(monkeypatch):
    """A pair of matrices per thread: on a many-core host they stop at SIDE_BY_SIDE_BYTES."""
    monkeypatch.setattr(peak, "SIDE_BY_SIDE_BYTES", 2 * 2 * 64 * 64 * 4)  # two fp32 64 x 64 pairs
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        capped = peak.measure_matmul_peak("cpu", torch.float32, sizes=(128,), repeats=2)
        small = peak.measure_matmul_peak("cpu", torch.float32, sizes=(64,), repeats=2)
    finally:
        torch.set_num_threads(previous)
    assert capped["side_by_side_flops_per_s"] is None and "side by side" not in capped["how"]
    assert small["side_by_side_flops_per_s"] > 0
