"""The embedded code model's sizes and budgets. Its config (lingjax.presets.EMBEDDED, official spelling) has
every Ling-3 feature: KDA and MLA layers in groups (`layer_group_size`), a leading dense layer, group-limited
routing with a selection bias, shared experts and one MTP layer.

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
from lingjax.presets import PRESETS

# Training shares the embedding with the output head (see the module docstring).
TIE_EMBEDDINGS = True

# Size budgets of the product (bytes, MB = 10^6 B).
SHIPPED_BYTES_BUDGET = 22_000_000
RESUME_BYTES_BUDGET = 50_000_000
CHECKPOINT_DISK_BUDGET = 60_000_000  # a saved resume state on disk, orbax's files included: what a run carries

EMBEDDED = PRESETS["embedded"]
SMALL = PRESETS["small"]  # the same structure at toy sizes, for tests and `--config small`
EOS_TOKEN_IDS = EMBEDDED["eos_token_id"]  # <|endoftext|>, <|role_end|> (lingjax.train.bpe.SPECIAL_TOKENS)
PAD_TOKEN_ID = EMBEDDED["pad_token_id"]

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
