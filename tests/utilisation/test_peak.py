"""The matmul peak: measured once per device, dtype, threads and torch version, then read from the cache."""

import torch

from slipstream.utilisation import peak


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
