"""Reward functions (slipstream.rewards): TRL's convention, built-ins, files next to the config, and
one-line errors naming the function for every way a function can go wrong."""

from __future__ import annotations

import math

import pytest

from slipstream.rewards import (
    RewardCall,
    RewardError,
    answer_tag,
    format_regex,
    length_penalty,
    load_reward,
    load_rewards,
    score,
    weighted,
)


def test_builtins():
    completions = ["so <answer>42</answer>", "<answer> 41 </answer>", "no tag", "<answer>4.2e1</answer>"]
    assert answer_tag(None, completions, None, answer=["42", "42", "42", 42]) == [1.0, 0.0, 0.0, 1.0]
    chat = [[{"role": "assistant", "content": "<sum>7</sum>"}]]
    assert answer_tag(None, chat, None, tag="sum", column="total", total=["7"]) == [1.0]
    with pytest.raises(KeyError, match="no column 'answer'"):
        answer_tag(None, ["x"], None, label=["1"])
    assert format_regex(
        None,
        ["<think>a</think> <answer>1</answer>", "1"],
        None,
        pattern=r"<think>.*</think>\s*<answer>.*</answer>",
    ) == [1.0, 0.0]
    assert length_penalty(None, ["a", "b"], [[1] * 10, [1] * 30], limit=20) == [0.0, -0.5]


def test_a_file_next_to_the_config_and_args(tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompts, completions, completion_ids, bonus=0.0, **columns):\n"
        "    return [float(c.isupper()) + bonus for c in completions]\n"
    )
    by_name = load_reward({"function": "my_rewards:shout", "weight": 2, "args": {"bonus": 0.5}}, tmp_path)
    by_file = load_reward(f"{tmp_path / 'my_rewards.py'}:shout")
    assert (
        by_name.name == by_file.name == "shout"
        and by_name.weight == 2.0
        and by_name(["p", "q"], ["HI", "hi"], [[1], [2]], {}) == [1.5, 0.5]
    )
    assert by_file(["p"], ["HI"], [[1]], {}) == [1.0]
    builtin = load_reward({"function": "length_penalty", "args": {"limit": 4}})
    assert builtin(["p"], ["x"], [[1] * 6], {}) == [-0.5]


def test_none_is_left_out_of_the_sum(tmp_path):
    (tmp_path / "r.py").write_text(
        "def odd_only(prompts, completions, completion_ids, **c):\n"
        "    return [1.0 if len(ids) % 2 else None for ids in completion_ids]\n"
    )
    functions = load_rewards(
        [
            {"function": "answer_tag", "weight": 1.0},
            {"function": "length_penalty", "weight": 0.5, "args": {"limit": 1}},
            {"function": "r.py:odd_only", "weight": 3.0},
        ],
        tmp_path,
    )
    values = score(functions, ["p", "p"], ["<answer>1</answer>", "x"], [[1, 2], [1]], {"answer": ["1", "2"]})
    assert values[0][:2] == [1.0, -1.0] and math.isnan(values[0][2])
    assert values[1] == [0.0, 0.0, 1.0]
    assert weighted(values[0], functions) == 0.5 and weighted(values[1], functions) == 3.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("raise RuntimeError('boom')", r"reward f \(r.py:f\) raised RuntimeError: boom"),
        ("return [1.0]", r"reward f \(r.py:f\) returned 1 values for 2 completions"),
        ("return 1.0", r"reward f \(r.py:f\) returned float; it must return a list of 2 numbers"),
        ("return [1.0, float('nan')]", r"reward f \(r.py:f\) returned nan for completion 1"),
        ("return [1.0, 'yes']", r"reward f \(r.py:f\) returned 'yes' for completion 1"),
    ],
)
def test_a_function_that_goes_wrong_is_named(tmp_path, body, message):
    (tmp_path / "r.py").write_text(f"def f(prompts, completions, completion_ids, **columns):\n    {body}\n")
    function = load_reward("r.py:f", tmp_path)
    with pytest.raises(RewardError, match=message):
        function(["p", "p"], ["a", "b"], [[1], [2]], {})


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nothing_here", r"neither 'module:function', a built-in .* nor a reward model directory"),
        ("no_such_module_xyz:f", r"cannot import 'no_such_module_xyz'"),
        ("missing.py:f", r"missing.py: no such reward file"),
        ({"function": "answer_tag", "wieght": 1}, r"unknown key\(s\) wieght"),
        ({"function": "answer_tag", "weight": "high"}, r"weight' must be a finite number"),
        ({"function": "length_penalty", "args": {"limt": 3}}, r"args' do not fit length_penalty"),
        ({"function": "math:nothing"}, r"'math' has no function 'nothing'"),
    ],
)
def test_bad_specs_are_refused_by_key(tmp_path, spec, message):
    with pytest.raises(RewardError, match=message):
        load_rewards([spec], tmp_path)
    with pytest.raises(RewardError, match=r"grpo\.rewards\[0\]|missing.py|cannot import|has no function"):
        load_rewards([spec], tmp_path)


