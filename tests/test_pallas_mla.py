"""The split-L MLA decode kernel (lingjax.pallas.mla_decode) in interpret mode against
lingjax.ops.mla.mla_absorbed: fresh random inputs, every output element written (interpret mode NaN-fills
outputs first, and rel_err fails on NaN), zeros past `tokens`, row invariance bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.ops import mla
from lingjax.pallas.mla_decode import mla_decode_attention

N, R, V, RANK = 16, 8, 16, 32  # nope, rope, value head dims and the latent rank (small; Flash: 128/64/128/512)
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-4}  # bf16: q and p in two bf16 halves each (~2^-16 per product)


def _inputs(seed, rows, h, cap, dtype):
    ks = jax.random.split(key_for("mla_decode", seed, rows, h, cap), 4)
    q_nope = jax.random.normal(ks[0], (rows, h, N))
    q_pe = jax.random.normal(ks[1], (rows, h, R))
    cache = jax.random.normal(ks[2], (cap, RANK + R)).astype(dtype)
    w_kvb = jax.random.normal(ks[3], (h * (N + V), RANK)) / RANK**0.5
    return q_nope, q_pe, cache, w_kvb


def _check(seed, rows, tokens, h, cap, start, dtype=jnp.float32, tol=None, **opts):
    """Rows at positions start, start+1, ... (a verify's consecutive tokens); returns o."""
    q_nope, q_pe, cache, w_kvb = _inputs(seed, rows, h, cap, dtype)
    positions = start + jnp.arange(rows)
    o = mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, 0.3, tokens=tokens, **opts)
    want = mla.mla_absorbed(q_nope, q_pe, cache, w_kvb, positions, 0.3, tokens=tokens)
    assert o.shape == want.shape == (rows, h, V)
    assert rel_err(o, want) <= (tol or TOL[dtype])
    assert not np.any(np.asarray(o[tokens:]))
    return o


@pytest.mark.parametrize("tokens", [1, 4, 16])
@pytest.mark.parametrize("h", [16, 3])  # one token per block of 16 rows (Flash at TP2); blocks across tokens
def test_matches_reference(tokens, h):
    _check(0, 16, tokens, h, 64, 5)
    _check(1, tokens, tokens, h, 64, 64 - tokens)  # the last slot, no padding rows


@pytest.mark.parametrize("opts", [dict(block_l=4, splits=3), dict(block_l=8, splits=1), dict(block_l=16, splits=64),
                                  dict(block_l=4, splits=4)])
def test_tiles_and_splits(opts):
    """Tiles and splits change only the rounding order; more splits than tiles leave splits empty."""
    for start in (0, 17, 40):
        _check(2, 16, 5, 4, 64, start, **opts)


@pytest.mark.parametrize("tokens,h", [(1, 16), (4, 16), (5, 3)])
def test_bf16_cache_halves(tokens, h):
    """A bf16 cache: its tile stays bf16 and q, then p, go in as two bf16 halves (~2^-16 relative per
    product, where the f32 reference is exact on the bf16 values)."""
    _check(5, 16, tokens, h, 64, 20, jnp.bfloat16, block_l=8, splits=4)


def test_bf16_cache_and_far_slots_unread():
    """A bf16 cache (the model's); slots past every row's position are never needed: poisoning them with
    1e30 changes nothing (they are masked, or their tiles never read)."""
    q_nope, q_pe, cache, w_kvb = _inputs(3, 16, 16, 96, jnp.bfloat16)
    positions = 20 + jnp.arange(16)
    o = mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, 0.3, tokens=4, block_l=8)
    poisoned = cache.at[24:].set(1e30)
    assert np.array_equal(np.asarray(o), np.asarray(mla_decode_attention(q_nope, q_pe, poisoned, w_kvb, positions,
                                                                         0.3, tokens=4, block_l=8)))
    assert rel_err(o, mla.mla_absorbed(q_nope, q_pe, cache, w_kvb, positions, 0.3, tokens=4)) <= 1e-4


@pytest.mark.parametrize("h,dtype", [(16, jnp.bfloat16), (6, jnp.bfloat16), (6, jnp.float32)])
def test_row_invariance(h, dtype):
    """Row j's result is the same bit for bit whatever T and the padding rows hold (a verify equals
    plain decode): tokens 1, 4 and 7 over the same rows, and 4 tokens with other padding rows. h = 6:
    blocks of 16 rows mix tokens, so a row's block sees further at larger T. (Not the 4 real rows alone:
    the model always runs 16 rows here, and XLA's CPU dot in absorb_query rounds by its row count on some
    machines, 1 ulp apart between 4 and 16 rows, whatever the kernel does.)"""
    cap = 128
    q_nope, q_pe, cache, w_kvb = _inputs(4, 16, h, cap, dtype)
    positions = 50 + 3 * jnp.arange(16)
    cfg = dict(block_l=8, splits=4)
    out = {t: np.asarray(mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, 0.3, tokens=t, **cfg))
           for t in (1, 4, 7)}
    for t in (1, 4):
        assert np.array_equal(out[t][:t], out[7][:t])
    noise = jax.random.normal(jax.random.key(5), q_nope.shape[:2] + (q_nope.shape[2] + q_pe.shape[2],))
    other = mla_decode_attention(q_nope.at[4:].set(noise[4:, :, :q_nope.shape[2]].astype(q_nope.dtype)),
                                 q_pe.at[4:].set(noise[4:, :, q_nope.shape[2]:].astype(q_pe.dtype)), cache, w_kvb,
                                 positions, 0.3, tokens=4, **cfg)
    assert np.array_equal(np.asarray(other)[:4], out[4][:4])
