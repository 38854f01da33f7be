"""Blockwise fp8 weights, the official fp8 checkpoint's layout (docs/fp8.md): a weight [..., N, K] is stored as
float8_e4m3fn `q` [..., N, K] and one float32 `scale_inv` per block of BN x BK elements, [..., ceil(N/BN),
ceil(K/BK)], with w ≈ q · scale_inv of the block the element falls in (the last block of a dimension may be
partial). Leading dimensions (stacked experts) carry their own scales.

`quantize` makes that layout from a weight (lingjax convert --fp8, tests); `dequantize` is the plain-JAX
reference every fp8 kernel is checked against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
BLOCK = (128, 128)  # the official checkpoint's weight_block_size
SCALE_FORMATS = ("float32", "ue8m0")  # ue8m0: every scale a power of two (quantization_config.scale_fmt)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> tuple[int, ...]:
    """The scale_inv shape of a weight of `shape` ([..., N, K]) in blocks of `block` (BN, BK)."""
    if len(shape) < 2:
        raise ValueError(f"an fp8 weight has at least two dimensions, got shape {list(shape)}")
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def expand_scales(scale_inv: jax.Array, shape: tuple[int, ...], block: tuple[int, int] = BLOCK) -> jax.Array:
    """scale_inv [..., ceil(N/BN), ceil(K/BK)] -> the scale of every element, [..., N, K]."""
    n, k = shape[-2:]
    full = jnp.repeat(jnp.repeat(scale_inv, block[0], axis=-2), block[1], axis=-1)
    return full[..., :n, :k]


def dequantize(q: jax.Array, scale_inv: jax.Array, dtype=jnp.bfloat16, block: tuple[int, int] = BLOCK) -> jax.Array:
    """q · scale_inv, computed in f32 and rounded once to `dtype`: [..., N, K]."""
    if tuple(scale_inv.shape) != scale_shape(q.shape, block):
        raise ValueError(f"scale_inv shape {list(scale_inv.shape)} does not match weight {list(q.shape)} in blocks "
                         f"of {list(block)}: expected {list(scale_shape(q.shape, block))}")
    return (q.astype(jnp.float32) * expand_scales(scale_inv.astype(jnp.float32), q.shape, block)).astype(dtype)


def quantize(w, block: tuple[int, int] = BLOCK, scale_fmt: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """A weight [..., N, K] (any float dtype) -> (q float8_e4m3fn [..., N, K], scale_inv float32 [..., N/BN, K/BK])
    on the host. Each block's scale maps its largest magnitude to E4M3_MAX (ue8m0: the next power of two up, so
    nothing overflows); an all-zero block gets scale 1. Rounding to e4m3 is to nearest even."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError("cannot quantize a weight with NaN or infinite entries")
    *lead, n, k = w.shape
    bn, bk = block
    sn, sk = scale_shape(w.shape, block)[-2:]
    padded = np.zeros((*lead, sn * bn, sk * bk), np.float32)
    padded[..., :n, :k] = w
    blocks = padded.reshape(*lead, sn, bn, sk, bk)
    amax = np.abs(blocks).max(axis=(-3, -1))  # [..., sn, sk]
    scale = np.where(amax > 0, amax / E4M3_MAX, 1.0).astype(np.float32)
    if scale_fmt == "ue8m0":
        scale = np.exp2(np.ceil(np.log2(scale))).astype(np.float32)
    q = blocks / scale[..., :, None, :, None]
    q = np.asarray(jnp.asarray(np.clip(q, -E4M3_MAX, E4M3_MAX), jnp.float32).astype(FP8))
    return np.ascontiguousarray(q.reshape(*lead, sn * bn, sk * bk)[..., :n, :k]), scale
