"""Resume checks what it resumes: fingerprints, damaged checkpoints, pruning, Ctrl-C, unrecorded ends.

The runs are in-process and tiny (TINY from test_train: 12 steps, a checkpoint every 4); one
uninterrupted reference run and one run stopped by Ctrl-C after step 10 are shared by the
module and copied by each test that resumes them.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from slipstream.cli import main
from slipstream.data import demo_tokenizer
from slipstream.data.samples import tokenizer_parts
from slipstream.train.checkpoints import (
    STATE,
    TRAINER_STATE,
    WEIGHTS,
    newest_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from slipstream.train.config import load_config
from slipstream.train.errors import TrainError, TrainInterrupted
from slipstream.train.fingerprint import compare
from slipstream.train.loop import train

from ..ports import free_port
from .fault_runner import faulty_train, interrupt_after, signal_after
from .test_train import TINY, losses

FAULT_RUNNER = Path(__file__).with_name("fault_runner.py")


def tiny_config(folder: Path, out: Path, *overrides: str, data: dict | None = None):
    path = folder / f"config-{out.name}.yaml"
    path.write_text(yaml.safe_dump({**TINY, **(data or {}), "output_dir": str(out)}))
    return load_config(path, list(overrides))


def adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def steps_of(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its losses and its adapter."""
    folder = tmp_path_factory.mktemp("reference")
    train(tiny_config(folder, folder / "out"), progress=False)
    return losses(folder / "out"), adapter(folder / "out")


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run stopped by Ctrl-C after step 10 (checkpoints at 4, 8 and 10), never to be changed."""
    folder = tmp_path_factory.mktemp("stopped")
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
    with pytest.raises(TrainInterrupted) as caught:
        train(tiny_config(folder, folder / "out"), progress=False, after_step=interrupt_after(10))
    # the handlers put back are the ones found (SIG_IGN under `nohup ... &`, Python's default otherwise)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    return folder / "out", str(caught.value)


@pytest.fixture
def run_copy(stopped, tmp_path):
    """A private copy of the stopped run (its output_dir is not fingerprinted: the copy resumes)."""
    out = tmp_path / "out"
    shutil.copytree(stopped[0], out)
    return out


def test_ctrl_c_saves_the_last_step_and_resume_reproduces_the_run(stopped, run_copy, reference):
    out, message = stopped
    assert "SIGINT: stopped after step 10 of 12; checkpoint" in message and "step-000010" in message
    assert message.endswith("run the same command with --resume to continue") and "\n" not in message
    assert steps_of(out) == ["step-000004", "step-000008", "step-000010"]
    assert not (out / "run.json").exists() and not (out / "adapter").exists()
    _, summary = train(tiny_config(run_copy.parent, run_copy), resume=True, progress=False)
    reference_losses, reference_adapter = reference
    assert losses(run_copy) == reference_losses  # bit for bit, before and after the stop
    assert summary["resumed"]["step"] == 10 and summary["final_loss"] == reference_losses[-1]
    resumed = adapter(run_copy)
    assert resumed.keys() == reference_adapter.keys()
    assert all(torch.equal(resumed[k], reference_adapter[k]) for k in resumed)


def test_ctrl_c_from_the_cli_is_one_line_and_a_non_zero_exit(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**TINY, "training": {"steps": 4}, "output_dir": str(tmp_path / "o")}))
    with faulty_train(interrupt_after(2)):
        assert main(["train", str(config)]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("slipstream train: SIGINT: stopped after step 2 of 4; checkpoint ")
    assert last.endswith("--resume to continue")
    assert steps_of(tmp_path / "o") == ["step-000002"]  # though checkpoint_every does not ask for it
    assert main(["train", str(config), "--resume"]) == 0
    assert "finished 4 steps, final loss" in capsys.readouterr().out


def test_sigterm_stops_the_same_way(tmp_path):
    """What torchrun forwards to its workers, and schedulers send before preempting a job."""
    with pytest.raises(
        TrainInterrupted, match=r"^SIGTERM: stopped after step 3 of 12; checkpoint .*step-000003"
    ):
        train(
            tiny_config(tmp_path, tmp_path / "o"), progress=False, after_step=signal_after(3, signal.SIGTERM)
        )
    assert read_checkpoint(tmp_path / "o" / "checkpoints" / "step-000003").loss is not None
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path):
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default handler here")
    twice = signal_after(6, signal.SIGINT, signal.SIGINT)
    with pytest.raises(TrainInterrupted, match=r"stopped at once .* --resume continues from .*step-000004$"):
        train(tiny_config(tmp_path, tmp_path / "o"), progress=False, after_step=twice)
    assert steps_of(tmp_path / "o") == ["step-000004"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_run_stopped_after_its_last_step_completes_on_resume(tmp_path, capsys, reference):
    """Killed after the last checkpoint but before run.json: --resume writes the adapter and run.json."""
    config = tiny_config(tmp_path, tmp_path / "o")
    with pytest.raises(TrainInterrupted, match="after step 12 of 12"):
        train(config, progress=False, after_step=interrupt_after(12))
    assert not (tmp_path / "o" / "run.json").exists()
    assert main(["train", str(tmp_path / "config-o.yaml"), "--resume"]) == 0
    assert f"finished 12 steps, final loss {reference[0][-1]:.4f}" in capsys.readouterr().out
    run = json.loads((tmp_path / "o" / "run.json").read_text())
    assert run["status"] == "finished" and run["final_loss"] == reference[0][-1]
    assert (tmp_path / "o" / "adapter" / "adapter_model.safetensors").exists()
    assert losses(tmp_path / "o") == reference[0]

    # the same, from a checkpoint an older slipstream wrote (no loss, no fingerprint): --force
    (tmp_path / "o" / "run.json").unlink()
    state = tmp_path / "o" / "checkpoints" / "step-000012" / STATE
    state.write_text(json.dumps({"step": 12}))
    with pytest.raises(TrainError, match="no fingerprint: an older slipstream wrote it.*pass --force"):
        train(config, resume=True, progress=False)
    _, summary = train(config, resume=True, force=True, progress=False)
    assert summary["final_loss"] == reference[0][-1]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lora.rank=8", "config changed: lora.rank 4 -> 8"),
        (
            "lora.target_modules=[q_proj, v_proj]",
            'lora.target_modules ["q_proj", "v_proj", "gate_proj"] -> ["q_proj", "v_proj"]',
        ),
    ],
)
def test_a_different_adapter_shape_is_refused_even_with_force(run_copy, override, message):
    config = tiny_config(run_copy.parent, run_copy, override)
    for force in (False, True):
        with pytest.raises(TrainError) as caught:
            train(config, resume=True, force=force, progress=False)
        text = str(caught.value)
        assert text.startswith(f"cannot resume from {run_copy / 'checkpoints' / 'step-000010'}: ")
        assert message in text and "not even with --force" in text and "\n" not in text
    assert steps_of(run_copy) == ["step-000004", "step-000008", "step-000010"]


def test_a_changed_config_is_refused_naming_the_key_and_force_accepts_it(run_copy, caplog):
    config = tiny_config(run_copy.parent, run_copy, "optimizer.lr=0.02", "training.steps=14")
    with pytest.raises(TrainError) as caught:
        train(config, resume=True, progress=False)
    assert str(caught.value).endswith(
        "config changed: optimizer.lr 0.01 -> 0.02, training.steps 12 -> 14: pass --force to resume anyway"
    )
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        _, summary = train(config, resume=True, force=True, progress=False)
    assert "resuming anyway (--force): config changed: optimizer.lr 0.01 -> 0.02" in caplog.text
    assert summary["resumed"]["forced"] == [
        "config changed: optimizer.lr 0.01 -> 0.02, training.steps 12 -> 14"
    ]
    assert len(losses(run_copy)) == 14
    assert json.loads((run_copy / "run.json").read_text())["resumed"]["step"] == 10


def test_settings_that_do_not_change_the_result_may_change_on_resume(run_copy, reference):
    config = tiny_config(
        run_copy.parent,
        run_copy,
        "training.checkpoint_every=1",
        "training.keep_checkpoints=2",
        "training.log_every=1",
        "speedups.chunked_loss=false",
    )
    train(config, resume=True, progress=False)
    assert steps_of(run_copy) == ["step-000011", "step-000012"]
    assert max(abs(a - b) for a, b in zip(losses(run_copy), reference[0], strict=True)) <= 1e-5


def test_a_changed_data_file_is_refused_unless_forced_and_a_moved_one_resumes(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"text": f"row {i} " + "word " * (5 + i)}) + "\n" for i in range(24)))
    data = {"data": {"path": str(rows), "max_seq_len": 64}, "training": {"steps": 4, "checkpoint_every": 2}}
    config = tiny_config(tmp_path, tmp_path / "o", data=data)
    with pytest.raises(TrainInterrupted):
        train(config, progress=False, after_step=interrupt_after(2))
    moved = tmp_path / "moved" / "rows.jsonl"
    moved.parent.mkdir()
    shutil.copy(rows, moved)
    with rows.open("a") as stream:
        stream.write(json.dumps({"text": "one more row"}) + "\n")
    with pytest.raises(TrainError) as caught:
        train(config, resume=True, progress=False)
    text = str(caught.value)
    assert f"data file changed since the checkpoint ({rows}: sha256 " in text
    assert text.endswith("pass --force to resume anyway") and "config changed" not in text
    # the same bytes elsewhere are the same data: data.path itself is not fingerprinted
    at_moved = tiny_config(
        tmp_path, tmp_path / "o", data={**data, "data": {**data["data"], "path": str(moved)}}
    )
    shutil.copytree(tmp_path / "o", tmp_path / "o-copy")
    at_moved.output_dir = str(tmp_path / "o-copy")
    _, summary = train(at_moved, resume=True, progress=False)
    assert summary["resumed"]["forced"] == []
    _, summary = train(config, resume=True, force=True, progress=False)
    assert summary["resumed"]["forced"][0].startswith("data file changed since the checkpoint")


def test_a_changed_tokenizer_is_named(tmp_path):
    tokenizer = demo_tokenizer()
    before = {"config": {}, "data": {"sha256": "x"}, "tokenizer": tokenizer_parts(tokenizer)}
    tokenizer.chat_template = "{{ messages }}"
    after = {"config": {}, "data": {"sha256": "x"}, "tokenizer": tokenizer_parts(tokenizer)}
    (change,) = compare(before, after)
    assert change.what == "tokenizer changed since the checkpoint (chat template)" and not change.structural
    assert compare(before, before) == []


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda c: (c / WEIGHTS).unlink(), f"{WEIGHTS} is missing"),
        (lambda c: (c / WEIGHTS).write_bytes((c / WEIGHTS).read_bytes()[:100]), f"{WEIGHTS} is unreadable"),
        (lambda c: (c / TRAINER_STATE).write_bytes(b"\x80\x02garbage"), f"{TRAINER_STATE} is unreadable"),
        (lambda c: (c / STATE).write_text('{"step": 10, "lo'), f"{STATE} is unreadable"),
    ],
    ids=["no-weights", "truncated-weights", "garbled-trainer-state", "torn-state-json"],
)
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    run_copy, reference, caplog, damage, reason
):
    damage(run_copy / "checkpoints" / "step-000010")
    (run_copy / "checkpoints" / ".step-000012.tmp-4242").mkdir()  # a write a kill caught halfway
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        _, summary = train(tiny_config(run_copy.parent, run_copy), resume=True, progress=False)
    assert f"step-000010 is damaged: {reason}" in caplog.text and "falling back" in caplog.text
    assert summary["resumed"]["step"] == 8 and summary["resumed"]["skipped_damaged"][0].startswith(
        f"step-000010: {reason}"
    )
    assert losses(run_copy) == reference[0]  # steps 9-12 again, from step 8: the same run
    assert not (run_copy / "checkpoints" / ".step-000012.tmp-4242").exists()


def test_no_usable_checkpoint_is_said_plainly(run_copy):
    for name in ("step-000004", "step-000008", "step-000010"):
        (run_copy / "checkpoints" / name / TRAINER_STATE).write_bytes(b"")
    with pytest.raises(TrainError) as caught:
        train(tiny_config(run_copy.parent, run_copy), resume=True, progress=False)
    text = str(caught.value)
    assert text.startswith(f"{run_copy / 'checkpoints'}: no usable checkpoint to resume from (step-000010: ")
    assert "step-000004: trainer_state.pt is empty" in text and text.endswith(
        "pass --overwrite to start over"
    )


def test_keep_checkpoints_keeps_the_newest_n(tmp_path):
    config = tiny_config(
        tmp_path, tmp_path / "o", "training.checkpoint_every=2", "training.keep_checkpoints=2"
    )
    train(config, progress=False)
    assert steps_of(tmp_path / "o") == ["step-000010", "step-000012"]
    assert read_checkpoint(tmp_path / "o" / "checkpoints" / "step-000012").step == 12


def test_a_failed_checkpoint_write_leaves_nothing_behind(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    assert save_checkpoint(tmp_path, 1, model, optimizer, scheduler).name == "step-000001"

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        TrainError, match=r"step-000002: cannot write the checkpoint \(No space left on device\)$"
    ):
        save_checkpoint(tmp_path, 2, model, optimizer, scheduler)
    with pytest.raises(TrainError, match=r"step-000001: cannot write"):  # replacing one: the old one stays
        save_checkpoint(tmp_path, 1, model, optimizer, scheduler)
    assert steps_of(tmp_path) == ["step-000001"]
    assert read_checkpoint(tmp_path / "checkpoints" / "step-000001").step == 1


def test_pruning_rules(tmp_path):
    root = tmp_path / "checkpoints"

    def make(step, complete=True):
        folder = root / f"step-{step:06d}"
        folder.mkdir(parents=True)
        if complete:
            (folder / STATE).write_text(json.dumps({"step": step}))

    for step in (2, 4, 6, 8):
        make(step)
    make(1, complete=False)  # older than every kept one: goes
    make(7, complete=False)  # between kept ones: stays (resume warns about it)
    make(12)  # past the step just saved (a run that fell back): untouched
    assert prune_checkpoints(tmp_path, 0, 8) == []  # 0 keeps all
    removed = prune_checkpoints(tmp_path, 2, 8)
    assert sorted(p.name for p in removed) == ["step-000001", "step-000002", "step-000004"]
    assert sorted(p.name for p in root.iterdir()) == [
        "step-000006",
        "step-000007",
        "step-000008",
        "step-000012",
    ]
    prune_checkpoints(tmp_path, 1, 8)
    assert sorted(p.name for p in root.iterdir()) == ["step-000008", "step-000012"]
    assert newest_checkpoint(tmp_path).name == "step-000012"
    with pytest.raises(ValueError, match="at least 0"):
        prune_checkpoints(tmp_path, -1, 8)


@pytest.mark.multiprocess
def test_ctrl_c_on_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    """Rank 1 alone is interrupted: the ranks agree, rank 0 writes the checkpoint, both exit non-zero."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**TINY, "training": {"steps": 4}, "output_dir": str(tmp_path / "o")}))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            free_port(),
            str(FAULT_RUNNER),
            "--interrupt-after",
            "2",
            "--rank",
            "1",
            "train",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode != 0
    assert "a stop request on another rank: stopped after step 2 of 4" in done.stderr
    assert "SIGINT: stopped after step 2 of 4" in done.stderr
    assert steps_of(tmp_path / "o") == ["step-000002"]
    state = json.loads((tmp_path / "o" / "checkpoints" / "step-000002" / STATE).read_text())
    assert state["fingerprint"]["config"]["torchrun world size"] == 2
    with pytest.raises(TrainError, match=r"config changed: torchrun world size 2 -> 1: pass --force"):
        train(load_config(config), resume=True, progress=False)
