"""One live run per output directory: ``.slipstream-run.lock``, held from set-up to the last write.

Two runs writing one directory would both prune checkpoints and both append to
``metrics.jsonl``. A run takes the lock before it looks at or changes anything in its output
directory (``prepare_output``) and lets go when it ends, however it ends:

- the lock is an exclusive ``flock`` on the file, which the kernel drops when the holder dies,
  so a live holder is told from a dead one without guessing; the file holds the holder's pid,
  host and start time (JSON) so that the refusal can name it;
- a second live run is refused with one line naming that pid, host and start time;
- a file left by a process that died (SIGKILL, a power cut) is taken over with a warning that
  names it;
- where the file system has no ``flock`` (some network mounts), a record whose pid is gone on
  this host is stale; a record from another host cannot be checked and is refused, saying how
  to remove it.

It is a file of its own, not a field of the ``.slipstream-run`` marker: taking a lock must be
one atomic step, and the marker is rewritten by rename (a new file each time).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from .errors import TrainError

logger = logging.getLogger("slipstream")

LOCK = ".slipstream-run.lock"


def _record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _describe(record: dict) -> str:
    return f"pid {record.get('pid', '?')} on {record.get('host', '?')}, started {record.get('started', '?')}"


def _read(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    raw = b""
    while chunk := os.read(fd, 65536):
        raw += chunk
    try:
        record = json.loads(raw.decode()) if raw.strip() else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {"pid": "?", "host": "?", "started": "? (unreadable lock file)"}
    return record if isinstance(record, dict) else None


def _alive_here(record: dict) -> bool | None:
    """Whether the recorded process still runs: None when it cannot be told (another host)."""
    if record.get("host") != socket.gethostname():
        return None
    try:
        os.kill(int(record["pid"]), 0)
    except (KeyError, TypeError, ValueError):
        return None
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


class RunLock:
    """The output directory's lock, held by this process (see the module docstring)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        """Take ``out``'s lock (creating ``out``), or raise ``TrainError`` naming the live holder."""
        out = Path(out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise TrainError(f"{out}: output_dir is a file, not a directory") from None
        except OSError as error:
            raise TrainError(
                f"{out}: cannot create the output directory ({error.strerror or error})"
            ) from None
        path = out / LOCK
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as error:
                raise TrainError(f"{path}: cannot open the run lock ({error.strerror or error})") from None
            try:
                flocked = cls._flock(fd, path, out)
                # The holder before us may have removed the file between our open and our lock:
                # then we hold a lock on a file nobody else can see. Start again on the new one.
                if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)
        try:
            previous = _read(fd)
            if previous:  # a record, and yet we hold the lock (or no flock can tell): is it stale?
                if not flocked:
                    alive = _alive_here(previous)
                    if alive is None or alive:
                        raise TrainError(cls._refusal(out, previous, checked=alive is not None))
                logger.warning(
                    "%s: took over the lock of a run that is no longer running (%s)", out, _describe(previous)
                )
            os.ftruncate(fd, 0)
            os.lseek(fd, 0, os.SEEK_SET)
            os.write(fd, (json.dumps(_record()) + "\n").encode())
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    @staticmethod
    def _flock(fd: int, path: Path, out: Path) -> bool:
        """True if the kernel lock is ours; False where the file system has none; raises if held."""
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            raise TrainError(RunLock._refusal(out, _read(fd) or {}, checked=True)) from None
        except OSError as error:
            if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                return False
            raise TrainError(f"{path}: cannot lock it ({error.strerror or error})") from None

    @staticmethod
    def _refusal(out: Path, holder: dict, *, checked: bool) -> str:
        if checked:
            return (
                f"{out}: another slipstream run is writing there ({_describe(holder)}): wait for it to end, "
                "or choose another output_dir"
            )
        return (
            f"{out}: another slipstream run may be writing there ({_describe(holder)}; that host cannot be "
            f"checked from here): if it is not running, delete {out / LOCK}"
        )

    def release(self) -> None:
        """Let go: remove the file (while still holding it), then close. Safe to call twice."""
        if self._fd < 0:
            return
        with contextlib.suppress(OSError):
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                os.unlink(self.path)
        os.close(self._fd)
        self._fd = -1
