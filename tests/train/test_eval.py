"""`slipstream train` with an eval set: its loss, where it is logged, the split, and the bad inputs."""

import json
import math

import pytest

from slipstream.cli import main
from slipstream.data import demo_samples, demo_tokenizer
from slipstream.data.labels import IGNORE_INDEX
from slipstream.objectives import sft as sft_objective
from slipstream.objectives.evaluation import split_rows
from slipstream.train import metrics as train_metrics
from slipstream.train.config import ConfigError, load_config
from slipstream.train.distributed import Distributed
from slipstream.train.errors import TrainError, TrainInterrupted
from slipstream.train.loop import train
from tests.objectives.test_evaluation import stock_eval_loss
from tests.train.test_train import TINY, write_config

EVAL = {**TINY, "data": {**TINY["data"], "eval_fraction": 0.2}}


def records(out) -> list[dict]:
    def refuse(constant):  # strict JSON: NaN / Infinity are not allowed
        raise ValueError(constant)

    return [
        json.loads(line, parse_constant=refuse) for line in (out / "metrics.jsonl").read_text().splitlines()
    ]


def test_the_eval_loss_falls_is_logged_and_matches_a_stock_computation(tmp_path, monkeypatch):
    scalars = []

    class Writer:  # tensorboard is optional and not installed here: record what would be written
        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def close(self):
            pass

    monkeypatch.setattr(train_metrics, "_tensorboard", lambda out: Writer())
    data = {**EVAL, "training": {"steps": 6, "eval_every": 3, "log_every": 4, "tensorboard": True}}
    model, summary = train(load_config(write_config(tmp_path, data)), progress=False)
    metrics = records(tmp_path / "out")
    evaluated = [(r["step"], r["eval_loss"]) for r in metrics if "eval_loss" in r]
    assert [step for step, _ in evaluated] == [3, 6]  # kept although log_every is 4
    assert [r["step"] for r in metrics] == [3, 4, 6]
    assert evaluated[-1][1] < evaluated[0][1]  # it learns
    assert [(step, value) for tag, value, step in scalars if tag == "eval/loss"] == evaluated
    run = json.loads((tmp_path / "out" / "run.json").read_text())
    best = min(evaluated, key=lambda item: item[1])
    tokenizer = demo_tokenizer()
    _, held_out = split_rows(demo_samples(tokenizer, num_rows=120, seed=0), 0.2, 0, "demo")
    assert run["eval"] == {
        "best": {"step": best[0], "loss": best[1]},
        "last": {"step": 6, "loss": evaluated[-1][1]},
        "source": "data.eval_fraction 0.2 of the demo data",
        "rows": 24,
        "tokens": sum(min(len(s["input_ids"]), 256) for s in held_out),
        "label_tokens": sum(
            sum(1 for label in s["labels"][1:256] if label != IGNORE_INDEX) for s in held_out
        ),
    }
    assert summary["eval"] == run["eval"]
    assert all(module.training for module in model.modules())  # evaluation restored every module's mode
    expected = stock_eval_loss(model, held_out, 256)
    assert abs(run["eval"]["last"]["loss"] - expected) <= 1e-5 * expected


def test_the_eval_split_is_by_row_disjoint_and_seeded(tmp_path):
    samples = [{"input_ids": [i, i + 1], "labels": [i, i + 1]} for i in range(50)]
    train_rows, held_out = split_rows(samples, 0.1, 7, "rows")
    assert len(held_out) == 5 and len(train_rows) == 45
    assert sorted(map(id, train_rows + held_out)) == sorted(map(id, samples))  # a partition
    assert not {id(s) for s in train_rows} & {id(s) for s in held_out}
    assert train_rows == [s for s in samples if s in train_rows]  # training keeps the file's order
    assert split_rows(samples, 0.1, 7, "rows") == (train_rows, held_out)  # deterministic
    assert split_rows(samples, 0.1, 8, "rows")[1] != held_out  # the seed decides
    assert len(split_rows(samples, 0.999, 0, "rows")[0]) == 1  # training keeps a row
    with pytest.raises(Exception, match="needs at least 2 usable rows"):
        split_rows(samples[:1], 0.5, 0, "rows")
    # in the run: no training bin holds an eval row, and the split never depends on anything but the seed
    config = load_config(write_config(tmp_path, EVAL))
    tokenizer = demo_tokenizer()
    data = sft_objective.SFT(config).read(tokenizer, Distributed())
    bins, evals = data.bins, data.evals
    trained = {tuple(d["input_ids"]) for b in bins for d in b}
    evaluated = {tuple(d["input_ids"]) for b in evals.bins for d in b}
    assert evals.rows == 24 and not trained & evaluated
    assert len(trained) + len(evaluated) == len(
        {tuple(s["input_ids"][:256]) for s in demo_samples(tokenizer, 120)}
    )


