"""noaux_tc router, the Pallas form of lingjax.ops.moe.route: gate GEMV, sigmoid, biased group-limited top-k.

Two launches (docs/kernels/moe.md):
  1. moe_router_gemv, grid (E / be, K splits, T / bt): partial logits [KS, T, E] f32 whose sum over KS is
     x · router_wᵀ. Many small programs, so that enough loads are in flight to stream the weight.
  2. moe_router_select, one token per program: the partials summed in K order, sigmoid, the bias added for
     selection only, top-2 sum per group, the top `topk_group` groups, the top-k experts, weights from the raw
     scores, renormalised and scaled.
The selection (token_routing, token_expert) also runs inside lingjax.pallas.moe_experts' decode up kernel,
which routes its token itself. Ties resolve to the lower index at every stage and the experts come out in
the reference's order (descending biased score), as jax.lax.top_k: the same ids, bit for bit.

precision="f32": exact products in f32 (bf16 x and weight on the tensor cores, whose bf16 products are exact,
with f32 accumulation; f32 operands as IEEE f32 FMAs). precision="bf16" rounds x (and an f32 weight) to bf16,
as the reference does.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import (
    MIN_DOT_K,
    X_ROW_MIN_BYTES,
    dot_nt,
    is_pow2,
    pallas_call,
    reads_one_row,
    resolve_interpret,
    short_dot,
    x_rows,
)

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class RouterTuning:
    """The router launches' static choices. The GEMV's tiles are the largest divisors of their dimension up to
    the values given (be of E, k_splits of D, bk of D / k_splits)."""

    be: int = 16  # experts per GEMV program
    bk: int = 256  # the GEMV's K step
    k_splits: int = 10  # K splits of the GEMV, each a program per expert tile and token block
    bt: int = 16  # token rows per GEMV program
    warps: int = 4  # per GEMV program
    stages: int = 3  # the GEMV's K-loop pipeline
    select_warps: int = 4  # per select program (one token each)
    x_row_min_bytes: int = X_ROW_MIN_BYTES  # T = 1: a K step's x row from this size (per 4 warps) is read once


def _divisor(n: int, want: int) -> int:
    """Largest d ≤ want dividing n."""
    return next(d for d in range(min(want, n), 0, -1) if n % d == 0)


def _gemv_tiles(d: int, n_exp: int, tuning: RouterTuning):
    """(k_splits, k_per_split, bk, be) of the GEMV at hidden size d over n_exp experts."""
    k_splits = _divisor(d, tuning.k_splits)
    k_per_split = d // k_splits
    return k_splits, k_per_split, _divisor(k_per_split, tuning.bk), _divisor(n_exp, tuning.be)


def _gemv_dtype(x_dtype, w_dtype, precision: str):
    """The GEMV's dot operand dtype: f32 at precision "f32" unless x and the weight are both bf16 (whose products
    f32 holds exactly, so the tensor cores compute them), else bf16."""
    exact_in_bf16 = x_dtype == w_dtype == jnp.bfloat16
    return F32 if precision == "f32" and not exact_in_bf16 else jnp.bfloat16


def gemv_supports(x_dtype, router_w, precision: str = "f32", tuning: RouterTuning = RouterTuning()) -> str | None:
    """None when the GEMV for x of `x_dtype` and router_w [E, D] (an array or ShapeDtypeStruct) lowers to Triton
    and computes right on the GPU, else why not: its blocks must be powers of 2, and its K step at least MIN_DOT_K
    on 16-bit operands."""
    n_exp, d = router_w.shape
    k_splits, k_per_split, bk, be = _gemv_tiles(d, n_exp, tuning)
    if not is_pow2(bk):
        return (f"the router GEMV's K step of {bk} (hidden size {d} in {k_splits} K splits of {k_per_split}), "
                "not a power of 2")
    if not is_pow2(be):
        return f"the router GEMV's expert tile of {be} ({n_exp} experts), not a power of 2"
    if not is_pow2(tuning.bt):
        return f"the router GEMV's token block of {tuning.bt}, not a power of 2"
    if short_dot(bk, _gemv_dtype(x_dtype, router_w.dtype, precision)):
        return (f"the router GEMV's K step of {bk} (hidden size {d} in {k_splits} K splits) on bf16 operands, "
                f"under the {MIN_DOT_K} a 16-bit Triton dot needs")
    return None


def select_supports(n_exp: int, top_k: int) -> str | None:
    """None when the selection code lowers to Triton for n_exp experts and top_k, else why not: it works on
    [1, E], [G, E / G] and [k, ·] blocks, which Triton needs in powers of 2."""
    if not is_pow2(n_exp):
        return f"{n_exp} experts in the router's selection, not a power of 2"
    if not is_pow2(top_k):
        return f"top_k {top_k} in the router's selection, not a power of 2"
    return None


def supports(x, router_w, bias, *, top_k, n_group, topk_group, scaling, renormalize, precision="f32",
             tuning: RouterTuning = RouterTuning(), interpret=None) -> str | None:
    """None when `route` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes right
    on the GPU, else why not (gemv_supports, select_supports)."""
    del bias, n_group, topk_group, scaling, renormalize, interpret
    return gemv_supports(x.dtype, router_w, precision, tuning) or select_supports(router_w.shape[0], top_k)


def _gemv_kernel(x_ref, w_ref, p_ref, *, t, bt, be, bk, k_per_split, dtype, x_row):
    # x_ref [R ≥ T, D] (rows past T unread); w_ref [E, D]; p_ref [KS, T, E] f32 partial logits
    ei, si, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = jnp.minimum(ti * bt + jnp.arange(bt), t - 1)  # [BT] clamped: tail rows repeat the last token
    cols = pl.ds(ei * be, be)

    def step(kk, acc):
        ks = pl.ds(pl.multiple_of(si * k_per_split + kk * bk, bk), bk)
        xs = x_rows(x_ref, rows, ks, x_row).astype(dtype)  # [BT, BK] (T = 1: x's one row, broadcast)
        ws = w_ref[cols, ks].astype(dtype)  # [BE, BK]
        return acc + dot_nt(xs, ws)  # xs, ws already in `dtype`

    acc = jax.lax.fori_loop(0, k_per_split // bk, step, jnp.zeros((bt, be), F32))
    p_ref[si, rows, cols] = acc


def _group_heads(sel2, kk):
    """Each group's kk ≥ 2 largest biased scores, in order, with their expert ids, and the top-2 sum per group:
    sel2 [G, S] -> (values [G, kk], ids [G, kk] int32, top-2 sums [G]). kk argmax passes along the group
    axis, every group in the same pass; lax.argmax breaks ties to the lower index, as lax.top_k."""
    g, s = sel2.shape
    j2 = jax.lax.broadcasted_iota(jnp.int32, (g, s), 1)
    r2 = jax.lax.broadcasted_iota(jnp.int32, (g, kk), 1)
    vals, ids = jnp.full((g, kk), -jnp.inf, F32), jnp.zeros((g, kk), jnp.int32)
    work, firsts = sel2, []
    for r in range(kk):
        a = jax.lax.argmax(work, 1, jnp.int32)  # [G]
        v = jnp.max(work, axis=1)  # the same pass's value
        firsts.append(v)
        vals = jnp.where(r2 == r, v[:, None], vals)
        ids = jnp.where(r2 == r, a[:, None], ids)
        work = jnp.where(j2 == a[:, None], -jnp.inf, work)
    return vals, ids + jax.lax.broadcasted_iota(jnp.int32, (g, kk), 0) * s, firsts[0] + firsts[1]


def _ranked_heads(logits, bias, *, n_group, topk_group, top_k):
    """select_token's ranking: (raw scores [1, E] f32, the kept groups' head ids [1, G·k] int32, each head's
    rank [1, G·k] int32: 0..k-1 for the token's top k, best first)."""
    n_exp = logits.shape[1]
    gsize = n_exp // n_group
    kk = min(max(top_k, 2), gsize)  # the group scores need two (the config keeps groups of at least 2)
    nc = n_group * kk
    scores = 1.0 / (1.0 + jnp.exp(-logits))  # sigmoid, f32
    sel = scores + bias[None, :]  # bias steers selection only
    vals, ids, top2 = _group_heads(sel.reshape(n_group, gsize), kk)  # [G, kk]
    gscore = top2.reshape(1, n_group)  # top-2 sum per group, summed in lax.top_k's order
    me, other = gscore[:, :, None], gscore[:, None, :]
    gi = jax.lax.broadcasted_iota(jnp.int32, (1, n_group, n_group), 1)
    go = jax.lax.broadcasted_iota(jnp.int32, (1, n_group, n_group), 2)
    beaten = (other > me) | ((other == me) & (go < gi))  # groups ranked ahead of this one
    keep = jnp.sum(jnp.where(beaten, 1, 0), axis=2) < topk_group  # [1, G]
    cv = jnp.where(keep.reshape(n_group, 1), vals, -jnp.inf).reshape(1, nc)  # heads of the kept groups
    ci = ids.reshape(1, nc)
    ahead = (cv > cv.reshape(nc, 1)) | ((cv == cv.reshape(nc, 1)) & (ci < ci.reshape(nc, 1)))  # [head, other]
    return scores, ci, jnp.sum(jnp.where(ahead, 1, 0), axis=1).reshape(1, nc)


