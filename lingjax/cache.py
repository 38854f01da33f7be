"""Decode-time caches: one explicit pytree, donated to every jitted step.

Per KDA layer: the recurrent state and the conv window (last W-1 pre-conv q/k/v inputs).
Per MLA layer (and the MTP layer, whose cache the drafter owns): the latent cache, c ‖ roped k_pe
per token. Slots at or past the committed length hold stale values; attention masks them by position.

Under speculation a verify forward leaves every KDACache untouched and returns KDAStaged instead
(the state and conv window after each verified row); `commit` copies the accepted row in.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lingjax.config import KDA, LingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDACache:
    state: jax.Array  # [H, K, V] f32
    conv: jax.Array  # [W-1, 3, H·d] activation dtype: q, k, v channel blocks (split by heads under TP)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    latent: jax.Array  # [capacity, kv_lora_rank + qk_rope_head_dim] activation dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAStaged:
    states: jax.Array  # [T, H, K, V] f32: the state after each verified row
    windows: jax.Array  # [T, W-1, 3, H·d]: the conv window after each verified row


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
    layers: tuple  # KDACache | MLACache per layer


def init_mla_cache(cfg: LingConfig, capacity: int, dtype) -> MLACache:
    return MLACache(latent=jnp.zeros((capacity, cfg.mla_cache_dim), dtype))


def init_cache(cfg: LingConfig, capacity: int, dtype) -> ModelCache:
    """Zeroed caches for `capacity` positions."""

    def kda():
        return KDACache(
            state=jnp.zeros((cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
            conv=jnp.zeros((cfg.conv_size - 1, 3, cfg.kda_dim), dtype),
        )

    return ModelCache(layers=tuple(kda() if t == KDA else init_mla_cache(cfg, capacity, dtype)
                                   for t in cfg.layer_types))


def commit(cache: ModelCache, staging: tuple, n) -> ModelCache:
    """Copy row n (a device int: the last accepted row) of every KDA layer's staging into its cache.
    Runs every round, zero-accept (n = 0: the state after the bonus token alone) included."""
    layers = tuple(
        KDACache(state=jax.lax.dynamic_index_in_dim(st.states, n, keepdims=False),
                 conv=jax.lax.dynamic_index_in_dim(st.windows, n, keepdims=False)) if st is not None else c
        for c, st in zip(cache.layers, staging)
    )
    return ModelCache(layers=layers)
