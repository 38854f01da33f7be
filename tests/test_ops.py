"""Reference ops checked against each other and against independent numpy formulations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import key_for, rel_err
from lingjax.ops import kda, mla, moe
from lingjax.ops.rope import rope_interleaved


def _kda_inputs(seed, t, h, d, state_scale=1.0):
    ks = jax.random.split(key_for("kda", seed, t, h, d), 6)
    from lingjax.ops.norms import l2norm

    q = l2norm(jax.random.normal(ks[0], (t, h, d))) * d**-0.5
    k = l2norm(jax.random.normal(ks[1], (t, h, d)))
    v = jax.random.normal(ks[2], (t, h, d))
    g = -5.0 * jax.nn.sigmoid(jax.random.normal(ks[3], (t, h, d)) * 2)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (t, h)))
    s0 = state_scale * jax.random.normal(ks[5], (h, d, d))
    return q, k, v, g, beta, s0


def _kda_numpy(q, k, v, g, beta, s):
    """Closed form S_t = (I - b k kᵀ) Diag(exp g) S + b k vᵀ; o_t = S_tᵀ q_t, in float64."""
    q, k, v, g, beta, s = (np.asarray(a, np.float64) for a in (q, k, v, g, beta, s))
    out = np.zeros(v.shape)
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            kk = k[t, h][:, None]
            s[h] = (np.eye(len(kk)) - beta[t, h] * kk @ kk.T) @ (np.exp(g[t, h])[:, None] * s[h]) \
                + beta[t, h] * kk @ v[t, h][None, :]
            out[t, h] = s[h].T @ q[t, h]
    return out, s


@pytest.mark.parametrize("t,h,d", [(1, 3, 8), (6, 2, 16), (17, 1, 8)])
def test_kda_recurrent_matches_closed_form(t, h, d):
    q, k, v, g, beta, s0 = _kda_inputs(0, t, h, d)
    o, s = kda.kda_recurrent(q, k, v, g, beta, s0)
    o_ref, s_ref = _kda_numpy(q, k, v, g, beta, s0)
    assert rel_err(o, o_ref) < 1e-5 and rel_err(s, s_ref) < 1e-5


@pytest.mark.parametrize("t,h,d,chunk", [(1, 2, 8, 64), (63, 3, 16, 64), (130, 2, 16, 64), (40, 1, 8, 16)])
@pytest.mark.parametrize("seed", [0, 1])
def test_kda_chunked_matches_recurrent(t, h, d, chunk, seed):
    q, k, v, g, beta, s0 = _kda_inputs(seed, t, h, d)
    o, s = kda.kda_chunked(q, k, v, g, beta, s0, chunk=chunk)
    o_ref, s_ref, states = kda.kda_recurrent(q, k, v, g, beta, s0, return_states=True)
    assert rel_err(o, o_ref) < 1e-4 and rel_err(s, s_ref) < 1e-4
    assert rel_err(states[-1], s_ref) == 0.0


def test_kda_padding_rows_leave_state_unchanged():
    q, k, v, g, beta, s0 = _kda_inputs(3, 20, 2, 8)
    valid = (jnp.arange(20) < 11)
    g = jnp.where(valid[:, None, None], g, 0.0)
    beta = jnp.where(valid[:, None], beta, 0.0)
    for core in (kda.kda_recurrent, kda.kda_chunked):
        _, s = core(q, k, v, g, beta, s0)
        _, s_ref = kda.kda_recurrent(q[:11], k[:11], v[:11], g[:11], beta[:11], s0)
        assert rel_err(s, s_ref) < 1e-5


def test_short_conv_continues_across_calls():
    c, w, t = 12, 4, 9
    ks = jax.random.split(key_for("conv"), 2)
    x = jax.random.normal(ks[0], (t, c))
    weight = jax.random.normal(ks[1], (c, w))
    full, _ = kda.short_conv(x, jnp.zeros((w - 1, c)), weight, t)
    xp = np.concatenate([np.zeros((w - 1, c)), np.asarray(x)])
    direct = np.stack([sum(np.asarray(weight)[:, j] * xp[i + j] for j in range(w)) for i in range(t)])
    assert rel_err(full, jax.nn.silu(direct)) < 1e-6
    window = jnp.zeros((w - 1, c))
    parts = []
    for lo, hi in [(0, 4), (4, 5), (5, 9)]:  # chunks, each padded to 8 rows with junk
        chunk = jnp.concatenate([x[lo:hi], 1e3 * jnp.ones((8 - (hi - lo), c))])
        out, window = kda.short_conv(chunk, window, weight, hi - lo)
        parts.append(out[: hi - lo])
    assert rel_err(jnp.concatenate(parts), full) < 1e-6
    assert rel_err(window, x[-(w - 1):]) == 0.0


@pytest.mark.parametrize("t", [1, 5, 12])
def test_mla_absorbed_matches_expanded(t):
    h, n, r, lat, v, cap = 3, 16, 8, 32, 16, 20
    ks = jax.random.split(key_for("mla", t), 5)
    q_nope = jax.random.normal(ks[0], (t, h, n))
    q_pe = jax.random.normal(ks[1], (t, h, r))
    latent = jax.random.normal(ks[2], (cap, lat))
    k_pe = jax.random.normal(ks[3], (cap, r))
    w_kvb = jax.random.normal(ks[4], (h * (n + v), lat)) / lat**0.5
    positions = jnp.arange(t) + 4
    cache = jnp.concatenate([latent, k_pe], -1)
    a = mla.mla_absorbed(q_nope, q_pe, cache, w_kvb, positions, 0.2)
    b = mla.mla_expanded(q_nope, q_pe, cache, w_kvb, positions, 0.2)
    assert rel_err(a, b) < 1e-5
    # slots past each row's position are invisible: poisoning them changes nothing
    c = mla.mla_absorbed(q_nope, q_pe, cache.at[4 + t:].set(1e30), w_kvb, positions, 0.2)
    assert rel_err(c, a) < 1e-6
    # tokens: the rows from it on come out zero, the others unchanged
    d = mla.mla_absorbed(q_nope, q_pe, cache, w_kvb, positions, 0.2, tokens=1)
    assert rel_err(d[:1], a[:1]) == 0.0 and not np.any(np.asarray(d[1:]))


def test_rope_interleaved_is_complex_rotation():
    x = jax.random.normal(key_for("rope"), (5, 2, 8))
    pos = jnp.array([0, 1, 7, 100, 4096])
    got = np.asarray(rope_interleaved(x, pos, 1e4))
    xc = np.asarray(x[..., 0::2]) + 1j * np.asarray(x[..., 1::2])
    ang = np.asarray(pos)[:, None, None] * 1e4 ** (-np.arange(0, 8, 2) / 8)
    yc = xc * np.exp(1j * ang)
    assert rel_err(got[..., 0::2], yc.real) < 1e-5 and rel_err(got[..., 1::2], yc.imag) < 1e-5


def _route_numpy(x, w, bias, top_k, n_group, topk_group, scaling, renorm):
    s = 1 / (1 + np.exp(-(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T)))
    sel = s + np.asarray(bias, np.float64)
    t, e = s.shape
    idx = np.zeros((t, top_k), int)
    wts = np.zeros((t, top_k))
    for i in range(t):
        groups = sel[i].reshape(n_group, -1)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1)
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        masked = np.full(e, -np.inf)
        for g in keep:
            masked[g * (e // n_group):(g + 1) * (e // n_group)] = sel[i, g * (e // n_group):(g + 1) * (e // n_group)]
        idx[i] = np.argsort(-masked, kind="stable")[:top_k]
        wts[i] = s[i, idx[i]]
        if renorm:
            wts[i] /= wts[i].sum() + 1e-20
    return wts * scaling, idx


@pytest.mark.parametrize("renorm", [True, False])
def test_route_matches_numpy(renorm):
    ks = jax.random.split(key_for("route", renorm), 3)
    x = jax.random.normal(ks[0], (7, 24))
    w = jax.random.normal(ks[1], (32, 24))
    bias = 0.3 * jax.random.normal(ks[2], (32,))
    weights, experts = moe.route(x, w, bias, top_k=4, n_group=4, topk_group=2, scaling=2.5, renormalize=renorm)
    w_ref, i_ref = _route_numpy(x, w, bias, 4, 4, 2, 2.5, renorm)
    order = np.argsort(np.asarray(experts), axis=1)
    assert (np.take_along_axis(np.asarray(experts), order, 1) == np.sort(i_ref, axis=1)).all()
    got_w = np.take_along_axis(np.asarray(weights), order, 1)
    ref_w = np.take_along_axis(w_ref, np.argsort(i_ref, axis=1), 1)
    assert rel_err(got_w, ref_w) < 1e-5


@pytest.mark.parametrize("limit", [0.0, 0.7])
@pytest.mark.parametrize("t", [1, 6, 33])
def test_experts_sorted_matches_gathered(t, limit):
    e, i, d, k = 8, 16, 24, 3
    ks = jax.random.split(key_for("experts", t, limit), 6)
    x = jax.random.normal(ks[0], (t, d))
    wg, wu = (jax.random.normal(kk, (e, i, d)) / d**0.5 for kk in ks[1:3])
    wd = jax.random.normal(ks[3], (e, d, i)) / i**0.5
    experts = jax.random.randint(ks[4], (t, k), 0, e)
    weights = jax.random.uniform(ks[5], (t, k))
    a = moe.experts_gathered(x, wg, wu, wd, weights, experts, limit)
    b = moe.experts_sorted(x, wg, wu, wd, weights, experts, limit)
    assert rel_err(a, b) < 1e-5
    # against a per-token loop
    ref = np.zeros((t, d))
    for tt in range(t):
        for kk in range(k):
            ex = int(experts[tt, kk])
            h = moe.swiglu(wg[ex] @ x[tt], wu[ex] @ x[tt], limit)
            ref[tt] += float(weights[tt, kk]) * np.asarray(wd[ex] @ h)
    assert rel_err(a, ref) < 1e-5


def test_swiglu_limit_clamps_after_silu():
    g = jnp.array([-10.0, 0.5, 3.0, 50.0])
    u = jnp.array([-9.0, 0.2, 2.0, 9.0])
    got = moe.swiglu(g, u, 4.0)
    want = np.minimum(np.asarray(jax.nn.silu(g)), 4.0) * np.clip(np.asarray(u), -4, 4)
    assert rel_err(got, want) < 1e-6
    assert rel_err(moe.swiglu(g, u, 0.0), jax.nn.silu(g) * u) < 1e-6


def test_kda_chain_contract_matches_prepare_and_recurrence():
    """kda_chain (the fused kernel's contract) = kda_prepare + recurrence with every state staged, on
    the first T rows of the unsliced projections (the rest garbage, their o rows zero), beta's logits
    x·b_projᵀ, the window read from the conv ring's slots before `start` (wrapping past slot 0), and the
    ring returned with the T rows' inputs at their slots, every other slot as it was."""
    t, rows, h, d, w, dm, start = 6, 9, 3, 8, 4, 40, 1
    slots = t + w - 1 + 2
    ks = jax.random.split(key_for("chain"), 8)
    p = h * d
    proj = jax.random.normal(ks[0], (rows, 5 * p))  # q|k|v|f|g
    x = jax.random.normal(ks[1], (rows, dm))  # the layer's input
    b_proj = jax.random.normal(ks[7], (h, dm)) / dm**0.5
    b = x[:t] @ b_proj.T  # beta's logits
    ring = jax.random.normal(ks[2], (slots, 3 * p))
    conv_w = 0.5 * jax.random.normal(ks[3], (3 * p, w))
    a_log = jnp.log(jax.random.uniform(ks[4], (h,), minval=1, maxval=16))
    dt_bias = jax.random.normal(ks[5], (p,))
    state = jax.random.normal(ks[6], (h, d, d))
    cfg = dict(num_heads=h, safe_gate=True, lower_bound=-5.0)
    o, staged, ring_out = kda.kda_chain(proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state, tokens=t, **cfg)
    assert o.shape == (rows, h, d) and staged.shape == (t, h, d, d)
    assert (np.asarray(o[t:]) == 0).all()
    window = ring[jnp.array([slots - 2, slots - 1, 0])]  # positions -2, -1, 0 before start = 1
    assert np.array_equal(np.asarray(kda.ring_window(ring, start, w)), np.asarray(window))
    qkv, f = proj[:t, : 3 * p], proj[:t, 3 * p : 4 * p]
    want_ring = np.asarray(ring).copy()
    want_ring[start:start + t] = np.asarray(qkv)
    assert np.array_equal(np.asarray(ring_out), want_ring)
    for n in range(1, t + 1):  # state after row n-1 == running the first n rows alone
        q, k, v, g, beta, win = kda.kda_prepare(qkv[:n], f[:n], b[:n], window, conv_w, a_log, dt_bias, n, **cfg)
        o_n, s_n = kda.kda_recurrent(q, k, v, g, beta, state)
        assert rel_err(staged[n - 1], s_n) < 1e-6 and rel_err(o[:n], o_n) < 1e-6
        # the next position's window, read from the returned ring, is the conv's own
        assert np.array_equal(np.asarray(kda.ring_window(ring_out, start + n, w)), np.asarray(win))


def test_route_bf16_precision_is_f32_routing_of_bf16_operands():
    ks = jax.random.split(key_for("route-bf16"), 3)
    x = jax.random.normal(ks[0], (5, 64))
    w = jax.random.normal(ks[1], (32, 64))
    bias = 0.3 * jax.random.normal(ks[2], (32,))
    kw = dict(top_k=4, n_group=4, topk_group=2, scaling=2.5, renormalize=True)
    got_w, got_e = moe.route(x, w, bias, precision="bf16", **kw)
    rounded = lambda a: a.astype(jnp.bfloat16).astype(jnp.float32)  # noqa: E731
    want_w, want_e = moe.route(rounded(x), rounded(w), bias, **kw)
    assert (np.asarray(got_e) == np.asarray(want_e)).all() and rel_err(got_w, want_w) < 1e-5
    with pytest.raises(ValueError, match="precision"):
        moe.route(x, w, bias, precision="fp8", **kw)
