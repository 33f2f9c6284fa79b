"""Between two steps an arm holds the memory its steps churn (bench/host_pages.py): what it holds,
that it never raises the peak, that it lets go before the next step, and that every A/B arm does it."""

from __future__ import annotations

import pytest
import torch

from slipstream.bench import host_pages
from slipstream.bench.ceiling import proc_status_kib
from slipstream.bench.command import ab_config
from slipstream.bench.host_pages import WarmPages, churn_bytes

linux_only = pytest.mark.skipif(not __import__("os").path.exists("/proc/self/status"), reason="reads /proc")


@linux_only
def test_the_hold_is_what_the_peak_held_beyond_now_and_never_raises_the_peak():
    block = torch.ones(64 * 2**20, dtype=torch.uint8)  # a step's churn: 64 MiB touched, then freed
    del block
    expected = churn_bytes()
    peak = proc_status_kib("VmHWM")
    warm = WarmPages()
    held = warm.hold()
    assert held.bytes == warm.held_bytes > 0
    assert abs(held.bytes - expected) <= 8 * 2**20  # (RSS moves a little between the two reads)
    assert proc_status_kib("VmHWM") <= peak + 1024  # held at most up to the peak, not past it
    assert proc_status_kib("VmRSS") * 1024 >= held.bytes  # resident: the process's own while it waits
    warm.release()
    assert warm.held_bytes == 0


def test_the_hold_is_capped_at_a_share_of_what_the_machine_has(monkeypatch):
    sizes = {"VmHWM": 30 * 2**20, "VmRSS": 2 * 2**20, "MemAvailable": 10 * 2**20}  # KiB: 28 GiB above now
    monkeypatch.setattr(host_pages, "proc_status_kib", lambda field, **_: sizes[field])
    assert churn_bytes() == int(10 * 2**30 * host_pages.MAX_SHARE_OF_AVAILABLE)
    sizes["VmHWM"] = sizes["VmRSS"]  # nothing churned: nothing held
    assert churn_bytes() == 0

    def unreadable(field, **_):
        raise OSError("no /proc")

    monkeypatch.setattr(host_pages, "proc_status_kib", unreadable)
    assert churn_bytes() is None
    assert WarmPages().hold().bytes == 0  # nothing known, nothing held


def test_every_arm_step_records_its_faults_its_hold_and_the_other_load(monkeypatch):
    """A short A/B arm: per step, the page faults inside the timed step, the bytes held warm after it
    (on a CPU with --keep-pages-warm, the default; none with it off) and the other load."""
    import dataclasses

    from slipstream.bench.runner import prepare_bins, run_arm

    monkeypatch.setattr(host_pages, "churn_bytes", lambda: 2**20)  # what a step churned: 1 MiB
    for keep in (True, False):
        config = ab_config(steps=3, warmup=1, num_rows=40, max_seq_len=128, keep_pages_warm=keep)
        plan, vocab, _ = prepare_bins(config)
        result = run_arm(dataclasses.asdict(config), "slipstream", plan, vocab)
        assert len(result["page_faults"]) == len(result["other_cores"]) == len(result["hold_s"]) == 3
        assert all(faults >= 0 for faults in result["page_faults"])
        assert result["held_bytes"] == ([2**20] * 3 if keep else [0, 0, 0])


def test_the_report_counts_the_steps_that_shared_the_machine(monkeypatch):
    """``summary``'s machine state per arm (faults, held memory, steps beside other work beyond the
    cores the arm left free) and the report's lines saying so."""
    from slipstream import hardware
    from slipstream.bench.render import machine_state_lines
    from slipstream.bench.runner import machine_state

    monkeypatch.setattr(hardware, "usable_cores", lambda: 4)
    config = ab_config(steps=4, warmup=1, threads=2)  # 2 spare cores: busy past 2 + BUSY_CORES
    run = {
        "page_faults": [900, 100, 300, 200],
        "other_cores": [3.0, 0.1, 2.5, None],  # the warm-up step's load is not counted
        "held_bytes": [0, 2**30, 2**30, 2**30],
    }
    state = machine_state(config, [run])
    assert state == {"median_page_faults": 200, "held_bytes": 2**30, "max_other_cores": 2.5, "busy_steps": 1}
    record = {"summary": {"slipstream": state, "trl": {"skipped": "not installed"}}}
    lines = machine_state_lines(record)
    assert "Page faults a timed step (median): slipstream 200" in lines[1]
    assert "held up to 1.00 GiB warm" in lines[1]
    assert lines[2].startswith("Intervals resample the steps of one process per arm")
    assert lines[3].startswith(
        "**Busy machine:** 1 timed step(s) of slipstream ran while other work took up to 2.50"
    )
    quiet = {"summary": {"slipstream": {**state, "busy_steps": 0}}, "config": {"repeats": 3}}
    assert (
        machine_state_lines(quiet)[2]
        == "Intervals resample the 3 repeats (a fresh process of each arm), then their steps."
    )
    assert len(machine_state_lines(quiet)) == 3
