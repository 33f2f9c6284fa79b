"""One live run per output directory: a second is refused by name, a dead one's lock is taken over."""

import errno
import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from slipstream.train import lock as lock_module
from slipstream.train.errors import TrainError
from slipstream.train.lock import LOCK, RunLock
from slipstream.train.loop import train

from .test_checkpoints import tiny_config


def _dead_pid() -> int:
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(done.stdout)


def test_a_second_live_run_is_refused_by_name_and_changes_nothing(tmp_path):
    out = tmp_path / "out"
    config = tiny_config(tmp_path, out, "training.steps=2")
    train(config, progress=False)  # a finished run...
    before = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}
    holder = RunLock.acquire(
        out
    )  # ...and a live one holding the directory (another process, as flock sees it)
    try:
        record = json.loads((out / LOCK).read_text())
        host = socket.gethostname()
        message = (
            rf"{out}: another slipstream run is writing there \(pid {record['pid']} on {host}, started .+\)"
        )
        for options in ({}, {"overwrite": True}, {"resume": True}):
            with pytest.raises(TrainError, match=message):
                train(config, progress=False, **options)
    finally:
        holder.release()
    after = {p.relative_to(out): p.stat().st_mtime_ns for p in out.rglob("*")}
    assert after == before and LOCK not in {p.name for p in out.iterdir()}
    train(config, progress=False, overwrite=True)  # free again


def test_a_dead_runs_lock_is_taken_over_with_a_warning(tmp_path, caplog):
    out = tmp_path / "out"
    out.mkdir()
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "started": "2026-11-30T10:00:00+0000"}
    (out / LOCK).write_text(json.dumps(stale))  # what a SIGKILLed run leaves (its flock died with it)
    with caplog.at_level(logging.WARNING, logger="slipstream"):
        train(tiny_config(tmp_path, out, "training.steps=2"), progress=False)
    assert f"took over the lock of a run that is no longer running (pid {stale['pid']} on " in caplog.text
    assert not (out / LOCK).exists()


def test_the_lock_is_let_go_however_the_run_ends(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(TrainError, match="nope"):  # fails in set-up, after the lock is taken
        train(tiny_config(tmp_path, out, "training.steps=2", "lora.target_modules=[nope]"), progress=False)
    assert not (out / LOCK).exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "mine.txt").write_text("not slipstream's")  # refused by prepare_output: the lock still goes
    with pytest.raises(TrainError, match="not empty and slipstream did not mark it"):
        train(tiny_config(tmp_path, theirs, "training.steps=2"), progress=False)
    assert sorted(p.name for p in theirs.iterdir()) == ["mine.txt"]


def test_without_flock_the_recorded_pid_decides(tmp_path, monkeypatch):
    """Where the file system has no flock (some network mounts): a pid alive here refuses, a dead one
    is taken over, another host's cannot be checked and is refused with how to clear it."""

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_flock)
    out = tmp_path / "out"
    out.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cases = {
            sleeper.pid: (socket.gethostname(), "another slipstream run is writing there"),
            4242: (
                "gpu-node-7",
                f"that host cannot be checked from here\\): if it is not running, delete {out / LOCK}",
            ),
        }
        for pid, (host, message) in cases.items():
            (out / LOCK).write_text(json.dumps({"pid": pid, "host": host, "started": "then"}))
            with pytest.raises(TrainError, match=message):
                RunLock.acquire(out)
            assert json.loads((out / LOCK).read_text())["pid"] == pid  # not taken
    finally:
        sleeper.kill()
        sleeper.wait()
    (out / LOCK).write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "then"}))
    taken = RunLock.acquire(out)
    assert json.loads((out / LOCK).read_text())["pid"] == os.getpid()
    taken.release()
    assert not (out / LOCK).exists()
