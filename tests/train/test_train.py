"""`slipstream train`: it trains, saves a loadable adapter, resumes exactly, and refuses bad input clearly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from slipstream.cli import main
from slipstream.train.config import ConfigError, load_config
from slipstream.train.loop import newest_checkpoint, train

TINY = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 120, "max_seq_len": 256},
    "lora": {"enabled": True, "rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 12, "checkpoint_every": 4},
    "seed": 0,
}


def write_config(tmp_path: Path, data: dict, name="config.yaml") -> Path:
    path = tmp_path / name
    data = {**data, "output_dir": str(tmp_path / "out")} if "output_dir" not in data else data
    path.write_text(yaml.safe_dump(data))
    return path


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_trains_and_the_adapter_reproduces_the_trained_logits(tmp_path):
    from peft import PeftModel

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    config = load_config(write_config(tmp_path, TINY))
    model, summary = train(config, progress=False)
    curve = losses(tmp_path / "out")
    assert len(curve) == 12 and sum(curve[-4:]) < sum(curve[:4])
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    base = build_model("qwen3", vocab_size=len(demo_tokenizer()), seed=0)
    loaded = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - trained).abs().max().item() <= 1e-5
    written = json.loads((tmp_path / "out" / "run.json").read_text())
    assert written["status"] == "finished"
    # utilisation: model FLOPs per token (linears and LoRA, plus the head's and attention's share),
    # MFU over steps 2..12 (the first is warm-up) against the peak measured in the run's dtype
    from slipstream.utilisation import flop_profile

    profile = flop_profile(model)
    per_token = written["model_flops_per_token"]
    # at most what a whole labelled 256-token document costs per token (the longest attention)
    assert profile.token_flops < per_token <= profile.micro_batch_flops([256], 256) / 256
    assert written["mfu_steps"] == 11 and 0 < written["mfu"] < 1.5
    assert written["matmul_peak"]["dtype"] == "float32" and written["matmul_peak"]["flops_per_s"] > 0
    assert written["achieved_tflops"] * 1e12 == pytest.approx(
        written["mfu"] * written["matmul_peak"]["flops_per_s"]
    )
    # every micro-batch's packed attention counted once, grouped or per document; each layer's call too
    grouping = written["attention_grouping_counts"]
    batches = grouping["batches_grouped"] + grouping["batches_per_document"]
    assert batches >= 12 and grouping["calls_grouped"] + grouping["calls_per_document"] >= 2 * batches


@pytest.mark.parametrize("four_bit", [False, True])
@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_trains_a_saved_model_directory(tmp_path, family, four_bit):
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    tokenizer = demo_tokenizer()
    build_model(family, vocab_size=len(tokenizer)).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    data = {
        **TINY,
        "model": {"path": str(tmp_path / "base")},
        "quantization": {"four_bit": four_bit},
        "lora": {**TINY["lora"], "target_modules": ["q_proj", "v_proj"], "experts": family == "qwen3-moe"},
        "training": {"steps": 4},
    }
    model, summary = train(load_config(write_config(tmp_path, data)), progress=False)
    assert summary["steps"] == 4 and all(map(lambda x: x == x, losses(tmp_path / "out")))  # finite
    if family == "qwen3-moe":
        assert (tmp_path / "out" / "adapter" / "experts" / "expert_lora.safetensors").exists()


def run_cli(args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "slipstream", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def killed_pid(done: subprocess.CompletedProcess) -> int:
    return int(done.stdout.split("fault_runner pid ", 1)[1].split()[0])


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_killed_run_resumes_to_the_same_losses(tmp_path):
    full = write_config(tmp_path, {**TINY, "output_dir": str(tmp_path / "full")}, "full.yaml")
    part = write_config(tmp_path, {**TINY, "output_dir": str(tmp_path / "part")}, "part.yaml")
    assert run_cli(["train", str(full)]).returncode == 0
    killed = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("fault_runner.py")),
            "--kill-after",
            "6",
            "train",
            str(part),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9  # SIGKILL
    assert newest_checkpoint(tmp_path / "part").name == "step-000004"
    # a checkpoint caught mid-write is never picked up
    (tmp_path / "part" / "checkpoints" / ".step-000008.tmp-123").mkdir()
    (tmp_path / "part" / "checkpoints" / "step-000010").mkdir()  # no state.json: incomplete
    assert newest_checkpoint(tmp_path / "part").name == "step-000004"
    stale = json.loads((tmp_path / "part" / ".slipstream-run.lock").read_text())  # the killed run's lock
    assert stale["pid"] == killed_pid(killed)
    resumed = run_cli(["train", str(part), "--resume"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert f"took over the lock of a run that is no longer running (pid {stale['pid']} on " in resumed.stderr
    assert not (tmp_path / "part" / ".slipstream-run.lock").exists()  # released at the end
    reference, again = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert len(again) == len(reference) == 12
    for step in range(4, 12):
        assert abs(again[step] - reference[step]) <= 1e-6, step


def test_config_errors_name_the_key_and_the_closest_valid_one(tmp_path, capsys):
    bad = write_config(tmp_path, {**TINY, "lora": {"rnak": 4}})
    assert main(["train", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "unknown key 'lora.rnak'" in err and "did you mean 'lora.rank'" in err
    with pytest.raises(ConfigError, match=r"config.yaml:\d+: 'optimizer.lr' must be a number, got 'fast'"):
        load_config(write_config(tmp_path, {**TINY, "optimizer": {"lr": "fast"}}))
    with pytest.raises(ConfigError, match="exactly one of 'training.steps'"):
        load_config(write_config(tmp_path, {**TINY, "training": {"steps": 3, "epochs": 1}}))
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  preset: qwen3\n data: [\n")
    with pytest.raises(ConfigError, match=r"broken.yaml:\d+: invalid YAML"):
        load_config(broken)
    (tmp_path / "latin1.yaml").write_bytes("seed: 0 # caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "latin1.yaml")
    assert load_config(write_config(tmp_path, TINY), ["optimizer.lr=0.5"]).optimizer.lr == 0.5


def test_bad_data_and_bad_directories_fail_cleanly(tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"text": "fine row"}\n{"text": \n')
    config = write_config(tmp_path, {**TINY, "data": {"path": str(rows), "max_seq_len": 64}})
    assert main(["train", str(config)]) == 1
    assert "rows.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "out" / "adapter").exists()

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    config = write_config(
        tmp_path, {**TINY, "data": {"path": str(empty)}, "output_dir": str(tmp_path / "o2")}
    )
    assert main(["train", str(config)]) == 1
    assert "empty.jsonl" in capsys.readouterr().err

    from slipstream.models import build_model

    build_model("llama").save_pretrained(tmp_path / "no_tokenizer")
    config = write_config(
        tmp_path,
        {**TINY, "model": {"path": str(tmp_path / "no_tokenizer")}, "output_dir": str(tmp_path / "o3")},
    )
    assert main(["train", str(config)]) == 1
    assert "no usable tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_long_samples_are_counted_under_each_policy(tmp_path, overflow):
    rows = tmp_path / "long.jsonl"
    rows.write_text("\n".join(json.dumps({"text": " ".join(["word"] * n)}) for n in (5, 300, 8, 12)) + "\n")
    data = {
        **TINY,
        "data": {"path": str(rows), "max_seq_len": 64, "overflow": overflow},
        "training": {"steps": 2},
    }
    _, summary = train(load_config(write_config(tmp_path, data)), progress=False)
    assert ("1 truncated" if overflow == "truncate" else "1 split into") in summary["packing"]


def test_a_finished_run_is_not_overwritten_without_asking(tmp_path, capsys):
    config = write_config(tmp_path, {**TINY, "training": {"steps": 2}})
    assert main(["train", str(config)]) == 0
    before = (tmp_path / "out" / "run.json").read_text()
    assert main(["train", str(config)]) == 1
    assert "already holds a finished run" in capsys.readouterr().err
    assert (tmp_path / "out" / "run.json").read_text() == before
    assert main(["train", str(config), "--overwrite"]) == 0


def test_every_example_config_is_valid(tmp_path):
    from tests.reward_stand_in import stand_in_reward_models

    for path in sorted(Path(__file__).resolve().parents[2].joinpath("examples").glob("*.yaml")):
        # a reward model an earlier walk-through stage exports (rlhf-grpo.yaml): a tiny one in its place
        config = load_config(path, stand_in_reward_models(path, tmp_path / path.stem))
        assert config.output_dir, path


def test_the_tiny_example_learns_and_its_adapter_loads_back(tmp_path):
    from peft import PeftModel

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    example = Path(__file__).resolve().parents[2] / "examples" / "tiny.yaml"
    config = load_config(example, [f"output_dir={tmp_path / 'tiny'}", "model.dtype=float32"])
    model, _ = train(config, progress=False)
    curve = losses(tmp_path / "tiny")
    assert sum(curve[-5:]) / 5 < sum(curve[:5]) / 5 - 1.0  # clearly falls
    ids = torch.tensor([[5, 17, 99, 3, 42, 7, 250]])
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=ids).logits
    base = build_model(config.model.preset, vocab_size=len(demo_tokenizer()), seed=config.seed)
    loaded = PeftModel.from_pretrained(base, tmp_path / "tiny" / "adapter").eval()
    with torch.no_grad():
        assert (loaded(input_ids=ids).logits - trained).abs().max().item() <= 1e-5


def test_missing_and_non_utf8_data_files_name_the_file(tmp_path, capsys):
    config = write_config(tmp_path, {**TINY, "data": {"path": str(tmp_path / "nowhere.jsonl")}})
    assert main(["train", str(config)]) == 1
    assert "nowhere.jsonl" in capsys.readouterr().err
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    config = write_config(
        tmp_path, {**TINY, "data": {"path": str(latin)}, "output_dir": str(tmp_path / "o4")}
    )
    assert main(["train", str(config)]) == 1
    assert "latin.jsonl:2" in capsys.readouterr().err
    assert not (tmp_path / "o4" / "adapter").exists()
