"""The shared-prefix data sets of benchmarks/ (tool-calling chats, best-of-N): seeded, read by
slipstream's chat path under Qwen3's real template, the prefix the same where it should be."""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

from slipstream.data import tokenize_row

from .conftest import labelled_runs

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _script(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # make_best_of_n imports make_tool_chats
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tool_chats():
    return _script("make_tool_chats")


def test_tool_chats_share_system_prompt_and_tools_and_label_every_assistant_turn(tool_chats, qwen3_tokenizer):
    system = [tool_chats.system_prompt(0, v) for v in range(3)]
    rng = random.Random(7)
    rows = [tool_chats.row(rng, system, tool_chats.tools()) for _ in range(12)]
    again = random.Random(7)
    assert rows == [tool_chats.row(again, system, tool_chats.tools()) for _ in range(12)]  # seeded
    assert len(set(system)) == 3 and all(
        s.startswith(system[0][:2000]) for s in system
    )  # desks differ at the end
    assert len({str(r["messages"][1:]) for r in rows}) == 12
    assert any(any("tool_calls" in m for m in r["messages"]) for r in rows)
    for r in rows:
        sample = tokenize_row(r, qwen3_tokenizer, response_only=True)
        turns = [m for m in r["messages"] if m["role"] == "assistant"]
        runs = labelled_runs(sample)
        assert len(runs) == len(turns)
        assert all(qwen3_tokenizer.decode(run).endswith("<|im_end|>") for run in runs)
        assert "<tool_response>" not in "".join(qwen3_tokenizer.decode(run) for run in runs)
    ids = tool_chats.rendered_ids(
        qwen3_tokenizer, [r for r in rows if r["messages"][0]["content"] == system[0]]
    )
    assert tool_chats.common_prefix(ids) > 1000


def test_best_of_n_rows_of_a_prompt_differ_in_the_answer_only(qwen3_tokenizer):
    best_of_n = _script("make_best_of_n")
    rows = best_of_n.prompt_rows(random.Random(3), 4)
    assert len(rows) == 4 and len({r["messages"][-1]["content"] for r in rows}) == 4
    assert len({str(r["messages"][:-1]) for r in rows}) == 1
    samples = [tokenize_row(r, qwen3_tokenizer, response_only=True) for r in rows]
    assert all(len(labelled_runs(s)) == 1 for s in samples)
