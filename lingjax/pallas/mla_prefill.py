"""Expanded MLA attention for a prefill chunk in Pallas: flash attention over the chunk's visible cache slots
(docs/kernels/mla.md).

kv_b_proj expands the cache's latents into per-head keys and values once per call ([L, H·(n+v)] in the cache's
dtype, computed up to the last tile the chunk reads); then one program per (block of BQ query rows, head) folds
the key tiles its rows can see into an online softmax, and no [T, H, L] score tensor ever reaches memory. Its
work grows with the chunk's position, not with the cache's capacity: a tile past the chunk's last position is
neither expanded nor read.

Rounding against the reference (lingjax.ops.mla.mla_expanded, which keeps keys, values and weights in f32): on a
bf16 cache the expanded keys and values are rounded to bf16, and so are the softmax weights before they multiply
the values, with f32 sums, as tensor-core flash attention does.

Reference: lingjax.ops.mla.mla_expanded.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import _NN, _NT, is_pow2, pallas_call, pow2_tile, resolve_interpret
from lingjax.pallas import gemm as gemm_kernel
from lingjax.pallas.mla_decode import _MIN_K  # the least contraction a tensor-core dot computes right

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class MLAPrefillTuning:
    """Performance-only choices of mla_prefill_attention; the defaults are the model's."""

    block_q: int = 64  # query rows per program, at most: the largest power of 2 up to this dividing T
    block_k: int = 64  # cache slots per key tile, at most: the largest power of 2 up to this dividing L
    num_warps: int = 4
    num_stages: int = 2  # Triton's software pipelining of the key-tile loops
    unmasked_head: bool = True  # the tiles every row of a block sees whole in a loop of their own, without the mask

    def tiles(self, rows: int, capacity: int) -> tuple[int, int]:
        """(BQ, BK): query rows per program and cache slots per key tile."""
        return pow2_tile(rows, self.block_q), pow2_tile(capacity, self.block_k)


