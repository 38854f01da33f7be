"""Kimi Delta Attention, Ling variant (docs/model.md §3): conv, gate, recurrence.

Shapes: T tokens, H heads, K = V = d head dim, C = 3·H·d conv channels, W conv width.
The state S_h is [K, V] (rows = key channels), kept in f32.
kda_chain, the decode/verify contract, takes the projections on all the forward's `rows` >= T rows
(the first T real, the rest padding: row invariance in lingjax.model) and returns o on all of them.
"""

import jax
import jax.numpy as jnp

from lingjax.ops.linear import dot_rows
from lingjax.ops.norms import l2norm


def short_conv(x: jax.Array, window: jax.Array, weight: jax.Array, n_valid) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise conv + SiLU over new inputs, continuing from the cached window.

    x: [T, C] pre-conv inputs; window: [W-1, C] the last W-1 pre-conv inputs before x;
    weight: [C, W] (weight[:, W-1] multiplies the current token). Rows >= n_valid are padding.
    Returns (silu(conv) [T, C] f32, window after the n_valid-th input [W-1, C]).
    """
    width = weight.shape[1]
    xcat = jnp.concatenate([window.astype(x.dtype), x], axis=0)  # [W-1+T, C]
    xf = xcat.astype(jnp.float32)
    t = x.shape[0]
    out = sum(weight[:, j].astype(jnp.float32) * xf[j : j + t] for j in range(width))
    new_window = jax.lax.dynamic_slice_in_dim(xcat, n_valid, width - 1, axis=0)
    return jax.nn.silu(out), new_window.astype(window.dtype)


def kda_gate(f: jax.Array, a_log: jax.Array, dt_bias: jax.Array, safe: bool, lower_bound: float) -> jax.Array:
    """Per-channel log decay g (f32). f: [T, H, d]; a_log: [H]; dt_bias: [H*d] -> g: [T, H, d]."""
    h, d = f.shape[-2:]
    x = f.astype(jnp.float32) + dt_bias.astype(jnp.float32).reshape(h, d)
    rate = jnp.exp(a_log.astype(jnp.float32))[:, None]  # [H, 1]
    if safe:
        return lower_bound * jax.nn.sigmoid(rate * x)  # in (lower_bound, 0)
    return -rate * jax.nn.softplus(x)


def ring_slots(start, count: int, size: int) -> jax.Array:
    """The conv ring's slots of positions start..start+count-1: position p lives in slot p mod size."""
    return jnp.remainder(start + jnp.arange(count, dtype=jnp.int32), size)


def ring_window(ring: jax.Array, start, width: int) -> jax.Array:
    """The conv window before position `start`: the W-1 pre-conv inputs at positions start-W+1..start-1,
    oldest first, read from the ring [N, C] (slots of positions before 0 hold the initial zeros)."""
    return ring[ring_slots(start - (width - 1), width - 1, ring.shape[0])]


def ring_write(ring: jax.Array, x: jax.Array, start) -> jax.Array:
    """The ring with the inputs x [T, C] of positions start..start+T-1 written at their slots (T <= N)."""
    return ring.at[ring_slots(start, x.shape[0], ring.shape[0])].set(x.astype(ring.dtype))


def kda_prepare(qkv, f, b, window, conv_w, a_log, dt_bias, n_valid, *, num_heads, safe_gate, lower_bound):
    """Everything before the recurrence, from the layer's raw projections.

    qkv: [T, 3P] pre-conv q|k|v projections; f: [T, P] f_proj; b: [T, H] b_proj; window: [W-1, 3P];
    conv_w: [3P, W] f32; a_log: [H]; dt_bias: [P]. Rows >= n_valid are padding: g = 0 and beta = 0
    there, so the recurrence leaves the state untouched.
    Returns q (l2-normalised, scaled by d^-0.5), k (l2-normalised), v: [T, H, d] f32; g: [T, H, d];
    beta: [T, H] (sigmoid applied here, exactly once); the conv window after row n_valid-1.
    """
    t = qkv.shape[0]
    x, new_window = short_conv(qkv, window, conv_w, n_valid)
    q, k, v = (a.reshape(t, num_heads, -1) for a in jnp.split(x, 3, axis=-1))
    d = q.shape[-1]
    valid = (jnp.arange(t) < n_valid)[:, None]
    g = kda_gate(f.reshape(t, num_heads, d), a_log, dt_bias, safe_gate, lower_bound)
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid, jax.nn.sigmoid(b.astype(jnp.float32)), 0.0)
    return l2norm(q) * d**-0.5, l2norm(k), v, g, beta, new_window


def kda_chain(proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state, *, tokens, num_heads, safe_gate,
              lower_bound):
    """Decode / verify over T = `tokens` new tokens at positions start..start+T-1, all valid: the contract
    of the fused chain-verify kernel.

    proj: [rows, >=4P] the layer's in_proj output (q|k|v in columns [0, 3P), f in [3P, 4P), further
    columns ignored); x: [rows, D] the layer's (normed) input and b_proj [H, D] its beta projection, taken
    here as b = x·b_projᵀ rounded once to x's dtype (lingjax.ops.linear.dot_rows), so the fused kernel
    computes beta's logits itself. Only rows < T are read: rows is the forward's padded row
    count (lingjax.model), 1 <= T <= rows. ring: [N, 3P] the conv ring (lingjax.cache.KDACache), N >= T + W - 1,
    so the T rows' slots never hold the window before `start`; conv_w, a_log, dt_bias as kda_prepare, plus
    the committed state [H, K, V] f32, which is only read. Taking the unsliced projections and returning
    the padded o spare the caller a slice or pad kernel on each side of the fused one.
    Returns (o [rows, H, V] f32 core output before the output norm, zero in rows >= T; staged
    [T, H, K, V] f32: the state after each row; the ring with the T rows' pre-conv q|k|v written at their
    positions' slots: a verify's rejected rows leave slots of positions past the accepted ones, which a
    later forward overwrites before it reads them, so the ring needs no commit).
    """
    p = dt_bias.shape[0]
    qkv = proj[:tokens, : 3 * p]
    b = dot_rows(x, b_proj)[:tokens]  # on every row, as the model's other row-wise ops (row invariance)
    window = ring_window(ring, start, conv_w.shape[1])
    q, k, v, g, beta, _ = kda_prepare(qkv, proj[:tokens, 3 * p : 4 * p], b, window, conv_w, a_log, dt_bias, tokens,
                                      num_heads=num_heads, safe_gate=safe_gate, lower_bound=lower_bound)
    o, _, staged = kda_recurrent(q, k, v, g, beta, state, return_states=True, unroll=True)  # row invariance
    return jnp.pad(o, [(0, proj.shape[0] - tokens), (0, 0), (0, 0)]), staged, ring_write(ring, qkv, start)


