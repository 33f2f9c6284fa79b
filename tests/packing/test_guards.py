"""Guards against silent cross-document attention; each test fails without its guard."""

from __future__ import annotations

import pytest
import torch

import slipstream
from slipstream.models import build_model
from slipstream.packing import PACKED_BATCH_KWARG, collate_packed
from slipstream.packing.attention import packed_sdpa_attention
from slipstream.packing.guards import UnsupportedArchitecture, active_batch
from tests.conftest import random_docs


def test_a_layer_that_drops_the_attention_kwargs_makes_the_step_raise():
    model = build_model("llama")
    slipstream.optimize(model)
    attention = model.model.layers[1].self_attn
    original = attention.forward

    def forward_without_kwargs(hidden_states, position_embeddings, attention_mask, **kwargs):
        kwargs.pop(PACKED_BATCH_KWARG)  # what a decoder layer that does not pass **kwargs on does
        return original(hidden_states, position_embeddings, attention_mask, **kwargs)

    attention.forward = forward_without_kwargs
    batch = collate_packed(random_docs([6, 9]))
    with pytest.raises(
        UnsupportedArchitecture, match=r"LlamaAttention \(layer 1\) was called without the packed"
    ):
        model(**batch.model_inputs())
    assert active_batch() is None  # cleared even though the forward raised
    del attention.forward
    model(**batch.model_inputs())  # and the next forward runs


def attention_inputs(lengths=(5, 7), heads=2, dim=8):
    batch = collate_packed(random_docs(list(lengths)))
    t = batch.num_tokens
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, t, dim, generator=generator) for _ in range(3))
    return batch, q, k, v


class Attention(torch.nn.Module):
    layer_idx = 3


def test_inputs_the_packed_attention_cannot_honour_are_refused():
    batch, q, k, v = attention_inputs()
    module = Attention()
    kw = {PACKED_BATCH_KWARG: batch}
    packed_sdpa_attention(module, q, k, v, None, **kw, output_router_logits=True)  # a flag passes
    mask = torch.zeros(1, 1, q.shape[2], q.shape[2])
    with pytest.raises(
        UnsupportedArchitecture, match=r"Attention \(layer 3\) builds an attention mask of its own"
    ):
        packed_sdpa_attention(module, q, k, v, mask, **kw)
    with pytest.raises(UnsupportedArchitecture, match="does not implement .*block_indices"):
        packed_sdpa_attention(module, q, k, v, None, **kw, block_indices=torch.arange(4))
    with pytest.raises(UnsupportedArchitecture, match="non-causal"):
        packed_sdpa_attention(module, q, k, v, None, **kw, is_causal=False)
    with pytest.raises(UnsupportedArchitecture, match="6 keys for 12 queries"):
        packed_sdpa_attention(module, q, k[:, :, :6], v[:, :, :6], None, **kw)


def test_a_sliding_window_kept_on_the_module_is_applied():
    batch, q, k, v = attention_inputs(lengths=(12, 9))
    windowed = Attention()
    windowed.sliding_window = 4  # applied by the model's mask function, never passed to the call
    got, _ = packed_sdpa_attention(windowed, q, k, v, None, **{PACKED_BATCH_KWARG: batch})
    want, _ = packed_sdpa_attention(
        Attention(), q, k, v, None, sliding_window=4, **{PACKED_BATCH_KWARG: batch}
    )
    full, _ = packed_sdpa_attention(
        Attention(), q, k, v, None, sliding_window=None, **{PACKED_BATCH_KWARG: batch}
    )
    assert torch.equal(got, want) and not torch.allclose(got, full)


def test_an_attention_module_marked_non_causal_is_refused():
    """BERT-style layers built with is_decoder=False say so on the module, not in the call."""
    batch, q, k, v = attention_inputs()
    bidirectional = Attention()
    bidirectional.is_causal = False
    with pytest.raises(UnsupportedArchitecture, match=r"Attention \(layer 3\) asks for non-causal"):
        packed_sdpa_attention(bidirectional, q, k, v, None, **{PACKED_BATCH_KWARG: batch})
    # the call's own flag wins, as in transformers
    packed_sdpa_attention(bidirectional, q, k, v, None, is_causal=True, **{PACKED_BATCH_KWARG: batch})


def test_a_sliding_window_only_the_config_names_is_refused():
    """PhiMoE applies config.sliding_window through its mask builder and passes nothing to the call."""
    from types import SimpleNamespace

    batch, q, k, v = attention_inputs()
    module = Attention()
    module.config = SimpleNamespace(sliding_window=4)
    with pytest.raises(UnsupportedArchitecture, match="sliding_window=4.*own mask builder"):
        packed_sdpa_attention(module, q, k, v, None, **{PACKED_BATCH_KWARG: batch})
    module.config = SimpleNamespace(sliding_window=4, use_sliding_window=False)  # switched off: fine
    packed_sdpa_attention(module, q, k, v, None, **{PACKED_BATCH_KWARG: batch})
    # passed explicitly by the call (Mistral, Qwen3): no ambiguity
    module.config = SimpleNamespace(sliding_window=4)
    packed_sdpa_attention(module, q, k, v, None, sliding_window=None, **{PACKED_BATCH_KWARG: batch})


def test_a_config_only_window_on_an_unpacked_row_is_exact_or_refused():
    """No PackedBatch (an evaluation row, a prompt): the model's mask builder, which would apply the
    window, does not run for slipstream's attention. A row within the window is exact; a longer one is
    refused rather than attended in full."""
    from types import SimpleNamespace

    _, q, k, v = attention_inputs()
    row = k.shape[-2]
    module = Attention()
    module.config = SimpleNamespace(sliding_window=row)  # the whole row fits: the window cuts nothing
    out, _ = packed_sdpa_attention(module, q, k, v, None)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    torch.testing.assert_close(out, expected)
    module.config = SimpleNamespace(sliding_window=row - 1)
    with pytest.raises(UnsupportedArchitecture, match=f"sliding_window={row - 1}.*own mask builder"):
        packed_sdpa_attention(module, q, k, v, None)
