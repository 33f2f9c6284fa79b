"""The CPU class probe, its override, and the dtype ``auto`` derives from it, on every class."""

from __future__ import annotations

import pytest
import torch

from slipstream.hardware import CPU_CLASSES, ENV_CPU_CLASS, cpu_class, probed_cpu_class
from slipstream.train.precision import fast_bf16, resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "capability", "expected"),
    [
        (True, True, "AVX512", "amx"),
        (False, True, "AVX512", "avx512-bf16"),
        (False, False, "AVX512", "avx2"),  # AVX-512 without its bf16 extension: bf16 still emulated
        (False, False, "AVX2", "avx2"),
        (False, False, "DEFAULT", "other"),
    ],
)
def test_the_probe_reads_torchs_cpu_features(monkeypatch, amx, avx512_bf16, capability, expected):
    monkeypatch.delenv(ENV_CPU_CLASS, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert probed_cpu_class() == expected
    found = cpu_class()
    assert (found.name, found.overridden) == (expected, False)
    assert fast_bf16(CPU)[0] is (expected in ("amx", "avx512-bf16"))


def test_each_class_decides_the_auto_dtype(fake_cpu_class):
    found = cpu_class()
    assert found.name == fake_cpu_class and found.overridden
    dtype, why = resolve_dtype("auto", CPU)
    assert dtype == (torch.float32 if fake_cpu_class == "avx2" else torch.bfloat16)
    assert f"{ENV_CPU_CLASS}={fake_cpu_class}" in why  # the override is said, never silent
    assert resolve_dtype("bfloat16", CPU) == (torch.bfloat16, "dtype bfloat16 (set)")  # a set dtype stays


def test_the_unset_override_is_the_real_probe(monkeypatch):
    monkeypatch.delenv(ENV_CPU_CLASS, raising=False)
    assert cpu_class().name == probed_cpu_class() in CPU_CLASSES


def test_an_unknown_class_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ENV_CPU_CLASS, "avx9000")
    with pytest.raises(ValueError, match=r"SLIPSTREAM_CPU_CLASS='avx9000': expected one of amx, avx512-bf16"):
        cpu_class()


def test_a_cached_figure_is_keyed_by_the_class_and_any_kernel_cap(monkeypatch):
    from slipstream.hardware import device_identity

    monkeypatch.delenv(ENV_CPU_CLASS, raising=False)
    for name in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(name, raising=False)
    real = device_identity(CPU)
    assert real["cpu_class"] == probed_cpu_class() and real["torch"] == torch.__version__
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")  # torch's fp32 GEMMs held to AVX2: another machine
    capped = device_identity(CPU)
    assert capped != real and "MKL_ENABLE_INSTRUCTIONS=AVX2" in capped["kernels"]
    monkeypatch.setenv(ENV_CPU_CLASS, "avx2")
    assert device_identity(CPU)["cpu_class"] == "avx2"


@pytest.mark.parametrize(
    "vendor, family, model, expected",
    [
        ("AuthenticAMD", 25, 1, "AMD family 25 model 1 (Zen 3)"),  # EPYC Milan: AVX2 only
        ("AuthenticAMD", 25, 17, "AMD family 25 model 17 (Zen 4)"),  # EPYC Genoa: AVX512-BF16
        ("AuthenticAMD", 26, 2, "AMD family 26 model 2 (Zen 5)"),  # EPYC Turin: AVX512-BF16
        ("AuthenticAMD", 23, 49, "AMD family 23 model 49 (Zen / Zen 2)"),
        ("GenuineIntel", 6, 143, "Intel family 6 model 143"),  # Sapphire Rapids: AMX
    ],
)
def test_the_cpu_generation_is_named_from_vendor_family_and_model(vendor, family, model, expected):
    from slipstream.hardware import cpu_generation

    fields = {"vendor_id": vendor, "cpu family": str(family), "model": str(model)}
    assert cpu_generation(fields) == expected
    assert cpu_generation({}) == ""


