"""`slipstream export SOURCE --gguf OUT.gguf`: the file loads back (transformers' GGUF loader) to the merged
model's logits, the llama architecture's query / key rows in llama.cpp's order (a negative control without
the reorder fails the check), and every refusal is one line that leaves nothing at OUT."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.cli import main
from slipstream.export import ExportError
from slipstream.export import gguf as gguf_module
from slipstream.export.gguf import _interleave_halves, plan_gguf, pre_tokenizer_name
from slipstream.export.gguf_export import export_gguf, modelfile

from .test_export import RUN, _base_dir, _train, dense_run  # noqa: F401 (a fixture)

pytest.importorskip("gguf")


def _transformers(report):
    (check,) = [c for c in report.checks if c.runtime.startswith("transformers")]
    return check


def _nothing_at(out: Path) -> None:
    assert not out.exists() and not out.with_suffix(".Modelfile").exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.stem}")]  # no temporary left


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    """A tiny llama with the demo tokenizer, given a BOS token (every real llama has one; transformers 5.17's
    GGUF loader cannot rebuild a llama tokenizer without it)."""
    from transformers import AutoTokenizer

    path = _base_dir(tmp_path_factory.mktemp("gguf-llama"), "llama")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.bos_token = tokenizer.eos_token
    tokenizer.save_pretrained(path)
    return _sharpened(path)


def _sharpened(path: Path) -> Path:
    """The model's head scaled up: a random tiny model's logits are nearly flat, so its top-1 token is a
    near-tie that any rounding flips; scaled, a top-1 disagreement means a different model, as on a real one."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(30.0)
    model.save_pretrained(path)
    return path


@pytest.fixture
def qwen3_dir(qwen3_model_dir) -> Path:
    """A tiny Qwen3 with Qwen3's real tokenizer and template (llama.cpp's qwen2 pre-tokenizer), sharpened."""
    return _sharpened(qwen3_model_dir)


@pytest.mark.parametrize("quant", ["f32", "f16", "q8_0"])
def test_a_merged_llama_directory_loads_back_to_its_logits(llama_dir, tmp_path, quant):
    out = tmp_path / f"model-{quant}.gguf"
    report = export_gguf(llama_dir, out, quant=quant)
    assert all(c.ok for c in report.checks)  # llama.cpp's too, where it is installed
    check = _transformers(report)
    assert check.ok and check.tokens_match and check.positions >= 200, check.describe()
    if quant == "f32":  # stored exactly: the same numbers up to the runtime's own arithmetic
        assert check.top1 == 1.0 and check.max_abs < 1e-3, check.describe()
    written = report.written
    assert written["pre_tokenizer"] == "gpt-2" and written["tokens"] >= 256
    assert out.read_bytes()[:4] == b"GGUF" and out.with_suffix(".Modelfile").exists()


def test_without_llama_cpps_query_key_order_the_check_fails_and_nothing_is_kept(
    llama_dir, tmp_path, monkeypatch
):
    """Negative control: the rotation pairs left in transformers' order (no reorder) give another model."""
    monkeypatch.setitem(gguf_module.FAMILIES, "llama", gguf_module.Family("LLAMA", False))
    out = tmp_path / "unordered.gguf"
    with pytest.raises(ExportError, match=r"not written: transformers' GGUF loader: top-1 agrees on"):
        export_gguf(llama_dir, out, quant="f32")
    _nothing_at(out)


def test_a_run_is_merged_then_written_and_the_cli_says_what_it_checked(qwen3_model_dir, tmp_path, capsys):
    """A LoRA run on a tiny Qwen3 with Qwen3's real tokenizer (its pre-tokenizer: llama.cpp's qwen2)."""
    run = _train(tmp_path, "run", {**RUN, "model": {"path": str(qwen3_model_dir), "dtype": "float32"}})
    out = tmp_path / "run.gguf"
    assert main(["export", str(run), "--gguf", str(out), "--quant", "f32"]) == 0
    printed = capsys.readouterr().out
    assert "checked transformers' GGUF loader: top-1 agrees on 100.0%" in printed
    assert f"wrote {out}" in printed and out.exists()
    # fp32 throughout: the file's logits are the merged run's to float rounding
    found = re.search(r"max \|logit difference\| ([0-9.e+-]+)", printed)
    assert found and float(found.group(1)) < 1e-3, printed