def _kernel(qn_ref, qp_ref, pos_ref, kv_ref, cache_ref, o_ref, *, n, r, v, rank, block_q, block_k, tokens, scale,
            unmasked_head):
    # qn_ref [T, H·n], qp_ref [T, H·r] (head h's columns side by side); pos_ref [T] int32; kv_ref [L, H·(n+v)]
    # (head h: n key columns, then v value columns); cache_ref [L, R + r] (its last r columns: the roped shared
    # key) -> o_ref [T, H·v] f32, head h's v columns of rows [i BQ, (i + 1) BQ); rows from `tokens` on zero.
    i, h = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_q, block_q)
    pos = pos_ref[rows]
    q_nope = qn_ref[rows, pl.ds(h * n, n)].astype(kv_ref.dtype)  # [BQ, n]
    q_pe = qp_ref[rows, pl.ds(h * r, r)].astype(cache_ref.dtype)  # [BQ, r]
    tiles = jnp.minimum(jnp.max(pos) // block_k + 1, kv_ref.shape[0] // block_k)  # the tiles holding a visible slot
    # the tiles every row sees whole (slots <= the block's first position) need no mask: a loop of their own
    whole = jnp.minimum((jnp.min(pos) + 1) // block_k, tiles) if unmasked_head else 0

    def fold(j, carry, masked: bool):
        m, l, acc = carry
        start = pl.multiple_of(j * block_k, block_k)
        slots = pl.ds(start, block_k)
        k_nope = kv_ref[slots, pl.ds(h * (n + v), n)]  # [BK, n]
        k_pe = cache_ref[slots, pl.ds(rank, r)]  # [BK, r]
        scores = jax.lax.dot_general(q_nope, k_nope, _NT, preferred_element_type=F32)
        scores = (scores + jax.lax.dot_general(q_pe, k_pe, _NT, preferred_element_type=F32)) * scale  # [BQ, BK]
        if masked:
            visible = (start + jnp.arange(block_k))[None, :] <= pos[:, None]
            scores = jnp.where(visible, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=1))
        base = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new  # no slot seen yet: e^(-inf - 0) = 0
        alpha = jnp.exp(m - base)
        p = jnp.exp(scores - base[:, None])
        value = kv_ref[slots, pl.ds(h * (n + v) + n, v)]  # [BK, v]
        acc = acc * alpha[:, None] + jax.lax.dot_general(p.astype(value.dtype), value, _NN, preferred_element_type=F32)
        return m_new, l * alpha + jnp.sum(p, axis=1), acc

    init = (jnp.full((block_q,), -jnp.inf, F32), jnp.zeros((block_q,), F32), jnp.zeros((block_q, v), F32))
    carry = jax.lax.fori_loop(0, whole, functools.partial(fold, masked=False), init)
    _, l, acc = jax.lax.fori_loop(whole, tiles, functools.partial(fold, masked=True), carry)
    real = (i * block_q + jnp.arange(block_q)) < tokens
    o_ref[rows, pl.ds(h * v, v)] = jnp.where(real[:, None], acc / l[:, None], 0.0)


def supports(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None,
             tuning: MLAPrefillTuning = MLAPrefillTuning(), interpret=None) -> str | None:
    """None when mla_prefill_attention lowers to Triton and computes right on the GPU for these arguments (only
    .shape and .dtype are read), else why not: head dims powers of 2 (every Triton block), each dot contracting at
    least 16 bf16 or 8 f32 values (n and r, and BK slots), tiles of at least 16 rows and slots, and the pipelined
    key tiles within shared memory."""
    del positions, scale, tokens, interpret
    rows, _, n = q_nope.shape
    r, capacity = q_pe.shape[-1], cache.shape[0]
    v = w_kvb.shape[0] // q_nope.shape[1] - n
    dtype = jnp.dtype(cache.dtype)  # the expanded keys' and values' too
    if dtype not in _MIN_K:
        return f"MLA cache dtype {dtype} is neither bfloat16 nor float32, the two the kernel's dots take"
    for dim, what in ((n, "nope head dim"), (r, "rope head dim"), (v, "value head dim")):
        if not is_pow2(dim):
            return f"MLA {what} {dim} is not a power of 2, which every Triton block needs"
    block_q, block_k = tuning.tiles(rows, capacity)
    least = f"the {_MIN_K[dtype]} values a {dtype} tensor-core dot must contract"
    for k, what in ((n, f"nope head dim {n} is"), (r, f"rope head dim {r} is"),
                    (block_k, f"key tiles of {block_k} slots (a {capacity}-slot cache) are")):
        if k < _MIN_K[dtype]:
            return f"MLA {what} below {least}"
    if block_q < 16:
        return f"MLA prefill query tiles of {block_q} rows ({rows} rows) are under the 16 of a tensor-core dot"
    shared = tuning.num_stages * block_k * (n + r + v) * dtype.itemsize
    if shared > gemm_kernel.SHARED_BYTES:
        return f"{tuning.num_stages} stages of {block_k}-slot key tiles: {shared} bytes of shared memory"
    return None


def expand(cache, w_kvb, live_rows, interpret: bool):
    """The cache's latents through kv_b_proj: [L, R + r] x [H·(n+v), R] -> [L, H·(n+v)] in the cache's dtype (f32
    sums, one rounding), computed for the first live_rows slots (an int32 scalar, traced; the rest unspecified).
    The Pallas GEMM (the step programs compile with XLA's GEMM autotuning off), or XLA's over every slot where the
    GPU's GEMM kernel does not take the shapes (interpret mode takes any)."""
    latent, dtype = cache[:, : w_kvb.shape[-1]], jnp.dtype(cache.dtype)
    w = w_kvb.astype(dtype)
    if interpret or gemm_kernel.supports(latent, w, dtype) is None:
        return gemm_kernel.gemm(latent, w, dtype, live_rows=live_rows, interpret=interpret)
    return jnp.dot(latent, w.T, preferred_element_type=F32).astype(dtype)


@functools.partial(jax.jit, static_argnames=("scale", "tokens", "tuning", "interpret"))
def mla_prefill_attention(q_nope, q_pe, cache, w_kvb, positions, scale, *, tokens=None,
                          tuning: MLAPrefillTuning = MLAPrefillTuning(), interpret=None):
    """Same arguments and result as lingjax.ops.mla.mla_expanded: q_nope [T, H, n], q_pe [T, H, r], cache
    [L, R + r] (latent | k_pe), w_kvb [H·(n+v), R], positions [T] (each row sees slots <= its position) -> o
    [T, H, v] f32, zero from row `tokens` on. The shapes the GPU takes: `supports`."""
    t, h, n = q_nope.shape
    r, rank = q_pe.shape[-1], w_kvb.shape[-1]
    v = w_kvb.shape[0] // h - n
    tokens = t if tokens is None else tokens
    assert cache.shape[1] == rank + r and 1 <= tokens <= t, (cache.shape, rank, r, tokens, t)
    block_q, block_k = tuning.tiles(t, cache.shape[0])
    interpret = resolve_interpret(interpret)
    positions = positions.astype(jnp.int32)
    kv = expand(cache, w_kvb, (jnp.max(positions) // block_k + 1) * block_k, interpret)  # the slots of every tile read
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=tuning.num_stages)
    o = pallas_call(
        functools.partial(_kernel, n=n, r=r, v=v, rank=rank, block_q=block_q, block_k=block_k, tokens=tokens,
                          scale=float(scale), unmasked_head=tuning.unmasked_head),
        grid=(t // block_q, h),
        out_shape=jax.ShapeDtypeStruct((t, h * v), F32),
        compiler_params=params,
        interpret=interpret,
        name="mla_prefill",
    )(q_nope.reshape(t, h * n), q_pe.reshape(t, h * r), positions, kv, cache)
    return o.reshape(t, h, v)
