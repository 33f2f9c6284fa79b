"""Sorted routing computes what transformers' eager experts compute, with ≤1 sync per layer."""

import pytest
import torch

import slipstream
from slipstream.bench.counters import HostSyncCounter
from slipstream.models import build_model
from slipstream.moe import UnsupportedExperts, experts_modules
from tests.conftest import random_docs

FAMILIES = ["qwen3-moe", "gpt-oss"]
COMPUTE = ["grouped_mm", "loop"]


def relative_error(actual, expected):
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-12)).item()


def pair(family, compute, **overrides):
    """(stock eager experts, sorted experts): same weights, both on slipstream's packed attention.

    Both keep the stock loss, so a training forward returns logits to compare."""
    stock = build_model(family, attn_implementation="eager", experts_implementation="eager", **overrides)
    slipstream.optimize(stock, moe_routing="stock", chunked_loss=False)
    fast = build_model(family, attn_implementation="eager", **overrides)
    fast.load_state_dict(stock.state_dict())
    slipstream.optimize(fast, moe_routing="sorted", moe_compute=compute, chunked_loss=False)
    return stock, fast


def route_everything_to_two_experts(model):
    """Zero router weights: every token picks the same top-k experts (the lowest ids, or by bias)."""
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("TopKRouter"):
                module.weight.zero_()
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
                    module.bias[5] = 3.0
                    module.bias[2] = 2.0


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("routing", ["spread", "all-to-one", "few-tokens"])
def test_loss_aux_loss_and_every_gradient_match_stock_eager(family, compute, routing):
    stock, fast = pair(family, compute, output_router_logits=True)
    if routing == "all-to-one":
        route_everything_to_two_experts(stock)
        route_everything_to_two_experts(fast)
    lengths = [2, 1] if routing == "few-tokens" else [5, 17, 9, 30]  # 3 tokens x top-2 < 8 experts
    batch = slipstream.collate_packed(random_docs(lengths))
    out_stock = stock(**batch.model_inputs())
    out_fast = fast(**batch.model_inputs())
    assert relative_error(out_fast.logits, out_stock.logits) <= 1e-5
    assert relative_error(out_fast.loss, out_stock.loss) <= 1e-5
    assert relative_error(out_fast.aux_loss, out_stock.aux_loss) <= 1e-5
    (out_stock.loss + out_stock.aux_loss).backward()
    (out_fast.loss + out_fast.aux_loss).backward()
    for (name, p_fast), (_, p_stock) in zip(fast.named_parameters(), stock.named_parameters(), strict=True):
        if p_stock.grad is None or p_stock.grad.abs().max() == 0:
            assert p_fast.grad is None or p_fast.grad.abs().max() == 0, name
            continue
        assert relative_error(p_fast.grad, p_stock.grad) <= 1e-5, name


@pytest.mark.parametrize("compute", COMPUTE)
@pytest.mark.parametrize("family", FAMILIES)
def test_experts_layer_output_and_input_gradients_match(family, compute):
    stock, fast = pair(family, compute)
    experts_stock, experts_fast = experts_modules(stock)[0], experts_modules(fast)[0]
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(
        40, experts_stock.hidden_size if hasattr(experts_stock, "hidden_size") else 64, generator=generator
    )
    top_k = stock.config.num_experts_per_tok
    scores = torch.randn(40, 8, generator=generator)
    weights, index = torch.softmax(scores, -1).topk(top_k, dim=-1)
    results = []
    for experts in (experts_stock, experts_fast):
        h = hidden.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        out = experts(h, index, w)
        out.square().sum().backward()
        results.append((out, h.grad, w.grad))
    for fast_value, stock_value in zip(results[1], results[0], strict=True):
        assert relative_error(fast_value, stock_value) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_host_syncs_per_layer(family):
    layers = build_model(family).config.num_hidden_layers
    counts = {}
    for compute in COMPUTE:
        _, fast = pair(family, compute)
        batch = slipstream.collate_packed(random_docs([40, 100, 25]))
        with HostSyncCounter() as syncs:
            fast(**batch.model_inputs()).loss.backward()
        counts[compute] = syncs.total
    assert counts["grouped_mm"] == 0
    assert counts["loop"] <= layers  # the one read of the counts per layer
    stock, _ = pair(family, "loop")
    with HostSyncCounter() as syncs:
        stock(**batch.model_inputs())
    assert syncs.total > 2 * layers  # eager: one or more per expert per layer


def test_moe_default_and_refusals():
    model = build_model("qwen3-moe")
    slipstream.optimize(model)  # sorted is the default for an MoE model
    assert model.config._experts_implementation == "slipstream_sorted"
    slipstream.optimize(model, moe_routing="stock")
    assert model.config._experts_implementation != "slipstream_sorted"
    with pytest.raises(ValueError, match="no MoE layers"):
        slipstream.optimize(build_model("llama"), moe_routing="sorted")
    with pytest.raises(ValueError, match="moe_routing"):
        slipstream.optimize(build_model("qwen3-moe"), moe_routing="fast")
    model = build_model("qwen3-moe")
    experts_modules(model)[0].has_post_expert_norm = True
    with pytest.raises(UnsupportedExperts, match="post-expert norm.*moe_routing='stock'"):
        slipstream.optimize(model, moe_routing="sorted")
    # The default takes sorted routing only where it is exact: here it stays stock, and says why.
    slipstream.optimize(model)
    assert model.config._experts_implementation != "slipstream_sorted"
    assert any("moe routing: stock" in p and "post-expert norm" in p for p in model.slipstream.policies)


def test_experts_declared_in_a_nested_config_count_as_moe():
    """DBRX declares its experts in config.ffn_config.moe_num_experts."""
    from types import SimpleNamespace

    from slipstream.moe.experts import is_moe_model

    nested = SimpleNamespace(config=SimpleNamespace(ffn_config=SimpleNamespace(moe_num_experts=16)))
    assert is_moe_model(nested)
    dense = SimpleNamespace(config=SimpleNamespace(ffn_config=SimpleNamespace(moe_num_experts=1)))
    assert not is_moe_model(dense)
