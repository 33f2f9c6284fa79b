"""`slipstream report` and the ab command's sweep / parity exit codes, on synthetic records."""

import json
import random

import pytest

from slipstream.bench import command
from slipstream.bench.ab_config import record_config
from slipstream.bench.command import sweep_grid
from slipstream.bench.report import (
    RUN_OPTIONS,
    ReportError,
    ceiling_table,
    cross_table,
    load_records,
    pair_records,
    report_rows,
    step_profile_table,
)
from slipstream.bench.runner import ABConfig
from slipstream.cli import main


def record(hardware: str, max_seq_len: int, gain: float, seed: int, diverge: bool = False) -> dict:
    rng = random.Random(seed)
    base = [0.5 * (1 + rng.uniform(-0.02, 0.02)) for _ in range(12)]
    fast = [t / gain * (1 + rng.uniform(-0.02, 0.02)) for t in base]
    loss = [7.0 - 0.1 * i for i in range(12)]
    summary = {
        "stock-packed": {"attn_implementation": "sdpa"},
        "slipstream": {"attn_implementation": "slipstream_docwise"},
    }
    return {
        "kind": "slipstream-ab",
        "config": {
            "model": "qwen3-8b",
            "layers": 4,
            "max_seq_len": max_seq_len,
            "grad_accum": 1,
            "batching": "bfd",
            "dtype": "bfloat16",
            "checkpointing": "off",
            "num_rows": 1500,
            "warmup": 2,
        },
        "fingerprint": {"device": hardware, "cpu": "x", "torch_threads": 2},
        "summary": summary,
        "runs": {
            "stock-packed": [{"step_s": base, "loss": loss}],
            "slipstream": [{"step_s": fast, "loss": [x + (0.5 if diverge else 0) for x in loss]}],
        },
    }


def write(tmp_path, name, data):
    path = tmp_path / name / "ab.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(data))
    return path


def test_cross_table_of_two_machines_and_two_batch_sizes(tmp_path, capsys):
    write(tmp_path, "h100-2k", record("NVIDIA H100", 2048, 1.20, 1))
    write(tmp_path, "h100-4k", record("NVIDIA H100", 4096, 1.30, 2))
    write(tmp_path, "4090-2k", record("NVIDIA GeForce RTX 4090", 2048, 1.10, 3))
    write(tmp_path, "4090-4k", record("NVIDIA GeForce RTX 4090", 4096, 1.15, 4))
    rows = report_rows(load_records([tmp_path]))
    assert len(rows) == 4
    table = cross_table(rows)
    lines = [line for line in table.splitlines() if line.startswith("| qwen3-8b")]
    assert len(lines) == 2  # one row per workload (sequence length), one column per machine
    assert "seq 2048" in lines[0] and "seq 4096" in lines[1]
    assert "NVIDIA H100" in table.splitlines()[0] and "RTX 4090" in table.splitlines()[0]
    by = {(r["hardware"], r["workload"].split(" · ")[2]): r for r in rows}
    assert by[("NVIDIA H100", "seq 4096")]["low"] <= 1.30 <= by[("NVIDIA H100", "seq 4096")]["high"]
    assert all(r["verdict"] == "faster" for r in rows)
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "report.png").exists()
    assert "4 records" in capsys.readouterr().out


def test_mismatched_workloads_are_never_paired(tmp_path):
    a, b = record("NVIDIA H100", 2048, 1.2, 1), record("NVIDIA H100", 4096, 1.2, 2)
    with pytest.raises(ReportError, match="max_seq_len"):
        pair_records(a, b)
    write(tmp_path, "a", a)
    write(tmp_path, "b", b)
    rows = report_rows(load_records([tmp_path]))
    assert len({r["workload"] for r in rows}) == 2 and all(r["records"] == 1 for r in rows)
    # two runs of the same workload on the same machine are pooled into one interval
    write(tmp_path, "a2", record("NVIDIA H100", 2048, 1.2, 5))
    pooled = [r for r in report_rows(load_records([tmp_path])) if "seq 2048" in r["workload"]]
    assert len(pooled) == 1 and pooled[0]["records"] == 2


