"""DSpark drafters shaped for timing rounds with random weights: the released Ling-3.0-flash draft's shape for a
target of any depth, and the bytes a propose reads (the byte floor of bench/step_bench.py's DSpark round)."""

from __future__ import annotations

from lingjax.spec.dspark_model import DSparkConfig


def ling_shaped_config(target_cfg, block_size: int = 8, markov_topk: int = 0) -> DSparkConfig:
    """A drafter of the released Ling-3.0-flash DSpark draft's published shape (docs/dspark.md: 5 layers of 32
    heads of 128, MLP 6144, Markov rank 256, 8 drafts a block) for a target of any depth: the target layers are
    Ling's 1, 11, 23, 29, 35 on a 42-layer target, spread the same way over another. For timing rounds with
    random weights."""
    n = target_cfg.num_hidden_layers
    layers = (1, 11, 23, 29, 35) if n == 42 else tuple(sorted({min(n - 1, round(f * (n - 1))) for f in
                                                              (1 / 41, 11 / 41, 23 / 41, 29 / 41, 35 / 41)}))
    return DSparkConfig(block_size=block_size, target_layer_ids=layers, mask_token_id=target_cfg.vocab_size - 1,
                        markov_rank=256, num_layers=5, hidden_size=target_cfg.hidden_size, num_heads=32,
                        num_kv_heads=32, head_dim=128, intermediate_size=6144, vocab_size=target_cfg.vocab_size,
                        rms_norm_eps=target_cfg.rms_norm_eps, markov_topk=markov_topk)


def propose_bytes(cfg: DSparkConfig, ctx: int, itemsize: int = 2) -> float:
    """The bytes a DSpark propose reads at batch 1 besides the target's lm_head: its layers, fc and norms, the
    context keys and values of `ctx` positions, W1's rows of the γ previous tokens and W2's rows the Markov head
    reads (all of it per draft, or markov_topk rows)."""
    d, h, g, hd, i, r = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                         cfg.markov_rank)
    layer = (h * hd * d + 2 * g * hd * d + d * h * hd + 3 * i * d) + 2 * hd + 2 * d
    cache = cfg.num_layers * 2 * ctx * g * hd
    w2_rows = cfg.markov_topk or cfg.vocab_size
    return (
        cfg.num_layers * layer + d * cfg.feature_size + 2 * d + cache + cfg.block_size * (1 + w2_rows) * r
    ) * itemsize
