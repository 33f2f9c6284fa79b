"""`slipstream ab --model DIR --data FILE [--config RUN.yaml]`: the user's model and data in every
arm, named and fingerprinted in the record, kept apart by `slipstream report`; bad input refused."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.bench.ab_config import record_config
from slipstream.bench.command import ab_config, ab_config_from_args, add_ab_arguments
from slipstream.bench.inputs import model_fingerprint
from slipstream.bench.render import markdown_report
from slipstream.bench.report import load_records, report_rows, workload
from slipstream.bench.runner import ABConfig, parity_failures, prepare_bins, run_ab
from slipstream.cli import build_parser, main
from slipstream.data import demo_tokenizer
from slipstream.models import build_model

CHATS = [
    {
        "messages": [
            {"role": "user", "content": f"What is the colour of lantern number {i}?"},
            {"role": "assistant", "content": f"Lantern {i} glows {'amber' if i % 2 else 'teal'} at night."},
        ]
    }
    for i in range(60)
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model saved as a user's directory: weights, config, tokenizer with a chat template."""
    out = tmp_path_factory.mktemp("my-model")
    tokenizer = demo_tokenizer()
    model = build_model("llama", vocab_size=len(tokenizer), seed=3, dtype=torch.float32)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in CHATS))
    return path


def _config(model_dir, chats, **overrides) -> ABConfig:
    values = dict(
        model=str(model_dir),
        data=str(chats),
        response_only=True,
        max_seq_len=128,
        steps=3,
        warmup=1,
        threads=1,
        lora_rank=4,
        arms=("stock-packed", "slipstream"),
    )
    return ab_config(**{**values, **overrides})


def test_every_arm_trains_the_directory_weights_on_the_file_rows_and_the_record_names_both(
    model_dir, chats, tmp_path
):
    record = run_ab(_config(model_dir, chats, schedule="cosine", lr=1e-3), progress=False)
    assert parity_failures(record) == []
    for arm in ("stock-packed", "slipstream"):  # every step's learning rate is the run's schedule's
        lr = record["runs"][arm][0]["lr"]
        assert lr[0] == pytest.approx(1e-3) and lr == sorted(lr, reverse=True) and lr[-1] < lr[0], arm
    assert "cosine schedule" in markdown_report(record)
    model, data = record["inputs"]["model"], record["inputs"]["data"]
    assert model["kind"] == "model directory" and model["path"] == str(model_dir.resolve())
    assert model["sha256"] == model_fingerprint(str(model_dir))["sha256"]
    assert data["kind"] == "data file" and data["path"] == str(chats.resolve()) and len(data["sha256"]) == 64
    assert record["config"]["model"] == str(model_dir)
    # response-only: the labels are the assistant turns of the file's rows
    plan, _, _ = prepare_bins(_config(model_dir, chats, share_prefixes="off"))  # the rows whole
    tokenizer = demo_tokenizer()
    labelled = [t for d in plan[0][0] for t in d["labels"] if t != -100]
    assert "glows" in tokenizer.decode(labelled) and "What is" not in tokenizer.decode(labelled)


def test_report_keeps_different_models_and_data_apart_and_pools_the_same_bytes(model_dir, chats, tmp_path):
    base = {
        "kind": "slipstream-ab",
        "fingerprint": {"device": "cpu", "cpu": "x", "torch_threads": 2},
        "summary": {
            "stock-packed": {"attn_implementation": "sdpa"},
            "slipstream": {"attn_implementation": "d"},
        },
        "runs": {
            "stock-packed": [{"step_s": [1.0, 1.0, 1.0], "loss": [2.0] * 3}],
            "slipstream": [{"step_s": [0.5, 0.5, 0.5], "loss": [2.0] * 3}],
        },
    }

    def record(data_sha: str, path: str) -> dict:
        config = _config(model_dir, chats)
        return {
            **base,
            "config": {**record_config(config), "data": path},
            "inputs": {
                "model": model_fingerprint(str(model_dir)),
                "data": {"kind": "data file", "path": path, "sha256": data_sha, "bytes": 1},
            },
        }

    for name, (sha, path) in {
        "a": ("1" * 64, "/home/me/chats.jsonl"),
        "b": ("1" * 64, "/mnt/other/chats.jsonl"),  # the same bytes elsewhere: the same workload
        "c": ("2" * 64, "/home/me/chats.jsonl"),  # other bytes at the same path: not
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "ab.json").write_text(json.dumps(record(sha, path)))
    rows = report_rows(load_records([tmp_path]))
    assert sorted(r["records"] for r in rows) == [1, 2]
    labels = {r["workload"] for r in rows}
    assert any("chats.jsonl@11111111" in w for w in labels) and any(
        "chats.jsonl@22222222" in w for w in labels
    )
    assert all(model_dir.name in w for w in labels)
    old = {**base, "config": {**record("1" * 64, "x")["config"], "model": "qwen3", "data": None}}
    assert workload(old).startswith("qwen3 · demo rows")  # a record from before `inputs`


