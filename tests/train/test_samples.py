"""``training.sample_prompts``: greedy answers into ``samples.jsonl`` at every evaluation, the
training left exactly as it is without them; bad values are one-line errors naming the key."""

import json
import random

import pytest
import torch

from slipstream.cli import main
from slipstream.data import demo_tokenizer
from slipstream.models.answer import Generator
from slipstream.train import loop
from slipstream.train.config import ConfigError, load_config
from slipstream.train.errors import TrainInterrupted
from slipstream.train.loop import train
from tests.train.test_train import TINY, write_config

PROMPTS = ["What is the capital of France?", "Write a haiku about rain."]
# LoRA dropout draws random numbers every step: an answer that drew one would change the curve
RUN = {**TINY, "lora": {**TINY["lora"], "dropout": 0.1}, "training": {"steps": 4, "eval_every": 2}}
SAMPLED = {**RUN, "training": {**RUN["training"], "sample_prompts": PROMPTS, "sample_max_new_tokens": 6}}


def jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def curve(out) -> list[tuple]:
    """What training computed, step by step (not the timings)."""
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in jsonl(out / "metrics.jsonl")]


def test_answers_at_every_evaluation_and_the_loss_curve_is_unchanged(tmp_path, monkeypatch, capsys):
    states = []
    write = loop.Samples.write

    def watched(self, model, tokenizer, step):  # every RNG before and after answering
        before = (torch.get_rng_state(), random.getstate())
        modes = [m.training for m in model.modules()]
        write(self, model, tokenizer, step)
        states.append((before, (torch.get_rng_state(), random.getstate())))
        assert [m.training for m in model.modules()] == modes and model.training

    monkeypatch.setattr(loop.Samples, "write", watched)
    with_samples, without = tmp_path / "with", tmp_path / "without"
    with_samples.mkdir(), without.mkdir()
    train(load_config(write_config(with_samples, SAMPLED)), progress=False)
    assert "slipstream train: samples at step 2 -> " in capsys.readouterr().out
    train(load_config(write_config(without, RUN)), progress=False)

    records = jsonl(with_samples / "out" / "samples.jsonl")
    assert [(r["step"], r["prompt"]) for r in records] == [(s, p) for s in (2, 4) for p in PROMPTS]
    for record in records:
        assert set(record) == {"step", "prompt", "answer", "new_tokens"}
        assert record["answer"].strip() and 1 <= record["new_tokens"] <= 6
    assert len(states) == 2
    for before, after in states:
        assert torch.equal(before[0], after[0]) and before[1] == after[1]
    assert curve(with_samples / "out") == curve(without / "out")  # exactly
    assert not (without / "out" / "samples.jsonl").exists()


def test_the_answers_are_slipstream_generate_s(tmp_path):
    """The last step's answers are what a Generator gives for the saved model, prompt for prompt."""
    data = {**SAMPLED, "training": {**SAMPLED["training"], "steps": 2, "eval_every": 0}}
    model, _ = train(load_config(write_config(tmp_path, data)), progress=False)
    records = jsonl(tmp_path / "out" / "samples.jsonl")
    assert [r["step"] for r in records] == [2, 2]  # eval_every 0, no eval set: at the end only
    from slipstream.generation import load_generator

    generator = load_generator(tmp_path / "out", device="cpu")
    for record in records:
        answer = generator.answer(record["prompt"], max_new_tokens=6)
        assert (answer.text, answer.new_tokens) == (record["answer"], record["new_tokens"])


def test_with_an_eval_set_the_answers_come_with_each_eval_loss(tmp_path):
    data = {**SAMPLED, "data": {**TINY["data"], "eval_fraction": 0.2}}
    train(load_config(write_config(tmp_path, data)), progress=False)
    evaluated = [r["step"] for r in jsonl(tmp_path / "out" / "metrics.jsonl") if "eval_loss" in r]
    assert evaluated == [2, 4]
    assert sorted({r["step"] for r in jsonl(tmp_path / "out" / "samples.jsonl")}) == evaluated


def test_a_resumed_run_keeps_the_answers_up_to_its_checkpoint_and_appends(tmp_path):
    data = {**SAMPLED, "training": {**SAMPLED["training"], "eval_every": 1, "checkpoint_every": 2}}

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainInterrupted):
        train(load_config(write_config(tmp_path, data)), progress=False, after_step=stop_at_3)
    first = jsonl(tmp_path / "out" / "samples.jsonl")
    assert [r["step"] for r in first] == [1, 1, 2, 2, 3, 3]
    train(load_config(write_config(tmp_path, data)), resume=True, progress=False)
    records = jsonl(tmp_path / "out" / "samples.jsonl")
    assert [r["step"] for r in records] == [1, 1, 2, 2, 3, 3, 4, 4]
    assert records[:4] == first[:4]  # kept; step 3 was given again by the resumed run
    assert records[4:6] == first[4:6]  # the same weights at step 3: the same greedy answers


def test_bad_sample_settings_are_one_line_errors_naming_the_key(tmp_path, capsys):
    for value, message in [
        (3, "'training.sample_prompts' must be a list, got int"),
        (["hi", None], "'training.sample_prompts[1]' must be a string, got None"),
        (["hi", ""], "'training.sample_prompts[1]' is empty"),
    ]:
        bad = write_config(tmp_path, {**RUN, "training": {**RUN["training"], "sample_prompts": value}})
        assert main(["train", str(bad)]) == 1
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    fsdp = {**SAMPLED, "training": {**SAMPLED["training"], "distributed": "fsdp2"}}
    with pytest.raises(ConfigError, match="training.sample_prompts.*fsdp2"):
        load_config(write_config(tmp_path, fsdp))
    assert not (tmp_path / "out").exists()


def test_greedy_answers_draw_no_random_number():
    from slipstream.models import build_model

    tokenizer = demo_tokenizer()
    model = build_model("qwen3", vocab_size=len(tokenizer), seed=0, dtype=torch.float32).eval()
    generator = Generator(model, tokenizer, "a preset")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    answer = generator.answer(PROMPTS[0], max_new_tokens=4)
    assert torch.equal(torch.get_rng_state(), state) and 1 <= answer.new_tokens <= 4