def test_an_eval_file_is_read_like_the_training_data(tmp_path):
    rows = tmp_path / "eval.jsonl"
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"Add each pair: {a}+{a}"},
                {"role": "assistant", "content": str(2 * a)},
            ]
        }
        for a in range(10)
    ]
    rows.write_text("".join(json.dumps(row) + "\n" for row in chats))
    data = {
        **TINY,
        # relative to the config; response-only training skips the demo rows whose prompt fills max_seq_len
        "data": {**TINY["data"], "eval_path": "eval.jsonl", "response_only": True, "skip_bad_rows": True},
        "training": {"steps": 2},
    }
    _, summary = train(load_config(write_config(tmp_path, data)), progress=False)
    evals = summary["eval"]
    assert evals["source"] == str(rows) and evals["rows"] == 10
    assert 0 < evals["label_tokens"] < evals["tokens"]  # response-only: the prompts carry no label
    assert evals["last"]["step"] == 2 and math.isfinite(evals["last"]["loss"])


def test_bad_eval_settings_are_one_line_errors(tmp_path, capsys):
    both = write_config(tmp_path, {**TINY, "data": {**EVAL["data"], "eval_path": "x.jsonl"}})
    with pytest.raises(ConfigError, match="data.eval_path.*data.eval_fraction.*not both"):
        load_config(both)
    for value, rule in [(1.0, "must be < 1"), (0, "must be > 0"), (-0.2, "must be > 0")]:
        bad = write_config(tmp_path, {**TINY, "data": {**TINY["data"], "eval_fraction": value}})
        assert main(["train", str(bad)]) == 1
        err = capsys.readouterr().err
        assert f"'data.eval_fraction' {rule}" in err and len(err.strip().splitlines()) == 1, err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    config = write_config(tmp_path, {**TINY, "data": {**TINY["data"], "eval_path": str(empty)}})
    assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "empty.jsonl" in line]
    assert len(lines) == 1 and "no usable rows" in lines[0] and "data.eval_path" in lines[0], err
    assert not (tmp_path / "out" / "adapter").exists()


def test_a_non_finite_eval_loss_is_null_and_said(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sft_objective, "evaluate", lambda *args: float("nan"))
    data = {**EVAL, "training": {"steps": 2, "eval_every": 1}}
    _, summary = train(load_config(write_config(tmp_path, data)), progress=False)
    assert [r["eval_loss"] for r in records(tmp_path / "out")] == [None, None]
    assert "the eval loss after step 2 is not finite: recorded as null" in capsys.readouterr().out
    assert summary["eval"]["best"] is None and summary["eval"]["last"] == {"step": 2, "loss": None}


def test_eval_records_rewind_on_resume_and_eval_every_is_not_fingerprinted(tmp_path):
    data = {**EVAL, "training": {"steps": 4, "eval_every": 2, "checkpoint_every": 2}}

    def stop_at_3(step):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(TrainInterrupted):
        train(load_config(write_config(tmp_path, data)), progress=False, after_step=stop_at_3)
    assert [r["step"] for r in records(tmp_path / "out")] == [1, 2, 3]
    first = [r["eval_loss"] for r in records(tmp_path / "out") if "eval_loss" in r]
    other = {**data, "data": {**data["data"], "eval_fraction": 0.3}}
    with pytest.raises(TrainError, match="eval_fraction"):  # it takes rows out of training: fingerprinted
        train(load_config(write_config(tmp_path, other)), resume=True, progress=False)
    changed = {**data, "training": {**data["training"], "eval_every": 1}}  # accepted without --force
    _, summary = train(load_config(write_config(tmp_path, changed)), resume=True, progress=False)
    metrics = records(tmp_path / "out")
    assert [r["step"] for r in metrics] == [1, 2, 3, 4]
    assert [r["eval_loss"] for r in metrics if "eval_loss" in r][0] == first[0]  # step 2, from before
    assert [r["step"] for r in metrics if "eval_loss" in r] == [2, 3, 4]
    assert summary["eval"]["last"]["step"] == 4
    assert summary["eval"]["best"]["step"] in (2, 3, 4)
