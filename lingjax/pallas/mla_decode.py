"""Absorbed MLA attention for decode and verify (T <= 16 query rows) in Pallas: split-L flash decoding
straight from the bf16 latent cache, reading only the slots the rows can see.

XLA's form of lingjax.ops.mla.mla_absorbed converts the whole cache (all `capacity` slots, 9216 in the
serving bench) to f32 once per layer and forward, writes that copy and reads it back for the scores and
again for the context, in ~10 launches whatever the context length. Here:
  1. `_split_kernel`, grid (split s, block of BM query rows): each (token, head) row's scores against a
     tile of BL cache slots are q_lat · c + q_pe · k_pe (the cache row is [c | k_pe], R + r wide), masked
     to slots <= the row's position, folded into an online softmax (running max m, sum l, context acc
     [BM, R] = Σ p c). Split s takes tiles s, s + S, s + 2S, ... and stops after the block's last visible
     tile, so a 256-token context reads 256 slots, not the capacity. The tile loop is Triton's scf.for
     (Pallas lowers a fori_loop with a traced bound to it), so num_stages > 1 software-pipelines the
     cache loads: at 8192 tokens this kernel went from 33-36 to 18-21 µs with 3 stages (on the H200).
     Writes (m, l, acc) per split; a split without tiles writes m = -inf, l = 0, acc = 0.
  2. `_combine_kernel`, grid (block of BM rows over all `rows` x H rows, BR columns of R): every split's
     partials in one [S, BM, BR] load, ctx = Σ e^{m_s - M} acc_s / Σ e^{m_s - M} l_s in one reduction
     over S; rows past `tokens` are zeros. (Walking the splits in a loop instead took 16-18 µs at 8192
     tokens against 3.6; summing all S in one program per row block took 45-470 µs.)
kv_b_proj's two halves stay in XLA on either side (lingjax.ops.mla.absorb_query, shared with the reference):
q_lat = q_nope W_uk on all rows, and o = ctx W_uv.

Row invariance (lingjax.model: a verify's row t must equal plain decode's row bit for bit): a row's
result depends on its own q, position and the cache alone. The tile-to-split map is fixed (it does not
follow the other rows' positions), and a tile a row cannot see leaves its (m, l, acc) exactly as they
were: its scores are -inf, so alpha = e^0 = 1 and p = 0. Each dot's rows are independent, and both
kernels' shapes and loop orders are the same at every T.

Dots: a bf16 cache's tile stays bf16 (exact) and the f32 operand (q, then p) goes in as two bf16 halves,
two bf16 tensor-core dots each, accurate to ~2^-16 (tf32 dots on a tile converted to f32 were 2^-11, and
slower: the f32 copy of every tile). An f32 cache (the CPU parity models) takes f32 dots.

Measured on the H200 (bench/results/mla_h200x2_2026-11-30_run2.md, Flash TP2 share, defaults): 18-19 µs
against XLA's 87 at 256 tokens of context, 33-35 against 87-88 at 8192 (8x the floor of the slots read).
In the Flash TP2 step at 8192 tokens, each change against the form before it in one process: the block
combine with bf16 halves, decode -5.2% and the round -2.5%; then 3 stages, decode -5.3%, round -0.8%.
(The first version was 4.0% and 1.8% faster than XLA's form.)

Reference: lingjax.ops.mla.mla_absorbed (math in ling3_architecture.md §4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.mla import absorb_query
from lingjax.pallas import _NT, pallas_call, pow2_tile, resolve_interpret

F32, BF16 = jnp.float32, jnp.bfloat16
BM = 16  # query rows per program: the tensor cores' minimum M; one token's heads at H = 16 (Flash at TP2)
_NN = (((1,), (0,)), ((), ()))  # a [M, K] · b [K, N]


def _parts(x, halves):
    """f32 x as the dots take it: (x,) against an f32 tile; against a bf16 tile its bf16 halves (hi, lo),
    hi + lo = x to ~2^-16 relative, so two bf16 tensor-core dots give ~f32 accuracy."""
    if not halves:
        return (x,)
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def _dot(parts, b, dims):
    """Σ over parts of part · b, f32 accumulation (b already in the parts' dtype)."""
    out = jax.lax.dot_general(parts[0], b, dims, preferred_element_type=F32)
    for a in parts[1:]:
        out = out + jax.lax.dot_general(a, b, dims, preferred_element_type=F32)
    return out


def _split_kernel(qr_ref, qp_ref, pos_ref, cache_ref, acc_ref, m_ref, l_ref, *, heads, real, block_l, splits,
                  scale):
    # qr_ref [rows x H, R] f32 and qp_ref [rows x H, r], row t*H + h; pos_ref [rows] int32; cache_ref
    # [L, R + r] -> acc_ref [S, N, R] f32, m_ref / l_ref [S, N] f32 for the first `real` = T x H rows
    # (N: `real` rounded up to BM; the rows between are padding, seeing nothing)
    s, b = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(b * BM, BM)
    idx = b * BM + jnp.arange(BM)  # row t*H + h
    src = jnp.minimum(idx, real - 1)  # the input row each reads (a padding row re-reads the last real one)
    pos = jnp.where(idx < real, pos_ref[src // heads], -1)  # -1: padding, sees nothing
    tiles = jnp.max(pos) // block_l + 1  # the cache tiles holding a slot some row sees
    halves = cache_ref.dtype == BF16
    q_lat, q_pe = _parts(qr_ref[src, :], halves), _parts(qp_ref[src, :].astype(F32), halves)
    rank, r = qr_ref.shape[1], qp_ref.shape[1]
    trips = jnp.maximum(tiles - s + splits - 1, 0) // splits

    def fold(j, carry):
        m, l, acc = carry
        start = pl.multiple_of((s + j * splits) * block_l, block_l)
        lat = cache_ref[pl.ds(start, block_l), pl.ds(0, rank)]  # [BL, R] in the cache's dtype
        k_pe = cache_ref[pl.ds(start, block_l), pl.ds(rank, r)]  # [BL, r]
        scores = (_dot(q_lat, lat, _NT) + _dot(q_pe, k_pe, _NT)) * scale
        slots = start + jnp.arange(block_l)
        scores = jnp.where(slots[None, :] <= pos[:, None], scores, -jnp.inf)  # [BM, BL]
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no slot seen yet: keep e^(-inf - base) = 0
        alpha = jnp.exp(m - base)
        p = jnp.exp(scores - base[:, None])
        acc = acc * alpha[:, None] + _dot(_parts(p, halves), lat, _NN)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BM,), -jnp.inf, F32), jnp.zeros((BM,), F32), jnp.zeros((BM, rank), F32))
    m, l, acc = jax.lax.fori_loop(0, trips, fold, init)
    m_ref[s, rows] = m  # a split without tiles: m = -inf, l = 0, acc = 0
    l_ref[s, rows] = l
    acc_ref[s, rows, :] = acc


