"""Peer arms in the A/B harness: TRL's trainer step like for like, skipped peers with their reason,
the Unsloth arm in its own virtualenv (slow; only where that virtualenv exists)."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS
from slipstream.bench.command import ab_config
from slipstream.bench.peers import unsloth_arm
from slipstream.bench.render import markdown_report
from slipstream.bench.report import report_markdown, report_rows
from slipstream.bench.runner import ABConfig, parity_failures, run_ab, run_arm, summarize


def _tiny(**overrides) -> ABConfig:
    values = dict(model="qwen3", max_seq_len=256, steps=3, warmup=1, num_rows=200, threads=1, lora_rank=4)
    return ab_config(**{**values, **overrides})


def test_the_peers_preset_names_every_peer_and_slipstream():
    peers = ARM_PRESETS["peers"]
    assert {"trl", "stock-offload", "unsloth", "unsloth-same-settings", "liger", "slipstream"} <= set(peers)
    assert all(
        ARM_SPECS[arm].stock for arm in peers if ARM_SPECS[arm].peer
    )  # baselines: speedups against them


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_trl_trains_our_bins_and_its_loss_curve_matches_ours_step_for_step(tmp_path):
    config = _tiny(arms=("trl", "stock-packed", "slipstream", "stock-offload", "liger"), grad_accum=2)
    record = run_ab(config, progress=False)
    summary = record["summary"]
    # TRL's collator, fused LM head, training_step, optimizer and clipping: the same numbers as ours
    assert summary["slipstream"]["loss_vs_trl"] in ("identical", "within tolerance")
    assert summary["stock-packed"]["loss_vs_trl"] in ("identical", "within tolerance")
    assert summary["slipstream"]["loss_max_rel_diff"] < 1e-5
    assert "speedup_vs_trl" in summary["slipstream"] and "interval_vs_trl" in summary["slipstream"]
    trl_run = record["runs"]["trl"][0]
    assert any("TRL SFTTrainer" in line for line in trl_run["policies"])
    assert trl_run["host_syncs_per_step"] >= 2  # its metrics are read to the host every micro-batch
    assert summary["slipstream"]["host_syncs_per_step"] == 0
    # the same docs, model and LoRA: TRL's model counts the same model FLOPs, and gets its own MFU
    assert trl_run["model_flops"] == record["runs"]["slipstream"][0]["model_flops"]
    assert summary["trl"]["mfu"] > 0 and "mfu" not in summary["liger"]
    assert parity_failures(record) == []
    # CUDA-only peers are skipped on a CPU, with the reason in the summary, the report and the tables
    assert "CUDA" in summary["stock-offload"]["skipped"]
    assert "CUDA GPU" in summary["liger"]["skipped"]
    text = markdown_report(json.loads(json.dumps(record)))
    assert (
        "| stock-offload | skipped: transformers' activation_checkpointing_enable(offload=True) copies"
        in text
    )
    rows = report_rows([(tmp_path / "ab.json", record)])
    assert {row["arm"] for row in rows} == {"slipstream vs trl", "slipstream vs stock-packed"}
    report = report_markdown([(tmp_path / "ab.json", record)], rows)
    assert "Arms skipped" in report and "liger on" in report


def test_a_peer_whose_curve_moves_is_caught():
    """The parity check the trl comparison relies on can fail: a shifted curve is 'diverged'."""
    config = _tiny(arms=("trl", "slipstream"))

    def run(arm, loss):
        return {
            "arm": arm,
            "step_s": [1.0, 1.0, 1.0],
            "tokens": [10, 10, 10],
            "loss": loss,
            "peak_memory_mb": 1.0,
            "memory_kind": "cpu peak RSS",
            "host_syncs_per_step": 0,
            "attn_implementation": "x",
        }

    summary = summarize(
        config, {"trl": [run("trl", [3.0, 2.0, 1.0])], "slipstream": [run("slipstream", [3.0, 2.1, 1.0])]}
    )
    assert summary["slipstream"]["loss_vs_trl"] == "diverged"


def test_a_peer_run_on_its_own_bf16_default_is_judged_at_bf16_tolerance():
    config = _tiny(arms=("unsloth", "slipstream"))
    base = {"step_s": [1.0] * 3, "tokens": [10] * 3, "peak_memory_mb": 1.0, "memory_kind": "m"}
    base |= {"host_syncs_per_step": None, "attn_implementation": "sdpa"}
    runs = {
        "unsloth": [{**base, "arm": "unsloth", "loss": [3.0, 2.0, 1.0], "dtype": "bfloat16"}],
        "slipstream": [{**base, "arm": "slipstream", "loss": [3.0, 2.01, 1.0], "dtype": "float32"}],
    }
    assert summarize(config, runs)["slipstream"]["loss_vs_unsloth"] == "within tolerance"


def test_the_unsloth_arm_is_skipped_with_the_reason_when_its_venv_cannot_be_made(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_UNSLOTH_VENV", str(tmp_path / "no-venv"))
    failing = tmp_path / "make.sh"
    failing.write_text("echo 'pip: no network' >&2; exit 1\n")
    monkeypatch.setattr(unsloth_arm, "MAKE_VENV", failing)
    config = _tiny(arms=("unsloth",))
    result = run_arm(dataclasses.asdict(config), "unsloth", [], 2048)
    assert "could not create the Unsloth virtualenv" in result["skipped"]
    assert "pip: no network" in result["skipped"]
    assert "--lora-rank" in unsloth_arm.unsloth_unavailable(_tiny(lora_rank=0), "cpu")
    assert "CPU backend only" in unsloth_arm.unsloth_unavailable(config, "cuda")


@pytest.mark.slow
def test_unsloth_on_its_defaults_and_on_ours_matches_our_loss(monkeypatch):
    venv = Path(".venv-unsloth").absolute()
    if not (venv / "bin" / "python").exists() or shutil.which("bash") is None:
        pytest.skip(f"no Unsloth virtualenv at {venv} (make it: bash {unsloth_arm.MAKE_VENV})")
    monkeypatch.setenv("SLIPSTREAM_UNSLOTH_VENV", str(venv))
    record = run_ab(_tiny(arms=("slipstream", "unsloth-same-settings", "unsloth")), progress=False)
    summary = record["summary"]
    assert summary["unsloth-same-settings"]["loss_vs_slipstream"] in ("identical", "within tolerance")
    assert summary["unsloth-same-settings"]["dtype"] == "float32"
    assert summary["unsloth"]["loss_vs_slipstream"] in ("identical", "within tolerance")
    policies = " ".join(record["runs"]["unsloth"][0]["policies"])
    assert "its default settings" in policies and "gradient checkpointing on" in policies


def test_stock_offload_installs_transformers_own_offloaded_checkpointing_and_why_it_is_cuda_only():
    """The arm's set-up is transformers' own; on a CPU-only torch its pinned host copies cannot even
    be allocated, which is why the arm is skipped there (if this starts passing, revisit the skip)."""
    import torch

    from slipstream.bench.peers import prepare_base_model
    from slipstream.models import build_model
    from slipstream.packing import collate_packed

    docs = [{"input_ids": list(range(3, 3 + n)), "labels": list(range(3, 3 + n))} for n in (7, 12, 5)]
    model = build_model("qwen3", vocab_size=64, seed=0).train()
    policies = prepare_base_model("transformers-offload", model)
    assert "_checkpointing_enable(offload=True)" in policies[0]  # activation_ (5.24) or gradient_ (5.17)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    if torch.cuda.is_available():
        pytest.skip("a CUDA torch: the arm runs for real in the A/B")
    with pytest.raises(RuntimeError, match="pin_memory"):
        model(**collate_packed(docs).stock_inputs()).loss.backward()


def _shared_start_config(tmp_path, **overrides) -> ABConfig:
    from tests.bench.test_ab_shared_prefixes import chat_file

    data = chat_file(tmp_path / "chats.jsonl", rows=24, system_words=60, longest=10)
    values = dict(data=str(data), response_only=True, max_seq_len=512, grad_accum=2, share_prefixes="on")
    return _tiny(**{**values, **overrides})


def test_the_unsloth_worker_is_handed_rows_on_data_whose_rows_share_a_start(tmp_path):
    """Peers get rows, never our packing plan: the workload written for the Unsloth worker on rows that
    share a start is each step's rows whole, which its own padding collator takes as they are."""
    from slipstream.bench.peers import unsloth_worker
    from slipstream.bench.runner import prepare_bins

    config = _shared_start_config(tmp_path)
    plan, vocab, packing = prepare_bins(config)
    assert packing["sharing"]["saved_fraction"] > 0.2  # the slipstream arm would share these rows
    work = tmp_path / "work"
    work.mkdir()
    unsloth_arm._write_workload(config, plan, vocab, work)
    steps = json.loads((work / "batches.json").read_text())
    assert [len(step) for step in steps] == [sum(len(docs) for docs in step) for step in plan]
    for step in steps:
        batch = unsloth_worker.pad(step, pad_id=0)  # raised KeyError 'input_ids' on groups
        assert batch["input_ids"].shape[0] == len(step)


@pytest.mark.slow
def test_unsloth_arms_run_on_rows_that_share_a_start(monkeypatch, tmp_path):
    venv = Path(".venv-unsloth").absolute()
    if not (venv / "bin" / "python").exists() or shutil.which("bash") is None:
        pytest.skip(f"no Unsloth virtualenv at {venv} (make it: bash {unsloth_arm.MAKE_VENV})")
    monkeypatch.setenv("SLIPSTREAM_UNSLOTH_VENV", str(venv))
    config = _shared_start_config(tmp_path, arms=("slipstream", "unsloth-same-settings", "unsloth"))
    record = run_ab(config, progress=False)
    summary = record["summary"]
    for arm in ("unsloth", "unsloth-same-settings"):
        assert "skipped" not in summary[arm], summary[arm]
        assert summary[arm]["loss_vs_slipstream"] in ("identical", "within tolerance"), arm
    assert any(line.startswith("shared prefixes on") for line in record["runs"]["slipstream"][0]["policies"])
