"""Random initialisation of a module's parameters: each nnx.Param keeps the distribution it was drawn from as
metadata (`random`), so lingjax.random_weights can redraw a whole model leaf by leaf, straight into its shards, and a
fresh drafter or a preset gets the same kind of weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

F32 = jnp.float32


def draw(key, shape, dtype, how: tuple) -> jax.Array:
    """A random array: how = ("normal", mean, std) or ("log_uniform", low, high), drawn in f32."""
    if how[0] == "normal":
        w = how[1] + how[2] * jax.random.normal(key, shape, F32)
    else:
        w = jnp.log(jax.random.uniform(key, shape, F32, minval=how[1], maxval=how[2]))
    return w.astype(dtype)


class ParamInit:
    """Random initialisation for presets, tests and fresh drafters (real weights come from a checkpoint). Each Param
    keeps its distribution as metadata (`random`), so lingjax.random_weights.random_model can draw the same
    kind of weights leaf by leaf, straight into their shards."""

    def __init__(self, rngs: nnx.Rngs, dtype):
        self.rngs, self.dtype = rngs, dtype

    def param(self, shape, how, dtype=None):
        return nnx.Param(draw(self.rngs.params(), shape, dtype or self.dtype, how), random=how)

    def matrix(self, *shape, dtype=None):  # [..., out, in], std 1/sqrt(in)
        return self.param(shape, ("normal", 0.0, shape[-1] ** -0.5), dtype)

    def norm(self, n):
        return self.param((n,), ("normal", 1.0, 0.1))
