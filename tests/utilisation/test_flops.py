"""Model FLOPs: a hand count on a tiny Llama, and torch's own FlopCounterMode on a dense step."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from slipstream.utilisation import flop_profile, mfu

# hidden 64, 4 query heads of 16, 2 KV heads (GQA), MLP 96, vocab 128, 2 layers
H, HEADS, KV, D, MLP, V, LAYERS = 64, 4, 2, 16, 96, 128, 2


def tiny_llama(attn="eager") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=H,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        intermediate_size=MLP,
        vocab_size=V,
        num_hidden_layers=LAYERS,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def test_a_hand_count_of_a_lora_step_on_packed_documents():
    model = tiny_llama()
    rank = 4
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    profile = flop_profile(model)
    # per layer and token: q, o (H x H), k, v (H x KV*D), gate, up (H x MLP), down (MLP x H): all frozen,
    # so forward + input gradient = 4 FLOPs per weight
    frozen = LAYERS * 4 * (2 * H * H + 2 * H * KV * D + 3 * H * MLP)
    # LoRA on q (H -> r -> H) and v (H -> r -> KV*D): trainable, 6 FLOPs per weight
    lora = LAYERS * 6 * (rank * (H + H) + rank * (H + KV * D))
    assert profile.breakdown["frozen_linear"] == frozen
    assert profile.breakdown["lora"] == lora
    assert profile.token_flops == frozen + lora
    assert profile.head_row_flops == 4 * H * V  # the LM head is frozen under LoRA
    seq_lens, head_rows = [10, 30, 1], 37
    # causal: L(L+1)/2 (query, key) pairs per document, 12 * D FLOPs per pair, query head and layer
    pairs = 55 + 465 + 1
    attention = LAYERS * 12 * D * HEADS * pairs
    expected = 41 * (frozen + lora) + head_rows * 4 * H * V + attention
    assert profile.micro_batch_flops(seq_lens, head_rows) == expected
    assert profile.step_flops([(seq_lens, head_rows)] * 3) == 3 * expected
    full = LAYERS * 12 * D * HEADS * (100 + 900 + 1)
    assert profile.micro_batch_flops(seq_lens, head_rows, causal="full") == expected - attention + full


def test_a_sliding_window_caps_the_pairs():
    profile = flop_profile(tiny_llama())
    assert profile.attention_pairs(10, None) == 55
    assert profile.attention_pairs(10, 4) == 10 + 6 * 4  # queries 0..3 see 1..4 keys, the rest 4 each
    assert profile.attention_pairs(3, 4) == 6


def test_a_dense_step_agrees_with_torch_flop_counter():
    """One document, no LoRA (every weight trainable), eager attention: FlopCounterMode counts the
    matmuls (mm/addmm/bmm) of forward and backward. Both leave out elementwise ops; our causal count
    is the unmasked half of each score matrix, eager computes the full square (``causal="full"``)."""
    model = tiny_llama()
    length = 48
    ids = torch.randint(0, V, (1, length))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()  # stock loss: logits on every row
    counted = counter.get_total_flops()
    profile = flop_profile(model)
    ours = profile.micro_batch_flops([length], head_rows=length, causal="full")
    assert ours == pytest.approx(counted, rel=0.03)
    half = profile.micro_batch_flops([length], head_rows=length)
    assert half < ours  # the causal half counts fewer attention FLOPs


def test_mfu_is_achieved_over_peak():
    assert mfu(2e12, 2.0, 4e12) == pytest.approx(0.25)
    assert mfu(1.0, 1.0, 0.0) is None


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_routed_experts_count_top_k_per_token_as_torch_does(name):
    """Eager experts run each expert on the tokens routed to it: FlopCounterMode sees top-k per token."""
    from slipstream.models.presets import build_model

    model = build_model(name, vocab_size=256, attn_implementation="eager")
    model.set_experts_implementation("eager")
    ids = torch.randint(0, 256, (1, 64))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    profile = flop_profile(model)
    assert profile.breakdown["experts"] > 0 and profile.breakdown["router"] > 0
    # (eager attention computes every score, sliding windows included: the full square)
    assert profile.micro_batch_flops([64], 64, causal="full") == pytest.approx(
        counter.get_total_flops(), rel=0.03
    )
    if name == "gpt-oss":  # its sliding layers (window 8) see fewer pairs than its full ones
        assert {window for _, _, window in profile.attention} == {None, 8}
