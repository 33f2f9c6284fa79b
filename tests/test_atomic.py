"""Atomic writes: the destination holds the old thing or the new one, never half; failures leave nothing."""

import pytest

from slipstream.atomic import atomic_directory, atomic_file, discard_directory, write_text_atomically
from slipstream.train.output_dir import is_leftover


def test_a_directory_appears_whole_and_replaces_the_old_one(tmp_path):
    target = tmp_path / "deep" / "adapter"
    with atomic_directory(target) as tmp:
        assert tmp.is_dir() and tmp.parent == target.parent and is_leftover(tmp.name)
        (tmp / "a").write_text("1")
        assert not target.exists()
    assert (target / "a").read_text() == "1" and not tmp.exists()
    with atomic_directory(target) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in target.iterdir()) == ["b"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["adapter"]  # nothing set aside stays


def test_a_failed_directory_write_leaves_the_old_one_and_nothing_else(tmp_path):
    target = tmp_path / "cache"
    with atomic_directory(target) as tmp:
        (tmp / "old").write_text("kept")
    with pytest.raises(RuntimeError), atomic_directory(target) as tmp:
        (tmp / "new").write_text("half")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]
    assert sorted(p.name for p in target.iterdir()) == ["old"]


def test_keep_and_refuse_when_the_directory_appeared_meanwhile(tmp_path):
    target = tmp_path / "entry"
    with atomic_directory(target, existing="keep") as tmp:
        (tmp / "mine").write_text("")
        target.mkdir()
        (target / "theirs").write_text("")  # another writer landed first
    assert sorted(p.name for p in target.iterdir()) == ["theirs"]
    with (
        pytest.raises(FileExistsError, match="not overwriting it"),
        atomic_directory(target, existing="refuse") as tmp,
    ):
        (tmp / "mine").write_text("")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


def test_files_are_written_whole_and_a_failure_leaves_the_old_one(tmp_path):
    path = tmp_path / "sub" / "run.json"
    write_text_atomically(path, "{}")
    with pytest.raises(RuntimeError), atomic_file(path) as tmp:
        assert is_leftover(tmp.name) and tmp.suffix == ".json"
        tmp.write_text("{half")
        raise RuntimeError("killed")
    assert path.read_text() == "{}" and sorted(p.name for p in path.parent.iterdir()) == ["run.json"]


def test_discard_directory(tmp_path):
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "state.json").write_text("{}")
    discard_directory(tmp_path / "step-000004")
    assert list(tmp_path.iterdir()) == []
