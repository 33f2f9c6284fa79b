"""slipstream doctor: every verdict right on this machine, a broken path caught, the first-use hint."""

from __future__ import annotations

import io
import json

import pytest
import torch
from rich.console import Console

import slipstream.loss.chunked_loss as chunked_loss_module
import slipstream.packing.attention.sdpa as attention_module
from slipstream.cli import main
from slipstream.compile import BREAK_EVEN_STEPS
from slipstream.doctor import first_use_hint, has_passed, run_doctor
from slipstream.doctor.decisions import compile_decision
from slipstream.doctor.marker import marker_key, write_marker
from slipstream.fused.compiled import BREAK_EVEN_STEPS as FUSED_BREAK_EVEN_STEPS
from slipstream.packing.attention import choose_backend
from slipstream.packing.calibration import attention_costs
from slipstream.train.precision import resolve_dtype


@pytest.fixture
def cache(_fresh_cache):
    """The test's fresh slipstream cache (conftest): no doctor has passed here yet."""
    return _fresh_cache


def doctor(**kwargs):
    out = io.StringIO()
    report, status = run_doctor(console=Console(file=out, width=200), **kwargs)
    return report, status, out.getvalue()


def verdicts(report) -> dict[str, str]:
    return {check["path"]: check["verdict"] for check in report["checks"]}


ALL_OK = {
    "packed attention": "ok",
    "sorted MoE routing": "ok",
    "offload-double": "ok",
    "chunked loss": "ok",
    "LoRA in compute dtype": "ok",
    "grouped attention": "ok",
    "ablation": "skipped",  # a fresh cache: no --preset ablation run on this device yet
}


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_every_path_is_ok_on_this_machine_and_the_marker_is_written(dtype, tmp_path):
    check_every_path_and_the_marker(dtype, tmp_path)


def test_every_path_is_ok_as_on_each_cpu_class(fake_cpu_class, tmp_path):
    """The probe faked to each CPU class: ``auto`` picks that class's dtype, and every path is ok in it."""
    report = check_every_path_and_the_marker("auto", tmp_path)
    assert report["model"]["dtype"] == ("float32" if fake_cpu_class == "avx2" else "bfloat16")
    if not torch.cuda.is_available():  # doctor says which class it sees (the override named)
        assert report["device"]["cpu_class"] == fake_cpu_class
        assert f"SLIPSTREAM_CPU_CLASS={fake_cpu_class}" in report["device"]["cpu_class_text"]


def check_every_path_and_the_marker(dtype: str, tmp_path) -> dict:
    report, status, text = doctor(dtype=dtype, json_path=tmp_path / "doctor.json")
    assert status == 0 and report["exit_status"] == 0
    assert verdicts(report) == ALL_OK, [c["reason"] for c in report["checks"]]
    assert json.loads((tmp_path / "doctor.json").read_text())["verdicts"] == report["verdicts"]
    for check in report["checks"]:
        if check["path"] != "ablation":  # (the ablation row reads remembered A/B verdicts: no step)
            assert check["syncs"] == 0 and check["syncs_allowed"] == 0  # packed batches promise no host sync
    packed = report["checks"][0]
    assert packed["stock_syncs"] > 0  # stock attention does sync: the counter is live
    offload = next(check for check in report["checks"] if check["path"] == "offload-double")
    assert offload["details"]["offload_copies"]["offloads"] > 0  # the schedule really ran
    if not torch.cuda.is_available():  # the decisions are the library's own
        backend, why = choose_backend("auto", torch.device("cpu"), has_sinks=False)
        assert {
            "path": "packed attention",
            "choice": f"{backend} (slipstream_docwise)",
            "why": why,
        } in report["decisions"]
        grouping = next(row for row in report["decisions"] if row["path"] == "attention grouping")
        assert grouping["choice"] == "auto" and "cost model" in grouping["why"]
        compiled = next(row for row in report["decisions"] if row["path"] == "compile (auto)")
        assert compiled["choice"].startswith(f"on from {BREAK_EVEN_STEPS['cpu']} steps")
        assert "torch.compile: inductor" in compiled["why"]
        short = next(row for row in report["decisions"] if row["path"] == "short-document kernel (auto)")
        # "auto" is bf16 where the CPU probe finds it native, else fp32, and the short kernel's reach is
        # what the calibration measured here in that dtype: the expectation from the same probe and figures
        chosen = resolve_dtype(dtype, torch.device("cpu"))[0]
        costs = attention_costs(torch.device("cpu"), chosen)  # doctor's own, cached
        assert report["attention_costs"]["source"] == costs.source
        limit = costs.short_limit(chosen)
        assert short["choice"] == (f"on up to {limit} tokens" if limit else "off")
        # the figures are shown where this machine measured them (the load probe's fake is quiet, so it
        # does; a busy calibration declines and keeps the built-in costs, which have none)
        measured = costs.figures.get("short_kernel_speedup_by_length")
        assert ("its speedup over SDPA by document length: 32 " in short["why"]) == bool(measured)
        fused = next(row for row in report["decisions"] if row["path"] == "fused kernels (auto)")
        assert fused["choice"] == f"compiled from {FUSED_BREAK_EVEN_STEPS['cpu']} steps, off below"
        assert fused["why"].startswith("Liger: cpu — Liger-Kernel's kernels are Triton, CUDA only; ")
        assert "compiled (inductor: RMSNorm x" in fused["why"] and "(Qwen3RMSNorm); SwiGLU x" in fused["why"]
    assert report["model"]["asked"] == "demo" and report["model"]["family"] == "qwen3"
    assert (
        "qwen3-moe"
        in next(check for check in report["checks"] if check["path"] == "sorted MoE routing")["model"]
    )  # the demo has no experts: said, and checked on a stand-in
    assert has_passed() and report["marker"] and report["marker"].endswith(".json")
    for title in ("Device", "Versions", "Fast paths on this device", "Checks"):
        assert title in text
    # the matmul peak MFU is measured against, in the dtype doctor checks (cached for ab and train)
    peak = report["device"]["matmul_peak"]
    assert peak["flops_per_s"] > 0 and peak["dtype"] == report["model"]["dtype"]
    assert "matmul peak" in text and "TFLOP/s" in text
    return report


