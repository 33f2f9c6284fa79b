"""GRPO with tools (``grpo.tools`` / ``grpo.environment``): the update trains each trajectory's own turns
and none of its tool results, equal to each trajectory run alone with those tokens masked (fp32); and
``slipstream train`` end to end on Qwen3's real template with a scripted engine: TRL's reward convention
(messages, ``environments``, ``get_reward``), the tool records, whole trajectories in samples.jsonl."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import yaml

from slipstream.objectives import grpo as grpo_module
from slipstream.objectives import grpo_engines
from slipstream.objectives.grpo import GRPO, GRPOSettings
from slipstream.objectives.grpo_rollouts import advantages_of
from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import train

from ..agents.conftest import TOOLS
from ..agents.scripted import ScriptedEngine, call
from ..packing.test_completions import random_completion_groups, stock_token_logprobs
from ..packing.test_groups import grads_of, rel
from .test_grpo import lora_models


def test_tool_results_are_context_the_update_never_trains():
    stock, packed = lora_models(init_zero=False)
    settings = GRPOSettings(loss="dapo", rewards=["answer_tag"], max_new_tokens=16, temperature=1.0)
    objective = GRPO(SimpleNamespace(grpo=settings, seed=0), settings)
    groups = random_completion_groups([(6, [9, 4, 7, 5]), (4, [3, 8, 6, 2])])
    generator = torch.Generator().manual_seed(3)
    for group in groups:  # a run of tool-result tokens inside some trajectories (never the first token)
        masks = []
        for ids in group["completions"]:
            mask = [1] * len(ids)
            if len(ids) > 4 and torch.rand((), generator=generator) < 0.8:
                start = int(torch.randint(1, len(ids) - 2, (), generator=generator))
                mask[start : start + 2] = [0, 0]
            masks.append(mask)
        group["model_masks"] = masks
        group["finished"] = [True] * len(masks)
    assert any(0 in m for g in groups for m in g["model_masks"])
    advantages = advantages_of([1.0, 0.0, 0.5, 0.2, 0.0, 0.3, 1.0, 0.4], 4, "group")
    counted = objective.counted_tokens(groups)
    assert counted == [sum(m) for g in groups for m in g["model_masks"]]
    (micro,) = objective.pack_update(groups, [2], advantages, counted, float(sum(counted)), "cpu")
    flat = torch.tensor([m for g in groups for mask in g["model_masks"] for m in mask], dtype=torch.float32)
    assert torch.equal(micro.mask, flat)
    objective.chunked = True
    loss, _ = objective.micro_batch(packed, micro, float(sum(counted)))
    loss.backward()
    # the reference: each prompt + trajectory alone through the stock model, the tool tokens' terms dropped
    logp = stock_token_logprobs(stock, groups, 1.0)
    adv = torch.tensor(
        [
            a
            for a, n in zip(advantages, [len(c) for g in groups for c in g["completions"]], strict=True)
            for _ in range(n)
        ]
    )
    ratio = torch.exp(logp - logp.detach())
    theirs = -(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * flat).sum() / flat.sum()
    theirs.backward()
    assert abs(loss.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item()))
    found, expected = grads_of(packed), grads_of(stock)
    assert max(rel(found[name], expected[name]) for name in expected) <= 1e-4


# ----------------------------------------------------------------------------- slipstream train

REWARDS = '''
def says_bridge(completions, **kwargs):
    """TRL's convention: each completion is the trajectory's list of messages."""
    return [1.0 if "bridge" in c[-1]["content"] else 0.0 for c in completions]


def saw_environments(completions, environments, **kwargs):
    return [float(len(e.looked_up)) for e in environments]
'''


def script(text: str, g: int) -> str:
    """g even: looks Velmora up, then answers with what it read; g odd: answers at once (wrongly)."""
    if g % 2:
        return "It is a harbour."
    if "<tool_response>" not in text:
        return call("find", key="velmora")
    return "Velmora is a bridge town."


def agent_config(folder, model_dir, **grpo):
    (folder / "tools.py").write_text(TOOLS)
    (folder / "rewards.py").write_text(REWARDS)
    rows = [
        {"prompt": [{"role": "user", "content": f"Where is Velmora? ({i})"}], "answer": "bridge"}
        for i in range(8)
    ]
    (folder / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"path": "prompts.jsonl", "max_seq_len": 512, "eval_fraction": 0.25},
        "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "optimizer": {"lr": 1e-2, "schedule": "constant"},
        "training": {"objective": "grpo", "steps": 2, "eval_every": 2},
        "grpo": {
            "num_generations": 4,
            "prompts_per_batch": 2,
            "max_new_tokens": 96,
            "rewards": ["rewards.py:says_bridge", "rewards.py:saw_environments"],
            "environment": "tools.py:Almanac",
            "tools": ["tools.py:lookup"],
            "eval_generations": 2,
            "eval_samples": 2,
            **grpo,
        },
        "seed": 0,
        "output_dir": str(folder / "out"),
    }
    (folder / "grpo.yaml").write_text(yaml.safe_dump(data))
    return folder / "grpo.yaml"


@pytest.fixture(params=[False, True], ids=["turn-by-turn", "kept-cache"])
def scripted(request, monkeypatch, qwen3_tokenizer):
    engine = ScriptedEngine(qwen3_tokenizer, script, in_place=request.param)
    monkeypatch.setattr(grpo_engines, "CachedSampler", lambda *args, **kwargs: engine)
    return engine


def test_a_grpo_run_with_tools_trains_on_trajectories_in_trls_convention(
    tmp_path, qwen3_model_dir, scripted, capsys
):
    train(load_config(agent_config(tmp_path, qwen3_model_dir)), progress=False)
    out = tmp_path / "out"
    found = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in found if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["tool_calls_per_trajectory"] == 0.5 and record["tool_calling_share"] == 0.5
        assert record["tool_failure_rate"] == 0.0 and record["malformed_call_share"] == 0.0
        assert record["turns_per_trajectory"] == 1.5 and 0 < record["tool_token_share"] < 1
        assert record["reward_says_bridge"] == 0.5  # the looked-up answer
        assert record["reward_saw_environments"] == 0.5  # environments: the rollouts' own instances
        assert record["reward_Almanac"] == 0.5  # get_reward, one more reward as TRL adds it
        assert record["reward"] == 1.5
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    looked = [s for s in samples if s["tool_calls"]]
    assert looked and all(
        [m["role"] for m in s["messages"]] == ["assistant", "tool", "assistant"] for s in looked
    )
    assert looked[0]["messages"][1] == {"role": "tool", "name": "find", "content": "velmora: 7"}
    run = (out / "run.json").read_text()
    assert "tools lookup, find, environment Almanac (hermes calls" in run


@pytest.mark.parametrize(
    "grpo, key",
    [
        ({"tools": ["tools.py:undocumented"]}, "grpo.tools"),
        ({"environment": "tools.py:NoReset"}, "grpo.environment"),
        ({"tools": ["nowhere.py:f"]}, "grpo.tools"),
    ],
)
def test_a_broken_tool_or_environment_is_refused_by_key(tmp_path, qwen3_model_dir, grpo, key):
    with pytest.raises(ConfigError) as caught:
        load_config(agent_config(tmp_path, qwen3_model_dir, **grpo))
    assert key in str(caught.value) and "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_with_vllms_log_probs_the_correction_reads_the_sampled_tokens_only(
    tmp_path, qwen3_model_dir, monkeypatch, qwen3_tokenizer
):
    """grpo.engine vllm with tools: the engine reports a log-prob per sampled token (here a fixed -2.0),
    the tool results none; TRL's correction compares the sampled tokens' alone, so the records are finite."""
    engine = ScriptedEngine(qwen3_tokenizer, script, logprob=-2.0)
    monkeypatch.setattr(grpo_module, "start_engine", lambda *args: (engine, "scripted vLLM"))
    config = agent_config(tmp_path, qwen3_model_dir, engine="vllm", vllm_importance_sampling_clip_max=100.0)
    train(load_config(config), progress=False)
    found = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in found if "loss" in r]
    assert len(steps) == 2 and engine.requests
    for record in steps:
        assert 0 < record["sampling_logp_difference"] < 50 and record["tool_calls_per_trajectory"] == 0.5
        assert 0.0 <= record["importance_sampling_clipped_share"] <= 1.0


# The conventions of TRL's own agent example (examples/scripts/grpo_agent.py): the rewards walk the
# trajectory's messages (a call's arguments as a dict, a tool message's content as the rows it returned);
# the final answer is in stars
TRL_EXAMPLE_REWARDS = """
import re


