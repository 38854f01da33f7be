"""noaux_tc router (ling3_architecture.md §6.1): gate GEMV, sigmoid, biased group-limited top-k, weights.

Two launches, both tiny:
  1. Gate GEMV, grid (E tile, K split, token block): partial logits [KS, T, E] f32. Reading the 2.6 MB
     router weight at full bandwidth needs many CTAs, which is why the GEMV is not folded into the
     selection (the seed write-up reached the same stopping point: folding it collapses parallelism).
  2. Selection, one program per token: sum the K-split partials, sigmoid, add the bias for selection
     only, top-2 sum per group, keep the top `topk_group` groups, top-k experts, weights from the raw
     scores, renormalise, scale.
Ties resolve to the lower index at every stage, as `jax.lax.top_k` does, and experts come out in the
reference's order (descending biased score).

precision="f32" (default, parity): x and the weight are upcast and the dot is IEEE f32; with a bf16
checkpoint this reads the same 2.6 MB as "bf16". precision="bf16" rounds x (and an f32 weight) to bf16
and uses the tensor cores with f32 accumulation — the seed's declared rounding change; logits then
differ by ~1e-2 relative and near-tied experts may swap.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import resolve_interpret

from lingjax.ops.moe import route as route_reference  # the reference

F32 = jnp.float32
_NT = (((1,), (1,)), ((), ()))


def _gemv_kernel(x_ref, w_ref, p_ref, *, bt, be, bk, k_per_split, exact):
    # x_ref [T, D]; w_ref [E, D]; p_ref [KS, T, E] f32 partial logits
    ei, si, ti = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t = x_ref.shape[0]
    rows = jnp.minimum(ti * bt + jnp.arange(bt), t - 1)  # [BT] clamped: tail rows repeat the last token
    cols = pl.ds(ei * be, be)
    dtype = F32 if exact else jnp.bfloat16
    prec = jax.lax.Precision.HIGHEST if exact else None

    def step(kk, acc):
        ks = pl.ds(pl.multiple_of(si * k_per_split + kk * bk, bk), bk)
        xs = x_ref[rows, ks].astype(dtype)  # [BT, BK]
        ws = w_ref[cols, ks].astype(dtype)  # [BE, BK]
        return acc + jax.lax.dot_general(xs, ws, _NT, precision=prec, preferred_element_type=F32)

    acc = jax.lax.fori_loop(0, k_per_split // bk, step, jnp.zeros((bt, be), F32))
    p_ref[si, rows, cols] = acc


def _argmax_untaken(v, taken, idx, n):
    """Largest v not yet taken, lowest index on ties (lax.top_k order). v, taken, idx: [N]."""
    v = jnp.where(taken, -jnp.inf, v)
    m = jnp.max(v)
    return jnp.min(jnp.where((v == m) & ~taken, idx, n))


def _select_kernel(p_ref, b_ref, w_ref, e_ref, *, n_group, topk_group, top_k, scaling, renormalize):
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


@functools.partial(
    jax.jit,
    static_argnames=("top_k", "n_group", "topk_group", "scaling", "renormalize", "precision", "be", "bk",
                     "k_splits", "bt", "warps", "stages", "interpret"),
)
def route(x, router_w, bias, *, top_k, n_group, topk_group, scaling, renormalize, precision="f32", be=16,
          bk=512, k_splits=1, bt=16, warps=4, stages=3, interpret=None):
    """Same as lingjax.ops.moe.route: x [T, D], router_w [E, D], bias [E] -> (weights [T, k] f32, experts
    [T, k] int32)."""
    if precision not in ("f32", "bf16"):
        raise ValueError(f"precision must be 'f32' or 'bf16', got {precision!r}")
    interpret = resolve_interpret(interpret)
    t, d = x.shape
    n_exp = router_w.shape[0]
    k_per_split = d // k_splits
    bk = min(bk, k_per_split)
    while k_per_split % bk:
        bk //= 2
    be = min(be, n_exp)
    while n_exp % be:
        be //= 2
    params = None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages)
    partial = pl.pallas_call(
        functools.partial(_gemv_kernel, bt=bt, be=be, bk=bk, k_per_split=k_per_split, exact=precision == "f32"),
        out_shape=jax.ShapeDtypeStruct((k_splits, t, n_exp), F32),
        grid=(n_exp // be, k_splits, pl.cdiv(t, bt)),
        compiler_params=params,
        interpret=interpret,
        name="moe_router_gemv",
    )(x, router_w)
    return pl.pallas_call(
        functools.partial(_select_kernel, n_group=n_group, topk_group=topk_group, top_k=top_k,
                          scaling=float(scaling), renormalize=bool(renormalize)),
        out_shape=(jax.ShapeDtypeStruct((t, top_k), F32), jax.ShapeDtypeStruct((t, top_k), jnp.int32)),
        grid=(t,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="moe_router_select",
    )(partial, bias.astype(F32))


if __name__ == "__main__":  # GPU: sweep tiles at Flash size, check ids against the reference, µs vs floor
    d, e, layers = 2560, 512, 8
    cfg = dict(top_k=8, n_group=8, topk_group=4, scaling=2.5, renormalize=True)
    for t in (1, 6, 16):
        ks = jax.random.split(jax.random.key(t), 3 * layers)
        sets = [(jax.random.normal(ks[3 * l], (t, d), F32).astype(jnp.bfloat16),
                 (jax.random.normal(ks[3 * l + 1], (e, d), F32) / d**0.5).astype(jnp.bfloat16),
                 0.1 * jax.random.normal(ks[3 * l + 2], (e,), F32)) for l in range(layers)]
        _, want = route_reference(*sets[0], **cfg)
        floor_us = e * d * 2 / 4.3e12 * 1e6
        for be, bk, k_splits in [(16, 512, 1), (16, 256, 2), (16, 256, 4), (32, 256, 4)]:
            kw = dict(be=be, bk=bk, k_splits=k_splits, **cfg)
            same = bool((route(*sets[0], **kw)[1] == want).all())
            run = jax.jit(lambda ss, kw=kw: jax.lax.fori_loop(0, 100, lambda _, acc: acc + sum(
                route(s[0], s[1], s[2] + acc * 0, **kw)[0][0, 0] for s in ss), 0.0))
            run(sets).block_until_ready()
            t0 = time.perf_counter()
            run(sets).block_until_ready()
            us = (time.perf_counter() - t0) / (100 * layers) * 1e6
            print(f"router T={t} be={be} bk={bk} ks={k_splits}: ids {'ok' if same else 'DIFFER'}, {us:.1f} us, "
                  f"{100 * floor_us / us:.0f}% of floor {floor_us:.2f} us")
