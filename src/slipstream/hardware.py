"""What this CPU can do fast: its class (AMX, AVX512-BF16 or AVX2 at most), probed once, overridable.

Every hardware-dependent choice slipstream makes on a CPU (``model.dtype: auto``, and through the
dtype every rule keyed to it) starts from :func:`cpu_class`. The classes, fastest bf16 first:

- ``amx``: AMX tiles (Intel Sapphire Rapids and later): bf16 GEMMs native, ~5x fp32;
- ``avx512-bf16``: AVX512-BF16 without AMX (AMD Zen 4/5, Intel Cooper Lake): bf16 native;
- ``avx2``: neither (AMD Zen 3, older Intel): bf16 is emulated, slower than fp32;
- ``other``: a CPU torch reports no x86 vector extension for (Arm, ...): no bf16 rule, fp32.

``SLIPSTREAM_CPU_CLASS`` (one of the names above) overrides the probe, for users and tests alike:
``SLIPSTREAM_CPU_CLASS=avx2`` makes every decision as on an AVX2-only, fp32-only CPU. It changes
slipstream's decisions, not torch's kernels; to run the kernels as such a CPU would too, start the
process with ``ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2`` (what ``.ci/run`` does for its
AVX2 pass; torch reads those once, at import).
"""

from __future__ import annotations

import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

import torch

CpuClassName = Literal["amx", "avx512-bf16", "avx2", "other"]
CPU_CLASSES: tuple[str, ...] = get_args(CpuClassName)
ENV_CPU_CLASS = "SLIPSTREAM_CPU_CLASS"
BF16_NATIVE = frozenset({"amx", "avx512-bf16"})


@dataclass(frozen=True)
class CpuClass:
    """The CPU's class (:data:`CPU_CLASSES`), whether bf16 is native there, and where it came from."""

    name: str
    overridden: bool  # from SLIPSTREAM_CPU_CLASS, not the probe

    @property
    def bf16_native(self) -> bool:
        return self.name in BF16_NATIVE

    def describe(self) -> str:
        """'AMX' / 'AVX512-BF16 (no AMX)' / ..., with ' (SLIPSTREAM_CPU_CLASS)' when overridden."""
        text = {
            "amx": "AMX",
            "avx512-bf16": "AVX512-BF16 (no AMX)",
            "avx2": "neither AMX nor AVX512-BF16",
            "other": "no x86 bf16 extension",
        }[self.name]
        return text + (f" ({ENV_CPU_CLASS}={self.name})" if self.overridden else "")


def probed_cpu_class() -> str:
    """The class torch's own CPU probes find (never the override)."""
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        return "amx"
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        return "avx512-bf16"
    capability = torch.backends.cpu.get_cpu_capability()
    return "avx2" if capability.startswith("AVX") else "other"


def cpu_class() -> CpuClass:
    """This CPU's class: ``SLIPSTREAM_CPU_CLASS`` where set (ValueError naming it if unknown), else probed."""
    override = os.environ.get(ENV_CPU_CLASS, "").strip()
    if override:
        if override not in CPU_CLASSES:
            raise ValueError(f"{ENV_CPU_CLASS}={override!r}: expected one of {', '.join(CPU_CLASSES)}")
        return CpuClass(override, overridden=True)
    return CpuClass(probed_cpu_class(), overridden=False)


