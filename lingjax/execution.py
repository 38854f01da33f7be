"""How a traced program runs: which kernel set, and the tensor-parallel mesh axis when the program
body runs inside shard_map (lingjax/sharding.py). Passed down explicitly, static under jit."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from lingjax import kernels


@dataclasses.dataclass(frozen=True)
class Exec:
    kernels: str = "xla"  # "xla" | "pallas", see lingjax.kernels
    tp_axis: str | None = None  # set inside shard_map: weights and heads are this device's shard
    router_precision: str = "f32"  # "f32" (parity) or "bf16" (declared rounding change), see ops.moe.route

    def op(self, name: str):
        return kernels.get(name, self.kernels)

    def psum(self, x: jax.Array) -> jax.Array:
        """The one all-reduce of a row-parallel sub-layer (identity without TP)."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def gather_vocab(self, logits: jax.Array) -> jax.Array:
        """Full-vocabulary logits from the vocab-parallel lm_head's shards (identity without TP)."""
        return jax.lax.all_gather(logits, self.tp_axis, axis=-1, tiled=True) if self.tp_axis else logits

    def argmax_vocab(self, logits: jax.Array) -> jax.Array:
        """argmax over the (possibly vocab-sharded) last axis, ties to the lowest id like jnp.argmax:
        each shard's max and local argmax, pmax of the maxima, pmin of the ids that reach it."""
        local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if not self.tp_axis:
            return local
        best = jnp.max(logits, axis=-1)
        offset = jax.lax.axis_index(self.tp_axis) * logits.shape[-1]
        top = jax.lax.pmax(best, self.tp_axis)
        ids = jnp.where(best == top, local + offset, jnp.iinfo(jnp.int32).max)
        return jax.lax.pmin(ids, self.tp_axis).astype(jnp.int32)
