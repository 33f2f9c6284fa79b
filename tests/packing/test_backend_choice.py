"""The attention backend for a packed batch: varlen only where its kernels run the model's dtype."""

import pytest
import torch

from slipstream.packing.attention import choose_backend, varlen

CUDA = torch.device("cuda")


@pytest.fixture
def varlen_kernel(monkeypatch):
    """A CUDA torch with a varlen kernel, as the GPUs we run on have (nothing is called)."""
    monkeypatch.setattr(varlen, "varlen_kernel", lambda: ("torch varlen_attn", None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_half_precision_model_on_cuda_takes_varlen(varlen_kernel, dtype):
    assert choose_backend("auto", CUDA, has_sinks=False, dtype=dtype)[0] == "varlen"


def test_an_fp32_model_on_cuda_stays_on_per_document_sdpa(varlen_kernel):
    backend, why = choose_backend("auto", CUDA, has_sinks=False, dtype=torch.float32)
    assert backend == "sdpa"
    assert "float16 / bfloat16 only" in why


def test_varlen_asked_for_an_fp32_model_is_refused_by_name(varlen_kernel):
    with pytest.raises(ValueError, match="runs float16 / bfloat16 only.*not float32"):
        choose_backend("varlen", CUDA, has_sinks=False, dtype=torch.float32)


def test_optimize_passes_the_models_dtype(monkeypatch):
    """optimize() hands choose_backend the embeddings' dtype (what the attention inputs are)."""
    import slipstream
    from slipstream.models import build_model

    seen = []
    real = choose_backend

    def spy(requested, device, has_sinks, dtype=None):
        seen.append(dtype)
        return real(requested, device, has_sinks, dtype)

    import importlib

    # the packed attention's own module, where optimize() applies it
    monkeypatch.setattr(
        importlib.import_module("slipstream.speedups.packed_attention"), "choose_backend", spy
    )
    slipstream.optimize(
        build_model("qwen3", vocab_size=64, seed=0, dtype=torch.bfloat16), packed_attention=True
    )
    assert seen == [torch.bfloat16]
