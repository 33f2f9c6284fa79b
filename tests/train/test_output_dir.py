"""What a run may do to its output directory: --overwrite deletes only what slipstream wrote in a
directory it marked; anything else is refused with one line and left untouched."""

import json
import logging
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main
from slipstream.train.config import load_config
from slipstream.train.errors import TrainError
from slipstream.train.lock import RunLock
from slipstream.train.loop import train
from slipstream.train.output_dir import MARKER, NewOutput, is_leftover, prepare_output

from .test_train import TINY


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def config_at(tmp_path: Path, output_dir: str, *overrides: str):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({**TINY, "training": {"steps": 2}, "output_dir": output_dir}))
    return load_config(path, list(overrides))


def test_overwrite_never_deletes_a_directory_slipstream_did_not_mark(tmp_path, capsys):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "data.jsonl").write_text('{"text": "precious"}\n')
    (folder / "checkpoints").mkdir()  # even a folder with slipstream's names in it
    (folder / "run.json").write_text("{}")
    before = snapshot(folder)
    config = config_at(tmp_path, str(folder))
    with pytest.raises(
        TrainError, match=r"--overwrite refused: .*\(no \.slipstream-run\); nothing was deleted"
    ):
        train(config, overwrite=True, progress=False)
    assert snapshot(folder) == before and sorted(p.name for p in folder.iterdir()) == [
        "checkpoints",
        "data.jsonl",
        "run.json",
    ]
    assert main(["train", str(tmp_path / "config.yaml"), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"slipstream train: {folder}: --overwrite refused")
    assert snapshot(folder) == before


def test_output_dir_dot_with_files_in_it_is_refused_and_left_alone(tmp_path, monkeypatch):
    work = tmp_path / "project"
    work.mkdir()
    (work / "train.py").write_text("print('mine')\n")
    monkeypatch.chdir(work)
    config = config_at(tmp_path, ".")
    for kwargs in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(TrainError, match=r"^\.: .*not empty and slipstream did not mark it"):
            train(config, progress=False, **kwargs)
    assert sorted(p.name for p in work.iterdir()) == ["train.py"]


def test_an_empty_current_directory_is_used_and_marked(tmp_path, monkeypatch):
    work = tmp_path / "empty"
    work.mkdir()
    monkeypatch.chdir(work)
    assert prepare_output(Path("."), resume=False, overwrite=False) is False
    marker = json.loads((work / MARKER).read_text())
    assert marker["format"] == 1 and marker["created"].endswith("Z") and marker["slipstream"]


def test_output_dir_that_is_a_file_or_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    with pytest.raises(TrainError, match=r"notes\.txt: output_dir is a file, not a directory$"):
        train(config_at(tmp_path, str(tmp_path / "notes.txt")), overwrite=True, progress=False)
    with pytest.raises(TrainError, match=r"notes\.txt/run: cannot create the output directory"):
        prepare_output(tmp_path / "notes.txt" / "run", resume=False, overwrite=False)
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_overwrite_of_a_marked_run_deletes_only_what_slipstream_wrote(tmp_path, caplog):
    out = tmp_path / "out"
    config = config_at(tmp_path, str(out), "training.checkpoint_every=1", "training.tensorboard=false")
    train(config, progress=False)
    assert {p.name for p in out.iterdir()} >= {MARKER, "adapter", "checkpoints", "metrics.jsonl", "run.json"}
    (out / "notes.md").write_text("my notes on this run\n")
    (out / "adapter" / "extra.bin").write_bytes(b"x")  # inside slipstream's own folder: goes with it
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        train(config, overwrite=True, progress=False)
    assert (out / "notes.md").read_text() == "my notes on this run\n"
    assert "kept 1 entry slipstream did not write: notes.md" in caplog.text
    assert not (out / "adapter" / "extra.bin").exists()
    assert json.loads((out / "run.json").read_text())["status"] == "finished"
    assert json.loads((out / MARKER).read_text())["format"] == 1


def test_a_marked_run_needs_resume_or_overwrite_and_not_both(tmp_path):
    out = tmp_path / "out"
    prepare_output(out, resume=False, overwrite=False)
    (out / "checkpoints" / "step-000002").mkdir(parents=True)
    with pytest.raises(
        TrainError, match="holds an unfinished run: pass --resume to continue it or --overwrite"
    ):
        prepare_output(out, resume=False, overwrite=False)
    with pytest.raises(TrainError, match="--resume and --overwrite contradict each other"):
        prepare_output(out, resume=True, overwrite=True)
    assert prepare_output(out, resume=True, overwrite=False) is True
    (out / "run.json").write_text("{}")
    with pytest.raises(TrainError, match=r"already holds a finished run \(run.json\); nothing to resume"):
        prepare_output(out, resume=True, overwrite=False)
    with pytest.raises(TrainError, match=r"already holds a finished run \(run.json\); pass --overwrite"):
        prepare_output(out, resume=False, overwrite=False)
    assert (out / "checkpoints" / "step-000002").is_dir()


def test_a_marked_directory_without_progress_starts_again_without_flags(tmp_path):
    """A run that failed during set-up (bad data, say) leaves only its marker and config."""
    out = tmp_path / "out"
    prepare_output(out, resume=False, overwrite=False)
    (out / "config.json").write_text("{}")
    (out / "mine.txt").write_text("kept")
    assert prepare_output(out, resume=False, overwrite=False) is False
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "mine.txt"]


