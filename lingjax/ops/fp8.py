"""Blockwise fp8 weights, the official fp8 checkpoint's layout (docs/fp8.md): a weight [..., N, K] is stored as
float8_e4m3fn `q` [..., N, K] and one float32 `scale_inv` per block of BN x BK elements, [..., ceil(N/BN),
ceil(K/BK)], with w ≈ q · scale_inv of the block the element falls in (the last block of a dimension may be
partial). Leading dimensions (stacked experts) carry their own scales.

`quantize` makes that layout from a weight (lingjax convert --fp8, tests); `dequantize` is the plain-JAX
reference every fp8 kernel is checked against. On the device a weight is an `Fp8Array` (q and its scales in device
blocks, which TP shards cut whole: `device_block`, `refine_scales`).
"""

from __future__ import annotations

import dataclasses
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


# ---- fp8 weights on the device ----------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Array:
    """A weight kept in fp8 on the device: q float8_e4m3fn [..., N, K] and scale float32 [..., N/gn, K/gk], one
    scale per gn x gk block (the `block`; w = q · scale of its block). Device blocks divide their dimensions
    exactly: they are the checkpoint's blocks or finer (`device_block`), so that a tensor-parallel shard holds
    whole blocks. A pytree: it passes through jit, shard_map and the model's weight tuple as its two arrays."""

    q: jax.Array
    scale: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.q.shape)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)

    @property
    def block(self) -> tuple[int, int]:
        """(gn, gk): the rows and columns one scale covers."""
        (n, k), (sn, sk) = self.q.shape[-2:], self.scale.shape[-2:]
        return n // sn, k // sk

    def __getitem__(self, index) -> Fp8Array:
        """Index the leading (stacked) dimensions only, e.g. the chosen experts: fp8 and scales alike."""
        if self.ndim < 3:
            raise IndexError("an Fp8Array indexes its stacked leading dimensions; this one has none")
        return Fp8Array(self.q[index], self.scale[index])

    def flatten_rows(self) -> Fp8Array:
        """[..., N, K] -> [prod(...) · N, K] (a stack of matrices read as one: KDA's in_proj). The scales follow
        row for row, so each block stays in its rows."""
        k, sk = self.q.shape[-1], self.scale.shape[-1]
        return Fp8Array(self.q.reshape(-1, k), self.scale.reshape(-1, sk))

    def dequantize(self, dtype=jnp.bfloat16) -> jax.Array:
        """q · scale in f32, rounded once to dtype: [..., N, K] (the reference every fp8 kernel is checked against)."""
        from lingjax.stacked import materialize

        gn, gk = self.block
        scale = jnp.repeat(jnp.repeat(materialize(self.scale).astype(jnp.float32), gn, axis=-2), gk, axis=-1)
        return (materialize(self.q).astype(jnp.float32) * scale).astype(dtype)


def dense(w, dtype) -> jax.Array:
    """A weight as a plain array of `dtype` for an op that does not read fp8 itself (w itself when it is one)."""
    return w.dequantize(dtype) if isinstance(w, Fp8Array) else w


def device_block(shape: tuple[int, ...], block: tuple[int, int] = BLOCK, shards: tuple[int, int] = (1, 1)
                 ) -> tuple[int, int]:
    """The block (gn, gk) a weight [..., N, K] keeps on the device: per dimension the largest size dividing the
    checkpoint's block, the dimension and its shard (N / shards[0], K / shards[1] under tensor parallelism), so
    every block is whole and lies inside one checkpoint block and one shard. At TP4, Flash's expert width 768
    splits into shards of 192: blocks of 64 rows, two per checkpoint block."""
    n, k = shape[-2:]
    return (math.gcd(block[0], n, n // shards[0]), math.gcd(block[1], k, k // shards[1]))


def refine_scales(scale_inv: np.ndarray, shape: tuple[int, ...], block: tuple[int, int],
                  device: tuple[int, int]) -> np.ndarray:
    """A checkpoint's scales [..., ceil(N/BN), ceil(K/BK)] -> the device block's [..., N/gn, K/gk] (device blocks
    inside checkpoint blocks: each takes the scale of the block it lies in)."""
    n, k = shape[-2:]
    rows = np.arange(n // device[0]) * device[0] // block[0]
    cols = np.arange(k // device[1]) * device[1] // block[1]
    return np.ascontiguousarray(np.asarray(scale_inv, np.float32)[..., rows[:, None], cols[None, :]])


def quantize_on_device(w: jax.Array, block: tuple[int, int], scale_fmt: str = "float32") -> Fp8Array:
    """quantize's rounding in jnp, for blocks that divide w's [..., N, K] exactly (random fp8 weights drawn on the
    device, a bf16 checkpoint quantized as it loads): -> Fp8Array."""
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")
    *lead, n, k = w.shape
    gn, gk = block
    if n % gn or k % gk:
        raise ValueError(f"blocks of {list(block)} do not divide a weight of shape {list(w.shape)}")
    blocks = w.astype(jnp.float32).reshape(*lead, n // gn, gn, k // gk, gk)
    amax = jnp.max(jnp.abs(blocks), axis=(-3, -1))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0)
    if scale_fmt == "ue8m0":
        scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
    q = jnp.clip(blocks / scale[..., :, None, :, None], -E4M3_MAX, E4M3_MAX).astype(FP8)
    return Fp8Array(q.reshape(w.shape), scale.astype(jnp.float32))


def refine_scales_on_device(scale: jax.Array, shape: tuple[int, ...], block: tuple[int, int],
                            device: tuple[int, int]) -> jax.Array:
    """refine_scales in jnp (inside a program: random fp8 weights cut for a TP size)."""
    if tuple(block) == tuple(device):
        return scale
    n, k = shape[-2:]
    rows = np.arange(n // device[0]) * device[0] // block[0]
    cols = np.arange(k // device[1]) * device[1] // block[1]
    return scale[..., rows[:, None], cols[None, :]]
