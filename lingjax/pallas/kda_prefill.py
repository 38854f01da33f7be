"""Chunked KDA prefill in Pallas: the chunked form of the gated delta rule (ling3_architecture.md §3),
split like fla's chunk_kda into parallel intra-chunk phases and one serial pass over the chunks.

Per head and chunk of C tokens with incoming state S, G_t = Σ_{i<=t} g_i (from the chunk start, [K]):
  M[t,s] = β_t Σ_k k_t k_s e^{G_t-G_s} (s < t),  A[t,s] = Σ_k q_t k_s e^{G_t-G_s} (s <= t)
  X = (I + M)^-1,  R = β k e^G,  B = β v,  W = X R,  U = X B
  V_new = U - W S,  O = (q e^G) S + A V_new = (q e^G - A W) S + A U
  S <- e^{G_C} S + (k e^{G_C-G})ᵀ V_new
Phase 1a (`_blocks_kernel`, grid (head, chunk)): the [C, C] matrices X and A.
Phase 1b (`_prepare_kernel`, grid (head, chunk)): W, U, Q' = q e^G - A W, O' = A U, KD = k e^{G_C-G} and
  γ = e^{G_C}, with full-chunk dots: everything that does not depend on S.
Phase 2 (`_state_kernel`, grid (head, V tile)) walks the chunks in order with only S-dependent work:
  O = Q' S + O',  S <- γ S + KDᵀ (U - W S).
With fuse_output=False phase 2 stores each chunk's incoming S instead of O, and phase 3 (`_output_kernel`,
grid (head, chunk, V tile)) forms O = Q' S + O' in parallel (fla's chunk_fwd_h / chunk_fwd_o split).

Phase 1a works in sub-chunks of D = 16 rows (Triton has no value slicing, so each D x D block of M, A, X
is its own array; the stores assemble the [C, C] rows): X's diagonal blocks by the doubling product
(I+M)^-1 = (I-M)(I+M²)(I+M⁴)... (M is nilpotent), its off-diagonal blocks by block forward substitution
X_ij = -X_ii Σ_m M_im X_mj. The pairwise decay e^{G_t-G_s} is factored as e^{G_t-r}·e^{r-G_s} with r = G at
the middle row of t's sub-chunk. For s in an earlier sub-chunk the s factor is <= 1 (G only falls); the t
factor, and both factors in the diagonal block, are at most e^{8·max|g|}. Both must stay clear of f32's
subnormals (e^-87, flushed to zero): a term q_t·k_s whose scaled factor underflows is lost, so the gate
must satisfy g > -8.6 for such losses to stay below 1e-8 of the output scale. The safe gate (g > lower_bound = -5)
keeps the factors within e^±40. (D = 32 would reach e^±80 at g = -5 and lose ~1e-4: measured.)

Dot precision on the GPU (`precision`, one choice for every dot): "tf32x3" (default, ~f32 accuracy: each
dot's error reaches the output at O(1) weight, so plain tf32's 2^-11 rounding shows as ~5e-4 relative
error); "tf32" (faster, ~5e-4); "ieee" (FMA, slow). Interpret mode always uses f32 (HIGHEST).

Reference: lingjax.ops.kda.kda_chunked (and kda_recurrent).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops import kda as kda_ops  # the reference: kda_ops.kda_chunked
from lingjax.pallas import resolve_interpret

SUB = 16  # phase 1a's sub-chunk rows (D)

PRECISIONS = {  # dot precision on the GPU; interpret mode always uses f32 (HIGHEST)
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,  # ~f32 accuracy on the tensor cores
    "tf32": lax.Precision.DEFAULT,
    "ieee": lax.Precision.HIGHEST,
}


def _dot(a, b, contract=(1, 0), *, precision):  # 2-D dot with f32 accumulation
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _blocks_kernel(q_ref, k_ref, g_ref, b_ref,  # inputs
                   x_ref, a_ref,  # outputs
                   *, chunk, block_k, precision):
    # q_ref, k_ref, g_ref [T, H, K]; b_ref [T, H] -> x_ref = (I + M)^-1, a_ref = A: [H, T, C] f32, row t of
    # chunk c holding columns s of the same chunk (zero above the diagonal)
    h, c = pl.program_id(0), pl.program_id(1)
    sub, f32 = SUB, jnp.float32
    nb = chunk // sub
    dot = functools.partial(_dot, precision=precision)
    rows = jnp.arange(sub)[:, None]
    cols = jnp.arange(sub)[None, :]
    eye = (rows == cols).astype(f32)

    def row(x, i):  # x[i] as a [1, BK] row (value slicing does not lower to Triton)
        return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0)[None, :]

    def block(i):  # rows of sub-chunk i
        return pl.ds(c * chunk + i * sub, sub)

    # Row block i of M and A (blocks j <= i) summed over K in pieces of BK: row factor e^{G_t - r},
    # column factor e^{r - G_s} (<= 1 for j < i), r = G at the middle row of sub-chunk i. Then row block
    # i of X = (I + M)^-1: the diagonal block by doubling, the rest by block forward substitution.
    x = {}
    for i in range(nb):
        def piece(kp, acc, i=i):  # acc: blocks (M_ij, A_ij), j <= i, summed over the pieces before kp
            kc = pl.ds(kp * block_k, block_k)
            carry = jnp.zeros((1, block_k), f32)
            k, big_g = [], []  # sub-chunks 0..i, [D, BK]
            for j in range(i + 1):
                k.append(k_ref[block(j), h, kc].astype(f32))
                big_g.append(carry + jnp.cumsum(g_ref[block(j), h, kc].astype(f32), axis=0))
                carry = row(big_g[j], sub - 1)
            r = row(big_g[i], sub // 2 - 1)
            k_row = k[i] * jnp.exp(big_g[i] - r)
            q_row = q_ref[block(i), h, kc].astype(f32) * jnp.exp(big_g[i] - r)
            k_cols = [k[j] * jnp.exp(r - big_g[j]) for j in range(i + 1)]
            return (tuple(mm + dot(k_row, kj, (1, 1)) for mm, kj in zip(acc[0], k_cols)),
                    tuple(aa + dot(q_row, kj, (1, 1)) for aa, kj in zip(acc[1], k_cols)))

        zeros = tuple(jnp.zeros((sub, sub), f32) for _ in range(i + 1))
        m, a = lax.fori_loop(0, k_ref.shape[-1] // block_k, piece, (zeros, zeros))
        beta = b_ref[block(i), h].astype(f32)[:, None]  # [D, 1]
        n = jnp.where(rows > cols, -beta * m[i], 0.0)  # N = -M_ii, strictly lower
        xi = eye + n
        for _ in range(sub.bit_length() - 2):  # (I + N)(I + N²)(I + N⁴)... up to N^(D-1)
            n = dot(n, n)
            xi = xi + dot(xi, n)
        x[i, i] = xi
        for j in range(i):
            x[i, j] = -dot(xi, sum(dot(beta * m[mm], x[mm, j]) for mm in range(j, i)))
        for j in range(nb):
            cs = pl.ds(j * sub, sub)
            x_ref[h, block(i), cs] = x[i, j] if j <= i else jnp.zeros_like(eye)
            a_ref[h, block(i), cs] = (jnp.where(rows >= cols, a[j], 0.0) if j == i else
                                      a[j] if j < i else jnp.zeros_like(eye))


def _prepare_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, x_ref, a_ref,  # inputs
                    w_ref, u_ref, qp_ref, op_ref, kd_ref, gl_ref,  # outputs
                    *, chunk, block_k, precision):
    # q_ref, k_ref, g_ref [T, H, K]; v_ref [T, H, V]; b_ref [T, H]; x_ref, a_ref [H, T, C]
    # -> w_ref, qp_ref, kd_ref [H, T, K]; u_ref, op_ref [H, T, V]; gl_ref [H, T/C, K] (all f32)
    h, c = pl.program_id(0), pl.program_id(1)
    t = pl.ds(c * chunk, chunk)
    f32 = jnp.float32
    dot = functools.partial(_dot, precision=precision)
    last = jnp.arange(chunk)[:, None] == chunk - 1
    x, a = x_ref[h, t, :], a_ref[h, t, :]  # [C, C]
    beta = b_ref[t, h].astype(f32)[:, None]  # [C, 1]
    @pl.loop(0, k_ref.shape[-1] // block_k)
    def _(kp):
        kc = pl.ds(kp * block_k, block_k)
        big_g = jnp.cumsum(g_ref[t, h, kc].astype(f32), axis=0)  # [C, BK]
        g_last = jnp.sum(jnp.where(last, big_g, 0.0), axis=0)[None, :]  # [1, BK]
        k = k_ref[t, h, kc].astype(f32)
        w = dot(x, beta * k * jnp.exp(big_g))  # W = X R
        w_ref[h, t, kc] = w
        qp_ref[h, t, kc] = q_ref[t, h, kc].astype(f32) * jnp.exp(big_g) - dot(a, w)  # Q' = q e^G - A W
        kd_ref[h, t, kc] = k * jnp.exp(g_last - big_g)
        gl_ref[h, pl.ds(c, 1), kc] = jnp.exp(g_last)

    @pl.loop(0, v_ref.shape[-1] // block_k)
    def _(vp):
        vc = pl.ds(vp * block_k, block_k)
        u = dot(x, beta * v_ref[t, h, vc].astype(f32))  # U = X B
        u_ref[h, t, vc] = u
        op_ref[h, t, vc] = dot(a, u)  # O' = A U


def _state_kernel(w_ref, u_ref, qp_ref, op_ref, kd_ref, gl_ref, s_ref,  # inputs
                  out_ref, sf_ref,  # outputs
                  *, chunk, block_k, block_v, fuse_output, precision):
    # w_ref, qp_ref, kd_ref [H, T, K]; u_ref, op_ref [H, T, V]; gl_ref [H, T/C, K]; s_ref [H, K, V]
    # -> out_ref: o [T, H, V] (fuse_output) or the state entering each chunk [H, T/C, K, V]; sf_ref [H, K, V]
    h, j = pl.program_id(0), pl.program_id(1)
    v0 = pl.ds(j * block_v, block_v)
    pieces = [pl.ds(p * block_k, block_k) for p in range(s_ref.shape[1] // block_k)]  # the state's K rows
    dot = functools.partial(_dot, precision=precision)

    def body(c, s):  # s: the state entering chunk c, as [BK, BV] pieces
        t = pl.ds(c * chunk, chunk)
        if fuse_output:
            out_ref[t, h, v0] = sum(dot(qp_ref[h, t, kc], sp) for kc, sp in zip(pieces, s)) + op_ref[h, t, v0]
        else:
            for kc, sp in zip(pieces, s):
                out_ref[h, c, kc, v0] = sp
        v_new = u_ref[h, t, v0] - sum(dot(w_ref[h, t, kc], sp) for kc, sp in zip(pieces, s))  # [C, BV]
        return tuple(gl_ref[h, c, kc][:, None] * sp + dot(kd_ref[h, t, kc], v_new, (0, 0))
                     for kc, sp in zip(pieces, s))

    final = lax.fori_loop(0, w_ref.shape[1] // chunk, body, tuple(s_ref[h, kc, v0] for kc in pieces))
    for kc, sp in zip(pieces, final):
        sf_ref[h, kc, v0] = sp


def _output_kernel(qp_ref, op_ref, hs_ref, o_ref, *, chunk, block_v, precision):
    # qp_ref [H, T, K]; op_ref [H, T, V]; hs_ref [H, T/C, K, V] -> o_ref [T, H, V]
    h, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t, v0 = pl.ds(c * chunk, chunk), pl.ds(j * block_v, block_v)
    o_ref[t, h, v0] = _dot(qp_ref[h, t, :], hs_ref[h, c, :, v0], precision=precision) + op_ref[h, t, v0]


def _call(kernel, grid, out_shape, *args, num_warps, num_stages, interpret, name):
    return pl.pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                          compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
                          )(*args)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "num_stages", "precision",
                                             "interpret"))
def intra_chunk(q, k, v, g, beta, *, chunk: int = 64, block_k: int = 16, num_warps: int = 4, num_stages: int = 2,
                precision: str = "tf32x3", interpret=None):
    """Phases 1a and 1b on inputs padded to a multiple of `chunk`: (W, Q', KD [H, T, K]; U, O' [H, T, V];
    γ [H, T/C, K]), all f32. Split out so the bench can time phase 1 alone."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    assert t % chunk == 0 and chunk >= SUB and chunk & (chunk - 1) == 0, (t, chunk)
    assert dk % block_k == 0 and dv % block_k == 0, (dk, dv, block_k)
    interpret = resolve_interpret(interpret)
    prec = lax.Precision.HIGHEST if interpret else PRECISIONS[precision]
    opts = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    f32, nc = jnp.float32, t // chunk
    tc = jax.ShapeDtypeStruct((h, t, chunk), f32)
    x, a = _call(functools.partial(_blocks_kernel, chunk=chunk, block_k=block_k, precision=prec),
                 (h, nc), (tc, tc), q, k, g, beta, name="kda_prefill_blocks", **opts)
    tk, tv = jax.ShapeDtypeStruct((h, t, dk), f32), jax.ShapeDtypeStruct((h, t, dv), f32)
    return _call(functools.partial(_prepare_kernel, chunk=chunk, block_k=block_k, precision=prec), (h, nc),
                 (tk, tv, tk, tv, tk, jax.ShapeDtypeStruct((h, nc, dk), f32)), q, k, v, g, beta, x, a,
                 name="kda_prefill_prepare", **opts)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "state_block_k", "block_v", "fuse_output",
                                             "num_warps", "intra_warps", "num_stages", "precision", "interpret"))
