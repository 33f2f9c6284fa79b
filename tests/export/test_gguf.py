"""`slipstream export SOURCE --gguf OUT.gguf`: the file loads back (transformers' GGUF loader) to the merged
model's logits, the llama architecture's query / key rows in llama.cpp's order (a negative control without
the reorder fails the check), and every refusal is one line that leaves nothing at OUT."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from slipstream.cli import main
from slipstream.export import ExportError, gguf_vocab
from slipstream.export import gguf as gguf_module
from slipstream.export.gguf import _interleave_halves, plan_gguf
from slipstream.export.gguf_check import TOKEN_PROBES
from slipstream.export.gguf_export import export_gguf, modelfile
from slipstream.export.gguf_vocab import pre_tokenizer_name

from .test_export import RUN, _base_dir, _train, dense_run  # noqa: F401 (a fixture)

pytest.importorskip("gguf")


# transformers 5.17's GGUF loader (the floor) rebuilds a Gemma file's tokenizer its own way: not at all for a
# byte-level one, with other tokens for a SentencePiece one, so its check (and the export) refuses there
gemma_loader = pytest.mark.skipif(
    tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 24),
    reason=f"transformers {transformers.__version__}'s GGUF loader cannot rebuild a Gemma file's tokenizer",
)


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


@pytest.mark.slow  # Qwen3's real 151k-token vocabulary: a minute or more on 2 cores
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


@pytest.mark.slow  # Qwen3's real 151k-token vocabulary: a minute or more on 2 cores
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


def _gemma_dir(root: Path, model_type: str, tokenizer=None) -> Path:
    """A tiny Gemma 2 or Gemma 3 text model with the demo tokenizer (byte-level BPE, BOS = EOS), shaped so
    that every Gemma key bites on the held prompts (20-40 tokens): a sliding window of 8 on some layers, a
    small attention soft-cap (Gemma 2), a final soft-cap other than llama.cpp's default (30 / none), for
    Gemma 3 a layer pattern llama.cpp's default period (6) does not give, a local RoPE base other than
    llama.cpp's default and a linear RoPE factor on the global layers (the 4B+ models' 8); the norms'
    weights random (Gemma's norms multiply by 1 + w, so a missing +1 shows) and the head sharpened through
    the final norm (the head is tied: scaling it would scale the embedding too)."""
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    from slipstream.data import demo_tokenizer

    if tokenizer is None:
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


@gemma_loader
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


@gemma_loader
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
    _refused(llama_dir, out, "from an importance matrix", quant="iq4_xs")
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
    dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 500000.0}  # as transformers 5 saves it
    (other / "config.json").write_text(json.dumps({**config, "rope_parameters": dynamic}))
    _refused(other, out, "RoPE scaling 'dynamic'")
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
    assert check.probes == len(TOKEN_PROBES) + 1, check.describe()  # and the chat template rendered
    assert not report.skipped


@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_cpp_sees_the_query_key_order_too(llama_dir, tmp_path, monkeypatch):
    """Negative control: without the reorder llama.cpp rotates other pairs, and its check says so."""
    monkeypatch.setitem(gguf_module.FAMILIES, "llama", gguf_module.Family("LLAMA", False))
    out = tmp_path / "unordered.gguf"
    with pytest.raises(ExportError, match=r"llama.cpp: .*top-1 agrees on"):
        export_gguf(llama_dir, out, quant="f32")
    _nothing_at(out)


@gemma_loader
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
@gemma_loader
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
    with pytest.raises(ExportError, match=r"llama.cpp: .*top-1 agrees on"):
        export_gguf(gemma_dirs[model_type], out, quant="f32")
    _nothing_at(out)


@gemma_loader
@pytest.mark.llamacpp
@needs_llama_cpp
def test_without_the_final_soft_cap_llama_cpps_logits_part(gemma_dirs, tmp_path, monkeypatch):
    """Control for the bound above: the final soft-cap left out (llama.cpp's gemma2 then caps at 30, not the
    model's 60), top-1 still agrees, the logits do not."""
    _gemma_keys_without(monkeypatch, final_softcap=None)
    report = export_gguf(gemma_dirs["gemma2"], tmp_path / "uncapped.gguf", quant="f32")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.max_abs > 1.0, check.describe()


# --- SentencePiece-style tokenizers (Llama 2, Mistral, Gemma): tokens, scores and the space prefix ---


@pytest.fixture(scope="module")
def spm_llama_dir(tmp_path_factory) -> Path:
    """A tiny llama with a SentencePiece-style tokenizer as Llama 2's own tokenizer.json writes it (a
    normalizer that prepends "▁"), ChatML's special tokens added, sharpened."""
    from slipstream.models import build_model

    from .spm_tokenizer import save_spm_tokenizer

    path = tmp_path_factory.mktemp("gguf-spm") / "llama-spm"
    tokenizer = save_spm_tokenizer(path)
    build_model("llama", vocab_size=len(tokenizer), dtype=torch.float32).save_pretrained(path)
    return _sharpened(path)


def test_sentencepiece_spacing_is_llama_cpps_space_prefix_or_refused():
    from slipstream.export.gguf_vocab import spm_space_prefix

    from .spm_tokenizer import spm_tokenizer_json

    assert spm_space_prefix(spm_tokenizer_json(spacing="legacy")) is True
    assert spm_space_prefix(spm_tokenizer_json(spacing="gemma")) is False
    gemma = spm_tokenizer_json(spacing="gemma") | {
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious"}
    }
    assert spm_space_prefix(gemma) is False  # Gemma splits on spaces its normalizer has already replaced
    metaspace = spm_tokenizer_json(spacing="metaspace-first")
    assert spm_space_prefix(metaspace) is None
    for scheme, expected in (("never", False), ("always", None)):
        metaspace["pre_tokenizer"]["prepend_scheme"] = scheme
        assert spm_space_prefix(metaspace) is expected
    assert spm_space_prefix(spm_tokenizer_json() | {"normalizer": None}) is None  # no rule at all


def test_merge_scores_make_the_first_merge_that_builds_a_token_win():
    from slipstream.export.gguf_vocab import _merge_scores

    scores = _merge_scores(["a b", "ab c", "b c", "a bc"])
    assert scores == {"ab": 0.0, "abc": -1.0, "bc": -2.0}  # "abc" keeps its first (higher) rank


def test_a_sentencepiece_llama_is_written_with_scores_byte_tokens_and_its_space_prefix(
    spm_llama_dir, tmp_path
):
    from gguf import GGUFReader, TokenType

    out = tmp_path / "spm.gguf"
    report = export_gguf(spm_llama_dir, out, quant="f32")
    assert _transformers(report).ok and _transformers(report).tokens_match
    written = report.written
    assert (written["tokenizer_model"], written["pre_tokenizer"], written["space_prefix"]) == (
        "llama",
        "default",
        True,
    )
    fields = GGUFReader(str(out)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    scores = fields["tokenizer.ggml.scores"].contents()
    assert fields["tokenizer.ggml.model"].contents() == "llama"
    assert fields["tokenizer.ggml.add_space_prefix"].contents() is True
    assert "tokenizer.ggml.merges" not in fields
    kind = dict(zip(tokens, types, strict=True))
    assert kind["<unk>"] == TokenType.UNKNOWN and kind["<s>"] == TokenType.CONTROL
    assert kind["<|im_start|>"] == TokenType.CONTROL and kind["<0x0A>"] == TokenType.BYTE
    assert kind["\u2581the"] == TokenType.NORMAL
    score = dict(zip(tokens, scores, strict=True))
    assert score["\u2581t"] > score["\u2581the"]  # "▁t" is merged before "▁the" can be


def test_a_llama_tokenizer_transformers_rebuilds_with_another_spacing_is_refused(tmp_path):
    """transformers 5's LlamaTokenizer replaces the file's normalizer by a Metaspace that prepends "▁" only to
    the first text: the run tokenized with that, llama.cpp cannot, so nothing is written."""
    from slipstream.models import build_model

    from .spm_tokenizer import save_spm_tokenizer

    source = tmp_path / "llama-tokenizer-class"
    tokenizer = save_spm_tokenizer(source, tokenizer_class="LlamaTokenizer")
    build_model("llama", vocab_size=len(tokenizer), dtype=torch.float32).save_pretrained(source)
    _refused(source, tmp_path / "out.gguf", "chat turns would be tokenized differently from the run")
    _nothing_at(tmp_path / "out.gguf")


@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_cpp_tokenizes_a_sentencepiece_llama_as_the_run_did(spm_llama_dir, tmp_path):
    """Spaces at the start and in runs, byte fallback, text after a special token and a ChatML conversation:
    llama.cpp's SentencePiece tokenizer with the written scores and space prefix gives the run's tokens."""
    report = export_gguf(spm_llama_dir, tmp_path / "spm.gguf", quant="f16")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.probes == 6, check.describe()  # TOKEN_PROBES and the chat rendering


@pytest.mark.llamacpp
@needs_llama_cpp
def test_without_the_space_prefix_llama_cpp_tokenizes_otherwise_and_nothing_is_kept(
    spm_llama_dir, tmp_path, monkeypatch
):
    """Negative control: the same file with add_space_prefix false is refused by llama.cpp's probes."""
    monkeypatch.setattr(gguf_vocab, "spm_space_prefix", lambda tokenizer_json: False)
    out = tmp_path / "no-prefix.gguf"
    with pytest.raises(ExportError, match=r"llama.cpp: .*tokenizes .* differently from the model"):
        export_gguf(spm_llama_dir, out, quant="f32")
    _nothing_at(out)


def _llama_cpp_source() -> Path:
    found = os.environ.get("SLIPSTREAM_LLAMA_CPP_SDIST", "")
    if not found or not Path(found).exists():
        pytest.skip("llama-cpp-python's source (make test-gguf keeps it and sets SLIPSTREAM_LLAMA_CPP_SDIST)")
    return Path(found)


@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_2s_real_vocabulary_tokenizes_as_llama_cpps_own_tests_expect(tmp_path):
    """Llama 2's real 32,000-token vocabulary (llama.cpp's models/ggml-vocab-llama-spm.gguf, read by
    transformers and saved as Llama 2's tokenizer.json writes it): the exported file tokenizes llama.cpp's
    own 47 test texts (leading spaces, runs of spaces, CJK, emoji) to the tokens llama.cpp's tests expect,
    and the export's verification passes on a tiny llama of that vocabulary."""
    import tarfile

    import llama_cpp
    from transformers import AutoTokenizer

    from slipstream.models import build_model

    from .spm_tokenizer import LEGACY_NORMALIZER

    vocab = "ggml-vocab-llama-spm.gguf"
    with tarfile.open(_llama_cpp_source()) as sdist:
        for suffix in ("", ".inp", ".out"):
            member = sdist.getmember(f"llama_cpp_python-0.3.36/vendor/llama.cpp/models/{vocab}{suffix}")
            (tmp_path / f"{vocab}{suffix}").write_bytes(sdist.extractfile(member).read())
    loaded = AutoTokenizer.from_pretrained(tmp_path, gguf_file=vocab)
    pipeline = json.loads(loaded.backend_tokenizer.to_str())
    pipeline |= {"normalizer": LEGACY_NORMALIZER, "pre_tokenizer": None}
    source = tmp_path / "llama2-vocab"
    source.mkdir()
    (source / "tokenizer.json").write_text(json.dumps(pipeline, ensure_ascii=False))
    (source / "tokenizer_config.json").write_text(
        json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>",
            "chat_template": "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] "
            "{{ m['content'] }} [/INST]{% elif m['role'] == 'assistant' %} {{ m['content'] }}{{ eos_token }}"
            "{% endif %}{% endfor %}",
        })
    )  # fmt: skip
    build_model("llama", vocab_size=32000, dtype=torch.float32).save_pretrained(source)
    out = tmp_path / "llama2-vocab.gguf"
    report = export_gguf(_sharpened(source), out, quant="f16")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.probes == 6, check.describe()

    texts = (tmp_path / f"{vocab}.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (tmp_path / f"{vocab}.out").read_text().split("\n")
    llm = llama_cpp.Llama(model_path=str(out), vocab_only=True, verbose=False)
    found = [llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) for text in texts]
    assert len(texts) == 47
    assert found == [[int(i) for i in line.split()] for line in expected[: len(texts)]]


# --- mixtures of experts: Qwen3-MoE (llama.cpp's qwen3moe) and Mixtral (its llama architecture) ---


def _moe_dir(root: Path, family: str, tokenizer) -> Path:
    """A tiny Qwen3-MoE (8 experts, top 2, renormalized) or Mixtral (4 experts, top 2), sharpened."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from slipstream.models import build_model

    path = root / family
    if family == "qwen3-moe":
        model = build_model("qwen3-moe", vocab_size=len(tokenizer), dtype=torch.float32)
    else:
        torch.manual_seed(0)
        config = MixtralConfig(
            vocab_size=len(tokenizer), hidden_size=64, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
            max_position_embeddings=512, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return _sharpened(path)


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory) -> Path:
    """With the demo tokenizer splitting text as Qwen's does (transformers 5.17's GGUF loader picks the
    pre-tokenizer by architecture; Qwen3's real 151,936 tokens would take a minute to read back)."""
    return _moe_dir(tmp_path_factory.mktemp("gguf-moe"), "qwen3-moe", _qwen_split_demo_tokenizer())


def _qwen_split_demo_tokenizer():
    """The demo tokenizer splitting text as Qwen's does (llama.cpp's qwen2 pre-tokenizer)."""
    from tokenizers import Regex, pre_tokenizers

    from slipstream.data import demo_tokenizer
    from slipstream.export.gguf_vocab import _QWEN2_REGEX

    tokenizer = demo_tokenizer()
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])  # fmt: skip
    return tokenizer