def test_config_file_gives_the_workload_and_options_on_the_command_line_win(model_dir, chats, tmp_path):
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model:\n  path: {model_dir}\n  dtype: bfloat16\n"
        f"data:\n  path: {chats}\n  response_only: true\n  max_seq_len: 96\n  overflow: split\n"
        "lora:\n  rank: 4\n  alpha: 8\n  target_modules: [q_proj, v_proj]\n"
        "optimizer:\n  lr: 0.001\ntraining:\n  steps: 500\n  grad_accum: 2\n"
        "speedups:\n  chunked_loss: false\nseed: 7\n"
    )
    parser = build_parser()
    config = ab_config_from_args(parser.parse_args(["ab", "--config", str(run), "--max-seq-len", "128"]))
    assert (
        config.model == str(model_dir)
        and config.train.data.path == str(chats)
        and config.train.data.response_only
    )
    assert (config.train.data.max_seq_len, config.train.data.overflow, config.train.model.dtype) == (
        128,
        "split",
        "bfloat16",
    )
    assert (config.lora_rank, config.train.lora.alpha, tuple(config.train.lora.target_modules)) == (
        4,
        8.0,
        ("q_proj", "v_proj"),
    )
    assert (
        config.train.optimizer.lr,
        config.train.seed,
        config.train.training.grad_accum,
        config.ab.steps,
    ) == (1e-3, 7, 2, 40)  # ab's own steps
    assert config.train.speedups.chunked_loss is False
    assert config.ab.train_config == str(run)
    # the command line's explicit value wins even where it equals ab's default
    explicit = ab_config_from_args(parser.parse_args(["ab", "--config", str(run), "--dtype", "float32"]))
    assert explicit.train.model.dtype == "float32"
    # without --config nothing changes: the defaults, as the benchmark scripts pass them
    import argparse

    script = argparse.ArgumentParser()
    add_ab_arguments(script, {"model": "qwen3", "max_seq_len": 512})
    assert (
        ab_config_from_args(script.parse_args([])).model,
        ab_config_from_args(script.parse_args([])).train.data.max_seq_len,
    ) == (
        "qwen3",
        512,
    )


