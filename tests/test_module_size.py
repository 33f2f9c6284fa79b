"""No module of ``src/slipstream`` over 600 lines: past that a file holds more than one job."""

from __future__ import annotations

from pathlib import Path

import slipstream

LIMIT = 600
PACKAGE = Path(slipstream.__file__).resolve().parent


def test_no_module_is_over_600_lines():
    lines = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert len(lines) > 50  # the walk found the package
    over = sorted(f"{path.relative_to(PACKAGE)}: {n}" for path, n in lines.items() if n > LIMIT)
    assert over == [], f"split by job: {over}"
