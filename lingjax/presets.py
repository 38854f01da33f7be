"""The named model configs, in one registry: HF-spelled `bailing_hybrid` config.json dicts (lingjax.config reads
either spelling). `lingjax.config.preset(name)` makes a LingConfig of one; lingjax.load and the CLI's --model take
any name here with random weights; the trainer trains "embedded" (the shipped code model) and "small".
"""

from __future__ import annotations

# Ling-3.0-flash in the official spelling. SwiGLU limits are third-party readings of the real file
# (docs/model.md §6.3, marked uncertain); a real checkpoint's config.json always wins.
FLASH = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "num_hidden_layers": 42,
    "hidden_size": 2560,
    "intermediate_size": 6144,
    "first_k_dense_replace": 2,
    "num_experts": 512,
    "num_experts_per_tok": 8,
    "num_shared_experts": 1,
    "moe_intermediate_size": 768,
    "moe_shared_expert_intermediate_size": 768,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "vocab_size": 157184,
    "tie_word_embeddings": False,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "rope_theta": 6e6,
    "rope_scaling": None,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "layer_group_size": 6,
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "num_nextn_predict_layers": 1,
    "expert_swiglu_limit_list": [0.0] * 35 + [4.0] * 7,
    "share_expert_swiglu_limit_list": [0.0] * 34 + [5.0] * 6 + [7.0] * 2,
    "eos_token_id": 156895,
    "pad_token_id": 156892,
}

# A small model with every feature of Flash (both attention kinds in one group, dense + MoE, MTP,
# SwiGLU limits) for the CLI on a fresh machine and for tests.
TINY = {
    **FLASH,
    "num_hidden_layers": 3,
    "layer_group_size": 3,
    "first_k_dense_replace": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 4,
    "topk_group": 2,
    "vocab_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "rope_theta": 10000.0,
    "expert_swiglu_limit_list": [0, 6.0, 6.0, 6.0],
    "share_expert_swiglu_limit_list": [0, 0, 8.0, 8.0],
    "eos_token_id": 511,
    "pad_token_id": 510,
}

# Flash's widths (hidden, heads, 512 experts, vocab) at reduced depth: one group of 5 KDA + 1 MLA,
# one dense layer; ~19 B parameters with MTP. For GPU benchmarks of per-layer cost and the step.
MID = {
    **FLASH,
    "num_hidden_layers": 6,
    "first_k_dense_replace": 1,
    "expert_swiglu_limit_list": [0.0] * 5 + [4.0],
    "share_expert_swiglu_limit_list": [0.0] * 5 + [7.0],
}

# Flash at 18 of its 42 layers (3 of its 7 groups, its 2 dense layers): ~55 GB in fp8, so it runs on one 80 GB GPU;
# with mid and Flash, the third depth for compile time and per-layer cost against depth.
FLASH18 = {
    **FLASH,
    "num_hidden_layers": 18,
    "expert_swiglu_limit_list": [0.0] * 15 + [4.0] * 3,
    "share_expert_swiglu_limit_list": [0.0] * 14 + [5.0] * 2 + [7.0] * 2,
}

# Flash's 42 layers and every one of its arrays with 128 experts a layer instead of 512: ~36 GB in fp8, so it runs
# on one 80 GB GPU. A decode reads what Flash's reads (its token's top 8 experts, of whatever count), through the
# same argument arrays and launches; only the router's GEMV is a quarter of Flash's. Flash's step on an H100.
FLASH_E128 = {**FLASH, "num_experts": 128}

# The shipped code model's architecture (lingjax.train.model_config: its sizes and budgets).
EMBEDDED = {
    "architectures": ["BailingMoeV3ForCausalLM"],
    "model_type": "bailing_hybrid",
    "vocab_size": 8192,
    "hidden_size": 192,
    "num_hidden_layers": 8,
    "layer_group_size": 4,  # layers 3 and 7 MLA, the rest KDA
    "first_k_dense_replace": 1,
    "intermediate_size": 512,  # the dense layer 0
    # attention: HF reads one head count for both kinds (linear_num_heads = num_attention_heads)
    "num_attention_heads": 3,
    "num_key_value_heads": 3,  # HF's MLA repeats k/v by heads // num_key_value_heads (its default is 32)
    "head_dim": 64,  # KDA head dim (official spelling)
    "short_conv_kernel_size": 4,
    "kda_safe_gate": True,
    "kda_lower_bound": -5.0,
    "q_lora_rank": None,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "rope_theta": 50000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "max_position_embeddings": 4096,
    # MoE: 16 experts in 4 groups, 2 groups kept, top-4, sigmoid scores + selection bias (noaux_tc)
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 40,
    "num_shared_experts": 2,  # HF sizes the shared expert as moe_intermediate_size · num_shared_experts
    "moe_shared_expert_intermediate_size": 80,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 1,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,  # the shipped checkpoint has its own lm_head.weight (lingjax.train.model_config)
    "eos_token_id": [0, 1],  # <|endoftext|>, <|role_end|> (lingjax.train.bpe.SPECIAL_TOKENS)
    "pad_token_id": 0,
    "bos_token_id": None,
}

# The same structure at toy sizes (2 groups of 2, every feature kept), for tests and the trainer's `--config small`.
SMALL = {
    **EMBEDDED,
    "vocab_size": 512,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_group_size": 2,  # layers 1 and 3 MLA
    "intermediate_size": 64,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "num_shared_experts": 2,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 4,
    "topk_group": 2,
}

PRESETS = {"flash": FLASH, "flash18": FLASH18, "flash_e128": FLASH_E128, "mid": MID, "tiny": TINY,
           "embedded": EMBEDDED, "small": SMALL}
