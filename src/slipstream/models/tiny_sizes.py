"""The tiny models' sizes, and which config attributes get which: the data the generic shrinker of
:mod:`slipstream.models.tiny_any` reads (kept apart from it so that module is the building logic only).

Every causal-LM family's attributes for width, heads, MLP, experts, state, windows, layers and
special token ids, by the names the registry's configs spell them; the thresholds the compatibility
sweep's document lengths are chosen around (``POSITION_THRESHOLD``, ``DYNAMIC_ROPE_POSITIONS``,
the reserved token ids).
"""

from __future__ import annotations

WIDTH = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
EXPERT_FFN = 32
VOCAB = 256
EXPERTS = 8
TOP_K = 2
WINDOW = 8  # sliding / chunked attention window: smaller than most test documents
STATE = 8  # SSM / recurrent state size
CHUNK = 8  # scan / linear-attention chunk: documents span several chunks
MAX_POSITIONS = 512
# Thresholds on a token's position or a document's length (Llama 4's temperature ``floor_scale``,
# longrope's ``original_max_position_embeddings``, ...): inside the range of the test documents'
# lengths and below a packed row's, so a value taken from the row instead of the document differs.
POSITION_THRESHOLD = 16
DYNAMIC_ROPE_POSITIONS = 32  # max_position_embeddings of the dynamic-RoPE model: above every test document
# Ids 0..RESERVED_LOW-1 are pad / bos / eos; the top RESERVED_HIGH ids are given to the other
# special tokens (image, audio, ...). Test documents use ids in between.
RESERVED_LOW = 3
RESERVED_HIGH = 16

# --------------------------------------------------------------------------- generic shrink table
# attribute -> target value. An int attribute is only ever made smaller, never larger.
WIDTH_KEYS = (
    "hidden_size",
    "d_model",
    "n_embd",
    "embed_dim",
    "emb_dim",
    "embedding_dim",
    "dim",
    "model_dim",
    "hidden_size_global",
    "backbone_hidden_size",  # a drafter's target model's width
    # vision / audio adapters: the tower's width in, the text model's out
    "adapter_in_dim",
    "adapter_input_size",
    "adapter_out_dim",
)
FFN_KEYS = (
    "intermediate_size",
    "ffn_dim",
    "decoder_ffn_dim",
    "encoder_ffn_dim",
    "n_inner",
    "ffn_hidden_size",
    "feed_forward_size",
    "dff",
    "dim_ff",
    "d_inner",
    "intermediate_size_mlp",
    "dense_intermediate_size",
    "d_ff",
)
EXPERT_FFN_KEYS = (
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "shared_intermediate_size",
    "shared_experts_intermediate_size",
    "expert_ffn_hidden_size",
)
HEAD_KEYS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "num_heads",
    "attention_heads",
    "decoder_attention_heads",
    "encoder_attention_heads",
    "num_decoder_attention_heads",
    "num_encoder_attention_heads",
    "swa_num_attention_heads",
)
# kv-head attributes and the head attribute they pair with (to tell GQA from MHA).
KV_HEAD_KEYS = {
    "num_key_value_heads": "num_attention_heads",
    "num_kv_heads": "num_attention_heads",
    "swa_num_key_value_heads": "swa_num_attention_heads",
    "num_query_groups": "num_attention_heads",
    "multi_query_group_num": "num_attention_heads",
}
HEAD_DIM_KEYS = (
    "head_dim",
    "swa_head_dim",
    "attention_head_dim",
    "kv_channels",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_head_dim",
    "dim_head",
    "attention_head_size",
    "d_head",
    "index_head_dim",
)
SMALL: dict[str, int] = {
    # MLA (DeepSeek-style) ranks and split head dims
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "o_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "qk_head_dim": 16,
    "query_pre_attn_scalar": HEAD_DIM,  # Gemma 2 / 3: the head dim
    # sparse-attention indexers
    "index_n_heads": 2,
    "index_topk": 8,
    # experts
    "num_experts": EXPERTS,
    "num_local_experts": EXPERTS,
    "n_routed_experts": EXPERTS,
    "moe_num_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "num_experts_per_token": TOP_K,
    "moe_topk": TOP_K,
    "moe_k": TOP_K,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "moe_num_shared_experts": 1,
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "router_hidden_size": 32,
    "zero_expert_num": 2,  # LongCat's zero-computation experts
    # linear attention / gated delta net
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    # SSM / recurrent mixers
    "mamba_d_state": STATE,
    "ssm_state_size": STATE,
    "state_size": STATE,
    "d_state": STATE,
    "mamba_n_heads": 4,
    "mamba_num_heads": 4,
    "n_mamba_heads": 2,
    "mamba_d_head": 32,
    "mamba_head_dim": 32,
    "mamba_headdim": 32,
    "mamba_n_groups": 1,
    "mamba_ngroups": 1,
    "n_groups": 1,
    "mamba_chunk_size": CHUNK,
    "mamba_dt_rank": 8,
    "time_step_rank": 8,
    "chunk_size": CHUNK,
    "lru_width": WIDTH,
    "rotary_dim": 8,  # partial rotary (GPT-J style): half of HEAD_DIM
    "attention_hidden_size": 2 * WIDTH,
    "adapter_rank": 8,
    "laurel_rank": 8,
    # positions, vocabularies
    "max_position_embeddings": MAX_POSITIONS,
    "n_positions": MAX_POSITIONS,
    "n_ctx": MAX_POSITIONS,
    "max_target_positions": MAX_POSITIONS,
    "max_source_positions": MAX_POSITIONS,
    "vocab_size": VOCAB,
    "unpadded_vocab_size": VOCAB,
    "decoder_vocab_size": VOCAB,
    # per-layer input embeddings (Gemma 3n / 4)
    "vocab_size_per_layer_input": VOCAB,
    "hidden_size_per_layer_input": 16,
    "output_vocab_size": VOCAB,
    "num_logits_to_keep": 1,
    "pretraining_tp": 1,
}
# Attributes holding a layer count (the first one present is the config's layer count).
LAYER_KEYS = (
    "num_hidden_layers",
    "n_layer",
    "n_layers",
    "num_layers",
    "decoder_layers",
    "num_decoder_layers",
    "num_blocks",
)
SECONDARY_LAYER_KEYS = ("encoder_layers", "num_encoder_layers")
# Sliding windows and similar local-attention spans, set to WINDOW when the config has one.
WINDOW_KEYS = (
    "sliding_window",
    "sliding_window_size",
    "attention_window_size",
    "attention_chunk_size",
    "local_attention_window_len",
    "keep_window_size",
)
# Token-id attributes: pad / bos / eos get the low reserved ids, every other special id one of
# the top RESERVED_HIGH ids (so random document ids never hit them).
LOW_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1}
# Routed-expert counts, and the router top-k attributes that go with them.
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts")
