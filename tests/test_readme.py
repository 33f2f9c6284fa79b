"""The README's and the docs pages' commands work: every `slipstream` command they show parses and
builds its config, the quick ones run (shortened where they would take minutes), and the one pointing
at a model the reader has not downloaded fails with the one-line error a user would get, not a config
error. Every relative link of those pages leads to a file (and a heading) that exists, and the
README's measured results are BENCHMARKS.md's figures."""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.bench.command import ab_config_from_args
from slipstream.cli import build_parser, main
from slipstream.train.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


HISTORY = DOCS / "benchmarks-history.md"  # the benchmarks' log: commands with the flags of their day


def doc_pages() -> list[Path]:
    """The README and every page under docs/ (where the README's long sections live), less the
    benchmarks' log, whose commands are a record of what ran then, not instructions."""
    return [ROOT / "README.md", *sorted(page for page in DOCS.glob("*.md") if page != HISTORY)]


def page_commands(page: Path) -> list[str]:
    """The `slipstream` / `torchrun` lines of one page's ```bash blocks, comments cut."""
    blocks = re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("slipstream ", "torchrun "))]


def readme_commands() -> list[str]:
    """Every page's commands, in page order, each once (the README's examples repeat lines of the
    pages: the export lines, run in order, must not run one twice)."""
    return list(dict.fromkeys(c for page in doc_pages() for c in page_commands(page)))


COMMANDS = readme_commands()


def page_section(page: str, title: str) -> str:
    """The section of ``page`` (relative to the root) whose ``## `` heading starts with ``title``."""
    text = (ROOT / page).read_text()
    assert f"\n## {title}" in text, f"{page} has no section '## {title}'"
    return text.split(f"\n## {title}", 1)[1].split("\n## ", 1)[0]


def test_the_readme_shows_the_commands_we_test():
    assert any(c.startswith("slipstream train examples/tiny.yaml") for c in COMMANDS)
    assert any(c.startswith("slipstream ab") for c in COMMANDS)
    assert any("optimizer.lr=1e-4" in c for c in COMMANDS)


def test_the_docs_pages_are_collected():
    """Commands come from the README and from the pages its sections moved to."""
    pages = {page.name for page in doc_pages()}
    assert {"README.md", "train.md", "preference.md", "rl.md", "ab.md", "export.md"} <= pages
    assert all(page_commands(ROOT / "docs" / name) for name in ("train.md", "ab.md", "export.md"))
    readme = page_commands(ROOT / "README.md")
    assert set(readme) < set(COMMANDS)


def test_the_readme_is_a_front_door():
    """The two commands as they are, and one example per job, each a command the tests run."""
    text = (ROOT / "README.md").read_text()
    two = page_section("README.md", "The two commands")
    (bash,) = re.findall(r"```bash\n(.*?)```", two, flags=re.S)
    assert [line.split("#")[0].strip() for line in bash.splitlines()] == ["make demo", "make test"]
    readme = page_commands(ROOT / "README.md")
    for job in (
        "slipstream train examples/tiny.yaml",
        "slipstream train examples/dpo.yaml",
        "slipstream train examples/grpo.yaml",
        "slipstream ab",
        "slipstream export runs/tiny ",
    ):
        assert any(c.startswith(job) for c in readme), job
    for page in ("train", "preference", "rl", "ab", "export", "doctor", "speedups", "testing"):
        assert f"](docs/{page}.md)" in text, page


FORMER_SECTIONS = [  # the README's sections before it became a front door: each still somewhere
    "The two commands",
    "Training from a config",
    "From data to a deployable model",
    "Preference tuning: DPO, IPO, SimPO, ORPO on packed pairs",
    "Reinforcement learning (GRPO): rollouts that prefill each prompt once",
    "Export a merged model",
    "Generating from a run: `slipstream generate`",
    "A real model for tests and benchmarks",
    "Library use",
    "Packed sequences, without the bookkeeping",
    "Shared prefixes: a start many rows repeat runs once",
    "MoE: sorted routing, 4-bit experts, expert LoRA",
    "The LM head and the loss, a chunk of labelled tokens at a time",
    "LoRA without dtype round trips",
    "Compiled decoder layers",
    "Fused RMSNorm / SwiGLU: Liger-Kernel on CUDA, compiled elsewhere",
    "Offloaded activation checkpointing, double-buffered",
    "Is every fast path right on this machine? `slipstream doctor`",
    "A/B on your own hardware",
    "Your model, your data",
    "How the verdicts are reached",
    "Data",
    "Layout",
]