def test_a_model_directory_trains_what_slipstream_train_would_and_the_record_says_so(
    model_dir, chats, fake_cpu_class
):
    """``ab --model DIR`` with nothing else: slipstream train's LoRA, learning rate, schedule and
    dtype (auto, decided by the faked CPU probe); a full fine-tune only when asked for."""
    from slipstream.train.config import LoraConfig, OptimizerConfig

    config = ab_config_from_args(build_parser().parse_args(["ab", "--model", str(model_dir)]))
    lora, optimizer = LoraConfig(), OptimizerConfig()
    assert (config.lora_rank, config.train.lora.alpha, tuple(config.train.lora.target_modules)) == (
        lora.rank,
        lora.alpha,
        tuple(lora.target_modules),
    )
    assert (config.train.optimizer.lr, config.train.optimizer.schedule) == (optimizer.lr, optimizer.schedule)
    assert config.train.model.dtype == ("float32" if fake_cpu_class == "avx2" else "bfloat16")
    assert config.defaults["source"] == "slipstream train's defaults (a model directory)"
    applied = config.defaults["fields"]
    assert applied["lora_rank"] == lora.rank and applied["schedule"] == "cosine"
    assert applied["dtype"].startswith(f"auto: {config.train.model.dtype} (this CPU has")
    explicit = ab_config_from_args(
        build_parser().parse_args(["ab", "--model", str(model_dir), "--lora-rank", "0", "--dtype", "float32"])
    )
    assert (explicit.lora_rank, explicit.train.model.dtype) == (0, "float32")  # a full fine-tune, asked for
    assert {"lora_rank", "lora_alpha", "dtype"}.isdisjoint(explicit.defaults["fields"])
    shape = ab_config_from_args(build_parser().parse_args(["ab"]))  # a built-in shape keeps the A/B's own
    assert (
        shape.lora_rank,
        shape.train.optimizer.lr,
        shape.train.optimizer.schedule,
        shape.train.model.dtype,
    ) == (0, 2e-3, "constant", "float32")
    assert shape.defaults["source"] == "the A/B's defaults for a built-in shape"


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"model": {"trust_remote_code": True}},
            "'model.trust_remote_code' is not supported by slipstream ab",
        ),
        ({"optimizer": {"lr": -1}}, "optimizer.lr"),
    ],
)
def test_a_config_file_an_ab_cannot_run_exactly_is_refused_naming_the_key(
    sections, message, model_dir, tmp_path, capsys
):
    import yaml

    run = tmp_path / "run.yaml"
    written = {"model": {"path": str(model_dir)}, "training": {"steps": 2}}
    for section, keys in sections.items():
        written[section] = {**written.get(section, {}), **keys}
    run.write_text(yaml.safe_dump(written))
    assert main(["ab", "--config", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_bad_models_and_data_are_one_line_errors(model_dir, chats, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    other = tmp_path / "other-model"  # another tokenizer's ids beyond this model's embeddings
    build_model("llama", vocab_size=64, seed=0, dtype=torch.float32).save_pretrained(other)
    demo_tokenizer().save_pretrained(other)
    cases = [
        (["--model", str(tmp_path / "nowhere")], "neither a built-in shape"),
        (["--model", str(not_a_model)], "no config.json"),
        (["--model", str(model_dir), "--layers", "1"], "runs as saved"),
        (["--model", str(model_dir), "--data", str(tmp_path / "missing.jsonl")], "no such file"),
        (["--model", str(model_dir), "--data", str(empty)], str(empty)),
        (["--model", str(other), "--data", str(chats)], "beyond the model's 64 embeddings"),
    ]
    capsys.readouterr()  # the set-up's own output (transformers' progress bars)
    for options, message in cases:
        code = main(["ab", *options, "--arms", "stock-packed", "--out", str(tmp_path / "out")])
        err = capsys.readouterr().err
        assert code == 2, (options, err)
        assert message in err and len(err.strip().splitlines()) == 1, (options, err)
    assert not (tmp_path / "out").exists()


def test_an_ab_longer_than_the_run_is_one_line_naming_the_file(model_dir, chats, tmp_path, capsys):
    """The A/B replays the run's first steps: more steps than the run trains is refused, not invented."""
    import yaml

    run = tmp_path / "run.yaml"
    run.write_text(
        yaml.safe_dump(
            {"model": {"path": str(model_dir)}, "data": {"path": str(chats)}, "training": {"steps": 3}}
        )
    )
    assert (
        main(
            [
                "ab",
                "--config",
                str(run),
                "--steps",
                "5",
                "--arms",
                "stock-packed",
                "--out",
                str(tmp_path / "out"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"slipstream ab: {run}: the run trains 3 optimizer steps (training.steps)"), err
    assert not (tmp_path / "out").exists()


def test_chat_template_renders_the_arms_rows_with_another_template(model_dir, chats, tmp_path):
    """``ab --chat-template FILE`` (or a train config's data.chat_template): the tokenizer every arm
    uses renders with that template, the samples differ accordingly, the record names the template."""
    from slipstream.bench.inputs import ab_tokenizer, data_fingerprint
    from slipstream.objectives.sft import SFT

    def ab_samples(config, tokenizer):  # the rows the run's objective reads, every arm's
        return SFT(config.train).samples(tokenizer)[0]

    template = tmp_path / "shouted.jinja"
    template.write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] | upper }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>ASSISTANT\n{% endif %}"
    )
    stock, other = _config(model_dir, chats), _config(model_dir, chats, chat_template=str(template))
    tokenizer = ab_tokenizer(other)
    assert tokenizer.chat_template == template.read_text() != ab_tokenizer(stock).chat_template
    own, shouted = ab_samples(stock, ab_tokenizer(stock)), ab_samples(other, tokenizer)
    assert own[0]["input_ids"] != shouted[0]["input_ids"]
    assert tokenizer.decode(shouted[0]["input_ids"]).startswith("<|im_start|>USER\n")
    assert "chat_template_sha256" in data_fingerprint(
        other
    ) and "chat_template_sha256" not in data_fingerprint(stock)
    parser = build_parser()
    assert ab_config_from_args(
        parser.parse_args(["ab", "--chat-template", str(template)])
    ).train.data.chat_template == str(template)
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model:\n  path: {model_dir}\ndata:\n  path: {chats}\n  chat_template: {template}\ntraining:\n  steps: 5\n"
    )
    assert ab_config(train_config=str(run)).train.data.chat_template == str(template)
    with pytest.raises(ValueError, match=f"^chat_template {tmp_path / 'nowhere.jinja'}: no such file"):
        _config(model_dir, chats, chat_template=str(tmp_path / "nowhere.jinja"))