def test_the_interleave_puts_each_heads_rotation_pairs_side_by_side():
    weight = torch.arange(8, dtype=torch.float32).repeat_interleave(3).reshape(8, 3)  # 2 heads of 4 rows
    rows = _interleave_halves(weight, heads=2)[:, 0].tolist()
    assert rows == [0, 2, 1, 3, 4, 6, 5, 7]


def test_the_pre_tokenizer_is_named_from_tokenizer_json(qwen3_tokenizer, tmp_path):
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "ByteLevel", "use_regex": True}}) == "gpt-2"
    digits = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, {"type": "ByteLevel", "use_regex": True}]}  # fmt: skip
    assert pre_tokenizer_name({"pre_tokenizer": digits}) == "smollm"
    qwen3_tokenizer.save_pretrained(tmp_path)
    assert pre_tokenizer_name(json.loads((tmp_path / "tokenizer.json").read_text())) == "qwen2"
    assert pre_tokenizer_name({"pre_tokenizer": {"type": "Metaspace"}}) is None
    assert pre_tokenizer_name({"pre_tokenizer": None}) is None


def test_a_qwen3_with_its_real_tokenizer_writes_qwens_pre_tokenizer_and_chatml_modelfile(qwen3_dir, tmp_path):
    out = tmp_path / "qwen3.gguf"
    report = export_gguf(qwen3_dir, out, quant="f16")
    check = _transformers(report)
    assert check.ok and check.tokens_match, check.describe()
    assert report.written["pre_tokenizer"] == "qwen2"
    text = out.with_suffix(".Modelfile").read_text()
    assert text.startswith("FROM ./qwen3.gguf\n") and "<|im_start|>{{ .Role }}" in text
    assert 'PARAMETER stop "<|im_end|>"' in text


def test_a_modelfile_for_a_template_that_is_not_chatml_leaves_the_template_to_the_gguf():
    text = modelfile("m.gguf", "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}", "</s>")
    assert "TEMPLATE" not in text and 'PARAMETER stop "</s>"' in text


# ----------------------------------------------------------------------------- Gemma 2 / Gemma 3 text