def select_token(logits, bias, *, n_group, topk_group, top_k, scaling, renormalize):
    """Routing of one token inside a kernel: logits [1, E] f32, bias [E] f32 -> (weights [1, k] f32, ids [1, k]
    int32), as lingjax.ops.moe.route, bit for bit.

    Few full-width reductions, each on the critical path: every group's k largest come from k passes along the
    group axis (all groups at once); their first two give the group scores, and one [G, G] count ranks the
    groups. The token's top k are among the kept groups' heads (an expert that beats a top-k member is itself
    a head), so one [G·k, G·k] count ranks them exactly for the top k. Ties resolve to the lower index."""
    scores, ci, rank = _ranked_heads(logits, bias, n_group=n_group, topk_group=topk_group, top_k=top_k)
    picked = jax.lax.broadcasted_iota(jnp.int32, (top_k, ci.shape[1]), 0) == rank  # [k, heads]
    top = jnp.sum(jnp.where(picked, ci, 0), axis=1)  # [k] expert ids, best first
    chosen = jax.lax.broadcasted_iota(jnp.int32, (top_k, scores.shape[1]), 1) == top.reshape(top_k, 1)  # [k, E]
    wts = jnp.sum(jnp.where(chosen, scores, 0.0), axis=1).reshape(1, top_k)  # raw scores
    if renormalize:
        wts = wts / (jnp.sum(wts, axis=1)[:, None] + 1e-20)
    return wts * scaling, top.reshape(1, top_k)


