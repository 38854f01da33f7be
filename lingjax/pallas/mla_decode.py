"""Absorbed MLA attention for decode and verify (T <= 16 query rows) in Pallas: split-L flash decoding
straight from the bf16 latent cache, reading only the slots the rows can see.

XLA's form of lingjax.ops.mla.mla_absorbed converts the whole cache (all `capacity` slots, 9216 in the
serving bench) to f32 once per layer and forward, writes that copy and reads it back for the scores and
again for the context, in ~10 launches whatever the context length. Here:
  1. `_split_kernel`, grid (split s, block of BM query rows): each (token, head) row's scores against a
     tile of BL cache slots are q_lat · c + q_pe · k_pe (the cache row is [c | k_pe], R + r wide), masked
     to slots <= the row's position, folded into an online softmax (running max m, sum l, context acc
     [BM, R] = Σ p c). Split s takes tiles s, s + S, s + 2S, ... and stops after the block's last visible
     tile, so a 256-token context reads 256 slots, not the capacity. Writes (m, l) per split, and acc
     where the split had tiles.
  2. `_combine_kernel`, grid (block of BM rows over all `rows` x H rows, BR columns of R): the splits'
     partials summed in split order, ctx = Σ e^{m_s - M} acc_s / Σ e^{m_s - M} l_s, reading acc of the
     splits that had tiles only; rows past `tokens` are zeros. (A first version summed all S splits' acc
     in one program per row block: at T = 1 that one program streamed S x 32 KB, and the pair took
     45-470 µs on the H200, against XLA's 79.)
     combine="block" (off by default: not yet timed on a GPU) loads all S splits' partials as one
     [S, BM, BR] block per program and sums them in one reduction, where "loop" walks the splits in a
     while loop that Triton does not pipeline (each step waits on its load: ~32 steps at 8192 tokens,
     probably most of the kernel pair's time there). The split kernel then writes acc = 0 for empty
     splits too.
kv_b_proj's two halves stay in XLA on either side: q_lat = q_nope W_uk (on all rows, as the reference,
then sliced) and o = ctx W_uv.

Row invariance (lingjax.model: a verify's row t must equal plain decode's row bit for bit): a row's
result depends on its own q, position and the cache alone. The tile-to-split map is fixed (it does not
follow the other rows' positions), and a tile a row cannot see leaves its (m, l, acc) exactly as they
were: its scores are -inf, so alpha = e^0 = 1 and p = 0. Each dot's rows are independent, and both
kernels' shapes and loop orders are the same at every T.

Dots (dots="tf32", the default) take f32 operands at the GPU's default precision (tf32 on the H200, like
XLA's f32 einsums of the reference path), each cache tile converted to f32 first; interpret mode on the
CPU computes them in f32. dots="bf16x2" (off by default: not yet timed on a GPU) keeps the tile in bf16
(exact: the cache is bf16) and splits the f32 operand (q, then p) into two bf16 halves, two bf16
tensor-core dots each, accurate to ~2^-16 instead of tf32's 2^-11, without the f32 copy of every tile.

Measured on the H200 (bench/results/mla_h200x2_2026-11-30.md, Flash TP2 share, defaults): 21 µs against
XLA's 86 at 256 tokens of context, 66-73 against 87-89 at 8192 (16-19x the floor of the slots read);
in the Flash TP2 step at 8192 tokens, decode 4.0% and the round 1.8% faster.

Reference: lingjax.ops.mla.mla_absorbed (math in ling3_architecture.md §4).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import _NT, pow2_tile, resolve_interpret

F32, BF16 = jnp.float32, jnp.bfloat16
BM = 16  # query rows per program: the tensor cores' minimum M; one token's heads at H = 16 (Flash at TP2)
_NN = (((1,), (0,)), ((), ()))  # a [M, K] · b [K, N]


def _block_rows(pos_ref, b, heads, real, block_l):
    """Block b's BM rows (row t*H + h): (their indices, the input rows they read (a padding row re-reads the
    last real one), each row's position (-1: padding, sees nothing), the cache tiles holding a slot some
    row sees). Both kernels take the block's tile count from here, so they agree on the splits that ran."""
    idx = b * BM + jnp.arange(BM)
    src = jnp.minimum(idx, real - 1)
    pos = jnp.where(idx < real, pos_ref[src // heads], -1)
    return idx, src, pos, jnp.max(pos) // block_l + 1


def _parts(x, dots):
    """f32 x as the dots take it: (x,) for "tf32"; for "bf16x2" its bf16 halves (hi, lo), hi + lo = x to
    ~2^-16 relative, so two bf16 tensor-core dots against a bf16 tile give ~f32 accuracy."""
    if dots == "tf32":
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
                  scale, write_empty, dots):
    # qr_ref [rows x H, R] f32 and qp_ref [rows x H, r], row t*H + h; pos_ref [rows] int32; cache_ref
    # [L, R + r] -> acc_ref [S, N, R] f32, m_ref / l_ref [S, N] f32 for the first `real` = T x H rows
    # (N: `real` rounded up to BM; the rows between are padding, seeing nothing)
    s, b = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(b * BM, BM)
    _, src, pos, tiles = _block_rows(pos_ref, b, heads, real, block_l)
    q_lat, q_pe = _parts(qr_ref[src, :], dots), _parts(qp_ref[src, :].astype(F32), dots)
    tile_dtype = F32 if dots == "tf32" else BF16
    rank, r = qr_ref.shape[1], qp_ref.shape[1]
    trips = jnp.maximum(tiles - s + splits - 1, 0) // splits

    def tile(j, carry):
        m, l, acc = carry
        start = pl.multiple_of((s + j * splits) * block_l, block_l)
        lat = cache_ref[pl.ds(start, block_l), pl.ds(0, rank)].astype(tile_dtype)  # [BL, R]
        k_pe = cache_ref[pl.ds(start, block_l), pl.ds(rank, r)].astype(tile_dtype)  # [BL, r]
        scores = (_dot(q_lat, lat, _NT) + _dot(q_pe, k_pe, _NT)) * scale
        slots = start + jnp.arange(block_l)
        scores = jnp.where(slots[None, :] <= pos[:, None], scores, -jnp.inf)  # [BM, BL]
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no slot seen yet: keep e^(-inf - base) = 0
        alpha = jnp.exp(m - base)
        p = jnp.exp(scores - base[:, None])
        acc = acc * alpha[:, None] + _dot(_parts(p, dots), lat, _NN)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((BM,), -jnp.inf, F32), jnp.zeros((BM,), F32), jnp.zeros((BM, rank), F32))
    m, l, acc = jax.lax.fori_loop(0, trips, tile, init)
    m_ref[s, rows] = m  # a split without tiles: m = -inf, l = 0 (and acc = 0, written if write_empty)
    l_ref[s, rows] = l

    @pl.when((trips > 0) | write_empty)
    def _():
        acc_ref[s, rows, :] = acc


