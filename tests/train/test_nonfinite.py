"""A diverged run never reports success and never loses what was finite (``training.on_nonfinite``).

The divergence is real (a learning rate of 1e38 on the tiny run) or a poisoned batch
(``fault_runner.nonfinite_at``: one step's loss made infinite, the weights left alone).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from slipstream.cli import main
from slipstream.train.checkpoints import (
    STATE,
    TRAINER_STATE,
    WEIGHTS,
    DamagedCheckpoint,
    prune_checkpoints,
    read_checkpoint,
    save_checkpoint,
)
from slipstream.train.errors import TrainError
from slipstream.train.loop import train
from slipstream.train.step import train_step

from .fault_runner import nonfinite_at
from .test_checkpoints import FAULT_RUNNER, tiny_config
from .test_train import TINY


def _strict_json(text: str):
    def refuse(token):
        raise ValueError(f"non-finite {token} in JSON")

    return json.loads(text, parse_constant=refuse)


def assert_nothing_nonfinite(out: Path) -> None:
    """Every file slipstream wrote in ``out``: JSON strict, tensors finite."""
    for path in out.rglob("*"):
        if path.suffix == ".json":
            _strict_json(path.read_text())
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                _strict_json(line)
        elif path.suffix == ".safetensors":
            for name, tensor in load_file(str(path)).items():
                assert torch.isfinite(tensor).all(), f"{path}: {name}"
        elif path.name == TRAINER_STATE:
            state = torch.load(path, weights_only=True)["optimizer"]["state"]
            for values in state.values():
                for tensor in values.values():
                    assert torch.isfinite(tensor).all(), path


def _config_file(tmp_path: Path, **training) -> Path:
    data = {**TINY, "training": {**TINY["training"], **training}, "output_dir": str(tmp_path / "out")}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_diverged_run_stops_non_zero_and_leaves_nothing_non_finite(tmp_path, capsys):
    """The issue's run: a learning rate of 1e38 (reached over a warmup, so some steps are finite)."""
    config = _config_file(tmp_path, checkpoint_every=1, keep_checkpoints=2)
    out = tmp_path / "out"
    diverge = [
        "--set",
        "optimizer.lr=1e38",
        "--set",
        "optimizer.warmup_steps=100",
        "--set",
        "optimizer.schedule=linear",
    ]
    assert main(["train", str(config), *diverge]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("slipstream train: step ") and "the run stopped" in err, err
    step = int(err.split("step ", 1)[1].split(" ", 1)[0])
    assert step > 2, err  # some finite steps first (else this test shows nothing)
    assert not (out / "adapter").exists() and not (out / "run.json").exists()
    assert_nothing_nonfinite(out)
    kept = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert kept == [f"step-{step - 2:06d}", f"step-{step - 1:06d}"]  # pruning kept the finite ones


def test_stop_names_the_checkpoint_to_go_back_to_and_resume_continues_from_it(tmp_path, capsys):
    config = _config_file(tmp_path, checkpoint_every=1, keep_checkpoints=3)
    out = tmp_path / "out"
    with nonfinite_at({6}):  # a bad batch at step 6
        assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "slipstream train: step 6 of 12: loss is inf and the gradient norm is nan (training.on_nonfinite: stop): "
        "the run stopped; nothing of that step was applied or written; the last finite checkpoint to go back "
        f"to is {out}/checkpoints/step-000004 (step-000005 is passed over: its weights would compute step 6 "
        "again): run the same command with --resume --force --set optimizer.lr=0.001 (a lower learning rate) "
        "to continue from it"
    ), err
    records = [_strict_json(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert records[-1] == {
        **records[-1],
        "step": 6,
        "loss": None,
        "nonfinite": ["loss", "grad_norm"],
        "skipped": False,
    }
    assert_nothing_nonfinite(out)
    assert main(["train", str(config), "--resume", "--force", "--set", "optimizer.lr=1e-3"]) == 0
    summary = json.loads((out / "run.json").read_text())
    assert summary["resumed"]["step"] == 4 and summary["skipped_nonfinite_steps"] == 0
    assert [
        "step-000005: its weights computed the non-finite step 6" in why
        for why in summary["resumed"]["skipped_damaged"]
    ] == [True]
    lrs = [record["lr"] for record in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    assert lrs == [1e-2] * 4 + [1e-3] * 8  # the new lr applies (the checkpoint's optimizer held 1e-2)
    assert_nothing_nonfinite(out)


def test_skip_resumes_from_the_checkpoint_a_stop_passed_over(tmp_path):
    config = _config_file(tmp_path, checkpoint_every=1)
    with nonfinite_at({6}):
        assert main(["train", str(config)]) == 1
    assert main(["train", str(config), "--resume", "--set", "training.on_nonfinite=skip"]) == 0
    assert json.loads((tmp_path / "out" / "run.json").read_text())["resumed"]["step"] == 5


def test_skip_drops_the_update_counts_and_logs_it(tmp_path, monkeypatch):
    import slipstream.train.loop as loop

    config = tiny_config(
        tmp_path, tmp_path / "out", "training.on_nonfinite=skip", "training.checkpoint_every=2"
    )
    weights = {}
    real = loop._train_step

    def recording(run, step):
        result = real(run, step)
        weights[step + 1] = {
            n: p.detach().clone() for n, p in run.driver.model.named_parameters() if p.requires_grad
        }
        return result

    monkeypatch.setattr(loop, "_train_step", recording)
    with nonfinite_at({3, 4}):
        _, summary = train(config, progress=False)
    assert summary["skipped_nonfinite_steps"] == 2 and math.isfinite(summary["final_loss"])
    for name, tensor in weights[2].items():  # steps 3 and 4: no update at all
        assert torch.equal(weights[3][name], tensor) and torch.equal(weights[4][name], tensor), name
    assert any(not torch.equal(weights[5][name], tensor) for name, tensor in weights[4].items())
    records = [_strict_json(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if "nonfinite" in r]
    assert [r["step"] for r in skipped] == [3, 4] and all(r["skipped"] for r in skipped)
    assert skipped[0]["nonfinite"] == ["loss", "grad_norm"] and skipped[0]["loss"] is None
    assert_nothing_nonfinite(tmp_path / "out")


def test_skip_stops_after_too_many_in_a_row(tmp_path):
    config = tiny_config(
        tmp_path, tmp_path / "out", "training.on_nonfinite=skip", "training.max_consecutive_skips=2"
    )
    with (
        nonfinite_at({3, 5, 6}),
        pytest.raises(TrainError, match=r"step 6 of 12: loss is inf.*2 non-finite steps in a row"),
    ):
        train(config, progress=False)  # 3 alone is skipped; 5 and 6 in a row stop it


def test_the_step_reads_the_device_once():
    """Loss and grad norm come to the host in one read, before the update: no extra sync for the check."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    class Out:
        def __init__(self, loss):
            self.loss = loss

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, input_ids, num_items_in_batch):
            return Out(self.inner(input_ids).sum() / num_items_in_batch)

    reads = []
    originals = {name: getattr(torch.Tensor, name) for name in ("item", "tolist", "__float__", "__bool__")}

    def counting(name):
        def read(self, *args):
            reads.append(name)
            return originals[name](self, *args)

        return read

    batch = ({"input_ids": torch.randn(3, 4)}, 3)
    try:
        for name in originals:
            setattr(torch.Tensor, name, counting(name))
        result = train_step(Wrapped(), [batch, batch], optimizer)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
    assert result["finite"] and reads == ["tolist"], reads
    before = model.weight.detach().clone()
    poisoned = ({"input_ids": torch.full((3, 4), float("inf"))}, 3)
    result = train_step(Wrapped(), [poisoned], optimizer)
    assert not result["finite"] and not math.isfinite(result["loss"]) and torch.equal(model.weight, before)
    assert all(p.grad is None for p in model.parameters())


def test_an_update_that_overflows_the_weights_stops_before_any_write(tmp_path, capsys):
    """Finite loss and grad norm, but the update itself overflows: caught before the checkpoint."""
    config = _config_file(tmp_path, checkpoint_every=1)
    assert main(["train", str(config), "--set", "optimizer.lr=1e38"]) == 1  # fp32, no warmup: inf at once
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("slipstream train: step 1 of 12: its update made the trainable weight '") and (
        "no earlier checkpoint to go back to: run the same command with --overwrite" in err
    ), err
    assert not (tmp_path / "out" / "checkpoints").exists()
    assert_nothing_nonfinite(tmp_path / "out")


def test_nothing_nonfinite_is_written_or_pruned_for(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    out = tmp_path / "out"
    for step in (1, 2):
        save_checkpoint(out, step, model, optimizer, scheduler, loss=1.0)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(
        TrainError, match=r"step-000003: not written: the trainable weight 'weight' holds NaN"
    ):
        save_checkpoint(out, 3, model, optimizer, scheduler, loss=1.0)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]
    # What an older slipstream left: a newer checkpoint with a NaN loss and NaN weights.
    legacy = out / "checkpoints" / "step-000003"
    legacy.mkdir()
    save_file(
        {"weight": model.weight.detach().clone(), "bias": model.bias.detach().clone()}, str(legacy / WEIGHTS)
    )
    torch.save(
        torch.load(out / "checkpoints" / "step-000002" / TRAINER_STATE, weights_only=True),
        legacy / TRAINER_STATE,
    )
    (legacy / STATE).write_text('{"format": 1, "step": 3, "loss": NaN}')
    assert prune_checkpoints(out, keep=1, newest_step=3) == [out / "checkpoints" / "step-000001"]
    assert (out / "checkpoints" / "step-000002").is_dir()  # the newest finite one stays
    with pytest.raises(DamagedCheckpoint, match="'weight' holds NaN or infinite values"):
        read_checkpoint(legacy)


@pytest.mark.multiprocess
@pytest.mark.parametrize("policy", [pytest.param("skip", marks=pytest.mark.slow), "stop"])
def test_every_rank_decides_the_same(tmp_path, policy):
    """One rank's batch goes non-finite: both ranks skip it (or both stop), none hangs."""
    torchrun = Path(sys.executable).with_name("torchrun")
    config = _config_file(tmp_path, steps=4, on_nonfinite=policy)
    done = subprocess.run(
        [str(torchrun), "--nproc_per_node", "2", str(FAULT_RUNNER), "--nonfinite-at", "2", "--rank", "1"]
        + ["train", str(config)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    records = [_strict_json(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    if policy == "skip":
        assert done.returncode == 0, done.stderr[-3000:]
        assert [r["step"] for r in records if "nonfinite" in r] == [2]
        assert json.loads((tmp_path / "out" / "run.json").read_text())["skipped_nonfinite_steps"] == 1
    else:
        assert done.returncode != 0
        assert done.stderr.count("step 2 of 4: loss is inf") == 2, done.stderr[-3000:]  # each rank says it
        assert records[-1]["step"] == 2 and not (tmp_path / "out" / "adapter").exists()
