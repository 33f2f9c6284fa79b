"""``training.objective: grpo``: group-normalised advantages as TRL computes them, the clipped
per-token loss (dapo / grpo / dr_grpo, with and without the KL) and its LoRA gradients equal to a
reference computed from each completion run alone through the stock model, and ``slipstream
train`` end to end: rollouts, rewards, metrics, evaluation, a reward function that fails."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

import slipstream
from slipstream.cli import main
from slipstream.models import build_model
from slipstream.objectives.answers import reference_sums
from slipstream.objectives.grpo import GRPO, GRPOSettings
from slipstream.objectives.grpo_rollouts import GRPOMicro, advantages_of
from slipstream.packing.completions import collate_completions
from slipstream.train.config import ConfigError, load_config
from slipstream.train.errors import TrainError
from slipstream.train.loop import train

from ..packing.test_completions import random_completion_groups, stock_token_logprobs
from ..packing.test_groups import grads_of, rel

VOCAB = 512


# ----------------------------------------------------------------------------- advantages


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_are_trls(scale):
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 2.0, 2.0, 2.0, 2.0, 0.0, 1.0, 3.0, -1.0])
    grouped = rewards.view(-1, 4)
    centred = (grouped - grouped.mean(1, keepdim=True)).view(-1)
    if scale == "group":
        expected = centred / (grouped.std(1).repeat_interleave(4) + 1e-4)
    elif scale == "batch":
        expected = centred / (rewards.std() + 1e-4)
    else:
        expected = centred
    found = advantages_of(rewards.tolist(), 4, scale, batch_std=rewards.std().item())
    assert torch.allclose(torch.tensor(found), expected, atol=1e-5)
    assert found[4:8] == [0.0] * 4  # a group whose rewards are all equal teaches nothing


# ----------------------------------------------------------------------------- the loss


def reference_loss(logp, ref, groups, advantages, settings, mask, old=None):
    """TRL's GRPO loss from per-completion token log-probs (old: the sampling policy's; None: logp
    detached, one update per batch)."""
    eps_low = settings.epsilon
    eps_high = settings.epsilon_high if settings.epsilon_high is not None else settings.epsilon
    lengths = [len(c) for g in groups for c in g["completions"]]
    per_seq, tokens, start = [], 0.0, 0
    for number, length in enumerate(lengths):
        lp = logp[start : start + length]
        ratio = torch.exp(lp - (lp.detach() if old is None else old[start : start + length]))
        A = advantages[number]
        loss_t = -torch.minimum(ratio * A, ratio.clamp(1 - eps_low, 1 + eps_high) * A)
        if ref is not None:
            delta = ref[start : start + length] - lp
            loss_t = loss_t + settings.beta * (torch.exp(delta) - delta - 1)
        m = mask[number]
        per_seq.append(
            (loss_t * m).sum() if settings.loss != "grpo" else (loss_t * m).sum() / max(1, length * m)
        )
        tokens += length * m
        start += length
    total = torch.stack(per_seq).sum()
    if settings.loss == "dapo":
        return total / tokens
    if settings.loss == "grpo":
        return total / len(lengths)
    return total / (len(lengths) * settings.max_new_tokens)


def lora_models(init_zero: bool):
    from peft import LoraConfig, get_peft_model

    base = build_model("llama", vocab_size=VOCAB)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=init_zero)
    stock, packed = copy.deepcopy(base), slipstream.optimize(copy.deepcopy(base))
    out = []
    for model in (stock, packed):
        torch.manual_seed(0)
        out.append(get_peft_model(model, copy.deepcopy(lora)).train())
    return out


@pytest.mark.parametrize(
    "loss, beta, truncated, stale",
    [
        ("dapo", 0.0, False, False),
        ("grpo", 0.0, False, False),
        ("dr_grpo", 0.0, False, False),
        ("dapo", 0.04, True, False),
        ("grpo", 0.1, True, False),
        ("dapo", 0.0, False, True),  # num_iterations > 1: old log-probs of another policy, ratios clip
        ("dr_grpo", 0.04, True, True),
    ],
)
def test_the_update_is_trls_loss_on_each_completion_run_alone(loss, beta, truncated, stale):
    stock, packed = lora_models(init_zero=False)  # a random adapter: the KL and every gradient act
    settings = GRPOSettings(loss=loss, beta=beta, rewards=["answer_tag"], max_new_tokens=8, temperature=0.9)
    objective = GRPO(SimpleNamespace(grpo=settings, seed=0), settings)
    objective.chunked = True
    groups = random_completion_groups([(6, [3, 5, 1, 4]), (4, [2, 6, 3, 3])])
    advantages = advantages_of([1.0, 0.0, 0.5, 0.2, 0.0, 0.0, 1.0, 0.3], 4, "group")
    mask = [1.0] * 8
    if truncated:
        mask[1] = mask[6] = 0.0  # two completions cut at max_new_tokens, left out
    lengths = [len(c) for g in groups for c in g["completions"]]
    completions = collate_completions(groups, temperature=0.9)
    owner = completions.completion_index
    micro = GRPOMicro(
        completions=completions,
        advantages=torch.tensor(advantages).index_select(0, owner),
        mask=torch.tensor(mask).index_select(0, owner),
        seq_tokens=torch.tensor([n * m for n, m in zip(lengths, mask, strict=True)]),
        reference=reference_sums(packed, completions.batch, True, adapter=True) if beta else None,
        tokens_in_step=sum(n * m for n, m in zip(lengths, mask, strict=True)),
    )
    old = None
    if (
        stale
    ):  # the sampling policy's log-probs: these, moved by up to +-0.5 (some ratios leave the clip range)
        with torch.no_grad():
            moved = torch.linspace(-0.5, 0.5, len(owner)).roll(3)
            old = stock_token_logprobs(stock, groups, 0.9) + moved
        micro.old = old.clone()
    weight = {"dapo": micro.tokens_in_step, "grpo": 8, "dr_grpo": 8 * 8}[loss]
    ours, metrics = objective.micro_batch(packed, micro, float(weight))
    ours.backward()
    logp = stock_token_logprobs(stock, groups, 0.9)
    ref = None
    if beta:
        with torch.no_grad(), stock.disable_adapter():
            ref = stock_token_logprobs(stock, groups, 0.9)
    theirs = reference_loss(logp, ref, groups, advantages, settings, mask, old)
    theirs.backward()
    assert abs(ours.item() - theirs.item()) <= 1e-5 * max(1.0, abs(theirs.item()))
    assert metrics[0].item() == pytest.approx(ours.item())
    if beta:
        assert metrics[2].item() > 0  # the adapter moved the policy off the base
    assert (metrics[1].item() > 0) == stale  # tokens clipped only when the sampling policy differs
    found, expected = grads_of(packed), grads_of(stock)
    assert found.keys() == expected.keys() and found
    worst = max(rel(found[name], expected[name]) for name in expected)
    assert worst <= 1e-4, worst


# ----------------------------------------------------------------------------- slipstream train

REWARDS = """
def even_tokens(prompts, completions, completion_ids, **columns):
    return [sum(1 for t in ids if t % 2 == 0) / len(ids) for ids in completion_ids]