def leak_across_documents(monkeypatch):
    """Packed attention that attends over the whole row: documents see each other."""
    monkeypatch.setattr(
        attention_module, "_per_document", lambda fn, batch, q, k, v, **kw: fn(q, k, v, batch=batch, **kw)
    )


def sync_in_attention(monkeypatch):
    """Packed attention that reads a value back to the host in every layer."""
    original = attention_module._per_document

    def syncing(fn, batch, query, key, value, **kw):
        bool(query.sum() > 0)
        return original(fn, batch, query, key, value, **kw)

    monkeypatch.setattr(attention_module, "_per_document", syncing)


def leak_across_groups(monkeypatch):
    """Grouped attention whose groups are not causal: a document's tokens see its later ones."""
    original = attention_module.run_grouped

    def leaking(fn, groups, query, key, value, **kw):
        return original(
            lambda q, k, v, **kw: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=q.shape[1] != k.shape[1]
            ),
            groups,
            query,
            key,
            value,
            **kw,
        )

    monkeypatch.setattr(attention_module, "run_grouped", leaking)


def loss_off_by_one_percent(monkeypatch):
    original = chunked_loss_module.linear_cross_entropy
    monkeypatch.setattr(chunked_loss_module, "linear_cross_entropy", lambda *a, **k: original(*a, **k) * 1.01)


@pytest.mark.parametrize(
    "breakage, dtype, wrong, why",
    [
        (leak_across_documents, "auto", "packed attention", "gradient"),
        (leak_across_documents, "float32", "packed attention", "loss off"),
        (sync_in_attention, "float32", "packed attention", "host syncs"),
        (loss_off_by_one_percent, "auto", "chunked loss", "loss off"),
        (leak_across_groups, "float32", "grouped attention", "loss off"),
    ],
)
def test_a_broken_path_is_WRONG_alone_and_the_exit_status_is_1(breakage, dtype, wrong, why, monkeypatch):
    breakage(monkeypatch)
    report, status, _ = doctor(dtype=dtype)
    assert status == 1
    assert verdicts(report) == {**ALL_OK, wrong: "WRONG"}, [c["reason"] for c in report["checks"]]
    assert why in next(c for c in report["checks"] if c["path"] == wrong)["reason"]
    assert report["marker"] is None and not has_passed()  # no marker: the hint keeps pointing at doctor


def test_the_cli_exit_status_is_1_when_a_path_is_wrong(monkeypatch, tmp_path, capsys):
    loss_off_by_one_percent(monkeypatch)
    assert main(["doctor", "--dtype", "float32", "--json", str(tmp_path / "d.json")]) == 1
    assert "WRONG" in capsys.readouterr().out
    assert json.loads((tmp_path / "d.json").read_text())["exit_status"] == 1


