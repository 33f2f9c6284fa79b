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
