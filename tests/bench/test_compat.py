"""The compatibility sweep: a fast subset by default, the whole registry when slow tests run."""

from __future__ import annotations

import pytest

from slipstream.bench.compat import advice, causal_lm_model_types, check_architecture, render_markdown, sweep

# One of each kind of outcome the sweep must keep right.
SUBSET = {
    "llama": "pass",
    "qwen3_moe": "pass",  # sorted routing
    "gpt_oss": "pass",  # attention sinks, sorted routing
    "lfm3": "pass",  # short convolutions run per document
    "phimoe": "refused",  # a sliding window only its config names
    "deepseek_v4": "refused",  # compressed keys (K != Q)
    "roberta": "pass",  # positions from padding_idx + 1, shifted
    "mamba": "refused",  # no AttentionInterface
}


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_each_architecture_is_exact_or_refused_with_a_verified_fallback(model_type):
    verdict = check_architecture(model_type)
    assert verdict.status == SUBSET[model_type], verdict.detail
    if verdict.status == "refused":
        assert "slipstream.optimize(model, " in verdict.detail
        assert verdict.fallback["result"].status == "pass"
    assert verdict.speedups["offload"] in ("on", "-") or verdict.speedups["offload"].startswith("off (")
    if model_type in ("qwen3_moe", "gpt_oss"):
        assert verdict.speedups == {
            "packed attention": "on",
            "sorted MoE routing": "on",
            "chunked loss": "on",
            "offload": "on",
        }


def test_advice_is_read_from_the_refusal():
    assert advice("... Use slipstream.optimize(model, packed_attention=False)") == {"packed_attention": False}
    assert advice("x. Use slipstream.optimize(model, moe_routing='stock').") == {"moe_routing": "stock"}
    assert advice("no way out named") is None


def test_the_table_counts_every_outcome():
    verdicts = [check_architecture(t).to_dict() for t in ("llama", "mamba")]
    text = render_markdown(verdicts, seconds=1.0)
    assert "| packed, exact | 1 |" in text and "| refused | 1 |" in text and "| total | 2 |" in text
    assert "| `mamba` | MambaForCausalLM | refused |" in text


@pytest.mark.slow
def test_the_whole_registry_is_exact_or_refused():
    """Every causal LM transformers registers: 0 silently wrong, 0 crashes, every one built."""
    verdicts = sweep(causal_lm_model_types(), workers=2)
    bad = {v["model_type"]: v["detail"] for v in verdicts if v["status"] in ("WRONG", "CRASH", "unbuilt")}
    assert not bad
    assert sum(v["status"] == "unchecked" for v in verdicts) <= 5
    assert sum(v["status"] == "pass" for v in verdicts) >= 97
