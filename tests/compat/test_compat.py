"""The compatibility sweep: a fast subset by default, the whole registry when slow tests run."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream import compat
from slipstream.compat import (
    LENGTHS,
    PAIR_LENGTHS,
    _cell,
    advice_of,
    causal_lm_model_types,
    check_architecture,
    check_prefix_sharing,
    pair_reference,
    preference_pairs,
    render_markdown,
    sweep,
)
from slipstream.models.tiny_any import (
    DYNAMIC_ROPE_POSITIONS,
    POSITION_THRESHOLD,
    WINDOW,
    require_installed,
    tiny_config,
    tiny_model,
)
from slipstream.packing import verdict as packing_verdict
from slipstream.packing.rowpos import AUDIT

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
    "llama4_text": "pass",  # chunked attention; temperature tuning by document position
    "phi3": "pass",  # longrope factors chosen per document
}

# Shared prompts refused (the column "refused"; the verdict stays as it was), and the refusal.
PREFIX_SHARING_REFUSED = {
    "llama4_text": "chunked attention (attention_chunk_size) with shared prompts",
    # longrope: the pairs' prompt + chosen and prompt + rejected straddle the threshold (PAIR_LENGTHS)
    "phi3": "cannot share one prompt",
}
# (the prefix groups' and tree columns: refused for the same architectures, GROUP_SHAPES and TREE_ROWS
# crossing the same thresholds)


@pytest.mark.parametrize("model_type", sorted(SUBSET))
def test_each_architecture_is_exact_or_refused_with_a_verified_fallback(model_type):
    require_installed(model_type)  # an older transformers without it: skipped, named (conftest)
    verdict = check_architecture(model_type)
    assert verdict.status == SUBSET[model_type], verdict.detail
    if model_type in PREFIX_SHARING_REFUSED:
        assert verdict.speedups["prefix_sharing"] == "refused"
        assert PREFIX_SHARING_REFUSED[model_type] in verdict.ablations["prefix_sharing"].detail
    elif verdict.speedups.get("packed attention") == "on":  # lfm3: its short convolutions over the prompt
        assert verdict.speedups["prefix_sharing"] == "on", verdict.ablations["prefix_sharing"].detail
    elif verdict.speedups.get("packed attention") == "off":
        assert verdict.speedups["prefix_sharing"] == "-"
    for column in ("prefix_groups", "prefix_tree"):  # refused where pairs are, for the same reason
        if model_type in PREFIX_SHARING_REFUSED:
            assert verdict.speedups[column] == "refused"
            assert PREFIX_SHARING_REFUSED[model_type] in verdict.ablations[column].detail
        elif verdict.speedups.get("packed attention") == "on":
            assert verdict.speedups[column] == "on", verdict.ablations[column].detail
            assert verdict.ablations[column].logits_error <= compat.GROUP_TOLERANCE["token_logprob"]
        elif verdict.speedups.get("packed attention") == "off":
            assert verdict.speedups[column] == "-"
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
            "grouped attention": "on",
            "short kernel": "on",
            # Qwen3-MoE's norms are Llama-style; GPT-OSS's multiply before the cast (kept), and no
            # MoE model has a dense gate/up/down MLP here
            "fused": "RMSNorm" if model_type == "qwen3_moe" else "-",
            "prefix_sharing": "on",
            "prefix_groups": "on",
            "prefix_tree": "on",
            "reward_head": "on",
        }
    if verdict.speedups.get("fused", "-") != "-":
        assert verdict.ablations["fused"].status == "pass"
    if verdict.speedups.get("packed attention") == "on":
        for column in ("grouped attention", "short kernel"):
            assert verdict.speedups[column] == "on"
            assert verdict.ablations[column].status == "pass"


def test_the_sweep_reports_the_short_kernel_wrong_when_it_loses_its_causal_mask(monkeypatch):
    import torch

    from slipstream.packing import calibration, short_attention
    from slipstream.packing.costs import BUILTIN

    monkeypatch.setattr(
        short_attention,
        "_additive_mask",
        lambda length, window, device, key_length: torch.zeros(length, key_length),
    )
    # the built-in costs, not this machine's calibration: the main arm's short kernel (auto) then runs
    # where the built-in reach says, on every machine; the ablation column forces it on either way
    monkeypatch.setattr(calibration, "attention_costs", lambda *args, **kwargs: BUILTIN)
    verdict = check_architecture("llama")
    assert verdict.status == "WRONG" and verdict.detail.startswith("short kernel"), verdict.detail
    assert verdict.speedups["short kernel"] == "WRONG"
    assert (
        verdict.speedups["grouped attention"] == "on"
    )  # fp32 "auto" keeps SDPA: only the forced column sees it


def test_the_sweep_reports_grouped_attention_wrong_when_groups_see_their_padding(monkeypatch):
    """A grouped SDPA without its causal mask: each document sees its later tokens and its padding."""
    import torch

    from slipstream.packing import calibration
    from slipstream.packing.attention import sdpa as attention_module
    from slipstream.packing.costs import BUILTIN

    original = attention_module.run_grouped

    def leaking(fn, groups, query, key, value, **kw):
        def full(q, k, v, **kw):
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=q.shape[1] != k.shape[1]
            )

        return original(full, groups, query, key, value, **kw)

    monkeypatch.setattr(attention_module, "run_grouped", leaking)
    free_calls = dataclasses.replace(BUILTIN, call_seconds=0.0)  # free calls: "auto" runs one per document
    monkeypatch.setattr(calibration, "attention_costs", lambda *args, **kwargs: free_calls)
    verdict = check_architecture("llama")
    assert verdict.status == "WRONG" and verdict.detail.startswith("grouped attention"), verdict.detail
    assert verdict.speedups["grouped attention"] == "WRONG"
    monkeypatch.undo()
    monkeypatch.setattr(attention_module, "run_grouped", leaking)  # tiny heads: "auto" groups these
    assert check_architecture("llama").status == "WRONG"


def test_the_pairs_cross_the_windows_and_thresholds():
    """Answers shorter and longer than the windows; prompt + answer on both sides of the position
    thresholds; every prompt + answer below the dynamic-RoPE threshold, the packed row above it."""
    answers = [n for _, chosen, rejected in PAIR_LENGTHS for n in (chosen, rejected)]
    alone = [prompt + n for prompt, chosen, rejected in PAIR_LENGTHS for n in (chosen, rejected)]
    assert min(answers) <= WINDOW < max(answers)
    assert min(alone) <= POSITION_THRESHOLD < max(alone)
    assert max(alone) < DYNAMIC_ROPE_POSITIONS < sum(map(sum, PAIR_LENGTHS))


@pytest.fixture(scope="module")
def tiny_llama():
    return tiny_model("llama", seed=compat.SEED)


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss"])  # sliding window; sinks + sorted routing
def test_prefix_shared_pairs_match_each_answer_run_alone(model_type):
    """(llama, qwen3_moe, roberta: through check_architecture above.)"""
    stock = tiny_model(model_type, seed=compat.SEED)
    pairs = preference_pairs(stock)
    assert [tuple(len(p[k]) for k in ("prompt_ids", "chosen_ids", "rejected_ids")) for p in pairs] == list(
        PAIR_LENGTHS
    )
    expected = pair_reference(stock, pairs)
    assert [len(e) for e in expected] == [n for _, c, r in PAIR_LENGTHS for n in (c, r)]
    result = check_prefix_sharing(stock, pairs, expected, {})
    assert result.status == "pass", result.detail
    assert result.logits_error <= compat.PAIR_TOLERANCE["token_logprob"]
    assert result.loss_error <= compat.PAIR_TOLERANCE["summed_logprob"]
    assert any(p.startswith("packed attention: slipstream") for p in result.policies)
    assert any(p.startswith("chunked loss: on") for p in result.policies)  # the sums: the chunked loss


def test_the_prefix_check_sees_a_rejected_answer_without_its_prompt(monkeypatch, tiny_llama):
    """The rejected answers attending to themselves only (their prefixes dropped): WRONG, named."""
    from slipstream.packing import pairs as pairs_module

    collate = pairs_module.collate_pairs

    def without_prefixes(pairs, prefix_sharing=True, device=None):
        return dataclasses.replace(collate(pairs, prefix_sharing, device), prefix_lens=None, _memo={})

    pairs = preference_pairs(tiny_llama)
    expected = pair_reference(tiny_llama, pairs)
    monkeypatch.setattr(pairs_module, "collate_pairs", without_prefixes)
    result = check_prefix_sharing(tiny_llama, pairs, expected, {})
    assert result.status == "WRONG", result.detail
    assert "pair 0's rejected answer" in result.detail or "pair 1's rejected answer" in result.detail
    assert "summed answer log-probs off" in result.detail


def test_the_prefix_check_reads_the_sums_from_the_logits_without_the_chunked_loss(tiny_llama):
    pairs = preference_pairs(tiny_llama)
    result = check_prefix_sharing(
        tiny_llama, pairs, pair_reference(tiny_llama, pairs), {"chunked_loss": False}
    )
    assert result.status == "pass" and "from the logits" in result.detail, result.detail


def test_the_groups_cross_the_windows_and_thresholds():
    """A prefix longer than the windows; prefix + continuation on both sides of the position
    thresholds and below the dynamic-RoPE threshold, the packed row above it; N = 4."""
    (prefix, continuations), *_ = compat.GROUP_SHAPES
    alone = [p + n for p, ns in compat.GROUP_SHAPES for n in ns]
    assert len(continuations) == 4 and prefix > WINDOW
    assert min(alone) <= POSITION_THRESHOLD < max(alone)
    assert max(alone) < DYNAMIC_ROPE_POSITIONS < sum(p + sum(ns) for p, ns in compat.GROUP_SHAPES)


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss", "lfm3"])  # window; sinks + routing; mixer
def test_prefix_groups_match_each_continuation_run_alone(model_type):
    """(llama, qwen3_moe, roberta, phi3, llama4_text: through check_architecture above.)"""
    stock = tiny_model(model_type, seed=compat.SEED)
    result = compat.check_prefix_groups(stock, compat.prefix_groups(stock), {})
    assert result.status == "pass", result.detail
    assert result.logits_error <= compat.GROUP_TOLERANCE["token_logprob"]
    assert result.loss_error <= compat.TOLERANCE["loss"] and result.grad_error <= compat.TOLERANCE["grad"]
    assert any(p.startswith("chunked loss: on") for p in result.policies)  # the loss: the chunked loss


def test_the_group_check_sees_a_continuation_without_its_prefix(monkeypatch, tiny_llama):
    from slipstream.packing import groups as groups_module

    collate = groups_module.collate_groups

    def without_prefixes(groups, prefix_sharing=True, device=None):
        batch = collate(groups, prefix_sharing, device)
        return dataclasses.replace(batch, prefix_lens=None, prefix_sources=None, _memo={})

    monkeypatch.setattr(groups_module, "collate_groups", without_prefixes)
    result = compat.check_prefix_groups(tiny_llama, compat.prefix_groups(tiny_llama), {})
    assert result.status == "WRONG" and "log-probs off" in result.detail and "loss off" in result.detail


def test_the_group_check_reads_the_loss_from_the_logits_without_the_chunked_loss(tiny_llama):
    result = compat.check_prefix_groups(tiny_llama, compat.prefix_groups(tiny_llama), {"chunked_loss": False})
    assert result.status == "pass", result.detail
    assert "packed_loss_from_logits" in result.detail


def test_the_tree_crosses_the_windows_and_thresholds():
    """Depth 4 with a row ending where a shared span ends; the first span longer than the windows; rows on
    both sides of the position thresholds and below the dynamic-RoPE threshold, the packed row above it."""
    spans, rows = compat.TREE_SPANS, compat.TREE_ROWS
    alone = [sum(spans[name] for name in row) for row in rows]
    assert spans["A"] > WINDOW and max(len(row) for row in rows) == 4
    assert min(alone) <= POSITION_THRESHOLD < max(alone)
    assert max(alone) < DYNAMIC_ROPE_POSITIONS < sum(spans.values())
    (tree,) = compat.prefix_tree(tiny_model("llama", seed=compat.SEED))
    assert len(tree["tree_nodes"]) == len(spans) and len(tree["tree_rows"]) == len(rows)


@pytest.mark.parametrize("model_type", ["mistral", "gpt_oss", "lfm3"])  # window; sinks + routing; mixer
def test_a_prefix_tree_matches_each_row_run_alone(model_type):
    stock = tiny_model(model_type, seed=compat.SEED)
    result = compat.check_prefix_tree(stock, compat.prefix_tree(stock), {})
    assert result.status == "pass", result.detail
    assert result.logits_error <= compat.GROUP_TOLERANCE["token_logprob"]
    assert result.loss_error <= compat.TOLERANCE["loss"] and result.grad_error <= compat.TOLERANCE["grad"]


def test_the_tree_check_sees_a_node_without_its_ancestors(monkeypatch, tiny_llama):
    from slipstream.packing import trees as trees_module

    collate = trees_module.collate_trees

    def without_ancestors(trees, device=None):
        return dataclasses.replace(collate(trees, device), parents=None, _memo={})

    monkeypatch.setattr(trees_module, "collate_trees", without_ancestors)
    result = compat.check_prefix_tree(tiny_llama, compat.prefix_tree(tiny_llama), {})
    assert result.status == "WRONG" and "log-probs off" in result.detail and "loss off" in result.detail


def test_advice_is_read_from_the_refusal_never_from_its_text():
    from slipstream.compat.arm import ArmResult, failed
    from slipstream.moe.experts import UnsupportedExperts
    from slipstream.packing.guards import UnsupportedArchitecture

    refused = failed(UnsupportedArchitecture("windows overlap"))
    assert refused.status == "refused" and advice_of(refused) == {"packed_attention": False}
    per_site = failed(UnsupportedExperts("x", avoid={"moe_compute": "loop"}))
    assert advice_of(per_site) == {"moe_compute": "loop"}
    # a message that names a way out is not advice: only the refusal's data is
    crash = failed(NotImplementedError("Use slipstream.optimize(model, packed_attention=False)"))
    assert crash.status == "CRASH" and advice_of(crash) is None
    assert advice_of(ArmResult("refused", "no way out named")) is None


def test_the_table_counts_every_outcome():
    verdicts = [check_architecture(t).to_dict() for t in ("llama", "mamba")]
    text = render_markdown(verdicts, seconds=1.0)
    assert "| packed, exact | 1 |" in text and "| refused | 1 |" in text and "| total | 2 |" in text
    assert "| `mamba` | MambaForCausalLM | refused |" in text
    assert "## Values computed from the packed row" in text
    assert "No column for Liger-Kernel's fused RMSNorm / SwiGLU / RoPE" in text  # CPU: never run here
    assert all(_cell(finding.feature) in text for finding in AUDIT)
    assert "compiled |" not in text and "--compile" in text  # the compiled column is opt-in
    assert (
        "| fused | prefix | groups | tree | reward | note |" in text and "*prefix* = preference pairs" in text
    )
    assert "*reward* = the architecture's one-label sequence classifier" in text
    assert "*tree* = a prefix tree of depth 4" in text
    assert "*groups* = prefix groups" in text
    assert (
        "| `llama` | LlamaForCausalLM | packed, exact | on | - | on | on | on | on | RMSNorm+SwiGLU | on | on | on |"
        in text
    )
    assert (
        "| `mamba` | MambaForCausalLM | refused | off | - | on | on | - | - | RMSNorm | - | - | - |" in text
    )


@pytest.mark.slow  # tens of seconds on a 2-core fp32-only CPU: make test-slow (.ci/run)
def test_the_opt_in_compiled_arm_is_checked_and_gets_its_column(monkeypatch):
    """``compile=True`` (the sweep's --compile) runs the passing arm again with compiled layers; here
    through aot_eager (the same dynamo graphs, no inductor codegen: ~50 s cold on this CPU)."""
    from slipstream.compile import regional

    monkeypatch.setattr(regional, "BACKEND", "aot_eager")
    monkeypatch.setitem(compat.FUSED_BACKENDS, True, "aot_eager")  # (inductor's own: make compile-check)
    verdict = check_architecture("llama", compile=True)
    assert verdict.status == "pass" and verdict.speedups["compiled"] == "on", verdict.ablations
    assert any(p.startswith("compile: decoder layers") for p in verdict.ablations["compiled"].policies)
    text = render_markdown([verdict.to_dict()])
    assert (
        "| grouped | short | fused | prefix | groups | tree | reward | compiled | note |" in text
        and "| on | on | RMSNorm+SwiGLU | on | on | on | on | on |" in text
    )


def test_position_thresholds_sit_inside_the_test_documents():
    """Each threshold on a position or a length is crossed by some documents and not others (or,
    for dynamic RoPE, by the row but by no document), so a value read off the row differs."""
    assert min(LENGTHS) <= POSITION_THRESHOLD < max(LENGTHS)
    assert max(LENGTHS) < DYNAMIC_ROPE_POSITIONS < sum(LENGTHS)
    assert tiny_config("llama4_text").floor_scale == POSITION_THRESHOLD
    assert tiny_config("llama4").text_config.floor_scale == POSITION_THRESHOLD
    for model_type in ("phi3", "phi4_multimodal", "phimoe", "ministral3"):
        rope = tiny_config(model_type).rope_parameters
        assert rope["original_max_position_embeddings"] == POSITION_THRESHOLD, model_type
    config = tiny_config("hunyuan_v1_dense")
    assert config.rope_parameters["rope_type"] == "dynamic"
    assert config.max_position_embeddings == DYNAMIC_ROPE_POSITIONS


def test_the_sweep_reports_llama4_wrong_without_its_temperature_adaptation(monkeypatch):
    """Llama 4's temperature tuning reads the row position: with floor_scale inside the documents,
    the sweep sees it (longrope's counterpart: tests/packing/test_rowpos.py)."""
    monkeypatch.setattr(packing_verdict, "row_position_features", lambda model: [])
    verdict = check_architecture("llama4_text")
    assert verdict.status == "WRONG", verdict.detail
    assert "self_attn" in verdict.detail


@pytest.mark.slow
def test_the_whole_registry_is_exact_or_refused():
    """Every causal LM transformers registers: 0 silently wrong, 0 crashes, every one built."""
    verdicts = sweep(causal_lm_model_types(), workers=2)
    bad = {v["model_type"]: v["detail"] for v in verdicts if v["status"] in ("WRONG", "CRASH", "unbuilt")}
    assert not bad
    assert sum(v["status"] == "unchecked" for v in verdicts) <= 5
    assert sum(v["status"] == "pass" for v in verdicts) >= 97


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen3_moe"])
def test_the_reward_head_on_packed_pairs_matches_transformers_on_each_sequence(model_type):
    from slipstream.compat.reward_parity import REWARD_TOLERANCE, check_reward

    stock = tiny_model(model_type, seed=compat.SEED)
    result = check_reward(stock, preference_pairs(stock), {})
    assert result.status == "pass", result.detail
    assert result.logits_error <= REWARD_TOLERANCE
    assert any(p.startswith("packed attention: slipstream") for p in result.policies)


def test_the_reward_column_refuses_an_architecture_without_a_sequence_classifier_by_name():
    from slipstream.compat.reward_parity import check_reward

    stock = tiny_model("cohere", seed=compat.SEED)
    result = check_reward(stock, preference_pairs(stock), {})
    assert result.status == "refused" and "no sequence-classification class for CohereConfig" in result.detail


def test_the_reward_check_sees_a_rejected_answer_without_its_prompt(monkeypatch, tiny_llama):
    from slipstream.compat.reward_parity import check_reward
    from slipstream.packing import pairs as pairs_module

    collate = pairs_module.collate_pairs

    def without_prefixes(pairs, prefix_sharing=True, device=None, pad_id=None):
        return dataclasses.replace(collate(pairs, prefix_sharing, device, pad_id), prefix_lens=None, _memo={})

    monkeypatch.setattr(pairs_module, "collate_pairs", without_prefixes)
    result = check_reward(tiny_llama, preference_pairs(tiny_llama), {})
    assert result.status == "WRONG" and "packed rewards off by" in result.detail, result.detail
