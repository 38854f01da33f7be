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


def residual_rms_norm(x: jax.Array, parts: jax.Array, weight: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    """A sub-layer's residual add and the next norm: h = x + Σ parts, the parts added in order in their dtype and
    rounded once to x's dtype; -> (h, rms_norm(h, weight, eps)). x: [R, D]; parts: [S, T, D], T <= R (a projection's
    split-K partial sums, or one part): rows past T add zero."""
    a = parts[0]
    for j in range(1, parts.shape[0]):
        a = a + parts[j]
    a = a.astype(x.dtype)
    if a.shape[0] < x.shape[0]:
        a = jnp.pad(a, [(0, x.shape[0] - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    h = x + a
    return h, rms_norm(h, weight, eps)
