"""Decode-time caches: one explicit pytree, donated to every jitted step.

Per KDA layer: the recurrent state and the conv ring, the pre-conv q/k/v input of position p in slot
p mod N, N = W - 1 + VERIFY_ROWS: the conv of the next token reads the W-1 slots before it, and a forward
of up to VERIFY_ROWS tokens writes its inputs into the slots after them, in place (the fused chain kernel
does, so a decode step moves no window).
Per MLA layer (and the MTP layer, whose cache the drafter owns): the latent cache, c ‖ roped k_pe
per token. Slots at or past the committed length hold stale values; attention masks them by position,
and the conv ring's are overwritten before they are read.

Under speculation a verify forward leaves every KDA state untouched and returns KDAStaged instead (the
state after each verified row, and the ring with every verified row written); `commit` copies the
accepted row's state in. The ring needs no commit: the slots of rejected rows belong to positions past
the accepted ones.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lingjax.config import KDA, VERIFY_ROWS, LingConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDACache:
    state: jax.Array  # [H, K, V] f32
    conv: jax.Array  # [N, 3, H·d] activation dtype, the ring (module docstring): q, k, v channel blocks (split
    # by heads under TP)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    latent: jax.Array  # [capacity, kv_lora_rank + qk_rope_head_dim] activation dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KDAStaged:
    states: jax.Array  # [T, H, K, V] f32: the state after each verified row
    conv: jax.Array  # [N, 3, H·d]: the conv ring with every verified row's input written


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
            conv=jnp.zeros((conv_ring_size(cfg), 3, cfg.kda_dim), dtype),
        )

    return ModelCache(layers=tuple(kda() if t == KDA else init_mla_cache(cfg, capacity, dtype)
                                   for t in cfg.layer_types))


def conv_ring_size(cfg: LingConfig) -> int:
    return cfg.conv_size - 1 + VERIFY_ROWS


def commit(cache: ModelCache, staging: tuple, n) -> ModelCache:
    """Copy row n's state (n a device int: the last accepted row) of every KDA layer's staging into its
    cache, beside the verify's ring. Runs every round, zero-accept (n = 0: the state after the bonus token
    alone) included."""
    layers = tuple(
        KDACache(state=jax.lax.dynamic_index_in_dim(st.states, n, keepdims=False), conv=st.conv)
        if st is not None else c for c, st in zip(cache.layers, staging)
    )
    return ModelCache(layers=layers)
