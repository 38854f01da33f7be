"""Absorbed MLA attention for decode and verify (up to VERIFY_ROWS query rows) in Pallas: split-L flash
decoding straight from the latent cache, reading only the slots the rows can see (docs/kernels/mla.md).

Two launches: `_split_kernel` folds each split's cache tiles into online-softmax partials (running max m,
sum l, context acc); `_combine_kernel` merges every split's partials in one reduction. kv_b_proj's two
products stay in XLA on either side (lingjax.ops.mla.absorb_query and absorb_output, shared with the reference).
A row's result depends on its own query, position and the cache alone, at every T (row invariance, lingjax.model).

Reference: lingjax.ops.mla.mla_absorbed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.mla import absorb_output, absorb_query
from lingjax.pallas import _NN, _NT, is_pow2, pallas_call, pow2_tile, resolve_interpret

F32, BF16 = jnp.float32, jnp.bfloat16
BM = 16  # query rows per program: the tensor cores' minimum M; one token's heads at H = 16 (Flash at TP2)
# The least contraction a tensor-core dot computes right on the H200 (bf16 operands, or f32 ones as TF32); the
# Triton IR lowers smaller ones, which then give wrong results (docs/kernels/mla.md).
_MIN_K = {jnp.dtype(BF16): 16, jnp.dtype(F32): 8}


@dataclasses.dataclass(frozen=True)
class MLATuning:
    """Performance-only choices of mla_decode_attention; the defaults are the model's."""

    block_l: int = 32  # cache slots per tile, at most: the largest power of 2 up to this dividing L
    splits: int = 32  # split programs along the cache per block of BM rows (a power of 2)
    num_warps: int = 4  # both launches
    num_stages: int = 3  # Triton's software pipelining of the split kernel's tile loop (the combine takes 1)
    combine_partials: int = 16384  # partials a combine program loads: its BR columns of R from S x BM x BR

    def tile_l(self, capacity: int) -> int:
        """BL: the cache slots of one tile."""
        return pow2_tile(capacity, self.block_l)

    def tile_r(self, rank: int) -> int:
        """BR: the latent columns of one combine program (at least 16 where R allows)."""
        return pow2_tile(rank, max(16, self.combine_partials // (self.splits * BM)))


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
    # (N: `real` rounded up to BM; the rows between are padding, seeing nothing). Split s folds tiles
    # s, s + S, ... up to the block's last visible one.
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


def supports(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None, tuning: MLATuning = MLATuning(),
             interpret=None) -> str | None:
    """None when mla_decode_attention lowers to Triton and computes right on the H200 for these arguments
    (only .shape and .dtype are read), else why not: every block it holds has power-of-2 dimensions, and
    each dot contracts at least 16 bf16 or 8 f32 values (R and r, and BL slots)."""
    del q_nope, positions, scale, tokens, interpret
    rank, r, dtype = w_kvb.shape[-1], q_pe.shape[-1], jnp.dtype(cache.dtype)
    if dtype not in _MIN_K:
        return f"MLA cache dtype {dtype} is neither bfloat16 nor float32, the two the kernel's dots take"
    if not is_pow2(rank):
        return f"MLA kv_lora_rank {rank} is not a power of 2, which every Triton block needs"
    if not is_pow2(r):
        return f"MLA rope head dim {r} is not a power of 2, which every Triton block needs"
    if not is_pow2(tuning.splits):
        return f"MLA splits {tuning.splits} is not a power of 2 (the combine holds every split's partials)"
    least = f"the {_MIN_K[dtype]} values a {dtype} tensor-core dot must contract"
    block_l = tuning.tile_l(cache.shape[0])
    for k, what in ((rank, f"kv_lora_rank {rank} is"), (r, f"rope head dim {r} is"),
                    (block_l, f"cache tiles of {block_l} slots (a {cache.shape[0]}-slot cache) are")):
        if k < _MIN_K[dtype]:
            return f"MLA {what} below {least}"
    return None


@functools.partial(jax.jit, static_argnames=("scale", "tokens", "tuning", "interpret"))
def mla_decode_attention(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None,
                         tuning: MLATuning = MLATuning(), interpret=None):
    """Same arguments and result as lingjax.ops.mla.mla_absorbed: q_nope [rows, H, n], q_pe [rows, H, r],
    cache [L, R + r] (latent | k_pe), w_kvb [H*(n+v), R], positions [rows] -> o [rows, H, v] f32, zero
    past row `tokens`. The shapes the GPU takes: `supports`."""
    rows, h, _ = q_nope.shape
    rank = w_kvb.shape[-1]
    r = q_pe.shape[-1]
    tokens = rows if tokens is None else tokens
    assert cache.shape[1] == rank + r and 1 <= tokens <= rows, (cache.shape, rank, r, tokens, rows)
    block_l, splits = tuning.tile_l(cache.shape[0]), tuning.splits
    interpret = resolve_interpret(interpret)
    q_lat = absorb_query(q_nope, w_kvb)  # every row, as the reference (row invariance)
    real = tokens * h
    n_rows = pl.cdiv(real, BM) * BM
    positions = positions.astype(jnp.int32)

    def params(stages):
        return None if interpret else pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=stages)

    acc, m, l = pallas_call(
        functools.partial(_split_kernel, heads=h, real=real, block_l=block_l, splits=splits, scale=float(scale)),
        grid=(splits, n_rows // BM),
        out_shape=(jax.ShapeDtypeStruct((splits, n_rows, rank), F32), jax.ShapeDtypeStruct((splits, n_rows), F32),
                   jax.ShapeDtypeStruct((splits, n_rows), F32)),
        compiler_params=params(tuning.num_stages),
        interpret=interpret,
        name="mla_decode_split",
    )(q_lat.reshape(rows * h, rank), q_pe.reshape(rows * h, r), positions, cache)
    out_rows = pl.cdiv(rows * h, BM) * BM
    block_r = tuning.tile_r(rank)
    ctx = pallas_call(
        functools.partial(_combine_kernel, real=real, block_r=block_r),
        grid=(out_rows // BM, rank // block_r),
        out_shape=jax.ShapeDtypeStruct((out_rows, rank), F32),
        compiler_params=params(1),
        interpret=interpret,
        name="mla_decode_combine",
    )(acc, m, l)
    ctx = ctx[: rows * h].reshape(rows, h, rank)
    return absorb_output(ctx, w_kvb, q_nope.shape[-1])