def test_report_errors_name_the_file(tmp_path, capsys):
    bad = tmp_path / "bad" / "ab.json"
    bad.parent.mkdir()
    bad.write_text("{not json")
    assert main(["report", str(tmp_path)]) == 1
    assert "bad/ab.json" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "nowhere")]) == 1


def test_sweep_grid_and_bad_sweeps():
    grid = sweep_grid(["batch_tokens=1024,2048", "grad_accum=1,2"])
    assert grid == [
        {"max_seq_len": 1024, "grad_accum": 1},
        {"max_seq_len": 1024, "grad_accum": 2},
        {"max_seq_len": 2048, "grad_accum": 1},
        {"max_seq_len": 2048, "grad_accum": 2},
    ]
    with pytest.raises(ValueError, match="--sweep"):
        sweep_grid(["speed=fast"])
    assert main(["ab", "--sweep", "speed=fast"]) == 2


def test_require_parity_exits_non_zero_on_a_diverged_curve(monkeypatch, tmp_path):
    diverged = record("cpu", 256, 1.0, 1, diverge=True)
    diverged["summary"]["slipstream"]["loss_vs_stock-packed"] = "diverged"
    diverged["summary"]["stock-packed"]["loss_vs_stock-packed"] = "identical"
    monkeypatch.setattr(command, "run_ab", lambda config: diverged)
    monkeypatch.setattr(command, "print_tables", lambda record: None)
    monkeypatch.setattr(command, "write_record", lambda record, out: (out / "ab.json", out / "ab.md"))
    assert main(["ab", "--out", str(tmp_path / "x")]) == 0  # reported, not fatal
    assert main(["ab", "--out", str(tmp_path / "y"), "--require-parity"]) == 3


def test_different_vocabularies_are_different_workloads(tmp_path):
    small, real = record("NVIDIA H100", 2048, 1.2, 1), record("NVIDIA H100", 2048, 1.2, 2)
    small["vocab_size"], real["vocab_size"] = 2048, 151936
    with pytest.raises(ReportError, match="vocab_size"):
        pair_records(small, real)
    write(tmp_path, "small", small)
    write(tmp_path, "real", real)
    workloads = {r["workload"] for r in report_rows(load_records([tmp_path]))}
    assert len(workloads) == 2 and any("vocab 151936" in w for w in workloads)


def test_memory_ceilings_appear_in_the_report(tmp_path, capsys):
    data = record("cpu", 4096, 1.2, 1)
    data["vocab_size"] = 151936
    data["ceiling"] = {
        arm: {"arm": arm, "budget_bytes": 8 * 10**9, "max_tokens": tokens, "capped": False, "probes": []}
        for arm, tokens in (("stock-packed", 3072), ("slipstream", 30720))
    }
    write(tmp_path, "ceiling", data)
    table = ceiling_table(load_records([tmp_path]))
    row = next(line for line in table.splitlines() if "| slipstream |" in line)
    assert "30,720 (10.0x stock-packed)" in row and "8.0 GB" in row
    assert main(["report", str(tmp_path)]) == 0
    assert "Memory ceiling" in capsys.readouterr().out


def test_a_lora_run_and_a_full_fine_tune_are_different_workloads(tmp_path):
    full, lora = record("NVIDIA H100", 2048, 1.2, 1), record("NVIDIA H100", 2048, 1.5, 2)
    full["config"]["lora_rank"], lora["config"]["lora_rank"] = 0, 8
    with pytest.raises(ReportError, match="lora_rank"):
        pair_records(full, lora)
    write(tmp_path, "full", full)
    write(tmp_path, "lora", lora)
    rows = report_rows(load_records([tmp_path]))
    assert len(rows) == 2 and all(r["records"] == 1 for r in rows)  # not pooled
    table = [line for line in cross_table(rows).splitlines() if line.startswith("| qwen3-8b")]
    assert len(table) == 2 and sum("lora_rank 8" in line for line in table) == 1


def test_the_run_options_are_config_fields():
    """A renamed run option would otherwise turn into workload and split repeats of one workload."""
    assert RUN_OPTIONS.issubset(record_config(ABConfig()))  # the record's keys