def kda_chunked_prefill(q, k, v, g, beta, state, chunk: int = 64, *, block_k: int = 16, state_block_k: int = 64,
                        block_v: int = 32, fuse_output: bool = True, num_warps: int = 4, intra_warps: int = 4,
                        num_stages: int = 2, precision: str = "tf32x3", interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chunked: (o [T, H, V] f32, final state [H, K, V]).

    `chunk` (C, a power of two >= 16): the chunk of every phase (the gate must satisfy g > -8.6, see the
    module docstring); `block_k`: phase 1's column pieces; `state_block_k` x `block_v`: phase 2's state
    pieces (one program per head and V tile); `intra_warps`: phase 1's warps, `num_warps`: phases 2 and
    3; `num_stages`: all. Padding rows (g = 0, beta = 0) leave the state as is, so T is padded up to a
    multiple of C here. Defaults, as
    compiled for sm_90 by Triton 3.9 (ptxas -v, K = V = 128): phase 1a spills ~120 bytes/thread, the
    others ~0; phase 2 takes 144 KiB of shared memory (num_stages=3 would exceed it).
    """
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    block_v, block_k, state_block_k = min(block_v, dv), min(block_k, dk, dv), min(state_block_k, dk)
    assert dv % block_v == 0 and dk % state_block_k == 0, (dk, dv, block_v, state_block_k)
    pad = -t_len % chunk
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    tp, nc = t_len + pad, (t_len + pad) // chunk
    w, u, qp, op, kd, gl = intra_chunk(q, k, v, g, beta, chunk=chunk, block_k=block_k, num_warps=intra_warps,
                                       num_stages=num_stages, precision=precision, interpret=interpret)
    interpret = resolve_interpret(interpret)
    prec = lax.Precision.HIGHEST if interpret else PRECISIONS[precision]
    opts = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    f32 = jnp.float32
    o_shape = jax.ShapeDtypeStruct((tp, h, dv), f32)
    states_shape = jax.ShapeDtypeStruct((h, nc, dk, dv), f32)  # the state entering each chunk
    out, final = _call(
        functools.partial(_state_kernel, chunk=chunk, block_k=state_block_k, block_v=block_v,
                          fuse_output=fuse_output, precision=prec), (h, dv // block_v),
        (o_shape if fuse_output else states_shape, jax.ShapeDtypeStruct((h, dk, dv), f32)),
        w, u, qp, op, kd, gl, state.astype(f32), name="kda_prefill_state", **opts)
    if not fuse_output:
        out = _call(functools.partial(_output_kernel, chunk=chunk, block_v=block_v, precision=prec),
                    (h, nc, dv // block_v), o_shape, qp, op, out, name="kda_prefill_output", **opts)
    return out[:t_len], final


if __name__ == "__main__":  # GPU: sweep tiles, check each against the recurrence, print µs and % of floor
    import statistics
    import time

    T, H, D, BW = 8192, 32, 128, 4.3e12  # tokens, heads, head dim, bytes/s for the floor
    ks = jax.random.split(jax.random.key(0), 6)
    norm = kda_ops.l2norm
    args = ((norm(jax.random.normal(ks[0], (T, H, D))) * D**-0.5).astype(jnp.bfloat16),
            norm(jax.random.normal(ks[1], (T, H, D))).astype(jnp.bfloat16),
            jax.random.normal(ks[2], (T, H, D), jnp.bfloat16),
            -5.0 * jax.nn.sigmoid(2 * jax.random.normal(ks[3], (T, H, D))),
            jax.nn.sigmoid(jax.random.normal(ks[4], (T, H))),
            jax.random.normal(ks[5], (H, D, D)))
    with jax.default_matmul_precision("highest"):
        o_ref, s_ref = jax.jit(kda_ops.kda_recurrent)(*args)
    floor = (T * H * D * (3 * 2 + 4 + 4) + T * H * 4 + 2 * H * D * D * 4) / BW * 1e6
    for kw in ({}, dict(fuse_output=False), dict(chunk=32, block_k=32), dict(block_v=16),
               dict(precision="tf32")):
        fn = jax.jit(functools.partial(kda_chunked_prefill, **kw))
        o, s = fn(*args)
        err = max(float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max()),
                  float(jnp.abs(s - s_ref).max() / jnp.abs(s_ref).max()))
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append((time.perf_counter() - t0) * 1e6)
        us = statistics.median(times)
        print(f"{kw or 'defaults'}: {us:8.1f} us, {100 * floor / us:5.1f}% of the {floor:.1f} us floor at "
              f"{BW / 1e12} TB/s, rel err {err:.1e}")
