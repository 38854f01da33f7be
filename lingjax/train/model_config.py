"""The embedded code model's config: an HF-spelled `bailing_hybrid` config.json dict (official spelling, as
`lingjax.config`'s presets), with every Ling-3 feature: KDA and MLA layers in groups (`layer_group_size`),
a leading dense layer, group-limited routing with a selection bias, shared experts and one MTP layer.

Sizes, with V vocab, D hidden, L layers (L_k KDA, L_m MLA, one dense, L - 1 MoE), H heads of KDA dim d
(P = H·d), MLA widths n (nope), r (rope), v (value), R (latent rank), E experts of width I, I_s shared width,
F dense width, W conv width; the MTP layer is one more MLA + MoE block:

    KDA layer     A_k = 6·P·D + H·D + 3·P·W + H + P + d
    MLA layer     A_m = H·(n + r)·D + (R + r)·D + R + H·(n + v)·R + H·D + H·v·D
    MoE layer     A_e = E·D + E + 3·E·I·D + 3·I_s·D
    dense layer   A_f = 3·F·D
    MTP extra     2·D·D + 3·D          (eh_proj, enorm, hnorm, final norm)
    norms         2·D per layer + D

    N (shipped, = lingjax.model.param_count(abstract_model(cfg, with_mtp=True)))
      = 2·V·D + L_k·A_k + (L_m + 1)·A_m + A_f + L·A_e + 2·D·(L + 1) + D + 2·D·D + 3·D

Training ties the output head to the embedding (`TIE_EMBEDDINGS`): the trained tree holds V·D fewer
parameters, N_t = N - V·D - L·E (the L router biases are balancing state, not trained). The shipped
checkpoint writes the head as its own tensor (an untied config): HF's BailingHybridForCausalLM ties no
weights whatever `tie_word_embeddings` says, so only an explicit lm_head.weight loads the same in both.

    shipped bytes  = 2·N + 2·(conv taps, A_log, dt_bias, router biases)     (those stay f32)
    resume bytes  ~= 4·N_t (f32 master) + 2·N_t (bf16 first moment) + 4·Σ(rows + cols) of each matrix's
                     factored second moment + 4·(vector sizes) + 4·L·E (biases)

The resume state binds first (~6·N_t <= 50 MB), which is why the experts are narrow and D is 192:
`tests/test_train_model.py` checks both budgets from shapes. SwiGLU limits are left out: HF 5.23's
bailing_hybrid has no clamp, and parity with it is part of the product.
"""

from __future__ import annotations

import copy

from lingjax.config import LingConfig

# Training shares the embedding with the output head (see the module docstring).
TIE_EMBEDDINGS = True

# Size budgets of the product (bytes, MB = 10^6 B).
SHIPPED_BYTES_BUDGET = 22_000_000
RESUME_BYTES_BUDGET = 50_000_000
CHECKPOINT_DISK_BUDGET = 60_000_000  # a saved resume state on disk, orbax's files included: what a run carries

EOS_TOKEN_IDS = [0, 1]  # <|endoftext|>, <|role_end|> (lingjax.train.bpe.SPECIAL_TOKENS)
PAD_TOKEN_ID = 0

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
    "tie_word_embeddings": False,  # the shipped checkpoint has its own lm_head.weight (module docstring)
    "eos_token_id": EOS_TOKEN_IDS,
    "pad_token_id": PAD_TOKEN_ID,
    "bos_token_id": None,
}

# The same structure at toy sizes (2 groups of 2, every feature kept) for tests and `--config small`.
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

CONFIGS = {"embedded": EMBEDDED, "small": SMALL}


def config_dict(name: str = "embedded") -> dict:
    """A fresh copy of a named config dict ("embedded" or "small")."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model config {name!r}; choose one of {sorted(CONFIGS)}")
    return copy.deepcopy(CONFIGS[name])


def embedded_config() -> LingConfig:
    return LingConfig.from_hf(EMBEDDED)


def small_test_config() -> LingConfig:
    return LingConfig.from_hf(SMALL)
