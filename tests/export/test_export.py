"""`slipstream export RUN_DIR --merged OUT`: the merged model computes what base + adapter computed,
loads with plain transformers, and every bad input is one line that names the path."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from slipstream.cli import main
from slipstream.export import ExportError, export_merged
from slipstream.train.config import load_config
from slipstream.train.loop import train

ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RUN = {
    "model": {"preset": "qwen3", "dtype": "float32"},
    "data": {"demo_rows": 40, "max_seq_len": 128},
    "lora": {"rank": 4, "alpha": 8, "target_modules": ALL_LINEAR, "modules_to_save": ["lm_head"]},
    "optimizer": {"lr": 1e-2, "schedule": "constant"},
    "training": {"steps": 3, "checkpoint_every": 2},
    "seed": 0,
}
PROMPT = [5, 17, 99, 3, 42, 7, 11, 250]


def _train(root: Path, name: str, data: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**data, "output_dir": str(root / name)}))
    train(load_config(path), progress=False)
    return root / name


def _base_dir(root: Path, family: str) -> Path:
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    tokenizer = demo_tokenizer()
    path = root / f"base-{family}"
    build_model(family, vocab_size=len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory) -> Path:
    """LoRA on every linear of attention and MLP, the LM head trained in full; checkpoint at step 2."""
    return _train(tmp_path_factory.mktemp("dense"), "run", RUN)


def _reference(run: Path, *, checkpoint: int | None = None):
    """Base + adapter rebuilt here by hand (PEFT, the preset with the run's seed): what the run trained."""
    from peft import PeftModel

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    base = build_model("qwen3", vocab_size=len(demo_tokenizer()), seed=0)
    model = PeftModel.from_pretrained(base, run / "adapter").eval()
    if checkpoint is not None:
        from safetensors.torch import load_file

        weights = load_file(str(run / "checkpoints" / f"step-{checkpoint:06d}" / "trainable.safetensors"))
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in weights.items():
                params[name].copy_(tensor)
    return model


def _logits(model, ids=PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.float()


def _greedy(model, steps: int = 8) -> list[int]:
    ids = list(PROMPT)
    for _ in range(steps):
        ids.append(int(_logits(model, ids)[0, -1].argmax()))
    return ids[len(PROMPT) :]


BLOCKED_LOAD = """
import importlib.machinery, json, sys
class Block:  # slipstream and peft are found, and importing either fails
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("slipstream", "peft"):
            return importlib.machinery.ModuleSpec(name, self)
        return None
    def create_module(self, spec):
        raise ImportError(f"blocked by the test: {spec.name}")
    def exec_module(self, module):
        raise ImportError(f"blocked by the test: {module.__name__}")
sys.meta_path.insert(0, Block())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
out = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
prompt = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    new = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False)
print(json.dumps({
    "tokens": new[0, prompt.shape[1]:].tolist(),
    "chat_template": bool(tokenizer.chat_template),
    "dtype": str(model.dtype),
    "leaked": sorted(m for m in sys.modules if m.split(".")[0] in ("slipstream", "peft")),
}))
"""


def _load_without_slipstream(out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_LOAD, str(out), json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_merged_model_equals_base_plus_adapter_and_loads_without_slipstream_or_peft(
    dense_run, tmp_path, capsys
):
    out = tmp_path / "merged"
    assert main(["export", str(dense_run), "--merged", str(out)]) == 0
    said = capsys.readouterr().out
    assert "wrote" in said and "relative" in said
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", ".slipstream-export"} <= names
    assert any(n.endswith(".safetensors") for n in names)
    config_text = (out / "config.json").read_text()
    assert "quantization_config" not in config_text and "slipstream" not in config_text
    assert json.loads(config_text)["dtype"] == "float32"

    from transformers import AutoModelForCausalLM

    reference = _reference(dense_run)
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    expected, got = _logits(reference), _logits(merged)
    assert (got - expected).abs().max() <= 1e-4 * expected.abs().max()
    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    untrained = build_model("qwen3", vocab_size=len(demo_tokenizer()), seed=0).eval()
    assert (_logits(untrained) - expected).abs().max() > 1e-2 * expected.abs().max()  # the adapter matters
    loaded = _load_without_slipstream(out)
    assert loaded["leaked"] == [] and loaded["chat_template"] and loaded["dtype"] == "torch.float32"
    assert loaded["tokens"] == _greedy(_reference(dense_run))


def test_checkpoint_n_in_bfloat16(dense_run, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "step2"
    report = export_merged(dense_run, out, dtype="bfloat16", checkpoint=2)
    assert report.source.endswith("step-000002") and report.dtype == "bfloat16"
    assert report.check.ok and report.check.tolerance == 5e-2
    marker = json.loads((out / ".slipstream-export").read_text())
    assert marker["merge_check"]["relative"] <= 1e-4  # the merge itself, in fp32, before the cast
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    shard = next(out.glob("*.safetensors"))
    with safe_open(str(shard), framework="pt") as handle:
        assert {handle.get_tensor(k).dtype for k in handle.keys()} == {torch.bfloat16}  # noqa: SIM118

    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    at_step_2, final = _logits(_reference(dense_run, checkpoint=2)), _logits(_reference(dense_run))
    error = (_logits(merged) - at_step_2).abs().max()
    assert error <= 5e-2 * at_step_2.abs().max()
    assert error < (final - at_step_2).abs().max()  # it is step 2's weights, not the final ones
    half = export_merged(dense_run, tmp_path / "fp16", dtype="float16")
    assert half.check.ok and half.check.tolerance == 1e-2


def test_a_wrong_merge_is_caught_and_nothing_is_written(dense_run, tmp_path, monkeypatch):
    import slipstream.export.merged as merged_module

    real = merged_module._merged

    def without_the_head(model, tied, dtype):  # a merge that forgets the trained LM head
        model.base_model.model.lm_head = model.base_model.model.lm_head.original_module
        return real(model, tied, dtype)

    monkeypatch.setattr(merged_module, "_merged", without_the_head)
    with pytest.raises(ExportError, match=r"not written: .*\(relative .* at probe row \d+, position \d+"):
        export_merged(dense_run, tmp_path / "wrong")
    assert not (tmp_path / "wrong").exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left either


def test_out_is_refused_unless_it_is_a_previous_export_and_overwrite_is_given(dense_run, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["export", str(dense_run), "--merged", str(out)]) == 0
    capsys.readouterr()
    assert main(["export", str(dense_run), "--merged", str(out)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"slipstream export: {out}: holds a previous export: pass --overwrite to replace it"
    )
    assert main(["export", str(dense_run), "--merged", str(out), "--overwrite"]) == 0
    capsys.readouterr()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    assert main(["export", str(dense_run), "--merged", str(mine), "--overwrite"]) == 1
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(f"slipstream export: {mine}: exists and is not a slipstream export")
        and "\n" not in err
    )
    assert (mine / "notes.txt").read_text() == "keep me"
    inside = dense_run / "merged"
    assert main(["export", str(dense_run), "--merged", str(inside)]) == 1
    assert f"{inside}: inside the run directory {dense_run}" in capsys.readouterr().err
    assert not inside.exists()


def _one_line_error(argv, capsys) -> str:
    assert main(["export", *argv]) == 1
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("slipstream export: ")
    return err.removeprefix("slipstream export: ")


def test_bad_inputs_are_one_line_naming_the_path(dense_run, tmp_path, capsys):
    out = str(tmp_path / "out")
    missing = tmp_path / "nowhere"
    assert _one_line_error([str(missing), "--merged", out], capsys) == f"{missing}: no such run directory"
    stranger = tmp_path / "stranger"
    stranger.mkdir()
    (stranger / "config.json").write_text("{}")
    assert _one_line_error([str(stranger), "--merged", out], capsys).startswith(
        f"{stranger}: not a slipstream run directory"
    )
    unfinished = tmp_path / "unfinished"
    shutil.copytree(dense_run, unfinished)
    (unfinished / "run.json").unlink()
    shutil.rmtree(unfinished / "adapter")
    err = _one_line_error([str(unfinished), "--merged", out], capsys)
    assert err.startswith(f"{unfinished}: the run is unfinished") and "--checkpoint N" in err and "2" in err
    err = _one_line_error([str(dense_run), "--merged", out, "--checkpoint", "7"], capsys)
    assert err == f"{dense_run / 'checkpoints' / 'step-000007'}: no such checkpoint (checkpoints: 2)"
    assert main(["export", str(unfinished), "--merged", out, "--checkpoint", "2"]) == 0  # what it should do
    capsys.readouterr()
    damaged = unfinished / "checkpoints" / "step-000002" / "trainable.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:100])
    err = _one_line_error([str(unfinished), "--merged", str(tmp_path / "o2"), "--checkpoint", "2"], capsys)
    assert err.startswith(f"{damaged.parent}: damaged checkpoint (trainable.safetensors is unreadable")
    full = tmp_path / "full-finetune"
    shutil.copytree(dense_run, full)
    saved = json.loads((full / "config.json").read_text())
    saved["lora"]["enabled"] = False
    (full / "config.json").write_text(json.dumps(saved))
    err = _one_line_error([str(full), "--merged", str(tmp_path / "o3")], capsys)
    assert err.startswith(f"{full}: lora.enabled is false") and "no adapter to merge" in err
    assert not (tmp_path / "out" / "adapter").exists()


@pytest.fixture(scope="module")
def qlora_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qlora")


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_a_4bit_base_is_dequantized_and_matches_base_plus_adapter(qlora_root, family, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slipstream.models.qlora import load_for_qlora, training_4bit_forward
    from slipstream.moe.lora import load_expert_lora

    base = _base_dir(qlora_root, family)
    moe = family == "qwen3-moe"
    data = {
        **RUN,
        "model": {"path": str(base), "dtype": "float32"},
        "quantization": {"four_bit": True},
        "lora": {
            **RUN["lora"],
            "target_modules": ["q_proj", "v_proj"] if moe else ALL_LINEAR,
            "experts": moe,
        },
    }
    run = _train(qlora_root, f"run-{family}", data)
    report = export_merged(run, tmp_path / "merged")
    assert report.check.relative <= 1e-4 and report.dtype == "float32"
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert "quantization_config" not in config
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    assert all(p.dtype == torch.float32 for p in merged.parameters())  # no 4-bit storage left

    reference = PeftModel.from_pretrained(load_for_qlora(base, compute_dtype=torch.float32), run / "adapter")
    if moe:
        load_expert_lora(reference, run / "adapter" / "experts")
    with training_4bit_forward(reference.eval()):  # not bitsandbytes' bf16 eval kernel: what training ran
        expected = _logits(reference)
    assert (_logits(merged) - expected).abs().max() <= 1e-4 * expected.abs().max()
    assert export_merged(run, tmp_path / "bf16", dtype="bfloat16").check.ok

    if family == "llama":  # the same adapter over another base model: refused, naming the adapter
        from slipstream.data import demo_tokenizer
        from slipstream.models import build_model

        other = tmp_path / "other-base"
        build_model("llama", vocab_size=len(demo_tokenizer()), hidden_size=32).save_pretrained(other)
        demo_tokenizer().save_pretrained(other)
        moved = tmp_path / "moved-run"
        shutil.copytree(run, moved)
        saved = json.loads((moved / "config.json").read_text())
        saved["model"]["path"] = str(other)
        (moved / "config.json").write_text(json.dumps(saved))
        with pytest.raises(
            ExportError, match=rf"^{moved / 'adapter'}: does not fit the base model {other}.*size mismatch"
        ):
            export_merged(moved, tmp_path / "never")
        assert not (tmp_path / "never").exists()


def test_expert_lora_merges_into_the_expert_weights(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model
    from slipstream.moe.experts import use_sorted_experts
    from slipstream.moe.lora import load_expert_lora

    data = {
        **RUN,
        "model": {"preset": "qwen3-moe", "dtype": "float32"},
        "lora": {
            **RUN["lora"],
            "target_modules": ["q_proj", "v_proj"],
            "experts": True,
            "modules_to_save": [],
        },
    }
    run = _train(tmp_path, "moe", data)
    report = export_merged(run, tmp_path / "merged")
    assert report.check.relative <= 1e-4
    assert "slipstream" not in (tmp_path / "merged" / "config.json").read_text()  # stock experts
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    untouched = build_model("qwen3-moe", vocab_size=len(demo_tokenizer()), seed=0)
    before = untouched.model.layers[0].mlp.experts.down_proj
    after = merged.model.layers[0].mlp.experts.down_proj
    assert (after - before).abs().max() > 1e-4  # the expert LoRA is in the experts' own weights
    reference = PeftModel.from_pretrained(untouched, run / "adapter")
    use_sorted_experts(reference)
    load_expert_lora(reference, run / "adapter" / "experts")
    expected = _logits(reference.eval())
    assert (_logits(merged) - expected).abs().max() <= 1e-4 * expected.abs().max()


@pytest.mark.parametrize(
    ("targets", "tied_after"),
    [(["q_proj", "embed_tokens", "lm_head"], False), (["q_proj"], True)],
    ids=["lora-on-embeddings-and-head", "head-untouched"],
)
def test_tied_embeddings_are_untied_only_where_the_adapter_changed_one_side(tmp_path, targets, tied_after):
    from transformers import AutoModelForCausalLM

    from slipstream.data import demo_tokenizer
    from slipstream.models import build_model

    tokenizer = demo_tokenizer()
    build_model("llama", vocab_size=len(tokenizer), tie_word_embeddings=True).save_pretrained(
        tmp_path / "base"
    )
    tokenizer.save_pretrained(tmp_path / "base")
    data = {
        **RUN,
        "model": {"path": str(tmp_path / "base"), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8, "target_modules": targets},
        "training": {"steps": 2},
    }
    run = _train(tmp_path, "tied", data)
    report = export_merged(run, tmp_path / "merged")
    assert report.check.relative <= 1e-4
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    assert merged.config.tie_word_embeddings is tied_after
    assert (merged.lm_head.weight is merged.model.embed_tokens.weight) is tied_after
