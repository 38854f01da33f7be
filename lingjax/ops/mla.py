"""Gated MLA attention core over a latent cache (docs/model.md §4).

The cache holds, per token, the normalised latent c [R] and the roped shared key k_pe [r], side by side
in one [L, R + r] row (R = kv_b_proj's input width). Two equal forms: `mla_expanded` (expand keys/values
through kv_b_proj: prefill) and `mla_absorbed` (fold kv_b_proj into the query and output: decode and
verify; lingjax.pallas.mla_decode is its kernel). Query row t sits at absolute position positions[t] and
sees cache slots j <= positions[t].
"""

import jax
import jax.numpy as jnp

F32 = jnp.float32


def _masked_softmax(scores: jax.Array, positions: jax.Array) -> jax.Array:
    """scores: [T, H, L] f32 -> causal softmax over slots j <= positions[t]."""
    slots = jnp.arange(scores.shape[-1])
    visible = slots[None, None, :] <= positions[:, None, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    return jax.nn.softmax(scores, axis=-1)


def _split(cache, w_kvb):
    """cache [L, R + r] -> (latent [L, R], k_pe [L, r]); R is kv_b_proj's input width."""
    rank = w_kvb.shape[-1]
    return cache[:, :rank], cache[:, rank:]


def _zero_past(o, tokens):
    """Rows from `tokens` on set to zero (None: none), as the Pallas kernel returns them."""
    return o if tokens is None else jnp.where((jnp.arange(o.shape[0]) < tokens)[:, None, None], o, 0.0)


def mla_expanded(q_nope, q_pe, cache, w_kvb, positions, scale, tokens=None):
    """q_nope: [T, H, n]; q_pe: [T, H, r]; cache: [L, R + r] (latent | k_pe); w_kvb: [H*(n+v), R];
    positions [T]. Returns o: [T, H, v] f32, zero from row `tokens` on (None: every row computed)."""
    latent, k_pe = _split(cache, w_kvb)
    h, n = q_nope.shape[1:]
    kv = jnp.einsum("lr,or->lo", latent, w_kvb, preferred_element_type=F32)
    kv = kv.reshape(latent.shape[0], h, -1)  # [L, H, n+v]
    k_nope, v = kv[..., :n], kv[..., n:]
    scores = jnp.einsum("thn,lhn->thl", q_nope.astype(F32), k_nope)
    scores += jnp.einsum("thr,lr->thl", q_pe.astype(F32), k_pe.astype(F32))
    p = _masked_softmax(scores * scale, positions)
    return _zero_past(jnp.einsum("thl,lhv->thv", p, v), tokens)


def absorb_query(q_nope, w_kvb):
    """kv_b_proj folded into the query: q_lat = q_nope W_uk, [T, H, R] f32 on every row. Shared with the Pallas
    kernel (lingjax.pallas.mla_decode), so both round q_lat alike.

    Both absorbed products (this and `absorb_output`) take kv_b_proj whole, [H, n+v, R] as one reshape of w_kvb,
    converted to f32 inside the GEMM: q_nope is padded with v zeros here, and the output keeps its last v columns
    there. A slice of one half (W_uk = w[:, :n]) is a strided copy XLA will not fuse into its GEMM, so every step
    would first write both halves out in f32 (twice the weight's bytes, then read again, one launch a layer);
    the zeros' products add exact zeros, and each output column's sum has the same terms either way (a GPU GEMM may
    add them in another order: a declared rounding change, docs/kernels/mla.md)."""
    h, n = q_nope.shape[1:]
    w = w_kvb.reshape(h, -1, w_kvb.shape[-1]).astype(F32)  # [H, n+v, R]
    padded = jnp.pad(q_nope.astype(F32), ((0, 0), (0, 0), (0, w.shape[1] - n)))
    return jnp.einsum("thj,hjr->thr", padded, w)


def absorb_output(ctx, w_kvb, n: int):
    """The context in latent space back through W_uv: ctx [T, H, R] f32 -> o [T, H, v] f32 (v = kv_b_proj's
    per-head rows less n = qk_nope_head_dim), from the whole weight as absorb_query says."""
    w = w_kvb.reshape(ctx.shape[1], -1, w_kvb.shape[-1]).astype(F32)  # [H, n+v, R]
    return jnp.einsum("thr,hjr->thj", ctx, w)[..., n:]


def _absorbed_weights(q_nope, q_pe, cache, w_kvb, positions, scale):
    """-> attention weights p [T, H, L] f32 in the absorbed form."""
    latent, k_pe = _split(cache, w_kvb)
    q_lat = absorb_query(q_nope, w_kvb)  # [T, H, R]
    scores = jnp.einsum("thr,lr->thl", q_lat, latent.astype(F32))
    scores += jnp.einsum("thr,lr->thl", q_pe.astype(F32), k_pe.astype(F32))
    return _masked_softmax(scores * scale, positions)


def attention_weights(q_nope, q_pe, cache, w_kvb, positions, scale):
    """mla_absorbed's arguments -> each query row's attention over the cache slots, [T, H, L] f32 (zero past
    its position): what lingjax.inspection shows."""
    return _absorbed_weights(q_nope, q_pe, cache, w_kvb, positions, scale)


def mla_absorbed(q_nope, q_pe, cache, w_kvb, positions, scale, tokens=None):
    """Same arguments and result as mla_expanded; never materialises per-head keys."""
    latent, _ = _split(cache, w_kvb)
    p = _absorbed_weights(q_nope, q_pe, cache, w_kvb, positions, scale)
    ctx = jnp.einsum("thl,lr->thr", p, latent.astype(F32))  # [T, H, R]
    return _zero_past(absorb_output(ctx, w_kvb, q_nope.shape[-1]), tokens)
