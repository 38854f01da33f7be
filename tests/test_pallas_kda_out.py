"""kda_output_fused (Pallas, interpret mode) against lingjax.ops.kda.kda_output on fresh random inputs."""

import jax
import jax.numpy as jnp
import pytest

from conftest import key_for, rel_err
from lingjax.ops.kda import kda_output
from lingjax.pallas.kda_out import kda_output_fused

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}
EPS = 1e-6


def _inputs(rows, tokens, h, dv, n, dtype, *tag):
    """o as the chain leaves it (zero in rows >= tokens), the in_proj output (g its last H·V columns)."""
    ko, kp, kn, kw = jax.random.split(key_for("kda_out", rows, tokens, h, dv, n, str(dtype), *tag), 4)
    o = jax.random.normal(ko, (rows, h, dv), jnp.float32)
    o = jnp.where((jnp.arange(rows) < tokens)[:, None, None], o, 0.0)
    proj = (2 * jax.random.normal(kp, (rows, 5 * h * dv), jnp.float32)).astype(dtype)
    norm_w = (1 + 0.1 * jax.random.normal(kn, (dv,), jnp.float32)).astype(dtype)
    o_proj = (jax.random.normal(kw, (n, h * dv), jnp.float32) * (h * dv) ** -0.5).astype(dtype)
    return o, proj, norm_w, o_proj


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("h,dv", [(3, 16), (5, 32)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference(tokens, h, dv, dtype):
    args = _inputs(16, tokens, h, dv, 96, dtype)
    got = kda_output_fused(*args, tokens=tokens, eps=EPS)
    want = kda_output(*args, tokens=tokens, eps=EPS)
    assert got.shape == want.shape == (16, 96) and got.dtype == jnp.float32
    # every element against the reference, padded rows (zero there) included: an unwritten tile fails
    assert rel_err(got[:tokens], want[:tokens]) <= TOL[dtype]
    assert bool((got[tokens:] == 0).all())


def test_padded_rows_are_not_read():
    """Whatever the rows past T hold, the result is the reference's for zero rows there (the chain's o)."""
    o, proj, norm_w, o_proj = _inputs(16, 4, 3, 16, 64, jnp.bfloat16, "pad")
    junk = jax.random.normal(key_for("junk"), o.shape, jnp.float32)
    dirty = jnp.where((jnp.arange(16) < 4)[:, None, None], o, junk)
    got = kda_output_fused(dirty, proj, norm_w, o_proj, tokens=4, eps=EPS)
    assert rel_err(got, kda_output(o, proj, norm_w, o_proj, tokens=4, eps=EPS)) <= TOL[jnp.bfloat16]


def test_row_invariance():
    """Row 0 rounds the same whatever T and the other rows hold (lingjax/model.py, row invariance)."""
    o, proj, norm_w, o_proj = _inputs(16, 6, 3, 16, 64, jnp.bfloat16, "inv")
    one = kda_output_fused(o.at[1:].set(0.0), proj, norm_w, o_proj, tokens=1, eps=EPS)
    six = kda_output_fused(o, proj, norm_w, o_proj, tokens=6, eps=EPS)
    assert bool((one[0] == six[0]).all())


@pytest.mark.parametrize("rows", [1, 5, 80])
def test_other_widths_take_the_reference(rows):
    args = _inputs(rows, min(rows, 4), 3, 16, 48, jnp.float32)
    got = kda_output_fused(*args, tokens=min(rows, 4), eps=EPS)
    assert rel_err(got, kda_output(*args, tokens=min(rows, 4), eps=EPS)) <= TOL[jnp.float32]


def test_shape_mismatch_is_an_error():
    o, proj, norm_w, o_proj = _inputs(16, 2, 3, 16, 48, jnp.float32)
    with pytest.raises(ValueError, match="disagree"):
        kda_output_fused(o, proj, norm_w, o_proj[:, :32], tokens=2, eps=EPS)