def test_a_local_config_is_checked_as_a_tiny_model_of_its_family(tmp_path, capsys):
    from transformers import MixtralConfig

    MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, vocab_size=32000
    ).save_pretrained(tmp_path / "mixtral")
    assert main(["doctor", "--model", str(tmp_path / "mixtral"), "--json", str(tmp_path / "d.json")]) == 0
    report = json.loads((tmp_path / "d.json").read_text())
    assert report["model"]["source"] == "local config" and report["model"]["family"] == "mixtral"
    assert report["model"]["checked_shape"].startswith("hidden 64, 2 layers")  # the shape checked is said
    assert verdicts(report) == ALL_OK
    assert next(check for check in report["checks"] if check["path"] == "sorted MoE routing")["model"] == str(
        tmp_path / "mixtral"
    )  # its own experts, no stand-in
    # the chunk size is decided for the real vocabulary, not the tiny one
    assert "vocab 32000" in next(d for d in report["decisions"] if d["path"] == "chunked loss")["why"]


def test_a_bad_model_is_named_and_exits_2(tmp_path, capsys):
    from transformers import ViTConfig

    (tmp_path / "empty").mkdir()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    ViTConfig().save_pretrained(tmp_path / "vit")
    cases = {
        str(tmp_path / "missing"): "not a preset",
        str(tmp_path / "empty"): "no config.json",
        str(tmp_path / "broken"): "could not be read",
        str(tmp_path / "vit"): "no causal-LM class",
    }
    for path, message in cases.items():
        assert main(["doctor", "--model", path]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"slipstream doctor: --model {path}: ") and message in err, err


@pytest.fixture
def terminal(capsys, monkeypatch):
    """stderr as a person's terminal: a TTY, no CI variable (the hint speaks only there)."""
    monkeypatch.delenv("CI", raising=False)
    _as_terminal(monkeypatch)
    return capsys


def _as_terminal(monkeypatch):
    # capsys swaps its stream in and out around each phase: patch the class it uses, not the object
    from _pytest.capture import CaptureIO

    monkeypatch.setattr(CaptureIO, "isatty", lambda self: True)


def test_the_hint_until_doctor_passes_then_never(terminal):
    capsys = terminal
    assert first_use_hint() is True
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        f"slipstream: first run on {marker_key()['device']}; check its fast paths with: slipstream doctor"
    ]
    _, status, _ = doctor()
    assert status == 0
    assert first_use_hint() is False
    assert capsys.readouterr().err == ""


def test_train_and_ab_print_the_hint_once(monkeypatch, tmp_path, terminal):
    capsys = terminal
    import slipstream.cli as cli
    import slipstream.train.loop as loop

    monkeypatch.setattr(cli, "run_grid", lambda grid, out_root: [])
    monkeypatch.setattr(loop, "train", lambda config, **kw: (None, {"steps": 0, "final_loss": 0.0}))
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  preset: demo\ntraining:\n  steps: 2\noutput_dir: {tmp_path / 'out'}\n")
    for argv in (["ab", "--out", str(tmp_path / "ab")], ["train", str(config)]):
        assert main(argv) == 0
        assert capsys.readouterr().err.count("slipstream doctor") == 1
    write_marker(marker_key(), {})  # what a passing doctor leaves
    assert main(["train", str(config)]) == 0
    assert "slipstream doctor" not in capsys.readouterr().err


