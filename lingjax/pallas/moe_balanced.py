"""Experiment (measured, not kept; bench/results/moe_h200_2026-12-01_run5.md call 2): the T = 1 MoE experts spread evenly over the SMs.

The shared expert is expert E of stacked [E+1, ...] arrays. Up: the 9·I rows (8 routed experts' then the
shared one's) in contiguous ranges, routed_progs programs of r_r rows and the rest of r_s rows (each a masked
`tile`-row gather of the flat [(E+1)·I, D] weights: a range may straddle two experts). Down: the 9·D output
rows (slot-major) in `down_progs` ranges, each one masked tile; the h operand holds consecutive slots' rows, so
a column takes the row of its own slot."""
import functools
import jax, jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from lingjax.pallas import dot_nt, pallas_call
from lingjax.pallas.moe_router import token_routing, partial_logits
from lingjax.pallas.moe_experts import _swiglu

F32 = jnp.float32


def _load(ref, rows, ks, valid, masked):
    """ref[rows, ks]; masked on the GPU (no traffic for lanes past the program's range). Interpret mode
    cannot discharge a masked gather: there every lane loads (its clamped row, which holds the same values)."""
    if masked:
        return plt.load(ref.at[rows, ks], mask=valid[:, None], other=0.0)
    return ref[rows, ks]


def _store(ref, v, val, valid, masked):
    if masked:
        plt.store(ref.at[v], val, mask=valid)
    else:
        ref[v] = val  # lanes past the range write the clamped row's own value


def _row_pick(acc, r):
    """acc [M, N] -> [N]: acc[r[n], n] (exact: the other rows add zeros)."""
    m = jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
    return jnp.sum(jnp.where(m == r[None, :], acc, 0.0), axis=0)


def _gather8(vals, slot):
    """vals [1, k], slot [N] -> vals[0, slot] ([N]; 0 where slot ≥ k)."""
    k = vals.shape[1]
    col = jax.lax.broadcasted_iota(jnp.int32, (slot.shape[0], k), 1)
    return jnp.sum(jnp.where(col == slot[:, None], vals, 0), axis=1)