def test_report_shows_each_sides_mfu_where_the_records_have_it_and_loads_older_ones(tmp_path):
    old = record("NVIDIA H100", 2048, 1.20, 1)  # a record from before MFU: no model FLOPs, no peak
    new = record("NVIDIA H100", 4096, 1.30, 2)
    new["summary"]["stock-packed"]["mfu"] = 0.2
    new["summary"]["slipstream"]["mfu"] = 0.3
    write(tmp_path, "old", old)
    write(tmp_path, "new", new)
    rows = report_rows(load_records([tmp_path]))
    by_seq = {r["workload"].split(" · ")[2]: r for r in rows}
    assert by_seq["seq 2048"]["mfu"] is None
    assert by_seq["seq 4096"]["mfu"] == pytest.approx(0.3) and by_seq["seq 4096"][
        "base_mfu"
    ] == pytest.approx(0.2)
    table = cross_table(rows)
    line_2k, line_4k = (line for line in table.splitlines() if line.startswith("| qwen3-8b"))
    assert "MFU" not in line_2k and "; MFU 30.0% vs 20.0%" in line_4k
    # pooled with an older record of the same workload, the MFU is left out rather than half-known
    write(tmp_path, "old-4k", record("NVIDIA H100", 4096, 1.30, 3))
    pooled = [r for r in report_rows(load_records([tmp_path])) if "seq 4096" in r["workload"]]
    assert pooled[0]["records"] == 2 and pooled[0]["mfu"] is None


def test_profiled_steps_appear_in_the_report(tmp_path, capsys):
    data = record("cpu", 1024, 2.0, 1)
    shares = {
        "matmul": 0.43,
        "attention": 0.29,
        "dtype_copies": 0.02,
        "compiled": 0.09,
        "optimizer": 0.02,
        "other": 0.15,
    }
    data["summary"]["slipstream"].update(
        mfu=0.2,
        step_profile={"shares": shares, "gemm_tflops": 1.03, "gemm_fraction_of_peak": 0.49, "total_s": 1.1},
    )
    write(tmp_path, "profiled", data)
    write(tmp_path, "plain", record("cpu", 1024, 2.0, 2))
    table = step_profile_table(load_records([tmp_path]))
    (row,) = [line for line in table.splitlines() if "| slipstream |" in line]
    assert "| 20.0% | 43% | 29% | 2% | 9% | 2% | 15% | 1.03 TFLOP/s (49% of peak) | profiled |" in row
    assert main(["report", str(tmp_path)]) == 0
    assert "Where a step goes" in capsys.readouterr().out
    assert step_profile_table(load_records([tmp_path / "plain"])) == ""


def test_a_profiled_run_is_the_same_workload_as_an_unprofiled_one():
    from slipstream.bench.report import workload

    profiled = record("cpu", 1024, 2.0, 1)
    profiled["config"]["profile_step"] = True
    assert workload(profiled) == workload(record("cpu", 1024, 2.0, 1))


def test_runs_of_too_few_timed_steps_are_reported_without_an_interval(tmp_path, capsys):
    """Records of one timed step each (--steps 3 --warmup 2): one gives the ratio alone and says why,
    and so does the plot; three pooled make an interval."""
    short = record("NVIDIA H100", 2048, 1.25, 1)
    short["runs"] = {
        arm: [{**runs[0], "step_s": runs[0]["step_s"][:3]}] for arm, runs in short["runs"].items()
    }
    write(tmp_path, "a", short)
    (row,) = report_rows(load_records([tmp_path]))
    assert row["low"] is None and row["high"] is None and row["timed_steps"] == 1
    assert "(1 timed step: no interval)" in cross_table([row])
    assert main(["report", str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    assert "(1 timed step: no interval)" in (tmp_path / "report" / "report.md").read_text()
    assert (tmp_path / "report" / "report.png").exists()
    write(tmp_path, "b", short)
    write(tmp_path, "c", short)
    (pooled,) = report_rows(load_records([tmp_path]))
    assert pooled["records"] == 3 and pooled["timed_steps"] == 3 and pooled["low"] is not None
