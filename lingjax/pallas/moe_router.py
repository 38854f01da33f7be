"""noaux_tc router (ling3_architecture.md §6.1): gate GEMV, sigmoid, biased group-limited top-k, weights.

Two launches, both tiny:
  1. Gate GEMV, grid (E tile, K split, token block): partial logits [KS, T, E] f32. Reading the 2.6 MB
     router weight at full bandwidth needs many CTAs in flight at once: the default K split of 10 gives
     32 × 10 = 320 programs of one 8 KB tile each (k_splits=1 gave 32 programs streaming 80 KB; 5 splits
     of 16 KB were ~0.3 µs slower at T = 1, 6 and 16, bench/results/moe_h200_2026-12-01_run4.md).
  2. Selection, one token per program of 4 warps (select="vector", the default; `token_routing`): sum the
     K-split partials, sigmoid, add the bias for selection only, top-2 sum per group, keep the top `topk_group`
     groups, top-k experts, weights from the raw scores, renormalise, scale. At T = 1 the model runs no select
     launch: lingjax.pallas.moe_experts.routed_experts ranks the token's experts inside its up kernel
     (`token_expert`, `token_routing`). Building
     the experts' align plan in this kernel too (one program over all tokens) was tried and measured slower
     than router + a separate align launch (T = 6 on the H200: 37.1 vs 27.7 µs,
     bench/results/moe_h200_2026-11-29_run3.md).
     select="serial" is the first version (one program per token, ~28 full-width argmax passes, each a
     cross-warp reduction), kept for the bench's comparison (LEGACY).
Ties resolve to the lower index at every stage, as `jax.lax.top_k` does, and experts come out in the
reference's order (descending biased score).

A one-launch router (the GEMV's last program to finish selecting for every token, after an arrival
counter) measured 23.6 µs against the two launches' 8.3 at T = 1 (bench/results/moe_h200x2_2026-11-30.md):
its selection ran on the GEMV's 16-row, 4-warp blocks and held registers in every program. Removed; the
code is in commit 3d43402.

precision="f32" (default, parity): the dot is exact-product f32. With bf16 x and weight (a bf16
checkpoint) every product is exact in f32, so it runs on the tensor cores with f32 accumulation (same
result up to summation order, as any f32 GEMV); with f32 operands Triton's IEEE f32 dot (no tensor
cores, 16 padded token rows of FMAs). precision="bf16" rounds x (and an f32 weight) to bf16 — the seed's
declared rounding change; logits then differ by ~1e-2 relative and near-tied experts may swap.

Reference: lingjax.ops.moe.route. Timings of every variant: bench/moe_bench.py.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import dot_nt, pallas_call, reads_one_row, resolve_interpret, x_rows

F32 = jnp.float32

# The first version's kernels (measured in bench/results/moe_h200_2026-11-29.md): the bench times them
# against the defaults.
LEGACY = dict(k_splits=1, bk=512, select="serial", select_warps=4, tensor_core_f32=False)


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


def _argmax_untaken(v, taken, idx, n):
    """Largest v not yet taken, lowest index on ties (lax.top_k order). v, taken, idx: [N]."""
    v = jnp.where(taken, -jnp.inf, v)
    m = jnp.max(v)
    return jnp.min(jnp.where((v == m) & ~taken, idx, n))


def _select_serial_kernel(p_ref, b_ref, w_ref, e_ref, *, n_group, topk_group, top_k, scaling, renormalize):
    # LEGACY: one token per program, one full-width argmax (a max and a min) per chosen element.
    # p_ref [KS, T, E] f32; b_ref [E] f32; w_ref [T, k] f32; e_ref [T, k] int32
    t = pl.program_id(0)
    n_exp = p_ref.shape[2]
    gsize = n_exp // n_group
    logits = jnp.sum(p_ref[:, t, :], axis=0)  # [E]
    scores = 1.0 / (1.0 + jnp.exp(-logits))  # sigmoid, f32
    sel = scores + b_ref[...]  # bias steers selection only
    eidx = jnp.arange(n_exp, dtype=jnp.int32)
    gid = eidx // gsize
    none = eidx < 0  # all False

    gidx = jnp.arange(n_group, dtype=jnp.int32)
    gscore = jnp.zeros((n_group,), F32)
    for g in range(n_group):  # top-2 sum per group
        first = _argmax_untaken(sel, gid != g, eidx, n_exp)
        second = _argmax_untaken(sel, (gid != g) | (eidx == first), eidx, n_exp)
        pick = jnp.sum(jnp.where((eidx == first) | (eidx == second), sel, 0.0))
        gscore = jnp.where(gidx == g, pick, gscore)

    gtaken = gidx < 0
    keep = none
    for _ in range(topk_group):
        g = _argmax_untaken(gscore, gtaken, gidx, n_group)
        gtaken = gtaken | (gidx == g)
        keep = keep | (gid == g)
    masked = jnp.where(keep, sel, -jnp.inf)

    kidx = jnp.arange(top_k, dtype=jnp.int32)
    taken, ids, wts = none, jnp.zeros((top_k,), jnp.int32), jnp.zeros((top_k,), F32)
    for j in range(top_k):
        i = _argmax_untaken(masked, taken, eidx, n_exp)
        taken = taken | (eidx == i)
        ids = jnp.where(kidx == j, i, ids)
        wts = jnp.where(kidx == j, jnp.sum(jnp.where(eidx == i, scores, 0.0)), wts)  # raw score
    if renormalize:
        wts = wts / (jnp.sum(wts) + 1e-20)
    w_ref[t, :] = wts * scaling
    e_ref[t, :] = ids


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

    A full-width reduction costs a select program ~0.2 µs on the H200 and sits on the critical path, so there
    are few: every group's k largest come from k passes along the group axis (all groups at once, ~0.12 µs a
    pass); their first two give the group scores, and the kept groups are ranked by one [G, G] count. The
    token's top k are among the kept groups' heads (any expert that beats a top-k member is itself one), so
    each head's rank among the G·k heads is one [G·k, G·k] count, exact for the top k; then the k ids and
    their raw scores. In one program of 4 warps this took 1.76 µs against 2.77 for k argmax passes over the
    kept experts (bench/results/moe_h200_2026-12-01_run4.md). Ties resolve to the lower index everywhere."""
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
    f32, the same id as token_routing's ids[0, j], without the weights: each of the decode's up programs needs
    only its own expert, and the ranking, picks and weights took ~1.25 of the selection's ~3 µs in every program
    on the H200 (bench/results/moe_h200_2026-12-01_run6.md)."""
    del scaling, renormalize
    _, ci, rank = _ranked_heads(logits, bias, n_group=n_group, topk_group=topk_group, top_k=top_k)
    return jnp.sum(jnp.where(rank == j, ci, 0))


def _select_kernel(p_ref, b_ref, w_ref, e_ref, **cfg):
    # one token per program: w_ref [T, k] f32; e_ref [T, k] int32
    row = pl.ds(pl.program_id(0), 1)
    w_ref[row, :], e_ref[row, :] = token_routing(p_ref, b_ref, pl.program_id(0), **cfg)


def _divisor(n: int, want: int) -> int:
    """Largest d ≤ want dividing n (the test dims are not multiples of the Flash tiles)."""
    return next(d for d in range(min(want, n), 0, -1) if n % d == 0)


def check_routing(n_exp: int, *, n_group: int, topk_group: int, top_k: int):
    """Raises unless the kept groups hold at least top_k of the n_exp experts."""
    if topk_group * (n_exp // n_group) < top_k:
        raise ValueError(f"top_k={top_k} needs at least that many experts in the {topk_group} kept groups")


# the GEMV launch's defaults (route's and partial_logits')
GEMV = dict(be=16, bk=256, k_splits=10, bt=16, warps=4, stages=3, tensor_core_f32=True)


def partial_logits(x, router_w, *, precision="f32", tokens=None, be=GEMV["be"], bk=GEMV["bk"],
                   k_splits=GEMV["k_splits"], bt=GEMV["bt"], warps=GEMV["warps"], stages=GEMV["stages"],
                   tensor_core_f32=GEMV["tensor_core_f32"], interpret=None):
    """The gate GEMV's launch: partial logits [KS, T, E] f32 of x's first T = `tokens` rows (default all), read
    in place; their sum over KS is x · router_wᵀ."""
    if precision not in ("f32", "bf16"):
        raise ValueError(f"precision must be 'f32' or 'bf16', got {precision!r}")
    interpret = resolve_interpret(interpret)
    t = x.shape[0] if tokens is None else tokens
    d = x.shape[1]
    n_exp = router_w.shape[0]
    k_splits = _divisor(d, k_splits)
    k_per_split = d // k_splits
    bk = _divisor(k_per_split, bk)
    be = _divisor(n_exp, be)
    exact_in_bf16 = tensor_core_f32 and x.dtype == router_w.dtype == jnp.bfloat16  # products exact in f32
    dtype = F32 if precision == "f32" and not exact_in_bf16 else jnp.bfloat16
    return pallas_call(
        functools.partial(_gemv_kernel, t=t, bt=bt, be=be, bk=bk, k_per_split=k_per_split, dtype=dtype,
                          x_row=reads_one_row(t, bk, x.dtype)),
        out_shape=jax.ShapeDtypeStruct((k_splits, t, n_exp), F32),
        grid=(n_exp // be, k_splits, pl.cdiv(t, bt)),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="moe_router_gemv",
    )(x, router_w)


@functools.partial(
    jax.jit,
    static_argnames=("top_k", "n_group", "topk_group", "scaling", "renormalize", "precision", "be", "bk",
                     "k_splits", "bt", "warps", "stages", "tensor_core_f32", "select", "select_warps",
                     "interpret"),
)
def route(x, router_w, bias, *, top_k, n_group, topk_group, scaling, renormalize, precision="f32", be=GEMV["be"],
          bk=GEMV["bk"], k_splits=GEMV["k_splits"], bt=GEMV["bt"], warps=GEMV["warps"], stages=GEMV["stages"],
          tensor_core_f32=GEMV["tensor_core_f32"], select="vector", select_warps=4, interpret=None):
    """Same as lingjax.ops.moe.route: x [T, D], router_w [E, D], bias [E] -> (weights [T, k] f32, experts
    [T, k] int32).

    select_warps: warps of each select program (one token each). 4 by default: on the H200 the select
    kernel took 4.9 µs at 4 warps, 5.0-5.2 at 2 and 5.5-5.6 at 1, at T = 1, 6 and 8
    (bench/results/moe_h200_2026-12-01.md).
    """
    if select not in ("vector", "serial"):
        raise ValueError(f"select must be 'vector' or 'serial', got {select!r}")
    interpret = resolve_interpret(interpret)
    t = x.shape[0]
    check_routing(router_w.shape[0], n_group=n_group, topk_group=topk_group, top_k=top_k)
    partial = partial_logits(x, router_w, precision=precision, tensor_core_f32=tensor_core_f32, be=be, bk=bk,
                             k_splits=k_splits, bt=bt, warps=warps, stages=stages, interpret=interpret)
    cfg = dict(n_group=n_group, topk_group=topk_group, top_k=top_k, scaling=float(scaling),
               renormalize=bool(renormalize))
    if select == "serial":
        kernel = functools.partial(_select_serial_kernel, **cfg)
    else:
        kernel = functools.partial(_select_kernel, **cfg)
    return pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t, top_k), F32), jax.ShapeDtypeStruct((t, top_k), jnp.int32)),
        grid=(t,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=select_warps, num_stages=1),
        interpret=interpret,
        name="moe_router_select",
    )(partial, bias.astype(F32))

