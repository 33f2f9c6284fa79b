"""What went wrong with which row: ``DataError`` (raised) and ``DataReport`` (kept, in skip mode).

A data problem is only useful to a user if it says where it is, so every ``DataError``
message starts with a location a text editor or ``ds[i]`` can go to:
``train.jsonl:17: invalid JSON (...)`` or ``rows.parquet: row 5: missing field 'messages'``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

BadRowPolicy = Literal["error", "skip"]
BAD_ROW_POLICIES: tuple[str, ...] = ("error", "skip")


class DataError(ValueError):
    """A problem in the data itself; ``str(error)`` is ``"<location>: <reason>"``."""

    def __init__(self, location: str, reason: str):
        super().__init__(f"{location}: {reason}")
        self.location = location
        self.reason = reason

    def __reduce__(self):  # keep it picklable (DataLoader workers) despite the two-argument constructor
        return (type(self), (self.location, self.reason))


def json_type(value: Any) -> str:
    """The JSON name of a value's type, for messages like "expected an object, got array"."""
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number" if isinstance(value, int | float) else type(value).__name__)


def check_bad_row_policy(on_bad_row: str) -> None:
    """Reject a typo in ``on_bad_row`` at once, rather than at the first bad row."""
    if on_bad_row not in BAD_ROW_POLICIES:
        raise ValueError(f"on_bad_row={on_bad_row!r}: expected one of {', '.join(BAD_ROW_POLICIES)}")


@dataclass
class DataReport:
    """Rows read and used, and every skipped row with the reason, for printing after a load."""

    rows_read: int = 0
    rows_used: int = 0
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (location, reason)
    cached: str | None = None  # the tokenized-cache entry the samples came from, if any

    def skip(self, location: str, reason: str) -> None:
        self.skipped.append((location, reason))

    def reject(self, error: DataError, on_bad_row: BadRowPolicy) -> None:
        """A bad row: raised with ``on_bad_row="error"``, else recorded as skipped."""
        if on_bad_row == "error":
            raise error
        self.skip(error.location, error.reason)

    def count_used(self, used: int, path: str | Path, rows: str = "rows") -> None:
        """Record ``used``; a load that kept no row at all raises, skip mode or not."""
        self.rows_used = used
        if not used:
            raise DataError(
                str(path), f"no usable {rows} ({self.rows_read} read, {len(self.skipped)} skipped)"
            )

    def summary(self, max_listed: int = 5) -> str:
        """One line of counts, then the first ``max_listed`` skipped rows."""
        lines = [f"rows: {self.rows_read} read, {self.rows_used} used, {len(self.skipped)} skipped"]
        if self.cached:
            lines[0] += " (tokenized samples read from the cache)"
        lines += [f"  skipped {location}: {reason}" for location, reason in self.skipped[:max_listed]]
        if len(self.skipped) > max_listed:
            lines.append(f"  ... and {len(self.skipped) - max_listed} more")
        return "\n".join(lines)

    def reasons(self) -> dict[str, int]:
        """How many rows were skipped for each reason (a row's own index left out)."""
        counts: dict[str, int] = {}
        for _, reason in self.skipped:
            key = _MESSAGE_INDEX.sub("messages[i]", reason)
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda item: -item[1]))

    def to_dict(self, max_listed: int = 20) -> dict[str, Any]:
        """For run.json: the counts, the reasons, and the first skipped rows."""
        return {
            "rows_read": self.rows_read,
            "rows_used": self.rows_used,
            "rows_skipped": len(self.skipped),
            "skip_reasons": self.reasons(),
            "skipped_first": [f"{location}: {reason}" for location, reason in self.skipped[:max_listed]],
            "from_cache": self.cached is not None,
        }


_MESSAGE_INDEX = re.compile(r"messages\[\d+\]")