def token_logits(p_ref, t):
    """Token t's logits [1, E] f32 inside a kernel: the sum of the GEMV's partials p_ref [KS, T, E] in K order."""
    row = pl.ds(t, 1)
    logits = p_ref[0, row, :]
    for s in range(1, p_ref.shape[0]):
        logits = logits + p_ref[s, row, :]
    return logits


def token_routing(p_ref, b_ref, t, **cfg):
    """Token t's routing from the GEMV's partial logits p_ref [KS, T, E] f32 and the bias b_ref [E] f32, inside a
    kernel: (weights [1, k] f32, ids [1, k] int32)."""
    return select_token(token_logits(p_ref, t), b_ref[...], **cfg)


def token_expert(logits, bias, j, *, n_group, topk_group, top_k, scaling, renormalize):
    """The j-th expert (int32 scalar, j traced) of a token's logits [1, E] f32 (token_logits) and the bias [E]
    f32: token_routing's ids[0, j], without the picks and weights, which each of the decode's up programs (one
    expert each) need not spend time on."""
    del scaling, renormalize
    _, ci, rank = _ranked_heads(logits, bias, n_group=n_group, topk_group=topk_group, top_k=top_k)
    return jnp.sum(jnp.where(rank == j, ci, 0))


def _select_kernel(p_ref, b_ref, w_ref, e_ref, **cfg):
    # one token per program: w_ref [T, k] f32; e_ref [T, k] int32
    row = pl.ds(pl.program_id(0), 1)
    w_ref[row, :], e_ref[row, :] = token_routing(p_ref, b_ref, pl.program_id(0), **cfg)