def _up(p_ref, b_ref, x_ref, wg_ref, wu_ref, h_ref, w_ref, e_ref, *, n_exp, i_dim, top_k, routed_progs, r_r, r_s,
        tile, bk, limit, shared_limit, routing, xrow, masked):
    p = pl.program_id(0)
    lane = jnp.arange(tile, dtype=jnp.int32)
    nr = top_k * i_dim  # routed rows
    bm = 16

    def block(v, valid, rows, lim):
        def step(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            if xrow:
                xs = jnp.broadcast_to(x_ref[pl.ds(0, 1), ks], (bm, bk))
            else:
                xs = x_ref[jnp.zeros((bm,), jnp.int32), ks]
            wg = _load(wg_ref, rows, ks, valid, masked)
            wu = _load(wu_ref, rows, ks, valid, masked)
            return acc[0] + dot_nt(xs, wg), acc[1] + dot_nt(xs, wu)

        zero = jnp.zeros((bm, tile), F32)
        g, u = jax.lax.fori_loop(0, x_ref.shape[1] // bk, step, (zero, zero))
        r0 = jnp.zeros((tile,), jnp.int32)
        h = _swiglu(_row_pick(g, r0), _row_pick(u, r0), lim).astype(h_ref.dtype)
        _store(h_ref, v, h, valid, masked)

    @pl.when(p < routed_progs)
    def _():
        wts, ids = token_routing(p_ref, b_ref, 0, **dict(routing))
        v = p * r_r + lane
        valid = (lane < r_r) & (v < nr)
        vc = jnp.minimum(v, nr - 1)
        slot = vc // i_dim
        rows = _gather8(ids, slot) * i_dim + vc % i_dim
        block(vc, valid, rows, limit)

        @pl.when(p == 0)
        def _():
            w_ref[...], e_ref[...] = wts, ids

    @pl.when(p >= routed_progs)
    def _():
        v = nr + (p - routed_progs) * r_s + lane
        valid = (lane < r_s) & (v < nr + i_dim)
        vc = jnp.minimum(v, nr + i_dim - 1)
        block(vc, valid, n_exp * i_dim + vc - nr, shared_limit)


def _down(w_ref, e_ref, h_ref, wd_ref, y_ref, *, n_exp, d, i_dim, top_k, r, tile, bk, masked):
    p = pl.program_id(0)
    lane = jnp.arange(tile, dtype=jnp.int32)
    nv = (top_k + 1) * d
    v = p * r + lane
    valid = (lane < r) & (v < nv)
    vc = jnp.minimum(v, nv - 1)
    slot = vc // d
    s0 = jnp.minimum(p * r, nv - 1) // d
    eid = jnp.where(slot < top_k, _gather8(e_ref[...], slot), n_exp)
    rows = eid * d + vc % d
    hrows = jnp.minimum(s0 + jnp.arange(16, dtype=jnp.int32), top_k)
    def step(kk, acc):
        ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
        wd = _load(wd_ref, rows, ks, valid, masked)
        return acc + dot_nt(h_ref[hrows, ks], wd)

    acc = jax.lax.fori_loop(0, i_dim // bk, step, jnp.zeros((16, tile), F32))
    out = _row_pick(acc, slot - s0)
    wl = jnp.where(slot < top_k, _gather8(w_ref[...], slot), 1.0)
    _store(y_ref, vc, out * wl, valid, masked)


BAL = dict(up_progs=132, shared_progs=13, up_tile=64, up_bk=128, up_stages=5, up_warps=4,
           down_progs=132, down_tile=256, down_bk=64, down_stages=4, down_warps=4, xrow=False, masked=True)


def balanced_experts(x, logits, bias, wg_all, wu_all, wd_all, limit, shared_limit, routing, interpret=False, **kw):
    """x [R, D] (row 0 the token); logits [KS, 1, E]; wg_all/wu_all [E+1, I, D]; wd_all [E+1, D, I] -> [1, D] f32."""
    c = dict(BAL, **kw)
    e1, i_dim, d = wg_all.shape
    n_exp = e1 - 1
    top_k = dict(routing)["top_k"]
    routed_progs = c["up_progs"] - c["shared_progs"]
    r_r = -(-top_k * i_dim // routed_progs)
    r_s = -(-i_dim // c["shared_progs"])
    assert r_r <= c["up_tile"] and r_s <= c["up_tile"], (r_r, r_s)
    params = lambda w, s: None if interpret else plt.CompilerParams(num_warps=w, num_stages=s)
    h, wts, ids = pallas_call(
        functools.partial(_up, n_exp=n_exp, i_dim=i_dim, top_k=top_k, routed_progs=routed_progs, r_r=r_r, r_s=r_s,
                          tile=c["up_tile"], bk=c["up_bk"], limit=float(limit), shared_limit=float(shared_limit),
                          routing=routing, xrow=c["xrow"], masked=c["masked"] and not interpret),
        out_shape=[jax.ShapeDtypeStruct(((top_k + 1) * i_dim,), x.dtype), jax.ShapeDtypeStruct((1, top_k), F32),
                   jax.ShapeDtypeStruct((1, top_k), jnp.int32)],
        grid=(c["up_progs"],),
        compiler_params=params(c["up_warps"], c["up_stages"]),
        interpret=interpret, name="moe_up_balanced",
    )(logits, bias, x, wg_all.reshape(e1 * i_dim, d), wu_all.reshape(e1 * i_dim, d))
    r = -(-(top_k + 1) * d // c["down_progs"])
    assert r <= c["down_tile"], r
    y = pallas_call(
        functools.partial(_down, n_exp=n_exp, d=d, i_dim=i_dim, top_k=top_k, r=r, tile=c["down_tile"], bk=c["down_bk"],
                          masked=c["masked"] and not interpret),
        out_shape=jax.ShapeDtypeStruct(((top_k + 1) * d,), F32),
        grid=(c["down_progs"],),
        compiler_params=params(c["down_warps"], c["down_stages"]),
        interpret=interpret, name="moe_down_balanced",
    )(wts, ids, h.reshape(top_k + 1, i_dim), wd_all.reshape(e1 * d, i_dim))
    y = y.reshape(top_k + 1, d)
    out = y[0]
    for j in range(1, top_k + 1):
        out = out + y[j]
    return out[None, :]