def _combine_kernel(acc_ref, m_ref, l_ref, pos_ref, o_ref, *, heads, real, block_l, block_r, at_once):
    # acc_ref [S, N, R], m_ref / l_ref [S, N] (N: the split kernel's rows) -> o_ref [rows x H, R] f32, columns
    # [c BR, (c + 1) BR) of one block of BM rows. at_once (combine="block"): every split's acc in one load
    # and one sum over S (the split kernel wrote acc = 0 for splits without tiles); else the splits that
    # had tiles one after another
    b, c = pl.program_id(0), pl.program_id(1)
    idx, _, _, tiles = _block_rows(pos_ref, b, heads, real, block_l)
    cols = pl.ds(c * block_r, block_r)

    @pl.when(b * BM < real)
    def _():
        rows = pl.ds(b * BM, BM)
        splits = acc_ref.shape[0]
        m = m_ref[:, rows]  # [S, BM]
        top = jnp.max(m, axis=0)
        top = jnp.where(top == -jnp.inf, 0.0, top)  # padding rows: nothing seen
        w = jnp.exp(m - top[None, :])  # e^-inf = 0: splits a row saw nothing in
        den = jnp.sum(w * l_ref[:, rows], axis=0)
        if at_once:
            num = jnp.sum(w[:, :, None] * acc_ref[:, rows, cols], axis=0)  # one tree over S at every T
        else:
            active = jnp.minimum(tiles, splits)  # the splits that had tiles: split s ran tiles s, s + S, ...

            def add(s, num):  # split order, the same at every T; a split a row saw nothing in adds exact zeros
                return num + jnp.exp(m_ref[s, rows] - top)[:, None] * acc_ref[s, rows, cols]

            num = jax.lax.fori_loop(0, active, add, jnp.zeros((BM, block_r), F32))
        o_ref[rows, cols] = jnp.where((idx < real)[:, None], num / den[:, None], 0.0)

    @pl.when(b * BM >= real)
    def _():
        o_ref[pl.ds(b * BM, BM), cols] = jnp.zeros((BM, block_r), F32)