def _qwen2_dir(root: Path) -> Path:
    """A tiny Qwen2 (Qwen2.5's shape: biases on q / k / v, no sliding window), sharpened."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    tokenizer = _qwen_split_demo_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases large enough that a missing or misplaced one shows
        for name, bias in model.named_parameters():
            if name.endswith("proj.bias"):
                bias.normal_(0.0, 1.0)
    path = root / "qwen2"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return _sharpened(path)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory) -> Path:
    return _qwen2_dir(tmp_path_factory.mktemp("gguf-qwen2"))


def test_a_qwen2_loads_back_with_its_attention_biases(qwen2_dir, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "qwen2.gguf"
    report = export_gguf(qwen2_dir, out, quant="f16")
    check = _transformers(report)
    assert check.ok and check.tokens_match and check.top1 >= 0.99, check.describe()
    assert all(c.ok for c in report.checks)  # llama.cpp's too, where it is installed
    tensors = {t.name: t.tensor_type.name for t in GGUFReader(str(out)).tensors}
    assert tensors["blk.0.attn_q.bias"] == tensors["blk.1.attn_v.bias"] == "F32"  # biases stay f32
    assert tensors["blk.0.attn_q.weight"] == "F16"


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory) -> Path:
    """With the demo tokenizer, given a BOS."""
    from slipstream.data import demo_tokenizer

    tokenizer = demo_tokenizer()
    tokenizer.bos_token = tokenizer.eos_token
    return _moe_dir(tmp_path_factory.mktemp("gguf-moe"), "mixtral", tokenizer)


def test_a_qwen3_moe_loads_back_with_each_layers_experts_stacked(qwen3_moe_dir, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "moe.gguf"
    report = export_gguf(qwen3_moe_dir, out, quant="f32")
    check = _transformers(report)
    assert check.ok and check.top1 == 1.0, check.describe()
    assert report.written["pre_tokenizer"] == "qwen2"
    reader = GGUFReader(str(out))
    fields = reader.fields
    assert fields["general.architecture"].contents() == "qwen3moe"
    assert fields["qwen3moe.expert_count"].contents() == 8
    assert fields["qwen3moe.expert_used_count"].contents() == 2
    assert fields["qwen3moe.expert_feed_forward_length"].contents() == 32
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    # GGUF lists a tensor's dimensions innermost first: [hidden, expert width, experts] for gate and up
    assert shapes["blk.0.ffn_gate_exps.weight"] == shapes["blk.0.ffn_up_exps.weight"] == (64, 32, 8)
    assert shapes["blk.0.ffn_down_exps.weight"] == (32, 64, 8)
    assert shapes["blk.0.ffn_gate_inp.weight"] == (64, 8)
    assert not [
        name for name in shapes if re.search(r"\.\d+\.", name.removeprefix("blk."))
    ]  # no expert alone


def test_experts_stacked_out_of_order_fail_the_check_and_nothing_is_kept(
    qwen3_moe_dir, tmp_path, monkeypatch
):
    """Negative control: each layer's down projections stacked in reverse expert order route every token's
    output through other experts: the check catches it."""
    stacked = gguf_module._stacked_experts

    def reversed_down(items, experts):
        for key, tensor in stacked(items, experts):
            yield key, tensor.flip(0) if key.endswith("experts.down_proj.weight") else tensor

    monkeypatch.setattr(gguf_module, "_stacked_experts", reversed_down)
    out = tmp_path / "shuffled.gguf"
    with pytest.raises(ExportError, match=r"transformers' GGUF loader: top-1 agrees on"):
        export_gguf(qwen3_moe_dir, out, quant="f32")
    _nothing_at(out)


def test_routing_llama_cpp_does_not_do_is_refused_before_anything_is_written(
    qwen3_moe_dir, mixtral_dir, tmp_path, monkeypatch
):
    for changes, words in (
        ({"norm_topk_prob": False}, "always renormalizes the chosen experts' weights"),
        ({"mlp_only_layers": [0]}, "has experts in every layer"),
        ({"decoder_sparse_step": 2}, "has experts in every layer"),
    ):
        source = tmp_path / f"moe-{next(iter(changes))}"
        shutil.copytree(qwen3_moe_dir, source)
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps(config | changes))
        _refused(source, tmp_path / "out.gguf", words)
        _nothing_at(tmp_path / "out.gguf")
    windowed = tmp_path / "mixtral-window"
    shutil.copytree(mixtral_dir, windowed)
    config = json.loads((windowed / "config.json").read_text())
    (windowed / "config.json").write_text(json.dumps(config | {"sliding_window": 64}))
    _refused(windowed, tmp_path / "out.gguf", "llama.cpp's llama architecture has no sliding window")
    # Mixtral is read back as Mixtral by llama.cpp alone: without it, verifying is impossible, so refused
    monkeypatch.setattr("slipstream.export.gguf_export.llama_cpp_available", lambda: False)
    _refused(mixtral_dir, tmp_path / "out.gguf", "only llama.cpp reads a mixtral GGUF back as it is")
    _nothing_at(tmp_path / "out.gguf")


@pytest.mark.llamacpp
@needs_llama_cpp
@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_llama_cpp_routes_each_token_through_the_same_experts(qwen3_moe_dir, mixtral_dir, tmp_path, family):
    source = qwen3_moe_dir if family == "qwen3-moe" else mixtral_dir
    report = export_gguf(source, tmp_path / f"{family}.gguf", quant="f16")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.top1 >= 0.99, check.describe()
    if family == "mixtral":  # transformers reads it as a dense Llama: said, not checked
        assert [c.runtime for c in report.checks] == ["llama.cpp"]
        assert any("dense Llama" in reason for reason in report.skipped)


@pytest.fixture(scope="module")
def gemma_spm_dir(tmp_path_factory) -> Path:
    """A tiny Gemma 3 text model with a SentencePiece-style tokenizer spaced as Gemma's (spaces become "▁",
    nothing prepended), loaded through transformers' GemmaTokenizer, which rebuilds that pipeline."""
    from .spm_tokenizer import save_spm_tokenizer

    root = tmp_path_factory.mktemp("gguf-gemma-spm")
    tokenizer = save_spm_tokenizer(root / "tokenizer", spacing="gemma", tokenizer_class="GemmaTokenizer")
    return _gemma_dir(root, "gemma3_text", tokenizer)


