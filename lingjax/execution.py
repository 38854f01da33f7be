"""How a traced program runs: which kernel set, and the tensor-parallel mesh axis when the program
body runs inside shard_map (lingjax/sharding.py). Passed down explicitly, static under jit."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lingjax import kernels


@dataclasses.dataclass(frozen=True)
class Exec:
    kernels: str = "xla"  # "xla" | "pallas", see lingjax.kernels
    tp_axis: str | None = None  # set inside shard_map: weights and heads are this device's shard
    router_precision: str = "f32"  # "f32" (parity) or "bf16" (declared rounding change), see ops.moe.route
    xla_ops: tuple[str, ...] = ()  # ops that run their XLA reference whatever `kernels` says (A/B of one kernel)
    # keyword options for ops' Pallas implementations, ((op, ((name, value), ...)), ...): an A/B of a kernel
    # option inside the whole step (bench/step_bench.py --kernel-option), e.g. the chain kernel's block_v
    kernel_options: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()

    def runs_pallas(self, name: str) -> bool:
        """Whether op `name` runs its Pallas implementation (whose extra options the caller may then pass)."""
        return self.kernels == "pallas" and name not in self.xla_ops

    def op(self, name: str):
        which = "pallas" if self.runs_pallas(name) else "xla"
        impl = kernels.get(name, which)
        options = dict(self.kernel_options).get(name) if which == "pallas" else None
        return functools.partial(impl, **dict(options)) if options else impl

    def psum(self, x: jax.Array) -> jax.Array:
        """The one all-reduce of a row-parallel sub-layer (identity without TP)."""
        return jax.lax.psum(x, self.tp_axis) if self.tp_axis else x

    def gather_vocab(self, logits: jax.Array) -> jax.Array:
        """Full-vocabulary logits from the vocab-parallel lm_head's shards (identity without TP)."""
        return jax.lax.all_gather(logits, self.tp_axis, axis=-1, tiled=True) if self.tp_axis else logits

    def argmax_vocab(self, logits: jax.Array) -> jax.Array:
        """argmax over the (possibly vocab-sharded) last axis, ties to the lowest id like jnp.argmax.
        Under TP, ONE collective: each shard's (max, global id of its local argmax) pair, as two f32
        (ids below 2^24 are exact), all-gathered; the first shard holding the top value wins, and
        shards hold increasing id ranges. A pmax then a pmin would cost two collectives per argmax."""
        local = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        if not self.tp_axis:
            return local
        shards = jax.lax.axis_size(self.tp_axis)
        if logits.shape[-1] * shards > 1 << 24:
            raise ValueError(f"vocabulary {logits.shape[-1] * shards} too large for f32 ids in argmax_vocab")
        offset = jax.lax.axis_index(self.tp_axis) * logits.shape[-1]
        pair = jnp.stack([jnp.max(logits, axis=-1).astype(jnp.float32), (local + offset).astype(jnp.float32)], -1)
        pairs = jax.lax.all_gather(pair, self.tp_axis)  # [shards, ..., 2]
        winner = jnp.argmax(pairs[..., 0], axis=0)  # the first maximum: the lowest shard
        return jnp.take_along_axis(pairs[..., 1], winner[None], axis=0)[0].astype(jnp.int32)
