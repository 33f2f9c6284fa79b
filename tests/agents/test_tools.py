"""``grpo.tools`` / ``grpo.environment`` in TRL's convention: loaded and checked at start (one line naming
what is wrong), called with keyword arguments; a tool that raises, hangs or returns something
unprintable answers the model with TRL's ``{'error': ...}`` text and the rollout goes on."""

from __future__ import annotations

import time

import pytest

from slipstream.agents.tools import ToolError, ToolSet


def load(tool_file, tools=(), environment=None, timeout_s=30.0):
    return ToolSet.load([f"{tool_file}:{name}" for name in tools], environment, None, timeout_s)


def test_tools_and_an_environment_load_with_their_schemas(tool_file):
    toolset = load(tool_file, ["lookup", "add", "slow_echo"], f"{tool_file}:Almanac")
    assert toolset.described == "lookup, add, slow_echo, find"
    assert toolset.rewards_itself
    names = [fn.__name__ for fn in toolset.schema_tools()]
    assert names == ["lookup", "add", "slow_echo", "find"]
    box, observation = toolset.open({"prompt": "hi", "answer": "7"})
    assert observation is None and box.environment.answer == "7"
    assert box.call("find", {"key": "velmora"}).content == "velmora: 7"
    assert box.environment.get_reward() == 1.0
    other, _ = toolset.open({"prompt": "hi"})
    assert other.environment is not box.environment and other.environment.looked_up == []  # one per rollout


def test_calls_are_by_keyword_sync_and_async(tool_file):
    box, _ = load(tool_file, ["lookup", "add", "slow_echo"]).open({})
    assert box.call("lookup", {"key": "Velmora"}).content == "a bridge town"
    result = box.call("add", {"a": 2, "b": 5})
    assert (result.content, result.failed) == ("7", False)
    assert box.call("slow_echo", {"text": "hey"}).content == "hey"


@pytest.mark.parametrize(
    "tool, arguments, text",
    [
        ("broken", {"x": 1}, "{'error': 'the almanac is closed'}"),  # TRL's: str({"error": str(e)})
        ("nowhere", {"x": 1}, "{'error': 'Tool nowhere not found.'}"),
        ("add", {"a": 1}, "{'error': \"add() missing 1 required positional argument: 'b'\"}"),
        ("odd", {"x": 1}, "{'error': 'the result cannot be printed: no text'}"),
    ],
)
def test_a_failing_call_answers_the_model_with_the_error_and_counts(tool_file, tool, arguments, text):
    box, _ = load(tool_file, ["broken", "add", "odd"]).open({})
    result = box.call(tool, arguments)
    assert result.failed and result.content == text


def test_a_hung_tool_times_out_and_the_rollout_goes_on(tool_file):
    box, _ = load(tool_file, ["hangs", "add"], timeout_s=0.2).open({})
    began = time.perf_counter()
    result = box.call("hangs", {"x": 1})
    assert result.failed and result.content == "{'error': 'timed out after 0.2 s'}"
    assert time.perf_counter() - began < 2.0
    assert box.call("add", {"a": 1, "b": 1}).content == "2"


@pytest.mark.parametrize(
    "tools, environment, message",
    [
        (["undocumented"], None, r"'grpo\.tools\[0\]' .*tools\.py:undocumented: .*docstring"),
        (["missing"], None, r"'grpo\.tools\[0\]': .*tools\.py has no 'missing'"),
        ([], "NoReset", r"'grpo\.environment': .*NoReset defines no reset\(\)"),
        (["lookup", "lookup"], None, r"two tools named lookup"),
        ([], "lookup", r"'grpo\.environment': .*lookup is not a class"),
    ],
)
def test_a_broken_tool_file_or_environment_is_one_line(tool_file, tools, environment, message):
    import re

    env = None if environment is None else f"{tool_file}:{environment}"
    with pytest.raises(ToolError) as caught:
        load(tool_file, tools, env)
    assert "\n" not in str(caught.value) and re.search(message, str(caught.value)), str(caught.value)


def test_a_missing_tool_file_is_one_line(tmp_path):
    with pytest.raises(ToolError, match=r"'grpo\.tools\[0\]': .*nowhere\.py: no such tool file"):
        ToolSet.load([f"{tmp_path}/nowhere.py:f"], None, None, 30.0)


