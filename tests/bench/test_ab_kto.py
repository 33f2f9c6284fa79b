"""``slipstream ab --objective kto``: the KTO arms, and one short real run against TRL's KTOTrainer."""

import json

import pytest

from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS
from slipstream.bench.command import ab_config
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import run_ab

ROWS = [
    {
        "prompt": f"question {i} about the number {i * 7} and its neighbours {i + 1} {i + 2} {i + 3}",
        # the label independent of the lengths: best-fit bins group rows by length, and a bin of one label
        # has no reward margin
        "completion": f"the answer is {i * 7}",
        "label": i % 2 == 0,
    }
    for i in range(40)
]


@pytest.fixture
def rows_file(tmp_path):
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    return path


def test_the_kto_preset_holds_kto_arms_only():
    assert ARM_PRESETS["kto"] == ("trl-kto", "slipstream-kto-no-prefix-sharing", "slipstream-kto")
    assert all(ARM_SPECS[arm].objective == "kto" for arm in ARM_PRESETS["kto"])
    assert ARM_SPECS["slipstream-kto"].pairs == "shared"


def test_a_kto_ab_refuses_other_objectives_arms(rows_file):
    with pytest.raises(ValueError, match="train another objective"):
        ab_config(objective="kto", data=str(rows_file), arms=("slipstream-dpo", "slipstream-kto"))


@pytest.mark.slow
def test_a_short_kto_ab_trains_the_same_rows_to_trls_losses(rows_file, tmp_path):
    """The demo shape in fp32, three steps, the same bins (rows and KL completions) in every arm: the
    adapter starts at zero, so every arm's step-0 loss is 0.5 (policy = reference, KL 0) and their
    gradient norms agree; the slipstream arms' loss curves agree with TRL's."""
    pytest.importorskip("trl")
    arms = ARM_PRESETS["kto"]
    config = ab_config(
        model="demo",
        layers=2,
        data=str(rows_file),
        objective="kto",
        arms=arms,
        steps=3,
        warmup=1,
        max_seq_len=256,
        lora_rank=4,
        lr=1e-3,
        dtype="float32",
        out_dir=str(tmp_path / "ab"),
    )
    record = run_ab(config, progress=False)
    runs = {arm: record["runs"][arm][0] for arm in arms}
    for arm in arms:
        assert runs[arm]["loss"][0] == pytest.approx(0.5, abs=1e-6), arm
    trl = runs["trl-kto"]
    for arm in arms[1:]:
        assert runs[arm]["grad_norm"][0] == pytest.approx(trl["grad_norm"][0], rel=1e-4), arm
        summary = record["summary"][arm]
        assert summary["loss_vs_trl-kto"] in ("identical", "within tolerance"), summary["loss_parity"]
        assert summary["reward_margin_parity"]["verdict"] != "differs", summary["reward_margin_parity"]
        assert summary["host_syncs_per_step"] == 0
    markdown = markdown_report(record)
    assert "trl-kto" in markdown and "| arm | rows/s |" in markdown  # KTO's rows, not pairs
    assert "Rows (each with its KL completion): " in markdown
