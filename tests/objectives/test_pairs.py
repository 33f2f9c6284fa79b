"""``slipstream train`` with a preference objective: DPO starts at ln 2, the shared prompt and the
per-step reference change nothing, resume is exact, the reference is cached, bad input is refused."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import pytest
import yaml

from slipstream.cli import main
from slipstream.train.config import ConfigError, load_config
from slipstream.train.errors import TrainInterrupted
from slipstream.train.loop import train
from tests.train.fault_runner import interrupt_after

LN2 = math.log(2.0)
WORDS = [
    *("the", "river", "runs", "north", "past", "old", "mills", "and", "quiet"),
    *("towns", "under", "grey", "hills", "where", "farmers", "grow", "wheat"),
]


def pair_rows(count: int = 16, seed: int = 0) -> list[dict]:
    """Plain-string pairs (the demo preset's tokenizer needs no chat template for them): prompts
    longer than each answer, answers of different lengths, never the same."""
    rng = random.Random(seed)

    def words(low, high):
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))

    rows = []
    for number in range(count):
        chosen, rejected = words(3, 8), words(2, 9)
        rows.append(
            {"prompt": f"Question {number}: {words(8, 16)}?", "chosen": chosen, "rejected": rejected + " no"}
        )
    return rows


def write_pairs(folder: Path, rows: list[dict] | None = None, name: str = "pairs.jsonl") -> Path:
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in (rows if rows is not None else pair_rows())))
    return path


def dpo_config(folder: Path, pairs: Path, out: str = "out", name: str | None = None, **sections) -> Path:
    """A tiny DPO config (the qwen3 preset, LoRA, fp32) written to ``folder``; ``sections`` merge into it."""
    data = {
        "model": {"preset": "qwen3", "dtype": "float32"},
        "data": {"path": str(pairs), "max_seq_len": 128},
        "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
        "optimizer": {"lr": 1e-2, "schedule": "constant"},
        "training": {"objective": "dpo", "steps": 3},
        "seed": 0,
        "output_dir": str(folder / out),
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / (name or f"{out}.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def losses(out: Path) -> list[float]:
    return [record["loss"] for record in records(out)]


def run(config_path: Path, **kwargs):
    return train(load_config(config_path), progress=False, **kwargs)


# ----------------------------------------------------------------------------- training


def test_dpo_starts_at_ln2_and_reports_rewards_and_eval_metrics(tmp_path):
    pairs = write_pairs(tmp_path, pair_rows(20))
    config = dpo_config(tmp_path, pairs, data={"eval_fraction": 0.25}, training={"eval_every": 2})
    _, summary = run(config)
    out = tmp_path / "out"
    written = records(out)
    assert len(written) == 3
    # a LoRA adapter starts at zero: the policy is the reference, every margin 0
    assert abs(written[0]["loss"] - LN2) <= 1e-5
    assert abs(written[0]["reward_margin"]) <= 1e-6 and written[0]["reward_accuracy"] == 0
    for record in written:
        for name in ("chosen_reward", "rejected_reward", "reward_margin", "reward_accuracy", "pairs_per_s"):
            assert name in record and math.isfinite(record[name]), (name, record)
        assert 0 <= record["reward_accuracy"] <= 1
    assert written[-1]["loss"] < written[0]["loss"]  # it learns to prefer the chosen answers
    # eval after step 2 and at the end, with its reward metrics
    assert [("eval_loss" in r) for r in written] == [False, True, True]
    assert {"eval_reward_margin", "eval_reward_accuracy"} <= written[-1].keys()
    run_json = json.loads((out / "run.json").read_text())
    preference = run_json["preference"]
    assert preference["objective"] == "dpo" and preference["prefix_sharing"] is True
    assert preference["reference"] == "precomputed" and preference["pairs"] == 15
    assert preference["last_step"]["loss"] == pytest.approx(written[-1]["loss"])
    evals = run_json["eval"]
    assert evals["pairs"] == 5 and [m["step"] for m in evals["metrics"]] == [2, 3]
    assert {"loss", "reward_margin", "reward_accuracy"} <= evals["metrics"][-1].keys()
    assert evals["last"]["loss"] == pytest.approx(evals["metrics"][-1]["loss"])
    assert summary["preference"] == preference
    # the reference was computed before step 0 and cached under $SLIPSTREAM_CACHE/reference
    assert any("reference log-probs computed once" in line for line in run_json["policies"])


def test_prefix_sharing_changes_nothing_but_the_work(tmp_path):
    pairs = write_pairs(tmp_path)
    shared = dpo_config(tmp_path, pairs, "shared", preference={"prefix_sharing": True})
    apart = dpo_config(tmp_path, pairs, "apart", preference={"prefix_sharing": False})
    run(shared)
    run(apart)
    a, b = losses(tmp_path / "shared"), losses(tmp_path / "apart")
    assert len(a) == len(b) == 3
    assert abs(a[0] - LN2) <= 1e-5 and abs(b[0] - LN2) <= 1e-5
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4, (a, b)
    margins = [[r["reward_margin"] for r in records(tmp_path / name)] for name in ("shared", "apart")]
    assert max(abs(x - y) for x, y in zip(*margins, strict=True)) <= 1e-4
    assert json.loads((tmp_path / "apart" / "run.json").read_text())["preference"]["prefix_sharing"] is False


def test_a_per_step_reference_gives_the_precomputed_losses(tmp_path):
    pairs = write_pairs(tmp_path)
    precomputed = dpo_config(tmp_path, pairs, "pre", preference={"reference": "precomputed"})
    per_step = dpo_config(tmp_path, pairs, "per", preference={"reference": "per_step"})
    _, summary = run(per_step)
    run(precomputed)
    a, b = losses(tmp_path / "pre"), losses(tmp_path / "per")
    assert max(abs(x - y) for x, y in zip(a, b, strict=True)) <= 1e-4, (a, b)
    assert summary["preference"]["reference"] == "per_step"
    assert not any("reference log-probs" in line for line in summary["policies"])


def test_resume_is_exact_and_the_resumed_run_reads_the_cached_reference(tmp_path, _fresh_cache):
    pairs = write_pairs(tmp_path)
    steps = {"steps": 4, "checkpoint_every": 2}
    full = dpo_config(tmp_path, pairs, "full", training=steps)
    part = dpo_config(tmp_path, pairs, "part", training=steps)
    _, full_summary = run(full)
    cached = list((_fresh_cache / "reference").glob("*.pt"))
    assert len(cached) == 1  # the train bins' sums (no eval set)
    assert any("computed once" in line for line in full_summary["policies"])
    with pytest.raises(TrainInterrupted):
        run(part, after_step=interrupt_after(2))
    assert sorted(p.name for p in (tmp_path / "part" / "checkpoints").iterdir()) == ["step-000002"]
    _, resumed = run(part, resume=True)
    assert resumed["resumed"]["step"] == 2
    assert losses(tmp_path / "part") == losses(tmp_path / "full")
    assert resumed["final_loss"] == full_summary["final_loss"]
    # the reference came from the cache both times after the first run; nothing new was written
    assert any("reference log-probs read from the cache" in line for line in resumed["policies"])
    assert list((_fresh_cache / "reference").glob("*.pt")) == cached


def test_the_cached_reference_is_read_by_a_second_run(tmp_path, _fresh_cache):
    pairs = write_pairs(tmp_path)
    _, first = run(dpo_config(tmp_path, pairs, "first", training={"steps": 1}))
    assert len(list((_fresh_cache / "reference").glob("*.pt"))) == 1
    _, second = run(dpo_config(tmp_path, pairs, "second", training={"steps": 1}))
    (line,) = [p for p in second["policies"] if "reference log-probs" in p]
    assert "read from the cache" in line and str(_fresh_cache / "reference") in line
    assert losses(tmp_path / "first") == losses(tmp_path / "second")
    # other pairs: another key, computed again
    _, third = run(
        dpo_config(
            tmp_path,
            write_pairs(tmp_path, pair_rows(16, seed=9), "other.jsonl"),
            "third",
            training={"steps": 1},
        )
    )
    assert any("computed once" in p for p in third["policies"])
    assert len(list((_fresh_cache / "reference").glob("*.pt"))) == 2


def test_the_packing_report_without_prefix_sharing_never_uses_more_slots_than_it_has(tmp_path):
    pairs = write_pairs(tmp_path)
    _, summary = run(dpo_config(tmp_path, pairs, preference={"prefix_sharing": False}, training={"steps": 1}))
    used, slots = map(int, re.search(r"(\d+) of (\d+) token slots", summary["packing"]).groups())
    assert used <= slots, summary["packing"]  # e.g. "1445 of 1024 token slots used (141.1%)"


@pytest.mark.parametrize("objective", ["ipo", "simpo"])
def test_ipo_and_simpo_train(tmp_path, objective):
    pairs = write_pairs(tmp_path)
    _, summary = run(dpo_config(tmp_path, pairs, training={"objective": objective, "steps": 2}))
    curve = losses(tmp_path / "out")
    assert len(curve) == 2 and all(math.isfinite(x) for x in curve)
    assert summary["preference"]["objective"] == objective
    if objective == "ipo":  # at the reference: (0 - 1 / (2 beta))^2 = 25 at beta 0.1
        assert curve[0] == pytest.approx(25.0, rel=1e-4)
    else:
        assert summary["preference"]["reference"] == "none"


# ----------------------------------------------------------------------------- refusals


REFUSALS = [
    ({"data": {"path": None}}, "data.path"),
    ({"speedups": {"packed_attention": False}}, "speedups.packed_attention"),
    ({"preference": {"reference": "per_step"}, "lora": {"enabled": False}}, "preference.reference"),
    ({"data": {"overflow": "split"}}, "data.overflow"),
]


@pytest.mark.parametrize("sections, key", REFUSALS, ids=[key for _, key in REFUSALS])
def test_what_a_preference_objective_cannot_do_is_refused_by_key(tmp_path, sections, key):
    config = dpo_config(tmp_path, write_pairs(tmp_path), **sections)
    with pytest.raises(ConfigError) as caught:
        load_config(config)
    message = str(caught.value)
    assert "\n" not in message and key in message and message.startswith(str(config)), message
    assert "training.objective 'dpo'" in message or "per_step" in message


def test_a_bad_pair_row_through_the_cli_is_one_line_naming_file_and_line(tmp_path, capsys):
    rows = pair_rows(6)
    rows[3] = {"prompt": "Q?", "chosen": "Same answer.", "rejected": "Same answer."}
    pairs = write_pairs(tmp_path, rows)
    config = dpo_config(tmp_path, pairs)
    capsys.readouterr()
    code = main(["train", str(config)])
    err = capsys.readouterr().err
    lines = [
        line
        for line in err.replace("\r", "\n").splitlines()
        if line.strip() and not line.startswith("slipstream train: dtype") and "%|" not in line
    ]
    assert code != 0
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert f"{pairs}:4: " in lines[0] and "same answer" in lines[0], lines[0]
    out = tmp_path / "out"
    assert not (out / "adapter").exists() and not (out / "run.json").exists()
