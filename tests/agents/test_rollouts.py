"""The agent loop as TRL's: turns and tool results in order, the results context only, a trajectory
that would outgrow its budget ending at its call, the iteration cap, malformed calls counted."""

from __future__ import annotations

import math

import pytest

from slipstream.agents.calls import ToolFormat
from slipstream.agents.rollouts import agent_rollouts
from slipstream.agents.tools import ToolSet
from slipstream.rollouts import Sampling

from .scripted import ScriptedEngine, call


def setup(
    qwen3_tokenizer,
    tool_file,
    script,
    G=3,
    max_new_tokens=200,
    cap=None,
    prompts=1,
    in_place=False,
    model=None,
):
    toolset = ToolSet.load([f"{tool_file}:lookup", f"{tool_file}:broken"], None, None, 5.0)
    tok = qwen3_tokenizer
    fmt = ToolFormat.of(tok)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Where is Velmora?"}],
        tools=toolset.schema_tools(),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    engine = ScriptedEngine(tok, script, in_place)
    boxes = [[toolset.open({})[0] for _ in range(G)] for _ in range(prompts)]
    found = agent_rollouts(
        engine,
        model,
        [list(prompt)] * prompts,
        boxes,
        fmt,
        G,
        Sampling(max_new_tokens=max_new_tokens),
        0,
        cap,
        context=32768,
    )
    return found, engine, list(prompt), fmt


def two_lookups(text: str, g: int) -> str:
    """g 0: answers at once; g 1: one lookup then the answer; g 2: two lookups (one failing), then the answer."""
    results = text.count("<tool_response>")
    if g == 0 or (g == 1 and results == 1) or (g == 2 and results == 2):
        return "Velmora is a bridge town."
    if results == 0:
        return call("lookup", key="velmora" if g == 1 else "Velmora")  # distinct turns: g is known after
    return call("broken", x=1)


