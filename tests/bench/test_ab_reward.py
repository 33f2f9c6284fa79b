"""``slipstream ab --objective reward``: the preset's arms, and one short real run against TRL's
``RewardTrainer`` on the same pairs, weights and seed."""

import json

import pytest

from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS
from slipstream.bench.command import ab_config
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import run_ab
from tests.bench.test_ab_dpo import ROWS


def test_the_reward_preset_holds_the_reward_models_pair_arms():
    assert ARM_PRESETS["reward"] == ("trl-reward", "slipstream-reward-no-prefix-sharing", "slipstream-reward")
    assert all(ARM_SPECS[arm].objective == "reward" and ARM_SPECS[arm].pairs for arm in ARM_PRESETS["reward"])
    with pytest.raises(ValueError, match="train another objective, reward \\(add --objective reward"):
        ab_config(arms=("slipstream-reward",))


@pytest.mark.slow
def test_a_short_reward_ab_trains_the_same_pairs_to_trls_losses(tmp_path):
    """The demo shape in fp32, three steps: step 0 (the same new score head, the same pairs) and every
    step after agree with TRL's RewardTrainer, loss and reward margin."""
    pytest.importorskip("trl")
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    arms = ARM_PRESETS["reward"]
    config = ab_config(
        model="demo", layers=2, data=str(path), objective="reward", arms=arms, steps=3, warmup=1,
        max_seq_len=256, lora_rank=4, lr=1e-3, dtype="float32", out_dir=str(tmp_path / "ab"),
    )  # fmt: skip
    record = run_ab(config, progress=False)
    first = record["runs"]["trl-reward"][0]["loss"][0]
    for arm in arms[1:]:
        assert record["runs"][arm][0]["loss"][0] == pytest.approx(first, rel=1e-5)
        summary = record["summary"][arm]
        assert summary["loss_vs_trl-reward"] in ("identical", "within tolerance"), summary["loss_parity"]
        assert summary["reward_margin_parity"]["verdict"] != "differs", summary["reward_margin_parity"]
        assert summary["host_syncs_per_step"] == 0
    assert "Preference pairs:" in markdown_report(record)
