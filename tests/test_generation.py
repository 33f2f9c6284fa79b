"""`slipstream generate`: a run's base model + adapter, greedy like PeftModel's own generate, streamed;
bad input is one line naming the path."""

import io
import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

import slipstream
from slipstream.cli import main

from .engines.test_vllm_engine import fake_workers, use_fake_engine

RUN = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 40, "max_seq_len": 128},
    "lora": {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 3},
    "seed": 0,
}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, _session_demo_tokenizer) -> Path:
    """A finished tiny run (3 steps of LoRA on the built-in data), shared by this module's tests."""
    from slipstream.train.config import load_config
    from slipstream.train.loop import train

    root = tmp_path_factory.mktemp("generate-run")
    cache = root / "cache"
    cache.mkdir()
    (cache / _session_demo_tokenizer.name).symlink_to(_session_demo_tokenizer, target_is_directory=True)
    (root / "config.yaml").write_text(yaml.safe_dump({**RUN, "output_dir": str(root / "out")}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SLIPSTREAM_CACHE", str(cache))
        train(load_config(root / "config.yaml"), progress=False)
    return root / "out"


def manual_greedy(run_dir: Path, prompt: str, max_new_tokens: int) -> str:
    """What PEFT and transformers give by hand: the preset rebuilt with the run's seed, the adapter, greedy."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from slipstream.models import build_model

    tokenizer = AutoTokenizer.from_pretrained(run_dir / "adapter")
    base = build_model("qwen3", vocab_size=len(tokenizer), seed=0, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, run_dir / "adapter").eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def test_generate_matches_peft_greedy_by_hand(run_dir):
    prompts = ["What is the capital of France?", "Write a line about the sea."]
    texts = slipstream.generate(run_dir, prompts, max_new_tokens=12)
    assert len(texts) == 2 and all(isinstance(text, str) and text for text in texts)
    assert texts == [manual_greedy(run_dir, prompt, 12) for prompt in prompts]
    assert slipstream.generate(run_dir / "adapter", prompts[0], max_new_tokens=12) == texts[:1]


def test_a_run_without_lora_generates_from_its_saved_model(tmp_path):
    from slipstream.generation import load_generator
    from slipstream.train.config import load_config
    from slipstream.train.loop import train

    data = {**RUN, "lora": {"enabled": False}, "training": {"steps": 1}, "output_dir": str(tmp_path / "out")}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    train(load_config(tmp_path / "config.yaml"), progress=False)
    generator = load_generator(tmp_path / "out")
    assert "fine-tuned model" in generator.source and not hasattr(generator.model, "peft_config")
    assert generator.model.config._attn_implementation in ("sdpa", "eager")  # not the packed training one
    assert isinstance(generator.generate("hello", max_new_tokens=6), str)


def test_a_moe_run_with_expert_lora_generates_with_its_expert_adapters(tmp_path):
    from slipstream.generation import load_generator
    from slipstream.moe.lora import expert_lora_state_dict
    from slipstream.train.config import load_config
    from slipstream.train.loop import train

    data = {
        **RUN,
        "model": {"preset": "qwen3-moe", "dtype": "float32"},
        "lora": {**RUN["lora"], "experts": True},
        "training": {"steps": 2},
        "output_dir": str(tmp_path / "out"),
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(data))
    trained, _ = train(load_config(tmp_path / "config.yaml"), progress=False)
    generator = load_generator(tmp_path / "out")
    loaded = expert_lora_state_dict(generator.model)
    saved = expert_lora_state_dict(trained)
    assert loaded and loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[name], saved[name].detach()) for name in saved)
    ids = torch.tensor([[5, 17, 99, 3, 42, 7]])
    trained.eval()
    with torch.no_grad():  # the expert adapters take part in the forward, as in training
        assert (generator.model(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max() <= 1e-5
    assert isinstance(generator.generate("hello", max_new_tokens=6), str)


def test_sampling_is_reproducible_by_seed(run_dir):
    first = slipstream.generate(run_dir, "hello", max_new_tokens=10, sample=True, temperature=1.5, seed=3)
    again = slipstream.generate(run_dir, "hello", max_new_tokens=10, sample=True, temperature=1.5, seed=3)
    assert first == again


def test_generation_uses_stock_attention(run_dir):
    from slipstream.generation import load_generator

    generator = load_generator(run_dir)
    assert generator.model.config._attn_implementation in ("sdpa", "eager")
    assert getattr(generator.model.get_base_model(), "slipstream", None) is None  # never optimized


def test_the_cli_streams_each_answer(run_dir, capsys, monkeypatch):
    from transformers import TextStreamer

    chunks = []
    original = TextStreamer.on_finalized_text

    def spy(self, text, stream_end=False):
        chunks.append(text)
        original(self, text, stream_end)

    monkeypatch.setattr(TextStreamer, "on_finalized_text", spy)
    expected = slipstream.generate(run_dir, "hello", max_new_tokens=12)[0]
    assert main(["generate", str(run_dir), "--prompt", "hello", "--max-new-tokens", "12"]) == 0
    captured = capsys.readouterr()
    assert captured.out == expected + "\n"
    assert len([chunk for chunk in chunks if chunk]) > 1  # printed piece by piece, not at the end
    assert "adapter" in captured.err  # what was loaded, on stderr


def test_the_cli_reads_a_prompt_file_and_stdin_lines(run_dir, tmp_path, capsys, monkeypatch):
    expected = slipstream.generate(run_dir, ["hello", "the sea"], max_new_tokens=6)
    (tmp_path / "prompts.txt").write_text("hello\n\nthe sea\n")
    assert (
        main(["generate", str(run_dir), "--file", str(tmp_path / "prompts.txt"), "--max-new-tokens", "6"])
        == 0
    )
    out = capsys.readouterr().out
    assert out == f"> hello\n{expected[0]}\n\n> the sea\n{expected[1]}\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nthe sea\n"))
    assert main(["generate", str(run_dir), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == out


def test_the_cli_loops_on_a_terminal_until_an_empty_line(run_dir, capsys, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    answers = iter(["hello", ""])
    monkeypatch.setattr(sys, "stdin", Terminal())
    monkeypatch.setattr("builtins.input", lambda prompt="": next(answers))
    expected = slipstream.generate(run_dir, "hello", max_new_tokens=6)[0]
    assert main(["generate", str(run_dir), "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected + "\n"


def _unfinished_run(tmp_path: Path) -> Path:
    run = tmp_path / "unfinished"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / ".slipstream-run").write_text("{}")
    (run / "config.json").write_text(json.dumps({"model": {"preset": "qwen3"}, "lora": {}, "training": {}}))
    return run


def _hub_adapter(tmp_path: Path) -> Path:
    adapter = tmp_path / "hub-adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/some-model"}))
    return adapter


def _gone_base(tmp_path: Path) -> Path:
    run = tmp_path / "gone"
    (run / "adapter").mkdir(parents=True)
    (run / "adapter" / "adapter_config.json").write_text("{}")
    (run / ".slipstream-run").write_text("{}")
    config = {"model": {"path": str(tmp_path / "deleted-model")}, "lora": {}, "training": {"steps": 1}}
    (run / "config.json").write_text(json.dumps(config))
    (run / "adapter" / "tokenizer_config.json").write_text("{}")
    return run


@pytest.mark.parametrize(
    "make, extra, message",
    [
        (lambda tmp: tmp / "nowhere", [], r"nowhere: no such run or adapter directory"),
        (
            _unfinished_run,
            [],
            r"unfinished: no adapter/ \(the run has not finished; its newest checkpoint is "
            r"step-000004",
        ),
        (
            _hub_adapter,
            [],
            r"hub-adapter: the adapter's base model 'org/some-model' is not a local directory",
        ),
        (_gone_base, [], r"gone: the run's base model .*deleted-model is not a local directory any more"),
        (lambda tmp: tmp, ["--file", "EMPTY"], r"empty\.txt: no prompts in the file"),
        (lambda tmp: tmp, ["--file", "MISSING"], r"missing\.txt: no such prompt file"),
        (lambda tmp: tmp, ["--prompt", "x", "--temperature", "0.7"], r"add --sample"),
        (lambda tmp: tmp, ["--prompt", "x", "--sample", "--top-p", "0"], r"top_p must be in \(0, 1\]"),
    ],
    ids=[
        "missing-dir",
        "unfinished-run",
        "hub-adapter",
        "base-gone",
        "empty-prompts",
        "missing-prompts",
        "temp-no-sample",
        "bad-top-p",
    ],
)
def test_bad_input_is_one_line_naming_it(tmp_path, capsys, monkeypatch, make, extra, message):
    import re

    (tmp_path / "empty.txt").write_text("\n  \n")
    extra = [
        {"EMPTY": str(tmp_path / "empty.txt"), "MISSING": str(tmp_path / "missing.txt")}.get(a, a)
        for a in extra
    ]
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # never waits on the terminal
    assert main(["generate", str(make(tmp_path)), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("slipstream generate: ")
    assert re.search(message, err), err


def test_no_prompt_anywhere_is_one_line(run_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    assert main(["generate", str(run_dir)]) == 1
    assert capsys.readouterr().err == (
        "slipstream generate: no prompt: give --prompt, --file, or prompts on stdin (one per line)\n"
    )


# ------------------------------------------------------------------------------- --engine vllm
@pytest.fixture
def engine_requests(tmp_path, monkeypatch) -> Path:
    """The stand-in engine (tests/engines/fake_vllm_worker.py); the file its requests and answers go to."""
    use_fake_engine(monkeypatch, tmp_path)
    messages = tmp_path / "engine-messages.jsonl"
    monkeypatch.setenv("FAKE_VLLM_MESSAGES", str(messages))
    return messages


def test_the_vllm_engine_answers_every_prompt_in_one_greedy_call(run_dir, engine_requests, capsys):
    from slipstream.generation import load_generator

    prompts = ["What is the capital of France?", "Write a line about the sea."]
    args = ["generate", str(run_dir), "--engine", "vllm", "--max-new-tokens", "6"]
    assert main([*args, "--prompt", prompts[0], "--prompt", prompts[1]]) == 0
    out, err = capsys.readouterr()
    (call,) = [json.loads(line) for line in engine_requests.read_text().splitlines()]
    request = call["request"]
    generator = load_generator(run_dir)
    assert request["prompts"] == [generator.inputs(p)["input_ids"][0].tolist() for p in prompts]
    assert request["n"] == 1 and request["temperature"] == 0.0 and request["top_p"] == 1.0
    assert request["max_tokens"] == 6 and sorted(request["stop_token_ids"]) == sorted(generator.stop_ids())
    texts = [
        generator.tokenizer.decode(group[0]["ids"], skip_special_tokens=True) for group in call["completions"]
    ]
    assert out == f"> {prompts[0]}\n{texts[0]}\n\n> {prompts[1]}\n{texts[1]}\n"
    assert "answered by vllm fake in its own process" in err and "vllm: 2 answers" in err
    assert not fake_workers()  # the engine stopped with the command


def test_the_vllm_engine_samples_with_the_options_given(run_dir, engine_requests):
    texts = slipstream.generate(
        run_dir,
        ["hi", "ho"],
        max_new_tokens=5,
        sample=True,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        engine="vllm",
    )
    (call,) = [json.loads(line) for line in engine_requests.read_text().splitlines()]
    request = call["request"]
    assert (request["temperature"], request["top_p"], request["seed"]) == (0.7, 0.9, 5)
    assert len(texts) == 2


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--max-new-tokens", "100000000"], r"exceed the model's context of \d+ tokens"),
        (["--vllm-gpu-memory-utilization", "1.5"], r"memory share must be in \(0, 1\)"),
        (["FAIL_START"], r"the vLLM engine failed start: ValueError: no such model type 'fake'"),
    ],
    ids=["too-long", "bad-share", "failed-start"],
)
def test_what_the_vllm_engine_cannot_do_is_one_line(
    run_dir, engine_requests, capsys, monkeypatch, extra, message
):
    import re

    if extra == ["FAIL_START"]:
        monkeypatch.setenv("FAKE_VLLM_FAIL_START", "1")
        extra = []
    assert main(["generate", str(run_dir), "--engine", "vllm", "--prompt", "hi", *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("slipstream generate: "), err
    assert re.search(message, err), err
    assert not engine_requests.exists() and not fake_workers()