def check_routing(n_exp: int, *, n_group: int, topk_group: int, top_k: int):
    """Raises unless the kept groups hold at least top_k of the n_exp experts."""
    if topk_group * (n_exp // n_group) < top_k:
        raise ValueError(f"top_k={top_k} needs at least that many experts in the {topk_group} kept groups")


def partial_logits(x, router_w, *, precision="f32", tokens=None, tuning: RouterTuning = RouterTuning(),
                   interpret=None):
    """The gate GEMV's launch: partial logits [KS, T, E] f32 of x's first T = `tokens` rows (default all), read
    in place; their sum over KS is x · router_wᵀ."""
    if precision not in ("f32", "bf16"):
        raise ValueError(f"precision must be 'f32' or 'bf16', got {precision!r}")
    interpret = resolve_interpret(interpret)
    t = x.shape[0] if tokens is None else tokens
    n_exp, d = router_w.shape
    k_splits, k_per_split, bk, be = _gemv_tiles(d, n_exp, tuning)
    dtype = _gemv_dtype(x.dtype, router_w.dtype, precision)
    bt = tuning.bt
    return pallas_call(
        functools.partial(_gemv_kernel, t=t, bt=bt, be=be, bk=bk, k_per_split=k_per_split, dtype=dtype,
                          x_row=reads_one_row(t, bk, x.dtype, tuning.x_row_min_bytes, tuning.warps)),
        out_shape=jax.ShapeDtypeStruct((k_splits, t, n_exp), F32),
        grid=(n_exp // be, k_splits, pl.cdiv(t, bt)),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=tuning.warps,
                                                                       num_stages=tuning.stages),
        interpret=interpret,
        name="moe_router_gemv",
    )(x, router_w)


@functools.partial(
    jax.jit,
    static_argnames=("top_k", "n_group", "topk_group", "scaling", "renormalize", "precision", "tuning", "interpret"),
)
def route(x, router_w, bias, *, top_k, n_group, topk_group, scaling, renormalize, precision="f32",
          tuning: RouterTuning = RouterTuning(), interpret=None):
    """Same as lingjax.ops.moe.route: x [T, D], router_w [E, D], bias [E] -> (weights [T, k] f32, experts
    [T, k] int32). Shapes it lowers for: `supports`."""
    interpret = resolve_interpret(interpret)
    t = x.shape[0]
    check_routing(router_w.shape[0], n_group=n_group, topk_group=topk_group, top_k=top_k)
    partial = partial_logits(x, router_w, precision=precision, tuning=tuning, interpret=interpret)
    cfg = dict(n_group=n_group, topk_group=topk_group, top_k=top_k, scaling=float(scaling),
               renormalize=bool(renormalize))
    return pallas_call(
        functools.partial(_select_kernel, **cfg),
        out_shape=(jax.ShapeDtypeStruct((t, top_k), F32), jax.ShapeDtypeStruct((t, top_k), jnp.int32)),
        grid=(t,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=tuning.select_warps, num_stages=1),
        interpret=interpret,
        name="moe_router_select",
    )(partial, bias.astype(F32))