# What TRL's docs and its own trl.rewards write: keyword arguments, **kwargs, async functions, the state.
TRL_STYLE = """
import asyncio

from trl.rewards import get_soft_overlong_punishment


def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]


def correct(completions, answer, **kwargs):
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


async def slow_len(prompts, completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(p)) for p in prompts]


overlong = get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)


def step_aware(completions, trainer_state, log_metric, log_extra, **kwargs):
    log_metric("seen_step", trainer_state.global_step)
    log_extra("length", [len(c) for c in completions])
    return [float(trainer_state.global_step)] * len(completions)
"""


def test_trl_reward_functions_run_unchanged_with_keywords_kwargs_and_async(tmp_path):
    """A reward file written for TRL: each function called by keyword, as GRPOTrainer calls it."""
    pytest.importorskip("trl.rewards")
    (tmp_path / "trl_style.py").write_text(TRL_STYLE)
    names = ["reward_len", "correct", "slow_len", "overlong", "step_aware"]
    functions = load_rewards([f"trl_style.py:{n}" for n in names], base=tmp_path)
    call = RewardCall(step=3, max_steps=10)
    prompts, completions = ["p", "pp"], ["7", " 8 "]
    values = score(functions, prompts, completions, [[1, 2, 3, 4, 5, 6], [1]], {"answer": ["7", "9"]}, call)
    assert [row[0] for row in values] == [-19.0, -17.0]  # completions, not the prompts, as `completions`
    assert [row[1] for row in values] == [1.0, 0.0]  # the row's column by name
    assert [row[2] for row in values] == [1.0, 2.0]  # awaited
    trl_rewards = pytest.importorskip("trl.rewards")
    own = trl_rewards.get_soft_overlong_punishment(max_completion_len=4, soft_punish_cache=2)
    assert [row[3] for row in values] == own(completion_ids=[[1, 2, 3, 4, 5, 6], [1]]) == [-1.0, 0.0]
    assert [row[4] for row in values] == [3.0, 3.0]  # trainer_state.global_step
    assert call.metric_means() == {"seen_step": 3.0} and call.extra == {"length": [1, 3]}


def test_trl_own_reward_by_module_name():
    trl_rewards = pytest.importorskip("trl.rewards")
    [function] = load_rewards(["trl.rewards:think_format_reward"])
    completions = [[{"content": "<think>\nwhy\n</think>\nso"}], [{"content": "so"}]]
    got = [row[0] for row in score([function], ["p", "p"], completions, [[1], [1]], {})]
    assert got == trl_rewards.think_format_reward(completions=completions) == [1.0, 0.0]


def test_a_function_that_cannot_take_trls_keywords_is_refused_at_start(tmp_path):
    (tmp_path / "narrow.py").write_text("def f(prompts, completions):\n    return [0.0] * len(completions)\n")
    with pytest.raises(
        RewardError,
        match=r"f takes neither completion_ids, trainer_state, log_extra, log_metric nor \*\*kwargs",
    ):
        load_reward("narrow.py:f", base=tmp_path)


def test_an_async_function_that_raises_is_named(tmp_path):
    (tmp_path / "bad.py").write_text("async def boom(**kwargs):\n    raise OSError('no network')\n")
    [function] = load_rewards(["bad.py:boom"], base=tmp_path)
    with pytest.raises(RewardError, match="reward boom .* raised OSError: no network"):
        score([function], ["p"], ["c"], [[1]], {})


def _reward_model_dir(folder, architecture_of=None):
    """A tiny sequence classifier (one label) with the demo tokenizer, saved as a model directory."""
    import torch
    from transformers import Qwen3Config, Qwen3ForSequenceClassification

    from slipstream.data.demo_bpe import demo_tokenizer

    tokenizer = demo_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_labels=1,
    )
    torch.manual_seed(0)
    model = (architecture_of or Qwen3ForSequenceClassification)(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_directory_scores_as_trl_does(tmp_path):
    """logits[:, 0] of prompt + completion, right-padded, no special tokens added (TRL's scoring)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    _reward_model_dir(tmp_path / "rm")
    [function] = load_rewards(["rm"], base=tmp_path)
    assert function.name == "rm"
    prompts, completions = ["2 + 2 =", "Say hi:"], [" 4", " hello there, friend"]
    got = [row[0] for row in score([function], prompts, completions, [[1], [1]], {})]
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "rm")
    model.config.pad_token_id = tokenizer.pad_token_id
    with torch.inference_mode():
        for text, value in zip([p + c for p, c in zip(prompts, completions, strict=True)], got, strict=True):
            alone = tokenizer(text, return_tensors="pt", add_special_tokens=False)
            assert model(**alone).logits[0, 0].item() == pytest.approx(
                value, rel=1e-5, abs=1e-6
            )  # padding: no effect


def test_a_model_directory_without_a_classifier_head_is_refused(tmp_path):
    from transformers import Qwen3ForCausalLM

    _reward_model_dir(tmp_path / "lm", architecture_of=Qwen3ForCausalLM)
    with pytest.raises(
        RewardError,
        match=r"lm is a model directory but not a sequence classifier \(architectures: Qwen3ForCausalLM\)",
    ):
        load_rewards(["lm"], base=tmp_path)
