"""Fused KDA chain-verify (and decode, T=1) in Pallas, plus the on-device commit.

One program per (head, V tile of BV columns). Each program reads the committed state tile
[K, BV] once, recomputes the short conv + SiLU, the l2norms, the safe gate and beta for its head
(cheap, V-independent, so duplicated per tile), runs the gated delta rule over the T <= 16 new
rows and writes the state after every row to `staged` and the output row to `o`. Every
K-reduction is over the whole K axis of one tile, so results do not depend on BV.

Reference: lingjax.ops.kda.kda_chain (math in ling3_architecture.md §3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops import kda as kda_ops
from lingjax.pallas import resolve_interpret

MAX_T = 16



def _chain_kernel(qkv_ref, f_ref, b_ref, win_ref, convw_ref, alog_ref, dtb_ref, s_ref,  # inputs
                  o_ref, st_ref,  # outputs
                  *, t_len, num_heads, dim, block_v, safe_gate, lower_bound):
    # qkv_ref [T, 3P]; f_ref [T, P]; b_ref [T, H]; win_ref [W-1, 3P]; convw_ref [3P, W] f32;
    # alog_ref [H]; dtb_ref [P]; s_ref [H, K, V] f32 -> o_ref [T, H, V] f32; st_ref [T, H, K, V] f32
    h, j = pl.program_id(0), pl.program_id(1)
    p = num_heads * dim
    width = convw_ref.shape[1]
    f32 = jnp.float32
    v0 = j * block_v

    def conv_silu(c0, n):  # rows t of SiLU(conv) for channels [c0, c0+n): list of T vectors [n]
        w = [convw_ref[pl.ds(c0, n), i] for i in range(width)]  # W x [n] f32
        src = [win_ref[r, pl.ds(c0, n)].astype(f32) for r in range(width - 1)]
        src += [qkv_ref[t, pl.ds(c0, n)].astype(f32) for t in range(t_len)]  # [W-1+T] x [n]
        rows = []
        for t in range(t_len):
            acc = w[0] * src[t]
            for i in range(1, width):
                acc = acc + w[i] * src[t + i]
            rows.append(acc * jax.nn.sigmoid(acc))
        return rows

    def l2norm(x):  # eps inside the sqrt, as lingjax.ops.norms.l2norm
        return x / jnp.sqrt(jnp.sum(x * x) + 1e-6)

    qs = [l2norm(x) * dim**-0.5 for x in conv_silu(h * dim, dim)]  # T x [K]
    ks = [l2norm(x) for x in conv_silu(p + h * dim, dim)]  # T x [K]
    vs = conv_silu(2 * p + h * dim + v0, block_v)  # T x [BV]

    rate = jnp.exp(alog_ref[h].astype(f32))
    dtb = dtb_ref[pl.ds(h * dim, dim)].astype(f32)
    s = s_ref[h, :, pl.ds(v0, block_v)]  # [K, BV] the committed state, read once
    for t in range(t_len):
        x = f_ref[t, pl.ds(h * dim, dim)].astype(f32) + dtb
        if safe_gate:
            g = lower_bound * jax.nn.sigmoid(rate * x)
        else:
            g = -rate * jax.nn.softplus(x)
        beta = jax.nn.sigmoid(b_ref[t, h].astype(f32))  # the only sigmoid on beta
        k = ks[t][:, None]
        s = s * jnp.exp(g)[:, None]  # decay rows
        u = jnp.sum(s * k, axis=0)  # [BV] predict
        s = s + k * (beta * (vs[t] - u))[None, :]  # delta write
        st_ref[t, h, :, pl.ds(v0, block_v)] = s
        o_ref[t, h, pl.ds(v0, block_v)] = jnp.sum(s * qs[t][:, None], axis=0)  # read the updated state


@functools.partial(jax.jit, static_argnames=("num_heads", "safe_gate", "lower_bound", "block_v",
                                             "num_warps", "interpret"))
def kda_chain_verify(qkv, f, b, window, conv_w, a_log, dt_bias, state, *, num_heads, safe_gate, lower_bound,
                     block_v: int = 16, num_warps: int = 4, interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chain: (o [T, H, V] f32, staged [T, H, K, V] f32)."""
    t_len = qkv.shape[0]
    h, dk, dv = state.shape
    assert 1 <= t_len <= MAX_T, f"chain-verify takes 1..{MAX_T} rows, got {t_len}"
    assert h == num_heads and dk == dv and qkv.shape[1] == 3 * h * dk, (qkv.shape, state.shape)
    block_v = min(block_v, dv)
    assert dv % block_v == 0
    kernel = functools.partial(_chain_kernel, t_len=t_len, num_heads=h, dim=dk, block_v=block_v,
                               safe_gate=safe_gate, lower_bound=lower_bound)
    return pl.pallas_call(
        kernel,
        grid=(h, dv // block_v),
        out_shape=(jax.ShapeDtypeStruct((t_len, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((t_len, h, dk, dv), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="kda_chain_verify",
    )(qkv, f, b, window, conv_w.astype(jnp.float32), a_log, dt_bias, state.astype(jnp.float32))


def _commit_kernel(n_ref, st_ref, win_ref, s_out, w_out, *, dim, block_k):
    # n_ref [1] int32; st_ref [T, H, K, V] f32; win_ref [T, W-1, 3P] -> s_out [H, K, V]; w_out [W-1, 3P]
    h, i = pl.program_id(0), pl.program_id(1)
    n = n_ref[0]
    p = pl.num_programs(0) * dim
    rows = pl.ds(i * block_k, block_k)
    s_out[h, rows, :] = st_ref[n, h, rows, :]

    @pl.when(i == 0)
    def _():  # head h's q, k and v channels of the accepted row's window
        for r in range(win_ref.shape[1]):
            for c0 in (h * dim, p + h * dim, 2 * p + h * dim):
                w_out[r, pl.ds(c0, dim)] = win_ref[n, r, pl.ds(c0, dim)]


@functools.partial(jax.jit, static_argnames=("block_k", "interpret"))
def kda_commit(staged, windows, n, *, block_k: int = 32, interpret=None):
    """Commit the accepted row: (staged [T, H, K, V], windows [T, W-1, 3P] from
    lingjax.ops.kda.conv_windows, n int32 device scalar = accepted count - 1)
    -> (state [H, K, V] = staged[n], window [W-1, 3P] = windows[n]), one launch.
    n = 0 is the zero-accept commit (state after the first row), n = T-1 all-accept."""
    _, h, dk, dv = staged.shape
    block_k = min(block_k, dk)
    assert windows.shape[2] == 3 * h * dk and dk % block_k == 0
    kernel = functools.partial(_commit_kernel, dim=dk, block_k=block_k)
    return pl.pallas_call(
        kernel,
        grid=(h, dk // block_k),
        out_shape=(jax.ShapeDtypeStruct(staged.shape[1:], staged.dtype),
                   jax.ShapeDtypeStruct(windows.shape[1:], windows.dtype)),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="kda_commit",
    )(jnp.asarray(n, jnp.int32).reshape(1), staged, windows)


def kda_commit_reference(staged, windows, n):
    """The same commit as two XLA dynamic slices."""
    return (jax.lax.dynamic_index_in_dim(staged, n, keepdims=False),
            jax.lax.dynamic_index_in_dim(windows, n, keepdims=False))


if __name__ == "__main__":  # GPU: sweep BV x warps, check each against the reference, print µs and % of floor
    import statistics
    import time

    H, D, R, BW = 32, 128, 64, 4.3e12  # heads, head dim, rotating input sets, bytes/s for the floor
    cfg = dict(num_heads=H, safe_gate=True, lower_bound=-5.0)
    keys = jax.random.split(jax.random.key(0), 3)
    conv_w = 0.5 * jax.random.normal(keys[0], (3 * H * D, 4))
    a_log = jnp.log(jax.random.uniform(keys[1], (H,), minval=1, maxval=16))
    dt_bias = jax.random.normal(keys[2], (H * D,))
    for t in (1, 6, 16):
        xs = [[jax.random.normal(jax.random.key(100 * r + i), shape, dt) for r in range(R)]
              for i, (shape, dt) in enumerate((((t, 3 * H * D), jnp.bfloat16), ((t, H * D), jnp.bfloat16),
                                               ((t, H), jnp.bfloat16), ((3, 3 * H * D), jnp.bfloat16),
                                               ((H, D, D), jnp.float32)))]
        args0 = [a[0] for a in xs[:4]] + [conv_w, a_log, dt_bias, xs[4][0]]
        with jax.default_matmul_precision("highest"):
            o_ref, st_ref = jax.jit(lambda *a: kda_ops.kda_chain(*a, **cfg))(*args0)
        floor = (H * D * D * 4 * (1 + t) + t * H * D * 4 + t * 5 * H * D * 2 + 3 * 3 * H * D * 2) / BW * 1e6
        for bv in (4, 8, 16, 32, 64, 128):
            for warps in (2, 4):
                fn = functools.partial(kda_chain_verify, **cfg, block_v=bv, num_warps=warps)
                o, st = fn(*args0)
                err = max(float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max()),
                          float(jnp.abs(st - st_ref).max() / jnp.abs(st_ref).max()))

                @jax.jit
                def loop(xs, fn=fn):
                    def body(i, carry):
                        al = a_log + i.astype(jnp.float32) * 0.0
                        return tuple(fn(*(a[r] for a in xs[:4]), conv_w, al, dt_bias, xs[4][r]) for r in range(R))
                    init = tuple((jnp.zeros_like(o), jnp.zeros_like(st)) for _ in range(R))
                    return jax.lax.fori_loop(0, 4, body, init)

                jax.block_until_ready(loop(xs))
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    jax.block_until_ready(loop(xs))
                    times.append((time.perf_counter() - t0) * 1e6 / (4 * R))
                us = statistics.median(times)
                print(f"T={t:2d} BV={bv:3d} warps={warps}: {us:7.2f} us, {100 * floor / us:5.1f}% of the "
                      f"{floor:.2f} us floor at {BW / 1e12} TB/s, rel err {err:.1e}")