@gemma_loader
def test_a_gemma_with_its_sentencepiece_spacing_is_written_without_a_space_prefix(gemma_spm_dir, tmp_path):
    report = export_gguf(gemma_spm_dir, tmp_path / "gemma-spm.gguf", quant="f32")
    assert (report.written["tokenizer_model"], report.written["space_prefix"]) == ("llama", False)
    check = _transformers(report)  # transformers reads a gemma3 file's tokenizer as Gemma's: same tokens
    assert check.ok and check.tokens_match, check.describe()
    assert all(c.ok for c in report.checks)  # llama.cpp's probes too, where it is installed


@gemma_loader
@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_cpp_tokenizes_a_gemma_as_the_run_did(gemma_spm_dir, tmp_path):
    report = export_gguf(gemma_spm_dir, tmp_path / "gemma-spm.gguf", quant="f16")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.probes == len(TOKEN_PROBES) + 1, check.describe()


# --- Llama 3.1's RoPE scaling (rope_type llama3): llama.cpp's rope_freqs.weight ---


@pytest.fixture(scope="module")
def llama3_rope_dir(tmp_path_factory) -> Path:
    return _llama3_rope_dir(tmp_path_factory.mktemp("gguf-llama3-rope"))


def _llama3_rope_dir(root: Path) -> Path:
    """A tiny llama with Llama 3.1's RoPE scaling, its original context 64 so the scaling bites on the held
    prompts (Llama 3.1's own 8,192 scales only frequencies slower than the prompts can show), sharpened."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from slipstream.data import demo_tokenizer

    tokenizer = demo_tokenizer()
    tokenizer.bos_token = tokenizer.eos_token
    rope = {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64, "rope_theta": 10000.0,
    }  # fmt: skip
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # attention sharp enough that the rotation's frequencies show in the logits
        for name, weight in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                weight.mul_(4.0)
    path = root / "llama3-rope"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return _sharpened(path)


def test_llama_3_1s_rope_scaling_is_written_as_rope_freqs(llama3_rope_dir, tmp_path):
    from gguf import GGUFReader

    out = tmp_path / "llama3-rope.gguf"
    report = export_gguf(llama3_rope_dir, out, quant="f32")
    check = _transformers(report)
    assert check.ok and check.top1 == 1.0 and check.max_abs < 1e-3, check.describe()
    (freqs,) = [t for t in GGUFReader(str(out)).tensors if t.name == "rope_freqs.weight"]
    factors = np.asarray(freqs.data)
    # head size 16: 8 pairs; the fastest pairs unscaled (1), the slowest divided by the factor (8)
    assert factors.shape == (8,) and factors[0] == 1.0 and factors[-1] == 8.0


def test_without_the_rope_factors_the_check_fails_and_nothing_is_kept(llama3_rope_dir, tmp_path, monkeypatch):
    """Negative control: the same file without rope_freqs.weight rotates at the unscaled frequencies."""
    monkeypatch.setattr(gguf_module, "llama3_rope_factors", lambda model_dir: None)
    out = tmp_path / "unscaled.gguf"
    with pytest.raises(ExportError, match=r"transformers' GGUF loader: .*top-1 agrees on"):
        export_gguf(llama3_rope_dir, out, quant="f32")
    _nothing_at(out)


def test_llama3_rope_scaling_outside_llama_and_other_scalings_are_refused(
    llama3_rope_dir, qwen2_dir, tmp_path
):
    for source, rope, words in (
        (qwen2_dir, {"rope_type": "llama3", "factor": 8.0}, "llama.cpp reads it for llama only"),
        (llama3_rope_dir, {"rope_type": "yarn", "factor": 4.0}, "RoPE scaling 'yarn' is not exported"),
    ):
        copy = tmp_path / f"{source.name}-{rope['rope_type']}"
        shutil.copytree(source, copy)
        config = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps(config | {"rope_parameters": rope}))
        _refused(copy, tmp_path / "out.gguf", words)
        _nothing_at(tmp_path / "out.gguf")


@pytest.mark.llamacpp
@needs_llama_cpp
def test_llama_cpp_rotates_with_llama_3_1s_scaling(llama3_rope_dir, tmp_path, monkeypatch):
    report = export_gguf(llama3_rope_dir, tmp_path / "llama3-rope.gguf", quant="f16")
    check = {c.runtime: c for c in report.checks}["llama.cpp"]
    assert check.ok and check.top1 >= 0.99, check.describe()
    monkeypatch.setattr(gguf_module, "llama3_rope_factors", lambda model_dir: None)  # negative control
    monkeypatch.setattr("slipstream.export.gguf_export.check_transformers", lambda *args: check)
    with pytest.raises(ExportError, match=r"llama.cpp: .*top-1 agrees on"):
        export_gguf(llama3_rope_dir, tmp_path / "unscaled.gguf", quant="f16")