def test_every_former_readme_section_is_on_a_page_the_readme_links():
    readme = (ROOT / "README.md").read_text()
    headings = {}
    for page in doc_pages():
        for line in _outside_code(page.read_text()).splitlines():
            if line.startswith("#"):
                headings.setdefault(line.lstrip("#").strip(), page)
    for title in FORMER_SECTIONS:
        assert title in headings, f"the README's former section '{title}' is on no page"
        page = headings[title]
        assert page.name == "README.md" or f"](docs/{page.name}" in readme, (title, page.name)


def _outside_code(text: str) -> str:
    """``text`` without its fenced code blocks (a `# comment` there is no heading, a `](` no link)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _outside_code(page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.*)$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", [*doc_pages(), HISTORY, ROOT / "BENCHMARKS.md"], ids=lambda page: page.name)
def test_every_relative_link_resolves(page):
    """Each relative link (and image) of the README, the docs pages, BENCHMARKS.md and its log names
    a file that exists, and a `#heading` anchor into a Markdown file names one of its headings."""
    links = re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text()))
    assert links or page.name == "compatibility.md"
    for link in links:
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} leads nowhere"
        if anchor and target.suffix == ".md":
            assert anchor in _anchors(target), f"{page.name}: {link}: no such heading in {target.name}"


def test_the_readmes_figures_are_benchmarks_figures():
    """Every speedup with its interval, and every figure with a thousands comma, in the README's
    table of measured results is written the same way in BENCHMARKS.md (bold aside)."""
    table = page_section("README.md", "Measured against the peers")
    benchmarks = (ROOT / "BENCHMARKS.md").read_text().replace("**", "")  # bold is not a figure
    speedups = re.findall(r"\d+\.\d+[×x] \[\d+\.\d+, \d+\.\d+\]", table)
    counts = re.findall(r"(?<![\d.])\d{1,3}(?:,\d{3})+(?![\d])", table)
    assert len(speedups) >= 10 and len(counts) >= 10
    for figure in speedups + counts:
        assert figure in benchmarks, f"the README's {figure} is not in BENCHMARKS.md"


@pytest.mark.parametrize("command", COMMANDS)
def test_every_readme_command_parses_and_builds_its_config(command, tmp_path):
    words = shlex.split(command)
    if words[0] == "torchrun":  # run end to end by tests/train/test_distributed.py
        words = words[words.index("slipstream") :]
    args = build_parser().parse_args(words[1:])
    if args.command == "train":
        if args.config == "CONFIG.yaml":  # the reader's own config: a minimal one
            config_path = tmp_path / "CONFIG.yaml"
            config_path.write_text("model:\n  preset: demo\ntraining:\n  steps: 2\n")
        else:
            config_path = ROOT / args.config
        from tests.reward_stand_in import stand_in_reward_models

        # a reward model an earlier command exports (docs/rlhf.md): a tiny one in its place
        load_config(config_path, [*args.set, *stand_in_reward_models(config_path, tmp_path)])
    elif args.command == "ab":
        if "MODEL_DIR" in command:  # the reader's own model: a tiny saved one
            command = command.replace("MODEL_DIR", str(_tiny_model_dir(tmp_path)))
        if "YOUR.yaml" in command:  # the reader's own run: a minimal one
            (tmp_path / "YOUR.yaml").write_text("model:\n  preset: demo\ntraining:\n  steps: 2\n")
            command = command.replace("YOUR.yaml", str(tmp_path / "YOUR.yaml"))
        ab_config_from_args(build_parser().parse_args(shlex.split(command)[1:]))


def _tiny_model_dir(tmp_path: Path) -> Path:
    import torch

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    out = tmp_path / "my-model"
    tokenizer = demo_tokenizer()
    build_model("llama", vocab_size=len(tokenizer), seed=0, dtype=torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.realmodel
def test_the_ab_on_your_model_and_data_runs_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    """The first "Your model, your data" command, as written but for fewer steps and two arms, on
    SmolLM2 and examples/data/chats.jsonl: the loss curves agree and the record names both."""
    (line,) = [
        c
        for c in COMMANDS
        if c.startswith("slipstream ab --model MODEL_DIR --data") and "--objective" not in c
    ]
    from slipstream.hardware import cpu_class

    monkeypatch.chdir(ROOT)
    words = shlex.split(line.replace("MODEL_DIR", str(smollm2)))[1:]
    shortened = ["--steps", "3", "--warmup", "1", "--arms", "stock-packed,slipstream", "--out", str(tmp_path)]
    if not cpu_class().bf16_native and "bfloat16" in words:
        # emulated bf16 (an AVX2-only CPU) makes this A/B 12 minutes on 2 cores: fp32 there, the line's
        # every other option as written (the bf16 A/B's own checks run on the demo shape, test_truth)
        words[words.index("bfloat16")] = "float32"
    assert main([*words, *shortened]) == 0, capsys.readouterr().err
    record = json.loads((tmp_path / "ab.json").read_text())
    assert record["inputs"]["model"]["path"] == str(smollm2.resolve())
    assert record["inputs"]["data"]["path"].endswith("examples/data/chats.jsonl")
    assert record["summary"]["slipstream"]["loss_vs_stock-packed"] in ("identical", "within tolerance")


def test_the_tiny_example_trains(tmp_path, capsys):
    overrides = [
        "--set",
        f"output_dir={tmp_path / 'tiny'}",
        "--set",
        "training.steps=3",
        "--set",
        "data.demo_rows=100",
    ]
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), *overrides]) == 0
    assert (tmp_path / "tiny" / "adapter" / "adapter_model.safetensors").exists()
    # `slipstream train CONFIG.yaml --resume` on the same config: a finished run has nothing left to do
    code = main(["train", str(ROOT / "examples" / "tiny.yaml"), *overrides, "--resume"])
    assert code in (0, 1)
    assert "Traceback" not in capsys.readouterr().err


def test_the_qwen3_8b_command_fails_only_on_the_missing_model(tmp_path, capsys):
    command = next(c for c in COMMANDS if "optimizer.lr=1e-4" in c)
    words = shlex.split(command)[1:]
    words[1] = str(ROOT / words[1])
    code = main([*words, "--set", f"output_dir={tmp_path / 'out'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert (
        err[-1]
        == "slipstream train: model.path /models/Qwen3-8B: no such directory (models are read from disk, never downloaded)"
    )


def test_the_default_ab_runs_shortened(tmp_path, capsys):
    assert (
        main(
            [
                "ab",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--rows",
                "120",
                "--max-seq-len",
                "256",
                "--threads",
                "1",
                "--out",
                str(tmp_path / "ab"),
            ]
        )
        == 0
    )
    assert (tmp_path / "ab" / "ab.json").exists()


def test_the_export_commands_run_on_the_tiny_example(tmp_path, monkeypatch, capsys):
    """Each `slipstream export` line of the README and docs/export.md, in order, on a shortened run
    of examples/tiny.yaml."""
    exports = [shlex.split(c)[1:] for c in COMMANDS if c.startswith("slipstream export runs/tiny ")]
    assert exports and all(words[1] == "runs/tiny" for words in exports)
    monkeypatch.chdir(tmp_path)
    shortened = [  # the smallest preset, short rows: the export lines are what is tested here
        "model.preset=qwen3",
        "model.dtype=float32",
        "lora.rank=4",
        "training.steps=20",
        "data.demo_rows=20",
        "data.max_seq_len=32",
        "output_dir=runs/tiny",
    ]
    assert main(["train", str(ROOT / "examples" / "tiny.yaml"), *(f"--set={s}" for s in shortened)]) == 0
    for words in exports:
        assert main(words) == 0, capsys.readouterr().err
        out = tmp_path / words[words.index("--merged") + 1]
        assert (out / "config.json").exists() and (out / ".slipstream-export").exists()


def walkthrough() -> tuple[list[str], str, list[str]]:
    """The "From data to a deployable model" section (docs/train.md): its command lines, its Python
    snippet and the chat lines it shows."""
    section = page_section("docs/train.md", "From data to a deployable model\n")
    (bash,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    (python,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    (shown,) = re.findall(r"```json\n(.*?)```", section, flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in bash.splitlines()]
    return [line for line in lines if line], python, shown.splitlines()


def test_the_walkthrough_shows_lines_of_its_data_file():
    _, _, shown = walkthrough()
    rows = (ROOT / "examples" / "data" / "chats.jsonl").read_text().splitlines()
    assert shown and all(line in rows for line in shown)
    assert all(json.loads(row)["messages"][-1]["role"] == "assistant" for row in rows)


@pytest.mark.realmodel
def test_the_walkthrough_runs_from_data_to_a_merged_model(smollm2, tmp_path, monkeypatch, capsys):
    """Every line of the walk-through, in order, as written, on SmolLM2 and examples/data/chats.jsonl:
    from a directory holding only the examples (the reader's checkout), training shortened to a few
    steps and answers to a few tokens. MODEL_DIR is what `python benchmarks/real_model.py` prints."""
    commands, snippet, _ = walkthrough()
    assert [c.split()[:2] for c in commands] == [
        ["python", "benchmarks/real_model.py"],
        ["slipstream", "train"],
        ["grep", "eval_loss"],
        ["slipstream", "generate"],
        ["slipstream", "export"],
    ]
    shortened = {
        "train": ["--set", "training.steps=4", "--set", "training.eval_every=2"],
        "generate": ["--max-new-tokens", "8"],
    }
    outputs = run_walkthrough(
        commands, smollm2, tmp_path, monkeypatch, capsys, lambda words: [*words, *shortened.get(words[0], [])]
    )
    for words, out in outputs:
        if words[0] == "generate":
            assert out.strip()  # the streamed answer
        elif words[1] == "benchmarks/real_model.py":
            assert Path(out.strip().splitlines()[-1]) == smollm2  # built already: printed at once
        elif words[0] == "grep":  # the eval loss at steps 2 and 4
            records = [json.loads(line) for line in out.splitlines()]
            assert [r["step"] for r in records] == [2, 4]
            assert all(math.isfinite(r["eval_loss"]) for r in records)
    run = json.loads((tmp_path / "runs" / "from-data" / "run.json").read_text())
    assert run["eval"]["last"]["step"] == 4 and run["eval"]["rows"] == 4
    merged = tmp_path / "merged" / "from-data"
    assert json.loads((merged / "config.json").read_text())["dtype"] == "bfloat16"

    printed = []
    namespace = {"print": lambda *args: printed.append(" ".join(map(str, args)))}
    exec(snippet.replace("max_new_tokens=32", "max_new_tokens=8"), namespace)  # plain transformers
    assert printed and printed[0].strip()
    assert namespace["model"].config.model_type == "llama" and "lora" not in str(namespace["model"]).lower()


def section_commands(page: str, title: str) -> list[str]:
    """The command lines of the section of ``page`` whose heading starts with ``title``."""
    section = page_section(page, title)
    (bash,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in bash.splitlines()]
    return [line for line in lines if line]


def preference_walkthrough() -> list[str]:
    """The "Preference tuning" section's command lines (docs/preference.md)."""
    return section_commands("docs/preference.md", "Preference tuning")


def test_the_preference_section_names_the_example_and_its_pairs():
    commands = preference_walkthrough()
    assert any(c.startswith("slipstream train examples/dpo.yaml") for c in commands)
    config = load_config(ROOT / "examples" / "dpo.yaml", ["model.path=MODEL_DIR"])
    assert config.training.objective == "dpo" and Path(config.data.path).exists()
    rows = [json.loads(line) for line in Path(config.data.path).read_text().splitlines()]
    assert rows and all({"prompt", "chosen", "rejected"} <= set(row) for row in rows)


@pytest.mark.realmodel
def test_the_preference_walkthrough_runs_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    """Every line of the preference section, in order, as written, on SmolLM2 and
    examples/data/pairs.jsonl, shortened (training to 4 steps, answers to 8 tokens, the A/B to 3
    steps): DPO trains (the first step's loss is ln 2: the policy is the reference), the held-out
    reward accuracy is logged, generate answers, export merges, and the A/B's slipstream arms agree."""
    commands = preference_walkthrough()
    assert [c.split()[:2] for c in commands] == [
        ["python", "benchmarks/real_model.py"],
        ["slipstream", "train"],
        ["grep", "eval_reward_accuracy"],
        ["slipstream", "generate"],
        ["slipstream", "export"],
        ["slipstream", "ab"],
        ["slipstream", "ab"],  # ab --config examples/orpo.yaml: the config's objective and its arms
    ]
    shortened = {
        "train": ["--set", "training.steps=4", "--set", "training.eval_every=2"],
        "generate": ["--max-new-tokens", "8"],
        "ab": ["--steps", "3", "--warmup", "1", "--arms", "slipstream-dpo-no-prefix-sharing,slipstream-dpo"],
    }

    def adjust(words):
        if words[0] != "ab":
            return [*words, *shortened.get(words[0], [])]
        # two arms instead of the preset (TRL's run takes minutes), fewer steps
        drop = {"--steps", "--preset"}
        words = [w for i, w in enumerate(words) if w not in drop and words[i - 1] not in drop]
        from_config = "--config" in words  # its own arms (the orpo preset), fewer steps
        words += ["--out", str(tmp_path / ("ab-config" if from_config else "ab"))]
        if from_config:
            return [*words, "--steps", "3", "--warmup", "1"]
        return [*words, *shortened.get("ab", [])]

    for words, out in run_walkthrough(commands, smollm2, tmp_path, monkeypatch, capsys, adjust):
        if words[0] == "grep":
            records = [json.loads(line) for line in out.splitlines()]
            assert [r["step"] for r in records] == [2, 4]
            assert all(0.0 <= r["eval_reward_accuracy"] <= 1.0 for r in records)
    metrics = [
        json.loads(line) for line in (tmp_path / "runs" / "dpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert abs(metrics[0]["loss"] - math.log(2)) < 1e-4
    run = json.loads((tmp_path / "runs" / "dpo" / "run.json").read_text())
    assert run["preference"]["objective"] == "dpo" and run["eval"]["metrics"][-1]["step"] == 4
    assert (tmp_path / "merged" / "dpo" / "config.json").exists()
    record = json.loads((tmp_path / "ab" / "ab.json").read_text())
    shared = record["summary"]["slipstream-dpo"]
    assert shared["loss_vs_slipstream-dpo-no-prefix-sharing"] != "diverged"
    assert shared["pairs_per_s"] > 0
    orpo = json.loads((tmp_path / "ab-config" / "ab.json").read_text())
    assert orpo["config"]["objective"] == "orpo" and "slipstream-orpo" in orpo["summary"]


def rl_walkthrough() -> list[str]:
    """The "Reinforcement learning (GRPO)" section's command lines (docs/rl.md)."""
    return section_commands("docs/rl.md", "Reinforcement learning (GRPO)")


def test_the_rl_section_names_the_example_its_prompts_and_its_reward_file():
    commands = rl_walkthrough()
    assert any(c.startswith("slipstream train examples/grpo.yaml") for c in commands)
    config = load_config(ROOT / "examples" / "grpo.yaml", ["model.path=MODEL_DIR"])
    assert config.training.objective == "grpo" and Path(config.data.path).exists()
    rows = [json.loads(line) for line in Path(config.data.path).read_text().splitlines()]
    assert rows and all({"prompt", "answer"} <= set(row) for row in rows)
    files = [spec["function"] for spec in config.grpo.rewards if ".py:" in spec["function"]]
    assert files and all(Path(f.rpartition(":")[0]).is_file() for f in files)


def run_walkthrough(commands, smollm2, tmp_path, monkeypatch, capsys, adjust) -> list[tuple[list[str], str]]:
    """A docs section's command lines run in order, as written, in ``tmp_path`` (examples/ and benchmarks/
    linked in): ``slipstream`` lines through ``main`` as ``adjust(words)`` gives them (a shortened run),
    the others as processes on the cached SmolLM2 (MODEL_DIR: what ``real_model.py`` printed); returns
    each line's words and what it printed."""
    (tmp_path / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    model_dir, outputs = None, []
    for command in commands:
        if command.startswith("slipstream "):
            words = shlex.split(command.replace("MODEL_DIR", str(model_dir)))[1:]
            assert main(adjust(words)) == 0, capsys.readouterr().err
            outputs.append((words, capsys.readouterr().out))
            continue
        env = {**os.environ, "SLIPSTREAM_CACHE": str(smollm2.parents[1]), "PYTHONPATH": str(ROOT / "src")}
        words = shlex.split(command)
        if words[0] == "python":
            words[0] = sys.executable
        done = subprocess.run(words, capture_output=True, text=True, env=env, check=False)
        assert done.returncode == 0, done.stderr
        outputs.append((words, done.stdout))
        if words[1] == "benchmarks/real_model.py":
            model_dir = Path(done.stdout.strip().splitlines()[-1])
    return outputs


@pytest.mark.realmodel
def test_the_rl_walkthrough_runs_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    """Every line of the RL section, in order, as written, on SmolLM2 and examples/grpo.yaml, shortened
    to 2 steps of 16-token completions: the rollouts, the rewards and the held-out reward are logged."""
    commands = rl_walkthrough()
    assert [c.split()[:2] for c in commands] == [
        ["python", "benchmarks/real_model.py"],
        ["slipstream", "train"],
        ["grep", "eval_reward"],
    ]
    shortened = [
        "--set",
        "training.steps=2",
        "--set",
        "training.eval_every=1",
        "--set",
        "grpo.max_new_tokens=16",
    ]
    outputs = run_walkthrough(
        commands, smollm2, tmp_path, monkeypatch, capsys, lambda words: [*words, *shortened]
    )
    records = [json.loads(line) for line in outputs[-1][1].splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]  # step 0: the starting weights (eval_at_start)
    assert all(0.0 <= r["eval_reward"] <= 1.75 for r in records)  # weights 1 + 0.5 + 0.25
    run = json.loads((tmp_path / "runs" / "grpo" / "run.json").read_text())
    assert run["grpo"]["num_generations"] == 4 and run["eval"]["metrics"][-1]["step"] == 2
    samples = (tmp_path / "runs" / "grpo" / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in samples] == [0] * 4 + [1] * 4 + [2] * 4


def agent_walkthrough() -> list[str]:
    """The "Agents" section's command lines (docs/rl.md)."""
    return section_commands("docs/rl.md", "Agents")


def test_the_agent_section_names_its_examples_data_and_environment():
    from transformers.utils import get_json_schema

    from slipstream.agents.tools import ToolSet

    commands = agent_walkthrough()
    assert [c.split()[:3] for c in commands if c.startswith("slipstream")] == [
        ["slipstream", "train", "examples/agent-sft.yaml"],
        ["slipstream", "export", "runs/agent-sft"],
        ["slipstream", "train", "examples/agent.yaml"],
    ]
    sft = load_config(ROOT / "examples" / "agent-sft.yaml", ["model.path=MODEL_DIR"])
    grpo = load_config(ROOT / "examples" / "agent.yaml")
    assert grpo.training.objective == "grpo" and grpo.grpo.environment and Path(grpo.data.path).exists()
    assert Path(sft.data.chat_template).is_file() and sft.data.chat_template == grpo.data.chat_template
    toolset = ToolSet.load(grpo.grpo.tools, grpo.grpo.environment, None, grpo.grpo.tool_timeout_s)
    assert toolset.rewards_itself and toolset.described == "lookup"
    # the SFT rows show the very tool GRPO gives the model: the same schema, its results worded alike
    (tool,) = toolset.schema_tools()
    rows = [json.loads(line) for line in Path(sft.data.path).read_text().splitlines()]
    assert rows and all(row["tools"] == [get_json_schema(tool)] for row in rows)
    prompts = [json.loads(line) for line in Path(grpo.data.path).read_text().splitlines()]
    assert not {r["river"] for r in prompts} & {
        r["messages"][1]["tool_calls"][0]["function"]["arguments"]["name"] for r in rows
    }
    box, _ = toolset.open(
        {"prompt": prompts[0]["prompt"], **{k: v for k, v in prompts[0].items() if k != "prompt"}}
    )
    town = box.environment.town
    assert prompts[0]["answer"] in box.call("lookup", {"name": town}).content
    box.call("lookup", {"name": prompts[0]["river"]})
    assert box.environment.get_reward() == 1.0


@pytest.mark.realmodel
def test_the_agent_walkthrough_runs_on_smollm2(smollm2, tmp_path, monkeypatch, capsys):
    """Every line of the Agents section, in order, as written, on SmolLM2: the SFT warm start (2 steps),
    its export, one GRPO step with the environment's tool (2 trajectories a prompt): the tool records,
    the held-out reward and whole trajectories in samples.jsonl."""
    commands = agent_walkthrough()
    shortened = {
        "examples/agent-sft.yaml": ["--set", "training.steps=2"],
        "examples/agent.yaml": [
            "--set",
            "training.steps=1",
            "--set",
            "grpo.num_generations=2",
            "--set",
            "grpo.eval_generations=1",
        ],
    }
    outputs = run_walkthrough(
        commands,
        smollm2,
        tmp_path,
        monkeypatch,
        capsys,
        lambda words: [*words, *(shortened.get(words[1], []) if words[0] == "train" else [])],
    )
    assert [json.loads(line)["step"] for line in outputs[-1][1].splitlines()] == [0, 1]
    out = tmp_path / "runs" / "agent"
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][-1]
    for key in (
        "tool_calls_per_trajectory",
        "tool_failure_rate",
        "turns_per_trajectory",
        "tool_token_share",
        "reward_Almanac",
        "reward_names_the_mayor",
    ):
        assert key in step, key
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and all(s["messages"][0]["role"] == "assistant" and "tool_calls" in s for s in samples)
