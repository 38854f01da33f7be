"""Decode-time caches: one explicit pytree, donated to every jitted step.

Per KDA layer: the recurrent state and the conv window (last W-1 pre-conv q/k/v inputs).
Per MLA layer (and the MTP layer): the latent cache, c ‖ roped k_pe per token.
Slots at or past the committed length hold stale values; attention masks them by position.
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
    conv: jax.Array  # [W-1, 3·H·d] activation dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    latent: jax.Array  # [capacity, kv_lora_rank + qk_rope_head_dim] activation dtype


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ModelCache:
    layers: tuple  # KDACache | MLACache per layer
    mtp: MLACache | None  # the MTP layer's own latent cache

    @property
    def capacity(self) -> int:
        mla = [c for c in self.layers if isinstance(c, MLACache)]
        return mla[0].latent.shape[0] if mla else 0


def init_cache(cfg: LingConfig, capacity: int, dtype, with_mtp: bool = False) -> ModelCache:
    """Zeroed caches for `capacity` positions."""

    def mla():
        return MLACache(latent=jnp.zeros((capacity, cfg.mla_cache_dim), dtype))

    def kda():
        return KDACache(
            state=jnp.zeros((cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim), jnp.float32),
            conv=jnp.zeros((cfg.conv_size - 1, 3 * cfg.kda_dim), dtype),
        )

    layers = tuple(kda() if t == KDA else mla() for t in cfg.layer_types)
    return ModelCache(layers=layers, mtp=mla() if with_mtp else None)