def _combine_kernel(acc_ref, m_ref, l_ref, o_ref, *, real, block_r):
    # acc_ref [S, N, R], m_ref / l_ref [S, N] (N: the split kernel's rows) -> o_ref [rows x H, R] f32, columns
    # [c BR, (c + 1) BR) of one block of BM rows: every split's partials in one load and one sum over S
    b, c = pl.program_id(0), pl.program_id(1)
    idx = b * BM + jnp.arange(BM)
    cols = pl.ds(c * block_r, block_r)

    @pl.when(b * BM < real)
    def _():
        rows = pl.ds(b * BM, BM)
        m = m_ref[:, rows]  # [S, BM]
        top = jnp.max(m, axis=0)
        top = jnp.where(top == -jnp.inf, 0.0, top)  # padding rows: nothing seen
        w = jnp.exp(m - top[None, :])  # e^-inf = 0: splits a row saw nothing in
        den = jnp.sum(w * l_ref[:, rows], axis=0)
        num = jnp.sum(w[:, :, None] * acc_ref[:, rows, cols], axis=0)  # one tree over S, the same at every T
        o_ref[rows, cols] = jnp.where((idx < real)[:, None], num / den[:, None], 0.0)

    @pl.when(b * BM >= real)
    def _():
        o_ref[pl.ds(b * BM, BM), cols] = jnp.zeros((BM, block_r), F32)


@functools.partial(jax.jit, static_argnames=("scale", "tokens", "block_l", "splits", "num_warps", "num_stages",
                                             "interpret"))
def mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None, block_l: int = 32,
                         splits: int = 32, num_warps: int = 4, num_stages: int = 3, interpret=None):
    """Same arguments and result as lingjax.ops.mla.mla_absorbed: q_nope [rows, H, n], q_pe [rows, H, r],
    cache [L, R + r] (latent | k_pe), w_kvb [H*(n+v), R], positions [rows] -> o [rows, H, v] f32, zero
    past row `tokens`. block_l: cache slots per tile (a power of 2 dividing L, at most this);
    splits: programs along the cache per block of rows; num_stages: Triton's software pipelining of the
    split kernel's tile loop (its cache loads issued that many tiles ahead)."""
    rows, h, _ = q_nope.shape
    rank = w_kvb.shape[-1]
    r = q_pe.shape[-1]
    tokens = rows if tokens is None else tokens
    assert cache.shape[1] == rank + r and 1 <= tokens <= rows, (cache.shape, rank, r, tokens, rows)
    block_l = pow2_tile(cache.shape[0], block_l)
    interpret = resolve_interpret(interpret)
    q_lat, w_uv = absorb_query(q_nope, w_kvb)  # every row, as the reference (row invariance)
    real = tokens * h
    n_rows = pl.cdiv(real, BM) * BM
    positions = positions.astype(jnp.int32)

    def params(stages):
        return None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=stages)

    acc, m, l = pallas_call(
        functools.partial(_split_kernel, heads=h, real=real, block_l=block_l, splits=splits, scale=float(scale)),
        grid=(splits, n_rows // BM),
        out_shape=(jax.ShapeDtypeStruct((splits, n_rows, rank), F32), jax.ShapeDtypeStruct((splits, n_rows), F32),
                   jax.ShapeDtypeStruct((splits, n_rows), F32)),
        compiler_params=params(num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(q_lat.reshape(rows * h, rank), q_pe.reshape(rows * h, r), positions, cache)
    out_rows = pl.cdiv(rows * h, BM) * BM
    block_r = pow2_tile(rank, max(16, 16384 // (splits * BM)))  # ~16K partials a program
    ctx = pallas_call(
        functools.partial(_combine_kernel, real=real, block_r=block_r),
        grid=(out_rows // BM, rank // block_r),
        out_shape=jax.ShapeDtypeStruct((out_rows, rank), F32),
        compiler_params=params(1),
        interpret=interpret,
        name="mla_decode_combine",
    )(acc, m, l)
    ctx = ctx[: rows * h].reshape(rows, h, rank)
    return jnp.einsum("thr,hvr->thv", ctx, w_uv)
