"""Projections: y = x·Wᵀ with the torch [out, in] weight layout and f32 accumulation."""

import jax
import jax.numpy as jnp

from lingjax.ops.fp8 import dense

F32 = jnp.float32


def linear(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """x: [..., in]; w: [out, in] -> [..., out] in out_dtype (default: x's dtype), accumulated in f32
    and rounded once. Under TP a column-parallel weight gives this device's slice of the outputs. An fp8 weight
    (lingjax.ops.fp8.Fp8Array) is dequantized to x's dtype first: the reference of lingjax.pallas.linear."""
    w = dense(w, x.dtype)
    return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=F32).astype(out_dtype or x.dtype)


def dot_rows(x: jax.Array, w: jax.Array) -> jax.Array:
    """linear for a weight of a few dozen outputs ([N, in], N ~ heads) on a few rows, as a multiply-reduce:
    f32 products, an f32 sum, one rounding to x's dtype (one reduction fusion in XLA: lingjax.model.narrow_linear
    says why). x: [..., in]; w: [N, in] -> [..., N]."""
    return jnp.sum(x[..., None, :].astype(F32) * dense(w, x.dtype).astype(F32), axis=-1).astype(x.dtype)


def rows_linear(x: jax.Array, w, out_dtype=None, *, tokens=None) -> jax.Array:
    """linear on the few rows of a decode or verify, for a plain or an fp8 weight: the reference of
    lingjax.pallas.linear.linear, which takes `tokens` (the real rows) and writes zeros past them; every row is
    computed here."""
    del tokens
    return linear(x, w, out_dtype)