@pytest.mark.parametrize("in_place", [False, True], ids=["turn-by-turn", "kept-cache"])
def test_trajectories_are_turns_and_results_in_order(qwen3_tokenizer, tool_file, in_place):
    found, engine, prompt, fmt = setup(qwen3_tokenizer, tool_file, two_lookups, in_place=in_place)
    tok = qwen3_tokenizer
    direct, once, twice = found.trajectories[0]
    assert (direct.turns, direct.calls, once.turns, once.calls, twice.turns, twice.calls) == (
        1,
        0,
        2,
        1,
        3,
        2,
    )
    assert twice.failures == 1 and once.failures == 0
    assert [m["role"] for m in twice.messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert twice.messages[1] == {"role": "tool", "name": "lookup", "content": "a bridge town"}
    assert twice.messages[3]["content"] == "{'error': 'the almanac is closed'}"
    assert twice.messages[-1] == {"role": "assistant", "content": "Velmora is a bridge town."}
    # the tokens: each turn as sampled, each result as the template renders it; only the turns are trained
    text = tok.decode(once.ids)
    assert text.count("<tool_response>") == 1 and text.endswith("Velmora is a bridge town.<|im_end|>")
    sampled = [t for t, m in zip(once.ids, once.model_mask, strict=True) if m]
    context = [t for t, m in zip(once.ids, once.model_mask, strict=True) if not m]
    assert (
        tok.decode(context)
        == "\n<|im_start|>user\n<tool_response>\na bridge town\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(sampled).startswith("<tool_call>") and once.tool_tokens == len(context)
    assert all(t.finished for t in found.trajectories[0])
    # the engine saw the first turns as one group of G, then each going trajectory alone, continued
    if in_place:  # one call: the turns went on from each row's cache
        assert [(len(p), n) for p, n, _ in engine.requests] == [(1, 3)]
    else:  # the first turns as one group of G, then each going trajectory alone, whole so far
        assert [(len(p), n) for p, n, _ in engine.requests] == [(1, 3), (2, 1), (1, 1)]
        for request in engine.requests[1][0] + engine.requests[2][0]:
            assert any(request == prompt + t.ids[: len(request) - len(prompt)] for t in (once, twice))
    assert found.iterations == 2


@pytest.mark.parametrize("in_place", [False, True], ids=["turn-by-turn", "kept-cache"])
def test_the_iteration_cap_ends_a_trajectory_at_its_call(qwen3_tokenizer, tool_file, in_place):
    found, _, _, _ = setup(
        qwen3_tokenizer,
        tool_file,
        lambda text, g: call("lookup", key="velmora"),
        G=2,
        cap=2,
        in_place=in_place,
    )
    for t in found.trajectories[0]:
        assert (t.turns, t.calls) == (3, 2) and t.messages[-1]["tool_calls"] and t.finished


@pytest.mark.parametrize("in_place", [False, True], ids=["turn-by-turn", "kept-cache"])
def test_a_result_past_the_budget_is_dropped_and_the_turn_after_it_cut(qwen3_tokenizer, tool_file, in_place):
    tok = qwen3_tokenizer
    first = len(tok(call("lookup", key="velmora"), add_special_tokens=False)["input_ids"]) + 1
    found, engine, _, _ = setup(
        qwen3_tokenizer, tool_file, two_lookups, G=3, max_new_tokens=first + 3, in_place=in_place
    )  # room for the call, not for its result
    for t in found.trajectories[0][1:]:
        assert t.calls == 1 and t.turns == 1 and len(t.ids) == first and t.messages[-1]["tool_calls"]
        assert sum(t.model_mask) == len(t.ids)  # nothing of the dropped result is in it
    assert len(engine.requests) == 1  # nothing went on
    budget = first + 40
    found, engine, _, _ = setup(
        qwen3_tokenizer,
        tool_file,
        lambda text, g: "x " * 60 + "..." if "<tool_response>" in text else call("lookup", key="velmora"),
        G=1,
        max_new_tokens=budget,
        in_place=in_place,
    )
    (t,) = found.trajectories[0]
    assert len(t.ids) == budget and not t.finished and t.turns == 2  # the second turn cut at what was left


@pytest.mark.parametrize("in_place", [False, True], ids=["turn-by-turn", "kept-cache"])
def test_a_malformed_call_ends_the_trajectory_and_is_counted(qwen3_tokenizer, tool_file, in_place):
    found, engine, _, _ = setup(
        qwen3_tokenizer,
        tool_file,
        lambda text, g: '<tool_call>\n{"name": "lookup", "arguments": {"key": }\n</tool_call>',
        G=2,
        in_place=in_place,
    )
    assert all(t.malformed == 1 and t.calls == 0 and t.turns == 1 for t in found.trajectories[0])
    assert len(engine.requests) == 1
    assert math.isclose(found.stats.completions, 2)


@pytest.mark.parametrize("in_place", [False, True], ids=["turn-by-turn", "kept-cache"])
def test_a_result_that_fills_the_budget_ends_the_trajectory_cut(qwen3_tokenizer, tool_file, in_place):
    first, _, _, _ = setup(qwen3_tokenizer, tool_file, two_lookups, G=2, in_place=in_place)
    once = first.trajectories[0][1]
    filled = once.model_mask.index(0) + once.model_mask.count(0)  # the call and its result, exactly
    found, engine, _, _ = setup(
        qwen3_tokenizer, tool_file, two_lookups, G=2, max_new_tokens=filled, in_place=in_place
    )
    t = found.trajectories[0][1]
    assert len(t.ids) == filled and t.ids == once.ids[:filled] and not t.finished
    assert [m["role"] for m in t.messages] == ["assistant", "tool"] and t.calls == 1
    assert all(n >= 1 for _, _, n in engine.requests)  # nothing asked for zero tokens


def test_a_sliding_window_model_goes_turn_by_turn(qwen3_tokenizer, tool_file):
    """The kept cache carries padding columns a sliding window would count: such a model is asked turn by
    turn even by an engine that can continue in place (a window not in use does not count)."""
    from types import SimpleNamespace

    from transformers import MistralConfig, Qwen2Config

    from slipstream.rollouts import text_config, windows_in_use

    def windowed(config) -> bool:
        return bool(windows_in_use(text_config(SimpleNamespace(config=config))))

    assert not windowed(Qwen2Config())  # use_sliding_window false
    assert windowed(Qwen2Config(use_sliding_window=True))
    model = SimpleNamespace(config=MistralConfig(sliding_window=4096))
    _, engine, _, _ = setup(qwen3_tokenizer, tool_file, two_lookups, in_place=True, model=model)
    assert [n for _, n, _ in engine.requests] == [3, 1, 1]  # the first turns, then each going one alone
