"""Rotary embeddings: interleaved (GPT-J) on the MLA rope dims (docs/model.md §4.3); the half-split (NeoX) layout of
the DSpark drafter."""

import jax
import jax.numpy as jnp


def rope_interleaved(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate pairs (x[2i], x[2i+1]) by angle pos · theta^(-2i/d); layout stays interleaved.

    x: [T, ..., d]; positions: [T] absolute 0-based. Angles in f32; result in x.dtype.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
    angle = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, d/2]
    angle = angle.reshape(angle.shape[:1] + (1,) * (x.ndim - 2) + angle.shape[1:])
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    even, odd = xf[..., 0::2], xf[..., 1::2]
    rotated = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def rope_half(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding in the NeoX / Llama layout (the DSpark drafter's): element i pairs with i + d/2, rotated
    by angle pos · theta^(-2i/d).

    x: [..., H, d]; positions: x.shape[:-2], absolute 0-based. Angles in f32; result in x.dtype.
    """
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))  # [d/2]
    angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [..., 1, d/2]
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    xf = x.astype(jnp.float32)
    lo, hi = xf[..., : d // 2], xf[..., d // 2 :]
    return jnp.concatenate([lo * cos - hi * sin, hi * cos + lo * sin], axis=-1).astype(x.dtype)
