"""Every example config A/Bs as ``train`` runs it: ``ab --config examples/X.yaml`` replays the run
``train`` plans (issue 62), so its slipstream arm's step 0 is ``train``'s own, loss and gradient norm.

An example that names a model or data file not on this machine gets a tiny random model of the same
family (the demo tokenizer and its ChatML template; Qwen3's real tokenizer where the example renders
tool calls) and the walk-through's chats, and every run is cut to 2 steps of at most 1,024 tokens
a micro-batch; the same ``--set``s go to ``train`` and to ``ab``, so both read the same file alike.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml

from slipstream.bench.command import ab_config
from slipstream.bench.runner import prepare_bins, run_arm
from slipstream.objectives import objective_for
from slipstream.train.config import load_config
from slipstream.train.loop import train

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(path.name for path in (ROOT / "examples").glob("*.yaml"))
CHATS = ROOT / "examples" / "data" / "chats.jsonl"
# the presets' own examples run in the default suite; those that load a model directory take longer
QUICK = {"tiny.yaml", "tiny-lora.yaml"}
# the slipstream arm of each kind of objective
ARM = {
    "samples": "slipstream",
    "pairs": "slipstream-{objective}",
    "rows": "slipstream-{objective}",  # KTO's unpaired rows
    "prompts": "slipstream-grpo",
}


def _family(path: str) -> str:
    """The built-in shape closest to the model an example names (its tiny stand-in)."""
    name = path.lower()
    return "gpt-oss" if "gpt-oss" in name else "llama" if "llama" in name else "qwen3"


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory, qwen3_tokenizer):
    """(family, tools) -> a tiny random model directory with the demo tokenizer, or with tools Qwen3's
    real tokenizer (its tool-call format)."""
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    made: dict[tuple[str, bool], Path] = {}

    def tiny(family: str, tools: bool) -> Path:
        if (family, tools) not in made:
            tokenizer = qwen3_tokenizer if tools else demo_tokenizer()
            folder = tmp_path_factory.mktemp(f"tiny-{family}")
            build_model(family, vocab_size=len(tokenizer), dtype=torch.float32).save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            made[family, tools] = folder
        return made[family, tools]

    return tiny


def _sets(name: str, tiny_dirs, out: Path) -> list[str]:
    """The ``--set``s that run example ``name`` here: a stand-in for what is not on disk, 2 steps."""
    path = ROOT / "examples" / name
    raw = yaml.safe_load(path.read_text())
    sets = ["training.steps=2", "training.epochs=null", f"output_dir={out}"]
    model = raw.get("model", {}).get("path")
    if model is not None and not (path.parent / model).is_dir():
        tools = "tools" in str(raw.get("data", {}).get("chat_template"))
        sets.append(f"model.path={tiny_dirs(_family(model), tools)}")
    data = raw.get("data", {}).get("path")
    if data is not None and not (path.parent / data).exists():
        sets.append(f"data.path={CHATS}")
    from tests.reward_stand_in import stand_in_reward_models

    # a reward model an earlier walk-through stage exports (rlhf-grpo.yaml): a tiny one in its place
    sets += stand_in_reward_models(path, out.parent / "reward-models")
    if raw.get("lora", {}).get("dropout"):
        sets.append("lora.dropout=0")  # an A/B runs without dropout (each arm would draw its own masks)
    if raw.get("data", {}).get("max_seq_len", 1024) > 1024:
        sets.append("data.max_seq_len=1024")  # the chats are short: a long budget only costs time here
    return sets


def _trains_step_1(path: Path, sets: list[str], out: Path) -> dict:
    """``slipstream train`` on the file with ``sets``: its first trained step's record (an evaluation at
    start comes first)."""
    train(load_config(path, sets), progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in records if "loss" in r)


def _own_arm(config) -> str:
    objective = config.training.objective
    return ARM[objective_for(objective).reads].format(objective=objective)


@pytest.mark.parametrize("name", sorted(QUICK))
def test_the_examples_slipstream_arm_steps_as_train_does(name, tiny_dirs, tmp_path):
    """In this process, through ``ab``'s own config and arm runner (the CLI below takes a minute an example)."""
    path = ROOT / "examples" / name
    sets = _sets(name, tiny_dirs, tmp_path / "out")
    logged = _trains_step_1(path, sets, tmp_path / "out")
    arm = _own_arm(load_config(path, sets))
    ab = ab_config(sets, train_config=str(path), arms=(arm,), steps=2, warmup=1)
    plan, vocab, _ = prepare_bins(ab)
    result = run_arm(dataclasses.asdict(ab), arm, plan, vocab)
    assert (result["loss"][0], result["grad_norm"][0]) == (logged["loss"], logged["grad_norm"]), name


# an example of each objective's preset and the 4-bit MoE one run every arm of their preset (a minute or
# more an arm here); the others run their own slipstream arm
WHOLE_PRESET = {"tiny.yaml", "dpo.yaml", "orpo.yaml", "grpo.yaml", "gpt-oss-20b-qlora.yaml"}


@pytest.mark.slow  # each arm in its own process
@pytest.mark.parametrize("name", EXAMPLES)
def test_ab_config_exits_0_on_every_example_and_its_arm_steps_as_train_does(
    name, tiny_dirs, tmp_path, capsys
):
    """``slipstream ab --config examples/X.yaml`` as a user runs it, 2 steps, with its objective's preset
    (peers included, a peer that cannot run here skipped with its reason) or its slipstream arm alone,
    on one thread as this test's ``train`` runs: exit 0, and the slipstream arm's step 0 is ``train``'s."""
    from slipstream.cli import main

    path = ROOT / "examples" / name
    sets = _sets(name, tiny_dirs, tmp_path / "run")
    logged = _trains_step_1(path, sets, tmp_path / "run")
    arm = _own_arm(load_config(path, sets))
    argv = ["ab", "--config", str(path), *[w for s in sets for w in ("--set", s)], "--steps", "2"]
    argv += ["--warmup", "1", "--threads", str(torch.get_num_threads()), "--out", str(tmp_path / "ab")]
    argv += [] if name in WHOLE_PRESET else ["--arms", arm]
    assert main(argv) == 0, capsys.readouterr().err
    run = json.loads((tmp_path / "ab" / "ab.json").read_text())["runs"][arm][0]
    assert (run["loss"][0], run["grad_norm"][0]) == (logged["loss"], logged["grad_norm"]), name