@functools.partial(jax.jit, static_argnames=("scale", "tokens", "block_l", "splits", "num_warps", "combine",
                                             "dots", "interpret"))
def mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None, block_l: int = 32,
                         splits: int = 32, num_warps: int = 4, combine: str = "loop", dots: str = "tf32",
                         interpret=None):
    """Same arguments and result as lingjax.ops.mla.mla_absorbed: q_nope [rows, H, n], q_pe [rows, H, r],
    cache [L, R + r] (latent | k_pe), w_kvb [H*(n+v), R], positions [rows] -> o [rows, H, v] f32, zero
    past row `tokens`. block_l: cache slots per tile (a power of 2 dividing L, at most this);
    splits: programs along the cache per block of rows. combine: "loop" (the splits that had tiles, one
    after another) or "block" (every split in one load); dots: "tf32" or "bf16x2" (the module docstring)."""
    if combine not in ("loop", "block"):
        raise ValueError(f"combine must be 'loop' or 'block', got {combine!r}")
    if dots not in ("tf32", "bf16x2") or (dots == "bf16x2" and cache.dtype != BF16):
        raise ValueError(f"dots must be 'tf32', or 'bf16x2' with a bfloat16 cache; got {dots!r}, {cache.dtype}")
    rows, h, n = q_nope.shape
    rank = w_kvb.shape[-1]
    r = q_pe.shape[-1]
    tokens = rows if tokens is None else tokens
    assert cache.shape[1] == rank + r and 1 <= tokens <= rows, (cache.shape, rank, r, tokens, rows)
    block_l = pow2_tile(cache.shape[0], block_l)
    interpret = resolve_interpret(interpret)
    w = w_kvb.reshape(h, -1, rank)  # [H, n+v, R]; each half converted to f32 where it is used (in its GEMM)
    w_uk, w_uv = w[:, :n].astype(F32), w[:, n:].astype(F32)
    q_lat = jnp.einsum("thn,hnr->thr", q_nope.astype(F32), w_uk)  # every row, as the reference (row invariance)
    real = tokens * h
    n_rows = pl.cdiv(real, BM) * BM
    positions = positions.astype(jnp.int32)
    params = None if interpret else pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    acc, m, l = pl.pallas_call(
        functools.partial(_split_kernel, heads=h, real=real, block_l=block_l, splits=splits, scale=float(scale),
                          write_empty=combine == "block", dots=dots),
        grid=(splits, n_rows // BM),
        out_shape=(jax.ShapeDtypeStruct((splits, n_rows, rank), F32), jax.ShapeDtypeStruct((splits, n_rows), F32),
                   jax.ShapeDtypeStruct((splits, n_rows), F32)),
        compiler_params=params,
        interpret=interpret,
        name="mla_decode_split",
    )(q_lat.reshape(rows * h, rank), q_pe.reshape(rows * h, r), positions, cache)
    out_rows = pl.cdiv(rows * h, BM) * BM
    at_once = combine == "block"
    block_r = pow2_tile(rank, max(16, 16384 // (splits * BM)) if at_once else 128)  # block: ~16K partials a program
    ctx = pl.pallas_call(
        functools.partial(_combine_kernel, heads=h, real=real, block_l=block_l, block_r=block_r, at_once=at_once),
        grid=(out_rows // BM, rank // block_r),
        out_shape=jax.ShapeDtypeStruct((out_rows, rank), F32),
        compiler_params=params,
        interpret=interpret,
        name="mla_decode_combine",
    )(acc, m, l, positions)
    ctx = ctx[: rows * h].reshape(rows, h, rank)
    return jnp.einsum("thr,hvr->thv", ctx, w_uv)