def _gemma_dir(root: Path, model_type: str) -> Path:
    """A tiny Gemma 2 or Gemma 3 text model with the demo tokenizer (byte-level BPE, BOS = EOS), shaped so
    that every Gemma key bites on the held prompts (20-40 tokens): a sliding window of 8 on some layers, a
    small attention soft-cap (Gemma 2), a final soft-cap other than llama.cpp's default (30 / none), for
    Gemma 3 a layer pattern llama.cpp's default period (6) does not give, a local RoPE base other than
    llama.cpp's default and a linear RoPE factor on the global layers (the 4B+ models' 8); the norms'
    weights random (Gemma's norms multiply by 1 + w, so a missing +1 shows) and the head sharpened through
    the final norm (the head is tied: scaling it would scale the embedding too)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    from slipstream.data import demo_tokenizer

    tokenizer = demo_tokenizer()
    tokenizer.bos_token = tokenizer.eos_token
    shape = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
        sliding_window=8, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, final_logit_softcapping=60.0,
    )  # fmt: skip
    if model_type == "gemma2":  # layers sliding, full, sliding, full
        config = Gemma2Config(**shape, attn_logit_softcapping=1.0)
    else:
        config = Gemma3TextConfig(
            **shape,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
        )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith("norm.weight"):
                weight.normal_(0.0, 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(4.0)  # attention scores large enough for the soft-cap and the window to matter
        norm = model.model.norm.weight
        norm.copy_((1.0 + norm) * 60.0 - 1.0)
    path = root / model_type
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-gemma")
    return {model_type: _gemma_dir(root, model_type) for model_type in ("gemma2", "gemma3_text")}


@pytest.mark.parametrize("quant", ["f32", "f16"])
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_a_gemma_loads_back_to_its_logits(gemma_dirs, tmp_path, model_type, quant):
    import gguf

    out = tmp_path / f"{model_type}-{quant}.gguf"
    report = export_gguf(gemma_dirs[model_type], out, quant=quant)
    assert all(c.ok for c in report.checks)  # llama.cpp's too, where it is installed
    check = _transformers(report)
    assert check.ok and check.tokens_match and check.positions >= 200, check.describe()
    if quant == "f32":
        assert check.top1 == 1.0 and check.max_abs < 1e-3, check.describe()
    fields = gguf.GGUFReader(str(out)).fields
    arch = "gemma2" if model_type == "gemma2" else "gemma3"

    def value(key):
        return fields[f"{arch}.{key}"].contents()

    assert fields["general.architecture"].contents() == arch
    assert value("attention.sliding_window") == 8 and value("final_logit_softcapping") == 60.0
    if arch == "gemma2":
        assert value("attention.sliding_window_pattern") == [True, False, True, False]
        assert value("attn_logit_softcapping") == 1.0 and value("rope.freq_base_swa") == 10000.0
    else:
        assert value("attention.sliding_window_pattern") == [True, True, False, True]
        assert f"{arch}.attn_logit_softcapping" not in fields
        assert value("rope.freq_base") == 1e6 and value("rope.freq_base_swa") == 1000.0
        assert value("rope.scaling.type") == "linear" and value("rope.scaling.factor") == 8.0
    # Gemma's norms multiply by 1 + w: the file holds 1 + w, in f32
    from safetensors.torch import load_file

    (stored,) = [t for t in gguf.GGUFReader(str(out)).tensors if t.name == "blk.0.attn_norm.weight"]
    weight = load_file(str(gemma_dirs[model_type] / "model.safetensors"))[
        "model.layers.0.input_layernorm.weight"
    ]
    assert np.array_equal(np.asarray(stored.data), (1.0 + weight).numpy())


def test_a_gemma_without_the_norms_plus_one_fails_the_check(gemma_dirs, tmp_path, monkeypatch):
    """Negative control: the norm weights as transformers stores them (w, not 1 + w) give another model."""
    family = gguf_module.FAMILIES["gemma2"]
    monkeypatch.setitem(gguf_module.FAMILIES, "gemma2", dataclasses.replace(family, norm_shift=0.0))
    out = tmp_path / "unshifted.gguf"
    with pytest.raises(ExportError, match=r"not written: transformers' GGUF loader: top-1 agrees on"):
        export_gguf(gemma_dirs["gemma2"], out, quant="f32")
    _nothing_at(out)


def _with_config(source: Path, root: Path, **changes) -> Path:
    """A copy of ``source`` whose config.json has ``changes``."""
    other = root / f"changed-{len(list(root.iterdir()))}"
    shutil.copytree(source, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, **changes}))
    return other


def test_a_gemma_that_llama_cpp_would_run_differently_is_refused_by_name(gemma_dirs, tmp_path):
    g2, g3 = gemma_dirs["gemma2"], gemma_dirs["gemma3_text"]
    root = tmp_path / "copies"
    root.mkdir()
    out = tmp_path / "out.gguf"
    _refused(
        _with_config(g2, root, query_pre_attn_scalar=64), out, "query_pre_attn_scalar 64: llama.cpp scales"
    )
    _refused(_with_config(g3, root, query_pre_attn_scalar=256), out, "1/sqrt(32)")
    _refused(_with_config(g2, root, attn_logit_softcapping=None), out, "always soft-caps both")
    _refused(_with_config(g3, root, attn_logit_softcapping=50.0), out, "gemma3 has no attention soft-capping")
    _refused(_with_config(g2, root, tie_word_embeddings=False), out, "untied LM head")
    _refused(_with_config(g2, root, hidden_activation="gelu"), out, "hidden_activation 'gelu'")
    _refused(_with_config(g3, root, use_bidirectional_attention=True), out, "use_bidirectional_attention")
    _refused(_with_config(g3, root, attention_bias=True), out, "attention_bias")
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6, "original_max_position_embeddings": 128}
    rope = json.loads((g3 / "config.json").read_text())["rope_parameters"]
    _refused(
        _with_config(g3, root, rope_parameters={**rope, "full_attention": yarn}), out, "RoPE scaling 'yarn'"
    )
    linear = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000.0}
    _refused(
        _with_config(g3, root, rope_parameters={**rope, "sliding_attention": linear}),
        out,
        "RoPE scaling 'linear' on the sliding layers",
    )
    _nothing_at(out)


def _refused(source: Path, out: Path, words: str, **options) -> None:
    with pytest.raises(ExportError) as caught:
        export_gguf(source, out, **options)
    message = str(caught.value)
    assert "\n" not in message and words in message, message


def test_what_cannot_be_written_exactly_is_refused_and_leaves_nothing(llama_dir, tmp_path):
    out = tmp_path / "out.gguf"
    _refused(llama_dir, out, "llama-quantize", quant="q4_k_m")
    _refused(llama_dir, out, "not a GGUF type the export writes", quant="q3")
    _refused(llama_dir, tmp_path / "out.bin", "must end in .gguf")
    _refused(tmp_path, out, "neither a slipstream run directory nor a merged model directory")
    other = tmp_path / "other"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt_neox"}))
    _refused(other, out, "model_type 'gpt_neox' is not a family the GGUF export writes")
    (other / "config.json").write_text(
        json.dumps({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    )
    _refused(other, out, "RoPE scaling 'yarn'")
    llama3 = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}  # as transformers 5 saves it
    (other / "config.json").write_text(json.dumps({**config, "rope_parameters": llama3}))
    _refused(other, out, "RoPE scaling 'llama3'")
    (other / "config.json").write_text(json.dumps(config))
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps({**tokenizer, "pre_tokenizer": {"type": "Whitespace"}}))
    _refused(other, out, "is not one llama.cpp reproduces")
    _nothing_at(out)


def test_a_run_that_cannot_be_merged_is_refused_and_leaves_nothing(dense_run, tmp_path):  # noqa: F811
    run = tmp_path / "unfinished"
    shutil.copytree(dense_run, run)
    shutil.rmtree(run / "adapter")
    (run / "run.json").unlink()
    out = tmp_path / "out.gguf"
    with pytest.raises(ExportError) as caught:
        export_gguf(run, out)
    assert "\n" not in str(caught.value) and str(run) in str(caught.value)
    _nothing_at(out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".gguf-merge-")]


def test_an_existing_file_is_replaced_only_with_overwrite_and_only_when_it_is_gguf(llama_dir, tmp_path):
    out = tmp_path / "model.gguf"
    out.write_text("my notes")
    _refused(llama_dir, out, "is not a GGUF file: not replaced", overwrite=True)
    out.write_bytes(b"GGUF" + bytes(16))
    _refused(llama_dir, out, "pass --overwrite")
    export_gguf(llama_dir, out, quant="f16", overwrite=True, verify=False)
    assert out.stat().st_size > 1000


def test_without_the_gguf_package_the_export_says_which_extra(llama_dir, tmp_path, monkeypatch):
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else found(name, *a)
    )
    out = tmp_path / "out.gguf"
    _refused(llama_dir, out, "pip install 'slipstream[gguf]'")
    _nothing_at(out)


def test_plan_refuses_before_reading_weights(llama_dir):
    assert plan_gguf(llama_dir, "Q8_0").quant == "q8_0"


# ----------------------------------------------------------------------------- llama.cpp itself

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python: make test-gguf"
)


@pytest.mark.llamacpp
@needs_llama_cpp
@pytest.mark.parametrize(
    "family, quant",
    # q8_0 on the tiny Qwen3 (rows of 64: two blocks) is noisier than on any real model; the real model's
    # q8_0 is measured in BENCHMARKS.md
    [("llama", "f16"), ("llama", "q8_0"), ("qwen3", "f16")],
)
def test_llama_cpp_tokenizes_and_predicts_as_the_merged_model(llama_dir, qwen3_dir, tmp_path, quant, family):
    source = llama_dir if family == "llama" else qwen3_dir
    out = tmp_path / f"{family}-{quant}.gguf"
    report = export_gguf(source, out, quant=quant)
    runtimes = {check.runtime: check for check in report.checks}
    check = runtimes["llama.cpp"]
    assert check.ok and check.tokens_match and check.positions >= 200, check.describe()
    assert not report.skipped


@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_cpp_sees_the_query_key_order_too(llama_dir, tmp_path, monkeypatch):
    """Negative control: without the reorder llama.cpp rotates other pairs, and its check says so."""
    monkeypatch.setitem(gguf_module.FAMILIES, "llama", gguf_module.Family("LLAMA", False))
    out = tmp_path / "unordered.gguf"
    with pytest.raises(ExportError, match=r"llama.cpp: top-1 agrees on"):
        export_gguf(llama_dir, out, quant="f32")
    _nothing_at(out)


@pytest.mark.llamacpp
@needs_llama_cpp
@pytest.mark.parametrize("quant", ["f32", "f16"])
@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_llama_cpp_runs_a_gemma_as_transformers_does(gemma_dirs, tmp_path, model_type, quant):
    """llama.cpp's gemma2 / gemma3 on the file: the window (8, shorter than every held prompt) on the
    sliding layers only, the soft-caps, the local RoPE base and the global layers' linear factor."""
    out = tmp_path / f"{model_type}-{quant}.gguf"
    report = export_gguf(gemma_dirs[model_type], out, quant=quant)
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.tokens_match and check.positions >= 200, check.describe()
    # the final soft-cap is monotone, so top-1 cannot see it: the logits themselves must agree (without the
    # cap, or with llama.cpp's default one, they differ by ~10; see the control below)
    assert check.max_abs < 0.5, check.describe()
    assert not report.skipped