def correctness_reward(completions, answer, **kwargs):
    scores = []
    for completion, expected in zip(completions, answer, strict=False):
        match = re.search(r"\\*(yes|no)\\*", completion[-1]["content"].lower())
        scores.append(-0.5 if match is None else 0.6 if match.group(1) == expected else -1.0)
    return scores


def query_reward(completions, answer, **kwargs):
    scores = []
    for completion, expected in zip(completions, answer, strict=False):
        queries = [
            call["function"]["arguments"].get("sql_command", "").lower()
            for turn in completion
            for call in turn.get("tool_calls") or []
        ]
        rows = [row for turn in completion if turn.get("role") == "tool" for row in turn["content"]]
        if not queries:
            scores.append(-1.5)
        else:
            scores.append(2.0 if bool(rows) == (expected == "yes") else -1.5)
    return scores
"""


def test_trls_agent_example_conventions_run_unchanged(
    tmp_path, qwen3_model_dir, qwen3_tokenizer, monkeypatch
):
    """A tool timed by signal.alarm that returns rows (a list of tuples), and rewards that read the calls'
    arguments and the rows, as TRL's agent example does: the run trains, the rewards see the rows."""
    import sqlite3

    from tests.agents.test_tools import TRL_DOCUMENTED

    db = tmp_path / "genes.db"
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE TABLE interactions (a TEXT, b TEXT)")
        conn.execute("INSERT INTO interactions VALUES ('JNKK', 'MAPK8')")

    def asks(text: str, g: int) -> str:
        """g even queries, then answers from the rows; g odd answers at once."""
        if g % 2:
            return "*no*"
        if "<tool_response>" not in text:
            return call("query_rows", sql_command="SELECT * FROM interactions WHERE a = 'JNKK'")
        return "*yes*" if "MAPK8" in text.rsplit("<tool_response>", 1)[1] else "*no*"

    engine = ScriptedEngine(qwen3_tokenizer, asks, in_place=True)
    monkeypatch.setattr(grpo_engines, "CachedSampler", lambda *args, **kwargs: engine)
    config = agent_config(tmp_path, qwen3_model_dir)
    (tmp_path / "trl_tools.py").write_text(TRL_DOCUMENTED.replace("DB = None", f"DB = {str(db)!r}"))
    (tmp_path / "trl_rewards.py").write_text(TRL_EXAMPLE_REWARDS)
    data = yaml.safe_load(config.read_text())
    data["grpo"].update(
        tools=["trl_tools.py:query_rows", "trl_tools.py:multiply"],
        environment=None,
        rewards=["trl_rewards.py:correctness_reward", "trl_rewards.py:query_reward"],
    )
    rows = [
        {"prompt": [{"role": "user", "content": f"Does JNKK interact with anything? ({i})"}], "answer": "yes"}
        for i in range(8)
    ]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config.write_text(yaml.safe_dump(data))
    train(load_config(config), progress=False)
    out = tmp_path / "out"
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert len(steps) == 2
    for record in steps:
        assert record["tool_calls_per_trajectory"] == 0.5 and record["tool_failure_rate"] == 0.0
        assert record["reward_correctness_reward"] == pytest.approx((0.6 - 1.0) / 2)
        assert record["reward_query_reward"] == pytest.approx((2.0 - 1.5) / 2)  # the rows reached it
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    tool = next(m for s in samples for m in s["messages"] if m["role"] == "tool")
    assert tool == {"role": "tool", "name": "query_rows", "content": [["JNKK", "MAPK8"]]}


