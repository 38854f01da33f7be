"""Chunked KDA prefill in Pallas: the chunked form of the gated delta rule (ling3_architecture.md §3).

One program per (head, V tile of BV columns) walks the chunks of BT tokens in order, carrying its
state tile [K, BV] in registers. Per chunk, with G the cumulative log decay from the chunk start:
  M = strict_lower(β_t Σ_k k_t k_i e^{G_t-G_i}),  Tm = (I + M)^-1   (doubling product: M is nilpotent)
  V_new = Tm (β v) - Tm (β k e^G) S,  O = (q e^G) S + causal(q_t·k_i e^{G_t-G_i}) V_new,
  S <- e^{G_last} S + (k e^{G_last-G})ᵀ V_new.
The pairwise decays are factored through the chunk's middle row r: e^{G_t-r}·e^{r-G_i}. That needs
|G_t - r| < ~85 (f32 exp range): with the safe gate (g > lower_bound = -5) a chunk of BT <= 32 keeps it
under 80. The intra-chunk work is V-independent and repeated per V tile (it is cheap next to the
serial walk over chunks).

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

PRECISIONS = {  # dot precision on the GPU; interpret mode always uses f32 (HIGHEST)
    "tf32x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,  # ~f32 accuracy on the tensor cores
    "tf32": lax.Precision.DEFAULT,
    "ieee": lax.Precision.HIGHEST,
}



def _prefill_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s_ref,  # inputs
                    o_ref, sf_ref,  # outputs
                    *, block_t, block_v, precision):
    # q_ref, k_ref, g_ref [T, H, K]; v_ref [T, H, V]; b_ref [T, H]; s_ref [H, K, V] f32
    # -> o_ref [T, H, V] f32; sf_ref [H, K, V] f32 (final state)
    h, j = pl.program_id(0), pl.program_id(1)
    c = block_t
    v0 = pl.ds(j * block_v, block_v)
    n_chunks = q_ref.shape[0] // c
    f32 = jnp.float32
    rows = jnp.arange(c)[:, None]
    cols = jnp.arange(c)[None, :]
    eye = (rows == cols).astype(f32)  # [C, C]
    mid, last = c // 2 - 1, c - 1

    def dot(a, b, contract=(1, 0)):  # 2-D dot with f32 accumulation
        return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                               precision=precision, preferred_element_type=f32)

    def row(x, i):  # x[i] as a [K] vector (value slicing does not lower to Triton)
        return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0)

    def body(ci, s):  # s: [K, BV] state before the chunk
        t = pl.ds(ci * c, c)
        q = q_ref[t, h, :].astype(f32)  # [C, K]
        k = k_ref[t, h, :].astype(f32)  # [C, K]
        v = v_ref[t, h, v0].astype(f32)  # [C, BV]
        beta = b_ref[t, h].astype(f32)[:, None]  # [C, 1]
        big_g = jnp.cumsum(g_ref[t, h, :].astype(f32), axis=0)  # [C, K], G_t = Σ_{i<=t} g_i
        r = row(big_g, mid)[None, :]
        k_neg = k * jnp.exp(r - big_g)  # the i side of e^{G_t - G_i}
        a_kk = dot(k * jnp.exp(big_g - r), k_neg, (1, 1))  # [C, C]
        a_qk = jnp.where(rows >= cols, dot(q * jnp.exp(big_g - r), k_neg, (1, 1)), 0.0)
        n = jnp.where(rows > cols, -beta * a_kk, 0.0)  # -M, strictly lower: nilpotent
        tm = eye + n
        for _ in range(c.bit_length() - 2):  # (I + M)^-1 = (I - M)(I + M^2)(I + M^4)...
            n = dot(n, n)
            tm = tm + dot(tm, n)
        w = dot(tm, beta * k * jnp.exp(big_g))  # [C, K]
        v_new = dot(tm, beta * v) - dot(w, s)  # [C, BV]
        o_ref[t, h, v0] = dot(q * jnp.exp(big_g), s) + dot(a_qk, v_new)
        g_last = row(big_g, last)  # [K]
        k_dec = k * jnp.exp(g_last[None, :] - big_g)  # [C, K]
        return jnp.exp(g_last)[:, None] * s + dot(k_dec, v_new, (0, 0))

    sf_ref[h, :, v0] = lax.fori_loop(0, n_chunks, body, s_ref[h, :, v0])


@functools.partial(jax.jit, static_argnames=("chunk", "block_t", "block_v", "num_warps", "num_stages",
                                             "precision", "interpret"))
def kda_chunked_prefill(q, k, v, g, beta, state, chunk: int = 64, *, block_t: int = 16, block_v: int = 32,
                        num_warps: int = 4, num_stages: int = 2, precision: str = "tf32x3", interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chunked: (o [T, H, V] f32, final state [H, K, V]).

    `chunk` is kept for the reference's signature; the kernel's chunk is `block_t` (the chunked form
    equals the recurrence up to rounding for any chunk). Padding rows (g = 0, beta = 0) leave the
    state as is, so T is padded up to a multiple of block_t here. Defaults: the fastest f32-accurate
    H200 configuration measured (bench/results/kda_h200_2026-11-29.md); precision="tf32" is ~1.4x
    faster at ~5e-4 relative error.
    """
    del chunk
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    block_v = min(block_v, dv)
    assert dv % block_v == 0 and block_t >= 16 and block_t & (block_t - 1) == 0
    pad = -t_len % block_t
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    interpret = resolve_interpret(interpret)
    kernel = functools.partial(_prefill_kernel, block_t=block_t, block_v=block_v,
                               precision=lax.Precision.HIGHEST if interpret else PRECISIONS[precision])
    o, final = pl.pallas_call(
        kernel,
        grid=(h, dv // block_v),
        out_shape=(jax.ShapeDtypeStruct((t_len + pad, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((h, dk, dv), jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunked_prefill",
    )(q, k, v, g, beta, state.astype(jnp.float32))
    return o[:t_len], final


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
    for bt in (16, 32):
        for bv in (16, 32, 64):
            for warps in (4, 8):
                fn = jax.jit(functools.partial(kda_chunked_prefill, block_t=bt, block_v=bv, num_warps=warps))
                o, s = fn(*args)
                err = max(float(jnp.abs(o - o_ref).max() / jnp.abs(o_ref).max()),
                          float(jnp.abs(s - s_ref).max() / jnp.abs(s_ref).max()))
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    times.append((time.perf_counter() - t0) * 1e6)
                us = statistics.median(times)
                print(f"BT={bt} BV={bv:3d} warps={warps}: {us:8.1f} us, {100 * floor / us:5.1f}% of the "
                      f"{floor:.1f} us floor at {BW / 1e12} TB/s, rel err {err:.1e}")
