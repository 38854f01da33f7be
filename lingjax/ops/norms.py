"""RMSNorm variants (docs/model.md §2, §3.5, §3.7)."""

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x²) + eps) · w, statistics in f32; the weight multiplies after the cast back."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(Σx² + eps) in f32 (eps inside the sqrt, as fla and HF do)."""
    xf = x.astype(jnp.float32)
    return xf / jnp.sqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)


def gated_rms_norm(o: jax.Array, weight: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """KDA output norm: rms_norm(o)·w·sigmoid(gate), all in f32 (weight shared by heads)."""
    of = o.astype(jnp.float32)
    y = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + eps)
    return y * weight.astype(jnp.float32) * jax.nn.sigmoid(gate.astype(jnp.float32))