def boom(prompts, completions, completion_ids, **columns):
    raise RuntimeError("the grader is down")


def trl_style(completions, answer, trainer_state, log_metric, **kwargs):  # TRL's keywords, by name
    log_metric("global_step", trainer_state.global_step)
    log_metric("max_steps", trainer_state.max_steps)
    kwargs["log_extra"]("golden", list(answer))  # a column a completion, as TRL's table shows it
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]


async def progress(completions, trainer_state, **kwargs):
    return [float(trainer_state.global_step)] * len(completions)
"""


def prompt_rows(count=12):
    return [{"prompt": f"Question {n}: what comes after {n}?", "answer": str(n + 1)} for n in range(count)]


def grpo_config(folder: Path, rewards=("rewards.py:even_tokens",), **sections) -> Path:
    (folder / "rewards.py").write_text(REWARDS)
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows()))
    data = {
        "model": {"preset": "qwen3", "dtype": "float32"},
        "data": {"path": "prompts.jsonl", "max_seq_len": 64},
        "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
        "optimizer": {"lr": 1e-2, "schedule": "constant"},
        "training": {"objective": "grpo", "steps": 3},
        "grpo": {"num_generations": 4, "prompts_per_batch": 2, "max_new_tokens": 6, "rewards": list(rewards)},
        "seed": 0,
        "output_dir": str(folder / "out"),
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_slipstream_train_runs_grpo_and_records_its_metrics(tmp_path):
    config = grpo_config(
        tmp_path,
        rewards=(
            "rewards.py:even_tokens",
            {"function": "length_penalty", "weight": 0.5, "args": {"limit": 4}},
        ),
        data={"eval_fraction": 0.25},
        grpo={"beta": 0.04},
    )
    model, summary = train(load_config(config), progress=False)
    out = tmp_path / "out"
    found = records(out)
    assert [r["step"] for r in found] == [1, 2, 3]
    for record in found:
        for key in (
            "loss",
            "grad_norm",
            "clip_fraction",
            "kl",
            "reward",
            "reward_std",
            "equal_rewards_share",
            "completion_mean_tokens",
            "truncated_share",
            "generation_s",
            "generation_tokens_per_s",
        ):
            assert key in record, key
        assert 0.0 <= record["reward_even_tokens"] <= 1.0 and record["reward_length_penalty"] <= 0.0
        assert record["completion_max_tokens"] <= 6
    assert found[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts at zero: policy = reference
    assert found[-1]["kl"] > 0.0
    assert "eval_reward" in found[-1]
    run = json.loads((out / "run.json").read_text())
    assert run["grpo"]["num_generations"] == 4 and run["grpo"]["beta"] == 0.04
    assert run["eval"]["metrics"][-1]["reward"] == found[-1]["eval_reward"]
    assert any(p.startswith("grpo: 4 completions per prompt") for p in run["policies"])
    assert (out / "adapter" / "adapter_model.safetensors").exists()


def test_a_grpo_run_generates_and_exports_like_any_lora_run(tmp_path):
    """The result of a GRPO run is a LoRA run's: ``slipstream generate`` answers from it and
    ``slipstream export --merged`` merges it (checked against the adapter by export itself)."""
    import slipstream
    from slipstream.cli import main

    config = grpo_config(tmp_path, training={"steps": 1})
    train(load_config(config), progress=False)
    out = tmp_path / "out"
    (text,) = slipstream.generate(out, ["Question 3: what comes after 3?"], max_new_tokens=4)
    assert isinstance(text, str)
    assert main(["export", str(out), "--merged", str(tmp_path / "merged")]) == 0
    assert (tmp_path / "merged" / "config.json").exists()


def test_eval_at_start_gives_the_base_reward_and_samples_keep_held_out_completions(tmp_path):
    config = grpo_config(
        tmp_path,
        data={"eval_fraction": 0.25},
        training={"eval_at_start": True, "eval_every": 2},
        grpo={"eval_samples": 2},
    )
    train(load_config(config), progress=False)
    out = tmp_path / "out"
    found = records(out)
    assert [r["step"] for r in found] == [0, 1, 2, 3]
    assert set(found[0]) == {"step", "eval_reward", "eval_reward_even_tokens"}  # the starting weights
    assert [r["step"] for r in found if "eval_reward" in r] == [0, 2, 3]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 2, 2, 3, 3]  # eval_samples a time
    for sample in samples:
        assert sample["prompt"].startswith("Question") and isinstance(sample["completion"], str)
        assert sample["reward"] == pytest.approx(sample["rewards"]["even_tokens"])
        assert 1 <= sample["new_tokens"] <= 6


def test_the_same_seed_samples_and_trains_the_same(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    train(load_config(grpo_config(one)), progress=False)
    train(load_config(grpo_config(two)), progress=False)
    keys = ("loss", "reward", "completion_mean_tokens")
    assert [[r[k] for k in keys] for r in records(one / "out")] == [
        [r[k] for k in keys] for r in records(two / "out")
    ]


def test_a_reward_function_that_raises_stops_the_run_naming_it_and_the_step(tmp_path, capsys):
    config = grpo_config(tmp_path, rewards=("rewards.py:boom",))
    with pytest.raises(
        TrainError, match=r"step 1: reward boom \(.*rewards.py:boom\) raised RuntimeError: the grader"
    ):
        train(load_config(config), progress=False)
    capsys.readouterr()
    code = main(["train", str(config), "--set", f"output_dir={tmp_path / 'cli'}"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and "the grader is down" in err
    assert not (tmp_path / "cli" / "adapter").exists()


def test_num_iterations_trains_each_round_of_rollouts_k_times(tmp_path):
    config = grpo_config(tmp_path, training={"steps": 4}, grpo={"num_iterations": 2}, optimizer={"lr": 5e-2})
    train(load_config(config), progress=False)
    found = records(tmp_path / "out")
    assert [r["iteration"] for r in found] == [1, 2, 1, 2]
    for first, again in (found[0:2], found[2:4]):
        assert again["generation_s"] == 0.0 and first["generation_s"] > 0.0
        assert (
            again["reward"] == first["reward"]
            and again["completion_mean_tokens"] == first["completion_mean_tokens"]
        )
        assert first["clip_fraction"] == 0.0  # the first update: the policy that sampled
        assert again["loss"] != first["loss"]  # the second: ratios off 1
    assert found[2]["reward"] != found[0]["reward"]  # a new round, new rollouts


REFUSALS = [
    ({"grpo": {"rewards": []}}, "grpo.rewards"),
    ({"grpo": {"rewards": ["nothing_here"]}}, "grpo.rewards"),
    (
        {"grpo": {"num_iterations": 2}, "training": {"steps": 4, "checkpoint_every": 3}},
        "training.checkpoint_every",
    ),
    ({"grpo": {"num_iterations": 2}, "training": {"steps": None, "epochs": 1}}, "training.epochs"),
    ({"grpo": {"beta": 0.1}, "lora": {"enabled": False}}, "grpo.beta"),
    ({"grpo": {"max_new_tokens": 64}}, "data.max_seq_len"),
    ({"grpo": {"num_generations": 1}}, "grpo.num_generations"),
    ({"speedups": {"packed_attention": False}}, "speedups.packed_attention"),
]


@pytest.mark.parametrize("sections, key", REFUSALS, ids=[key for _, key in REFUSALS])
def test_what_grpo_cannot_do_is_refused_by_key(tmp_path, sections, key):
    rewards = sections.get("grpo", {}).get("rewards", ["rewards.py:even_tokens"])
    config = grpo_config(tmp_path, rewards=rewards, **{k: v for k, v in sections.items()})
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    assert "\n" not in message and key in message and message.startswith(str(config)), message


def test_a_bad_prompt_row_is_named_by_file_and_line(tmp_path):
    config = grpo_config(tmp_path)
    rows = prompt_rows()
    rows[4] = {"question": "no prompt here"}
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(Exception, match=r"prompts.jsonl:5: missing field 'prompt'"):
        train(load_config(config), progress=False)


def test_a_trl_reward_gets_the_state_and_logs_metrics_into_the_step_record(tmp_path):
    config = grpo_config(
        tmp_path,
        rewards=("rewards.py:trl_style", {"function": "rewards.py:progress", "weight": 0.0}),
        training={"steps": 2, "eval_every": 1},
        data={"eval_fraction": 0.25},
    )
    train(load_config(config), progress=False)
    found = records(tmp_path / "out")
    # trainer_state.global_step: the optimizer steps done, as TRL's state
    assert [(r["global_step"], r["max_steps"]) for r in found] == [(0, 2), (1, 2)]
    assert all(0.0 <= r["reward_trl_style"] <= 1.0 for r in found)
    assert [r["reward_progress"] for r in found] == [0.0, 1.0]  # an async reward, awaited
    assert [r["eval_reward_progress"] for r in found] == [1.0, 2.0]  # evaluated after steps 1 and 2
    # log_extra's columns: kept with each held-out completion in samples.jsonl
    samples = [json.loads(line) for line in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert samples and all(
        s["extra"]["golden"] == str(int(s["prompt"].split()[-1][:-1]) + 1) for s in samples
    )