def _gemma_keys_without(monkeypatch, **changes) -> None:
    real = gguf_module.gemma_keys
    monkeypatch.setattr(gguf_module, "gemma_keys", lambda *args: dataclasses.replace(real(*args), **changes))


@pytest.mark.llamacpp
@needs_llama_cpp
@pytest.mark.parametrize(
    "model_type, missing",
    [
        ("gemma2", "norm +1"),  # the norms as transformers stores them (w, not 1 + w)
        ("gemma2", "attn_softcap"),  # llama.cpp's default, 50, for the model's 1
        ("gemma3_text", "window pattern"),  # llama.cpp's default period, 6: every layer sliding
        ("gemma3_text", "window"),  # gemma3 without a window: no layer slides
        ("gemma3_text", "rope_theta_swa"),  # llama.cpp's default local base, 10000, for the model's 1000
        ("gemma3_text", "rope_linear"),  # the global layers' RoPE unscaled
    ],
)
def test_without_a_gemma_key_llama_cpp_runs_another_model(
    gemma_dirs, tmp_path, monkeypatch, model_type, missing
):
    """Negative controls: each Gemma key (or the norms' +1) left out, llama.cpp's check fails."""
    import gguf

    if missing == "norm +1":
        family = gguf_module.FAMILIES[model_type]
        monkeypatch.setitem(gguf_module.FAMILIES, model_type, dataclasses.replace(family, norm_shift=0.0))
    elif missing == "window pattern":
        monkeypatch.setattr(gguf.GGUFWriter, "add_sliding_window_pattern", lambda self, value: None)
    elif missing == "rope_theta_swa":
        _gemma_keys_without(monkeypatch, rope_theta_swa=10000.0)
    else:
        _gemma_keys_without(monkeypatch, **{missing: None})
    out = tmp_path / "without.gguf"
    with pytest.raises(ExportError, match=r"llama.cpp: top-1 agrees on"):
        export_gguf(gemma_dirs[model_type], out, quant="f32")
    _nothing_at(out)


@pytest.mark.llamacpp
@needs_llama_cpp
def test_without_the_final_soft_cap_llama_cpps_logits_part(gemma_dirs, tmp_path, monkeypatch):
    """Control for the bound above: the final soft-cap left out (llama.cpp's gemma2 then caps at 30, not the
    model's 60), top-1 still agrees, the logits do not."""
    _gemma_keys_without(monkeypatch, final_softcap=None)
    report = export_gguf(gemma_dirs["gemma2"], tmp_path / "uncapped.gguf", quant="f32")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.max_abs > 1.0, check.describe()