def test_other_load_counts_the_cores_others_took_beyond_the_spare_ones(monkeypatch):
    """The machine's busy ticks less this process's, over the wall time: busy when they exceed the
    cores the measurement left free by more than BUSY_CORES (ticks faked: 4 cores, 2 threads)."""
    import os

    from slipstream import hardware

    ticks = os.sysconf("SC_CLK_TCK")
    clock = iter([100.0, 102.0])
    monkeypatch.setattr(hardware.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    for others_cores, busy in [(1.0, False), (2.2, False), (2.3, True)]:
        machine = iter([0, int((others_cores + 1.5) * 2 * ticks)])  # others + our 1.5 cores, for 2 s
        own = iter([0, int(1.5 * 2 * ticks)])
        monkeypatch.setattr(hardware, "_machine_busy_ticks", lambda m=machine: next(m))
        monkeypatch.setattr(hardware, "_own_ticks", lambda o=own: next(o))
        clock = iter([100.0, 102.0])
        with hardware.OtherLoad(threads=2) as load:
            pass
        assert load.spare_cores == 2 and abs(load.other_cores - others_cores) < 1e-6
        assert load.busy is busy, load.describe()
    monkeypatch.setattr(hardware.time, "monotonic", lambda: 100.0)
    monkeypatch.setattr(hardware, "_machine_busy_ticks", lambda: (_ for _ in ()).throw(OSError("no /proc")))
    with hardware.OtherLoad(threads=2) as load:
        pass
    assert not load.known and not load.busy and "unknown" in load.describe()


@pytest.mark.real_load  # the real hardware.other_load, not the quiet fake every other test gets
def test_every_reader_of_the_machines_load_asks_hardware_other_load():
    """One seam: ``hardware.other_load`` gives the real probe, and nothing else in slipstream reads the
    machine's load (an OtherLoad of its own, /proc/stat, the load average) or imports ``other_load``
    by name (a fake of ``hardware.other_load`` would miss that copy): so the fake tests/conftest.py
    puts there is what every measurement sees, whatever runs beside the suite."""
    import ast
    from pathlib import Path

    from slipstream import hardware

    with hardware.other_load(1) as load:
        pass
    assert type(load) is hardware.OtherLoad and load.threads == 1 and load.seconds >= 0
    package = Path(hardware.__file__).parent
    readers = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "hardware.py" and path.parent == package:
            continue
        text, where = path.read_text(), path.relative_to(package)
        readers += [
            f"{where}: {word}" for word in ("/proc/stat", "getloadavg", "cpu_percent") if word in text
        ]
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("hardware"):
                names = {alias.name for alias in node.names}
                readers += [f"{where}: imports {name}" for name in names & {"other_load", "OtherLoad"}]
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "OtherLoad":
                readers.append(f"{where}: OtherLoad(...)")
    assert readers == []


def test_a_registered_workers_time_is_its_own_and_other_children_stay_other_load():
    """A rollout engine's process (registered by whoever starts it) runs for the measurement: its CPU
    time counts as this process's. Any other child (a competing loop) stays other load."""
    import os
    import subprocess
    import sys

    from slipstream import hardware

    burn = "import sys, time\nwhile time.process_time() < 0.5: pass\nsys.stdout.write('x'); sys.stdout.flush()\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE)
    try:
        assert child.stdout.read(1) == b"x"  # it has run 0.5 s of CPU
        alone = hardware._ticks("self")
        assert hardware._own_ticks() - alone < 0.4 * os.sysconf("SC_CLK_TCK")  # not registered: other load
        hardware.add_worker(child.pid)
        assert hardware._own_ticks() - hardware._ticks("self") >= 0.4 * os.sysconf("SC_CLK_TCK")
    finally:
        hardware.remove_worker(child.pid)
        child.kill()
        child.wait()