def _cpuinfo_fields() -> dict[str, str]:
    """The first processor's ``key: value`` lines of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


# AMD's families and, for family 25, the model ranges of Zen 4 (the rest of 25 is Zen 3): what
# separates an AVX2-only EPYC (Zen 3) from an AVX512-BF16 one (Zen 4, Zen 5) by name.
_ZEN4_MODELS_OF_FAMILY_25 = (range(0x10, 0x20), range(0x60, 0x80), range(0xA0, 0xB0))


def cpu_generation(fields: dict[str, str] | None = None) -> str:
    """The CPU's vendor, family and model, and the generation they name where known:
    'AMD family 26 model 2 (Zen 5)', 'Intel family 6 model 143', ... ('' where unknown)."""
    fields = _cpuinfo_fields() if fields is None else fields
    vendor = fields.get("vendor_id", "")
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return ""
    name = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(vendor, vendor or "unknown vendor")
    text = f"{name} family {family} model {model}"
    generation = ""
    if name == "AMD":
        zen4 = any(model in r for r in _ZEN4_MODELS_OF_FAMILY_25)
        generation = {23: "Zen / Zen 2", 25: "Zen 4" if zen4 else "Zen 3", 26: "Zen 5"}.get(family, "")
    return f"{text} ({generation})" if generation else text


# Environment variables that cap the instruction sets torch's CPU kernels use (read once, at import):
# a figure measured under them is another machine's.
KERNEL_CAPS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    return _cpuinfo_fields().get("model name") or platform.processor() or platform.machine()


def device_identity(device: torch.device) -> dict[str, str]:
    """What a figure measured on ``device`` is keyed by (the matmul peak, the calibrations, the
    ablation verdicts): its name and torch's version; on a CPU also its class (the override
    included) and any cap on torch's kernels, so an emulated AVX2 machine never shares a cached
    figure with the real one."""
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    caps = ",".join(f"{name}={os.environ[name]}" for name in KERNEL_CAPS if os.environ.get(name))
    return {
        "device": cpu_name(),
        "cpu_class": cpu_class().name,
        "kernels": torch.backends.cpu.get_cpu_capability() + (f" ({caps})" if caps else ""),
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------- the machine's other work

# A measurement is called busy when other work took more than this many cores beyond those the
# measurement left free (cores - its threads), on average over the measurement.
BUSY_CORES = 0.25


def _machine_busy_ticks() -> int:
    """Clock ticks every core spent on anything but idling, since boot (/proc/stat's "cpu" line:
    user, nice, system, irq, softirq and steal: time the hypervisor gave our cores to others)."""
    with open("/proc/stat") as stat:
        fields = stat.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return user + nice + system + irq + softirq + steal


# Processes that work for this one's measurements (a rollout engine's): their CPU time is this
# process's own, not other load. Registered by whoever starts them (engines/vllm_engine.py).
_WORKERS: set[int] = set()


def add_worker(pid: int) -> None:
    """Count process ``pid`` (and what it starts) as this process's own work in the load probe."""
    _WORKERS.add(pid)


def remove_worker(pid: int) -> None:
    _WORKERS.discard(pid)


def _ticks(pid: str | int) -> int:
    """Clock ticks process ``pid`` (all its threads) has run, user and system (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as stat:
        after_name = stat.read().rsplit(")", 1)[1].split()
    return int(after_name[11]) + int(after_name[12])  # utime, stime (fields 14 and 15)


def _own_ticks() -> int:
    """Clock ticks this process and its registered workers (:func:`add_worker`) have run; other
    children (a test's competing loops) stay other load."""
    total = _ticks("self")
    for pid in list(_WORKERS):
        try:
            total += _ticks(pid)
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
    return total


def crowded(other_cores: float, threads: int) -> bool:
    """Did other work (``other_cores``, on average) take more than the cores a measurement running
    ``threads`` threads left free, by more than :data:`BUSY_CORES`? Then its timing is not this
    machine's alone."""
    return other_cores > max(0, usable_cores() - threads) + BUSY_CORES


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass
class OtherLoad:
    """The cores other processes (and the hypervisor's steal) took while a block ran, and whether that
    crowded a measurement running ``threads`` threads: ``with OtherLoad(threads) as load: ...``.

    A timing taken then is another machine's (every parallel region waits for a descheduled thread):
    a calibration that sees ``load.busy`` keeps its built-in rule instead of caching what it timed.
    Linux (/proc); elsewhere ``known`` is False and nothing is called busy."""

    threads: int
    other_cores: float = 0.0
    seconds: float = 0.0
    known: bool = True

    def __enter__(self) -> OtherLoad:
        self._started = time.monotonic()
        try:
            self._machine, self._own = _machine_busy_ticks(), _own_ticks()
        except (OSError, ValueError, IndexError):
            self.known = False
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.monotonic() - self._started
        if not self.known or self.seconds <= 0:
            return
        try:
            machine, own = _machine_busy_ticks(), _own_ticks()
        except (OSError, ValueError, IndexError):
            self.known = False
            return
        ticks = os.sysconf("SC_CLK_TCK")
        others = (machine - self._machine) - (own - self._own)
        self.other_cores = max(0.0, others / ticks / self.seconds)

    @property
    def spare_cores(self) -> int:
        return max(0, usable_cores() - self.threads)

    @property
    def busy(self) -> bool:
        return self.known and crowded(self.other_cores, self.threads)

    def describe(self) -> str:
        if not self.known:
            return "the machine's load is unknown here"
        return (
            f"other work took {self.other_cores:.2f} of {usable_cores()} cores while measuring at "
            f"{self.threads} threads ({self.spare_cores} spare)"
        )


def other_load(threads: int) -> OtherLoad:
    """The machine's other load while a block runs, for a measurement at ``threads`` threads: ``with
    hardware.other_load(threads) as load: ...`` (an :class:`OtherLoad`). Every reader of the load (the
    attention calibration, the A/B arms' timed steps) comes here, looked up at call time (never
    imported by name), so this is the one place a test fakes the machine's load (tests/conftest.py:
    quiet unless a test asks for a busy one), whatever else runs beside the suite."""
    return OtherLoad(threads)