def test_leftovers_of_a_killed_run_are_removed_on_resume_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    prepare_output(out, resume=False, overwrite=False)
    checkpoints = out / "checkpoints"
    (checkpoints / ".step-000008.tmp-4242").mkdir(parents=True)
    (checkpoints / ".step-000008.tmp-4242" / "trainable.safetensors").write_bytes(b"half")
    (checkpoints / ".step-000004.old-17").mkdir()
    (checkpoints / "step-000004").mkdir()
    (out / ".adapter.tmp-99").mkdir()
    (out / ".run.tmp-99.json").write_text("{")
    (out / ".metrics.tmp-7.jsonl").write_text("")
    (out / ".hidden-notes").write_text("mine")
    (out / "step.tmp-1").write_text("mine too")
    assert prepare_output(out, resume=True, overwrite=False) is True
    assert sorted(p.name for p in out.iterdir()) == [".hidden-notes", MARKER, "checkpoints", "step.tmp-1"]
    assert [p.name for p in checkpoints.iterdir()] == ["step-000004"]
    assert is_leftover(".config.tmp-12.json") and not is_leftover(".config.json")


def test_a_run_from_before_the_marker_can_be_resumed_but_not_overwritten(tmp_path):
    out = tmp_path / "old"
    (out / "checkpoints" / "step-000004").mkdir(parents=True)
    (out / "metrics.jsonl").write_text("")
    with pytest.raises(TrainError, match="holds a run from an older slipstream.*: choose a new or empty"):
        prepare_output(out, resume=False, overwrite=False)
    with pytest.raises(TrainError, match="--overwrite refused: the directory holds a run from an older"):
        prepare_output(out, resume=False, overwrite=True)
    assert (out / "checkpoints" / "step-000004").is_dir()
    assert prepare_output(out, resume=True, overwrite=False) is True
    assert (out / MARKER).is_file()


def test_resume_in_a_new_directory_starts_at_step_zero_with_a_warning(tmp_path, caplog):
    config = config_at(tmp_path, str(tmp_path / "fresh"))
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        _, summary = train(config, resume=True, progress=False)
    assert "no checkpoint to resume from: starting at step 0" in caplog.text
    assert summary["steps"] == 2 and "resumed" not in summary


def test_a_failed_set_up_undoes_only_what_it_made(tmp_path):
    """``NewOutput``: the directories a run created go, slipstream's entries go, anything else stays."""
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    assert NewOutput.of(tmp_path / "used") is None  # it holds something: never undone
    out = tmp_path / "a" / "b" / "run"
    new = NewOutput.of(out)
    assert new.created == tmp_path / "a"
    lock = RunLock.acquire(out)
    prepare_output(out, resume=False, overwrite=False)
    new.undo(lock)
    assert not (tmp_path / "a").exists()
    new = NewOutput.of(out)
    lock = RunLock.acquire(out)
    prepare_output(out, resume=False, overwrite=False)
    (out / "notes.txt").write_text("written meanwhile")  # not slipstream's: kept, and its folders
    new.undo(lock)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