# TRL's documented tools (docs/source/grpo_trainer.md, "Agent Training": multiply and a sync async_add)
# and a query tool shaped like its examples/scripts/grpo_agent.py one (read-only SQL timed by
# signal.alarm, rows returned as a list of tuples)
TRL_DOCUMENTED = '''
import signal
import sqlite3
from contextlib import contextmanager

DB = None


def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


@contextmanager
def timeout(seconds):
    def timeout_handler(signum, frame):
        raise TimeoutError(f"Operation timed out after {seconds} seconds")

    signal.signal(signal.SIGALRM, timeout_handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)


def query_rows(sql_command: str) -> list[tuple]:
    """
    Execute a read-only SQL command on the database.

    Args:
        sql_command: The SQL command to execute.

    Returns:
        A list of tuples containing the query results.
    """
    with timeout(5):
        conn = sqlite3.connect(f"file:{DB}?mode=ro", uri=True)
        try:
            return conn.execute(sql_command).fetchall()
        finally:
            conn.close()
'''


def test_trls_documented_tools_work_unchanged(tmp_path):
    """Sync tools run in the trainer's thread, as TRL runs them (signal.alarm works there); a list result
    reaches the template and the rewards as the list itself, anything else as its str()."""
    import sqlite3

    from transformers.utils import get_json_schema

    db = tmp_path / "genes.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE interactions (a TEXT, b TEXT)")
        conn.execute("INSERT INTO interactions VALUES ('JNKK', 'MAPK8')")
    (tmp_path / "trl_tools.py").write_text(TRL_DOCUMENTED.replace("DB = None", f"DB = {str(db)!r}"))
    toolset = load(tmp_path / "trl_tools.py", ["multiply", "async_add", "query_rows"])
    assert [get_json_schema(fn) for fn in toolset.schema_tools()] == [
        get_json_schema(fn) for fn in toolset.functions
    ]
    box, _ = toolset.open({})
    multiplied, added, rows, missing = box.call_turn(
        [
            ("multiply", {"a": 3, "b": 4}),
            ("async_add", {"a": 3, "b": 4}),
            ("query_rows", {"sql_command": "SELECT * FROM interactions WHERE a = 'JNKK'"}),
            ("query_rows", {"sql_command": "SELECT * FROM nowhere"}),
        ]
    )
    assert (multiplied.content, added.content) == ("12", "7")
    assert rows.content == [("JNKK", "MAPK8")] and not rows.failed  # the list itself, as TRL passes it
    assert missing.failed and missing.content == "{'error': 'no such table: nowhere'}"


def test_a_turns_results_follow_trls_order_and_its_async_calls_run_together(tool_file):
    """TRL answers the sync calls first (in the order called, failures where they fell), then the async
    ones, gathered concurrently."""
    box, _ = load(tool_file, ["slow_echo", "add", "nap"], timeout_s=10.0).open({})
    began = time.perf_counter()
    results = box.call_turn(
        [
            ("nap", {"seconds": 1.0}),
            ("slow_echo", {"text": "a"}),
            ("add", {"a": 1, "b": 2}),
            ("nope", {}),
            ("nap", {"seconds": 1.0}),
        ]
    )
    assert [(r.name, r.content) for r in results] == [
        ("add", "3"),
        ("nope", "{'error': 'Tool nope not found.'}"),
        ("nap", "slept"),
        ("slow_echo", "a"),
        ("nap", "slept"),
    ]
    assert time.perf_counter() - began < 1.9  # two naps of 1 s at once, not one after the other


def test_a_tool_that_swallows_the_interruption_is_timed_out_all_the_same(tool_file):
    box, _ = load(tool_file, ["stubborn"], timeout_s=0.2).open({})
    began = time.perf_counter()
    result = box.call("stubborn", {"x": 1})
    assert result.failed and result.content == "{'error': 'timed out after 0.2 s'}"
    assert time.perf_counter() - began < 2.0  # interrupted, not slept out


def test_a_hung_tool_times_out_off_the_main_thread_too(tool_file):
    import threading

    box, _ = load(tool_file, ["hangs", "add"], timeout_s=0.2).open({})
    found = []
    worker = threading.Thread(target=lambda: found.append(box.call("hangs", {"x": 1})))
    began = time.perf_counter()
    worker.start()
    worker.join()
    assert found[0].failed and found[0].content == "{'error': 'timed out after 0.2 s'}"
    assert time.perf_counter() - began < 2.0