def kda_step(state, q, k, v, g, beta):
    """One token of the gated delta rule, in the order of §3.6. state: [H, K, V]; q, k, g: [H, K]; v: [H, V]."""
    state = state * jnp.exp(g)[:, :, None]  # decay rows
    u = jnp.einsum("hkv,hk->hv", state, k)  # predict
    delta = beta[:, None] * (v - u)  # delta
    state = state + k[:, :, None] * delta[:, None, :]  # write
    o = jnp.einsum("hkv,hk->hv", state, q)  # read the updated state
    return state, o


def kda_recurrent(q, k, v, g, beta, state, return_states: bool = False, unroll: bool = False):
    """Token-by-token recurrence. q (normalised, scaled), k (normalised), g: [T, H, K]; v: [T, H, V];
    beta: [T, H]; state: [H, K, V] f32. Returns (o [T, H, V] f32, final state[, states after each token
    [T, H, K, V]]). unroll=True writes the T steps out as straight-line code, as XLA compiles a scan of
    one step: each step then rounds alike at every T (a verify row's state equals the T=1 decode's
    bit for bit; inside a loop body XLA fuses the step differently)."""

    def body(s, xs):
        s, o = kda_step(s, *xs)
        return s, (o, s) if return_states else (o, None)

    xs = tuple(a.astype(jnp.float32) for a in (q, k, v, g, beta))
    final, (o, states) = jax.lax.scan(body, state.astype(jnp.float32), xs, unroll=unroll)
    return (o, final, states) if return_states else (o, final)


def kda_chunked(q, k, v, g, beta, state, chunk: int = 64, checkpoint_chunks: bool = False):
    """Chunked form of kda_recurrent (same math up to rounding), for prefill. Same arguments and
    result as kda_recurrent without return_states. Padding rows (g = 0, beta = 0) leave the state as is.
    checkpoint_chunks (training): each chunk's intermediates are recomputed in the backward pass instead of
    kept for every chunk; the [H, C, C, K] decay tensors are C times a chunk's inputs."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    n = -(-t // chunk)
    pad = n * chunk - t

    def prep(a):
        a = jnp.pad(a.astype(jnp.float32), [(0, pad)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape((n, chunk) + a.shape[1:]).swapaxes(1, 2)  # [n, H, C, ...]

    qc, kc, vc, gc, bc = prep(q), prep(k), prep(v), prep(g), prep(beta)  # bc: [n, H, C]
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))  # i <= t
    strict = jnp.tril(jnp.ones((chunk, chunk), dtype=bool), -1)  # i < t
    eye = jnp.eye(chunk, dtype=jnp.float32)

    def body(s0, xs):
        qi, ki, vi, gi, bi = xs  # [H, C, K], [H, C, K], [H, C, V], [H, C, K], [H, C]
        big_g = jnp.cumsum(gi, axis=1)  # G_t = Σ_{i<=t} g_i
        # exp(G_t - G_i) for i <= t only; masking the exponent first keeps exp from overflowing.
        diff = big_g[:, :, None, :] - big_g[:, None, :, :]  # [H, C(t), C(i), K]
        decay = jnp.exp(jnp.where(causal[None, :, :, None], diff, -jnp.inf))
        kk = jnp.einsum("htk,hik,htik->hti", ki, ki, decay)
        m = jnp.where(strict, bi[:, :, None] * kk, 0.0)  # M[t, i], i < t
        rhs = jnp.concatenate([bi[..., None] * vi, (bi[..., None] * ki) * jnp.exp(big_g)], axis=-1)
        sol = jax.scipy.linalg.solve_triangular(eye + m, rhs, lower=True, unit_diagonal=True)
        u, wk = sol[..., :dv], sol[..., dv:]
        v_new = u - jnp.einsum("hck,hkv->hcv", wk, s0)  # [H, C, V]
        qk = jnp.einsum("htk,hik,htik->hti", qi, ki, decay)  # zero above the diagonal
        o = jnp.einsum("hck,hkv->hcv", qi * jnp.exp(big_g), s0) + jnp.einsum("hti,hiv->htv", qk, v_new)
        g_last = big_g[:, -1, :]  # [H, K]
        k_dec = ki * jnp.exp(g_last[:, None, :] - big_g)
        s1 = jnp.exp(g_last)[:, :, None] * s0 + jnp.einsum("hck,hcv->hkv", k_dec, v_new)
        return s1, o

    final, o = jax.lax.scan(jax.checkpoint(body) if checkpoint_chunks else body, state.astype(jnp.float32),
                            (qc, kc, vc, gc, bc))
    o = o.swapaxes(1, 2).reshape(n * chunk, h, dv)[:t]
    return o, final
