"""skinny_linear (Pallas, interpret mode) against lingjax.ops.linear.linear on fresh random inputs."""

import jax
import jax.numpy as jnp
import pytest

from conftest import key_for, rel_err
from lingjax.ops.linear import linear
from lingjax.pallas.skinny_linear import skinny_linear

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(rows, n, k, dtype, *tag):
    kx, kw = jax.random.split(key_for("linear", rows, n, k, str(dtype), *tag))
    return (jax.random.normal(kx, (rows, k), jnp.float32).astype(dtype),
            (jax.random.normal(kw, (n, k), jnp.float32) * k**-0.5).astype(dtype))


@pytest.mark.parametrize("rows", [16, 32, 64])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("out", [None, jnp.float32])
def test_matches_reference(rows, dtype, out):
    x, w = _inputs(rows, 96, 160, dtype)  # N, K not multiples of the default tiles: smaller tiles are chosen
    got = skinny_linear(x, w, out, block_n=32, block_k=64)
    assert got.shape == (rows, 96) and got.dtype == (out or dtype)
    # every element compared against a nonzero-scale reference: an unwritten tile would fail
    assert rel_err(got, linear(x, w, out)) <= TOL[out or dtype]


def test_row_invariance():
    """A row's result does not depend on what the other rows hold (lingjax/model.py, row invariance)."""
    x, w = _inputs(16, 64, 128, jnp.bfloat16, "inv")
    other = x.at[1:].set(jax.random.normal(key_for("other"), (15, 128), jnp.float32).astype(jnp.bfloat16))
    a, b = skinny_linear(x, w, jnp.float32), skinny_linear(other, w, jnp.float32)
    assert bool((a[0] == b[0]).all())


@pytest.mark.parametrize("rows", [1, 5, 80])
def test_other_widths_take_the_reference(rows):
    x, w = _inputs(rows, 48, 64, jnp.float32)
    assert rel_err(skinny_linear(x, w), linear(x, w)) <= TOL[jnp.float32]


def test_shape_mismatch_is_an_error():
    x, w = _inputs(16, 48, 64, jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        skinny_linear(x, w[:, :32])