def test_no_hint_for_a_script_ci_or_a_mistake(monkeypatch, tmp_path, capsys):
    """Not a terminal, or CI=true, or an invalid config / option: only the command's own output."""
    import slipstream.cli as cli
    import slipstream.train.loop as loop

    monkeypatch.setattr(cli, "run_grid", lambda grid, out_root: [])
    monkeypatch.setattr(loop, "train", lambda config, **kw: (None, {"steps": 0, "final_loss": 0.0}))
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  preset: demo\ntraining:\n  steps: 2\noutput_dir: {tmp_path / 'out'}\n")
    monkeypatch.delenv("CI", raising=False)
    assert first_use_hint() is False  # capsys' stderr is no terminal: a script or a pipe
    assert main(["train", str(config)]) == 0 and capsys.readouterr().err == ""
    _as_terminal(monkeypatch)
    assert first_use_hint() is True  # a person at a terminal
    capsys.readouterr()
    for ci in ("true", "1"):
        monkeypatch.setenv("CI", ci)
        assert first_use_hint() is False
        assert main(["train", str(config)]) == 0 and capsys.readouterr().err == ""
    monkeypatch.setenv("CI", "false")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  preset: demo\noptimizer:\n  lr: -1\ntraining:\n  steps: 2\n")
    assert main(["train", str(bad)]) == 1  # a terminal, no marker, but a mistake: its line alone
    assert capsys.readouterr().err.splitlines() == [
        f"slipstream train: {bad}:4: 'optimizer.lr' must be > 0, got -1.0"
    ]
    assert main(["ab", "--sweep", "nonsense"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "slipstream doctor" not in err, err
    assert main(["train", str(config)]) == 0
    assert capsys.readouterr().err.count("slipstream doctor") == 1  # the same terminal, a valid config


def test_an_unusable_cache_never_breaks_a_command(monkeypatch, tmp_path, terminal):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("SLIPSTREAM_CACHE", str(blocker / "cache"))  # under a file: nothing can be written
    path, problem = write_marker(marker_key(), {})
    assert path is None and problem
    assert first_use_hint() is True  # still just the hint
    monkeypatch.setattr("slipstream.doctor.marker.marker_key", lambda: 1 / 0)
    assert first_use_hint() is False  # anything failing: no hint, no error
    monkeypatch.setenv("RANK", "1")
    assert first_use_hint() is False  # under torchrun only rank 0 speaks


def test_the_pinned_memory_probe_is_bounded(monkeypatch):
    """Without a GPU here, torch's pinned allocation is faked: it fails above 256 MiB."""
    from slipstream.doctor import machine

    assert not machine.probe_pinned(cap_bytes=1 << 40).applicable or torch.cuda.is_available()
    real_empty = torch.empty
    asked = []

    def fake_empty(size, dtype=None, pin_memory=False):
        asked.append(size)
        if size > 256 << 20:
            raise RuntimeError("CUDA error: out of memory")
        return real_empty(1, dtype=dtype)

    monkeypatch.setattr(machine.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(machine.torch, "empty", fake_empty)
    failed = machine.probe_pinned(cap_bytes=1 << 40, start_bytes=64 << 20)
    assert failed.largest_bytes == 256 << 20 and failed.stopped.startswith("failed at 0.5 GiB")
    assert asked == [64 << 20, 128 << 20, 256 << 20, 512 << 20]  # doubling, one block at a time
    capped = machine.probe_pinned(cap_bytes=128 << 20, start_bytes=64 << 20)
    assert capped.largest_bytes == 128 << 20 and capped.stopped == "cap"
    assert capped.describe().startswith(">= 0.1 GiB (probe stopped at its cap")


def test_the_compile_row_says_what_auto_does_and_whether_inductor_can_run(monkeypatch):
    import slipstream.speedups.compile as compile_speedup  # where the compile row is decided

    choice, why = compile_decision(torch.device("cpu"))
    assert choice == f"on from {BREAK_EVEN_STEPS['cpu']} steps, off below" and "cold start on cpu" in why
    # CUDA has no measured break-even: auto stays off there, and says so
    monkeypatch.setattr(
        compile_speedup, "inductor_available", lambda device: (False, "Triton is not installed")
    )
    choice, why = compile_decision(torch.device("cuda"))
    assert choice == "off, whatever the run's length; compile='on' cannot run here"
    assert why.startswith("no measured break-even on cuda yet") and "Triton is not installed" in why


def _remembered_ablation(cache, beats: list[str]) -> None:
    """What a ``slipstream ab --preset ablation`` run leaves for this device (``bench.ablation``)."""
    from slipstream.bench.ablation import remember

    arms = ("slipstream-again", "slipstream-no-chunked-loss", "slipstream-no-short-kernel")
    summary = {"slipstream": {"ablation": {"noise_margin": 0.02, "beats_auto": beats, "a_a_control": True}}}
    for arm in arms:
        won = arm in beats
        summary[arm] = {
            "vs_slipstream": {
                "ratio": 1.2 if won else 0.99,
                "low": 1.1 if won else 0.96,
                "high": 1.3,
                "verdict": "x",
            },
            **(
                {"ablation_verdict": "beats auto" if won else "within noise"}
                if arm != "slipstream-again"
                else {}
            ),
        }
    record = {
        "summary": summary,
        "config": {"model": "demo", "dtype": "float32", "steps": 40},
        "created": "2026-12-01T22:00",
    }
    assert remember(record, torch.device("cpu")) is not None


def test_the_ablation_check_reads_what_ab_left_and_fails_where_an_arm_beats_auto(cache):
    _remembered_ablation(cache, beats=[])
    report, status, _ = doctor(dtype="float32")
    row = next(c for c in report["checks"] if c["path"] == "ablation")
    assert status == 0 and row["verdict"] == "ok" and "demo, float32: 2 arms, A/A noise 2.0%" in row["reason"]
    _remembered_ablation(cache, beats=["slipstream-no-chunked-loss"])  # a newer run of the same workload
    report, status, text = doctor(dtype="float32")
    row = next(c for c in report["checks"] if c["path"] == "ablation")
    assert status == 1 and row["verdict"] == "WRONG"
    assert "slipstream-no-chunked-loss 1.20x [1.10, 1.30] on demo, float32" in row["reason"]
