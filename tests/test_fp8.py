"""Blockwise fp8 weights (lingjax.ops.fp8): quantize / dequantize against e4m3's rounding bound, block by block."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for
from lingjax.ops import fp8

# e4m3: 3 mantissa bits, so a normal value rounds within half an ulp, 2^-4 of its magnitude; below 2^-6 (the
# smallest normal) the spacing is 2^-9, so a subnormal rounds within 2^-10 (in units of the block's scale)
REL_BOUND, SUBNORMAL_BOUND = 2.0**-4, 2.0**-10


def _weight(shape, *key):
    """Normal entries with a few large ones per row, so blocks differ in scale by orders of magnitude."""
    w = jax.random.normal(key_for("fp8", shape, *key), shape, jnp.float32)
    spread = jnp.exp2(jax.random.randint(key_for("fp8-spread", shape, *key), shape[:-1] + (1,), -6, 6))
    return np.array(w * spread)


@pytest.mark.parametrize("scale_fmt", fp8.SCALE_FORMATS)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (3, 130, 129), (5, 64)])
def test_round_trip_within_e4m3_rounding(shape, scale_fmt):
    w = _weight(shape, scale_fmt)
    q, scale = fp8.quantize(w, scale_fmt=scale_fmt)
    assert q.dtype == fp8.FP8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == fp8.scale_shape(shape)
    assert np.isfinite(q.astype(np.float32)).all() and (scale > 0).all()
    got = np.asarray(fp8.dequantize(jnp.asarray(q), jnp.asarray(scale), jnp.float32))
    per_element = np.asarray(fp8.expand_scales(jnp.asarray(scale), shape))
    bound = np.maximum(REL_BOUND * np.abs(w), SUBNORMAL_BOUND * per_element) * (1 + 1e-6)
    assert (np.abs(got - w) <= bound).all(), float((np.abs(got - w) / bound).max())
    assert np.abs(q.astype(np.float32)).max() <= fp8.E4M3_MAX


def test_scales_map_each_block_to_the_e4m3_range():
    """float32 scales: each block's largest magnitude lands on 448 exactly; ue8m0: scales are powers of two
    and no block overflows (its largest magnitude between 224 and 448)."""
    shape = (3, 300, 260)
    w = _weight(shape, "range")
    for scale_fmt in fp8.SCALE_FORMATS:
        q, scale = fp8.quantize(w, scale_fmt=scale_fmt)
        qa = np.abs(q.astype(np.float32))
        sn, sk = scale.shape[-2:]
        padded = np.zeros(shape[:-2] + (sn * 128, sk * 128), np.float32)
        padded[..., : shape[1], : shape[2]] = qa
        block_max = padded.reshape(shape[0], sn, 128, sk, 128).max(axis=(2, 4))
        if scale_fmt == "float32":
            np.testing.assert_array_equal(block_max, fp8.E4M3_MAX)
        else:
            assert (np.exp2(np.round(np.log2(scale))) == scale).all()
            assert (block_max > fp8.E4M3_MAX / 2 - 16).all() and (block_max <= fp8.E4M3_MAX).all()


def test_zero_block_and_bad_inputs():
    w = _weight((256, 256), "zero")
    w[:128, 128:] = 0.0
    q, scale = fp8.quantize(w)
    assert scale[0, 1] == 1.0 and not q[:128, 128:].astype(np.float32).any()
    assert np.asarray(fp8.dequantize(jnp.asarray(q), jnp.asarray(scale), jnp.float32))[:128, 128:].max() == 0
    with pytest.raises(ValueError, match="scale_inv shape \\[2, 1\\] does not match weight \\[256, 256\\]"):
        fp8.dequantize(jnp.asarray(q), jnp.asarray(scale[:, :1]))
    w[3, 4] = np.nan
    with pytest.raises(ValueError, match="NaN or infinite"):
        fp8.quantize(w)
    with pytest.raises(ValueError, match="scale_fmt"):
        fp8.quantize(np.ones((4, 4)), scale_fmt="e8m0")
    with pytest.raises(ValueError, match="at least two dimensions"):
        fp8.scale_shape((7,))