def test_trajectories_that_share_their_tool_schemas_and_turns_train_the_same_as_trees(
    tmp_path, qwen3_model_dir, monkeypatch, qwen3_tokenizer
):
    """data.share_prefixes tree on agent trajectories: the prompts' tool schemas and system prompt once a
    micro-batch, the trajectories that made the same call and read the same result share it, and the
    steps train what one prompt per group trains (fp32)."""
    engine = ScriptedEngine(qwen3_tokenizer, script, in_place=False)
    monkeypatch.setattr(grpo_engines, "CachedSampler", lambda *args, **kwargs: engine)
    runs = {}
    for mode in ("off", "tree"):
        folder = tmp_path / mode
        folder.mkdir()
        config = load_config(agent_config(folder, qwen3_model_dir))
        config.data.share_prefixes = mode
        config.data.eval_fraction = None
        config.training.eval_every = None
        config.grpo.beta = 0.04
        train(config, progress=False)
        runs[mode] = [
            json.loads(line) for line in (folder / "out" / "metrics.jsonl").read_text().splitlines()
        ]
    for off, tree in zip(runs["off"], runs["tree"], strict=True):
        for key in ("loss", "kl", "grad_norm", "reward"):
            assert tree[key] == pytest.approx(off[key], rel=1e-5, abs=1e-7), key
        assert tree["tree_micro_batches"] == 1
        # the schemas once for both prompts, and the looked-up trajectory's call and result once for two
        assert tree["update_tokens"] < tree["update_tokens_today"] * 0.75


def test_both_kinds_of_rollout_speak_the_turns_protocol_with_its_signatures():
    """GRPO reads a rollout's unfolding only through ``Turns``: the tool-calling plan and the single
    turn each define every method of it, with the protocol's parameters."""
    import inspect

    from slipstream.objectives.grpo_agents import AgentPlan
    from slipstream.objectives.grpo_rollouts import SingleTurn, Turns

    methods = [name for name, value in vars(Turns).items() if inspect.isfunction(value) and name[0] != "_"]
    assert methods == ["rollouts", "completions", "groups", "record", "samples", "line"]
    for kind in (SingleTurn, AgentPlan):
        for name in methods:
            ours, protocol = inspect.signature(getattr(kind, name)), inspect.signature(getattr(Turns, name))
            assert list(ours.parameters) == list(protocol.parameters), (kind.__name__, name)


def test_a_single_turn_scores_decoded_text_and_a_chat_prompt_as_one_assistant_message():
    from slipstream.objectives.grpo_rollouts import SingleTurn
    from slipstream.rollouts import Completion, Rollouts

    class Decoder:
        def decode(self, ids, skip_special_tokens):
            return " ".join(map(str, ids))

    prompts = [
        {"prompt": "text", "prompt_ids": [1]},
        {"prompt": [{"role": "user", "content": "hi"}], "prompt_ids": [2]},
    ]
    rollouts = Rollouts([[Completion([5, 6], True)], [Completion([7], False, [-0.5])]])
    turns = SingleTurn(Decoder())
    assert turns.completions(prompts, rollouts) == (["5 6", [{"role": "assistant", "content": "7"}]], {})
    groups = turns.groups(prompts, rollouts)
    assert groups[1] == {"prompt_ids": [2], "completions": [[7]], "finished": [False], "logprobs": [[-0.5]]}
    assert "model_masks" not in groups[0] and turns.record(rollouts) == {} and turns.samples(rollouts) == []
