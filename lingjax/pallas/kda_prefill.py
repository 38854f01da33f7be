"""Chunked KDA prefill in Pallas: the contract of lingjax.ops.kda.kda_chunked (and kda_recurrent).

Three launches over chunks of C tokens, split like fla's chunk_kda: per (head, chunk) the [C, C] matrices
(I + M)^-1 and A (`_blocks_kernel`), then everything else that does not depend on the state
(`_prepare_kernel`); then one serial pass over the chunks per (head, V tile) (`_state_kernel`) that carries
the state and writes the output. The math, the phases and their tiles: docs/kernels/kda.md.

The gate must satisfy g > -8.6 (the safe gate's g > -5 does): the in-chunk decays are factored around
16-row sub-chunks, and a larger |g| lets a factor underflow f32. The precision follows q, k, v's dtype:
bf16 inputs take fla's bf16 path (bf16 operands between the phases and in most dots, f32 state and
accumulators; ~3e-3 relative error), anything else the f32 path (every dot as 3-pass tf32, ~f32
accuracy). Interpret mode runs the f32 dots in f32 and keeps the bf16 roundings.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import is_pow2, pallas_call, resolve_interpret

SUB = 16  # phase 1a's sub-chunk rows (D): sets the gate's bound (module docstring), so not a tuning choice


@dataclasses.dataclass(frozen=True)
class PrefillTuning:
    """kda_chunked_prefill's launch shapes (performance only; the chunk and tiles change rounding alone).
    chunk: C, a power of two >= 16, every phase's chunk (T is padded up to a multiple of it); block_k /
    prepare_block_k: the K column pieces of phases 1a / 1b (1b's also its V pieces); state_block_k x
    block_v: phase 2's state pieces, one program per head and V tile; blocks_warps: phase 1a's warps
    (its 16 x 16 dots are replicated across warps, so more warps only split its loads and exps);
    num_warps: the other phases'; num_stages: every phase's."""
    chunk: int = 64
    block_k: int = 16
    prepare_block_k: int = 64
    state_block_k: int = 64
    block_v: int = 32
    blocks_warps: int = 1
    num_warps: int = 4
    num_stages: int = 2


@dataclasses.dataclass(frozen=True)
class _Prec:
    """How a precision name maps onto the dots: `solve` for M, A and X (always f32 operands), `dot` and
    `operand` (the dtype the other dots' operands, and their stored forms, are rounded to) for the rest."""
    solve: object
    dot: object
    operand: object = jnp.float32


PRECISIONS = {
    "tf32x3": _Prec(lax.DotAlgorithmPreset.TF32_TF32_F32_X3, lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
    "bf16": _Prec(lax.Precision.DEFAULT, lax.Precision.DEFAULT, jnp.bfloat16),
}


def precision_for(q, k, v) -> str:
    """bf16 activations get fla's bf16 path (error ~3e-3, within bf16's 1e-2); anything else the f32 path."""
    return "bf16" if all(a.dtype == jnp.bfloat16 for a in (q, k, v)) else "tf32x3"


def _resolve(precision, interpret) -> _Prec:
    p = PRECISIONS[precision]
    if interpret:  # the CPU has no tf32: f32 dots in f32, the bf16 rounding kept
        hi = lax.Precision.HIGHEST
        return _Prec(hi, hi if p.operand == jnp.float32 else lax.Precision.DEFAULT, p.operand)
    return p


def _dot(a, b, contract=(1, 0), *, precision):  # 2-D dot with f32 accumulation
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           precision=precision, preferred_element_type=jnp.float32)


def _op_dot(a, b, contract=(1, 0), *, prec: _Prec):  # a dot of the `dot` kind: operands rounded first
    return _dot(a.astype(prec.operand), b.astype(prec.operand), contract, precision=prec.dot)


def _sub_chunk_pieces(q_ref, k_ref, g_ref, h, c, kp, *, chunk, block_k):
    """Column piece kp of every D-row sub-chunk of chunk c: (q, k, G) lists of [D, BK] f32, G from the chunk
    start."""
    f32, nb, kc = jnp.float32, chunk // SUB, pl.ds(kp * block_k, block_k)
    q, k, big_g = [], [], []
    carry = jnp.zeros((1, block_k), f32)
    for j in range(nb):
        rows = pl.ds(c * chunk + j * SUB, SUB)
        q.append(q_ref[rows, h, kc].astype(f32))
        k.append(k_ref[rows, h, kc].astype(f32))
        big_g.append(carry + jnp.cumsum(g_ref[rows, h, kc].astype(f32), axis=0))
        carry = _row(big_g[j], SUB - 1)
    return q, k, big_g


def _row(x, i):  # x[i] as a [1, BK] row (value slicing does not lower to Triton)
    return jnp.sum(jnp.where(jnp.arange(x.shape[0])[:, None] == i, x, 0.0), axis=0)[None, :]


def _inverse_blocks(m, beta, *, nb, precision):
    """X = (I + βM)^-1 as D x D blocks {(i, j): X_ij, j <= i} from the blocks m[i, j] of the K-sum (β not
    yet applied) and the sub-chunks' β [D, 1]: diagonal blocks by doubling, the rest by block forward
    substitution."""
    dot = functools.partial(_dot, precision=precision)
    rows, cols = jnp.arange(SUB)[:, None], jnp.arange(SUB)[None, :]
    x = {}
    for i in range(nb):
        n = jnp.where(rows > cols, -beta[i] * m[i, i], 0.0)  # N = -βM_ii, strictly lower
        xi = (rows == cols).astype(jnp.float32) + n
        for _ in range(SUB.bit_length() - 2):  # (I + N)(I + N²)(I + N⁴)... up to N^(D-1)
            n = dot(n, n)
            xi = xi + dot(xi, n)
        x[i, i] = xi
        for j in range(i):
            x[i, j] = -dot(xi, sum(dot(beta[i] * m[i, mm], x[mm, j]) for mm in range(j, i)))
    return x


def _blocks_kernel(q_ref, k_ref, g_ref, b_ref,  # inputs
                   x_ref, a_ref,  # outputs
                   *, chunk, block_k, prec):
    # q_ref, k_ref, g_ref [T, H, K]; b_ref [T, H] -> x_ref = (I + M)^-1, a_ref = A: [H, T, C] (prec.operand),
    # row t of chunk c holding columns s of the same chunk (zero above the diagonal)
    h, c = pl.program_id(0), pl.program_id(1)
    nb = chunk // SUB
    dot = functools.partial(_dot, contract=(1, 1), precision=prec.solve)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]  # the lower blocks, in carry order

    def piece(kp, acc):  # acc: the blocks (M_ij, A_ij) in pair order, summed over the pieces before kp
        q, k, big_g = _sub_chunk_pieces(q_ref, k_ref, g_ref, h, c, kp, chunk=chunk, block_k=block_k)
        out = []
        for i in range(nb):  # row factor e^{G_t - r}, column factor e^{r - G_s}, r = G mid sub-chunk i
            r = _row(big_g[i], SUB // 2 - 1)
            row_scale = jnp.exp(big_g[i] - r)
            k_row, q_row = k[i] * row_scale, q[i] * row_scale
            for j in range(i + 1):
                k_col = k[j] * jnp.exp(r - big_g[j])
                out.append((dot(k_row, k_col), dot(q_row, k_col)))
        return tuple((mm + dm, aa + da) for (mm, aa), (dm, da) in zip(acc, out))

    zeros = jnp.zeros((SUB, SUB), jnp.float32)
    acc = lax.fori_loop(0, k_ref.shape[-1] // block_k, piece, tuple((zeros, zeros) for _ in pairs))
    m = {p: mm for p, (mm, _) in zip(pairs, acc)}
    a = {p: aa for p, (_, aa) in zip(pairs, acc)}
    beta = [b_ref[pl.ds(c * chunk + i * SUB, SUB), h].astype(jnp.float32)[:, None] for i in range(nb)]
    x = _inverse_blocks(m, beta, nb=nb, precision=prec.solve)
    causal = jnp.arange(SUB)[:, None] >= jnp.arange(SUB)[None, :]
    for i in range(nb):
        t = pl.ds(c * chunk + i * SUB, SUB)
        for j in range(nb):
            cs = pl.ds(j * SUB, SUB)
            x_ref[h, t, cs] = (x[i, j] if j <= i else zeros).astype(x_ref.dtype)
            a_blk = jnp.where(causal, a[i, j], 0.0) if j == i else a[i, j] if j < i else zeros
            a_ref[h, t, cs] = a_blk.astype(a_ref.dtype)


def _prepare_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, x_ref, a_ref,  # inputs
                    w_ref, u_ref, qp_ref, op_ref, kd_ref, gl_ref,  # outputs
                    *, chunk, block_k, prec):
    # q_ref, k_ref, g_ref [T, H, K]; v_ref [T, H, V]; b_ref [T, H]; x_ref, a_ref [H, T, C]
    # -> w_ref, qp_ref [H, T, K], u_ref [H, T, V], kd_ref [H, K, T] (prec.operand); op_ref [H, T, V],
    # gl_ref [H, T/C, K] (f32)
    h, c = pl.program_id(0), pl.program_id(1)
    t = pl.ds(c * chunk, chunk)
    f32 = jnp.float32
    dot = functools.partial(_op_dot, prec=prec)
    x, a = x_ref[h, t, :], a_ref[h, t, :]  # [C, C]
    beta = b_ref[t, h].astype(f32)[:, None]  # [C, 1]
    last = jnp.arange(chunk)[:, None] == chunk - 1

    @pl.loop(0, k_ref.shape[-1] // block_k)
    def _(kp):
        kc = pl.ds(kp * block_k, block_k)
        big_g = jnp.cumsum(g_ref[t, h, kc].astype(f32), axis=0)  # [C, BK]
        g_last = jnp.sum(jnp.where(last, big_g, 0.0), axis=0)[None, :]  # [1, BK]
        k = k_ref[t, h, kc].astype(f32)
        w = dot(x, beta * k * jnp.exp(big_g)).astype(w_ref.dtype)  # W = X R
        w_ref[h, t, kc] = w
        qp = q_ref[t, h, kc].astype(f32) * jnp.exp(big_g) - dot(a, w)  # Q' = q e^G - A W
        qp_ref[h, t, kc] = qp.astype(qp_ref.dtype)
        kd_ref[h, kc, t] = jnp.transpose(k * jnp.exp(g_last - big_g)).astype(kd_ref.dtype)  # KDᵀ
        gl_ref[h, pl.ds(c, 1), kc] = jnp.exp(g_last)

    @pl.loop(0, v_ref.shape[-1] // block_k)
    def _(vp):
        vc = pl.ds(vp * block_k, block_k)
        u = dot(x, beta * v_ref[t, h, vc].astype(f32)).astype(u_ref.dtype)  # U = X B
        u_ref[h, t, vc] = u
        op_ref[h, t, vc] = dot(a, u)  # O' = A U


def _state_kernel(w_ref, u_ref, qp_ref, op_ref, kd_ref, gl_ref, s_ref,  # inputs
                  o_ref, sf_ref,  # outputs
                  *, chunk, block_k, block_v, prec):
    # w_ref, qp_ref [H, T, K]; kd_ref [H, K, T]; u_ref, op_ref [H, T, V]; gl_ref [H, T/C, K]; s_ref [H, K, V]
    # -> o_ref [T, H, V]; sf_ref [H, K, V] (f32)
    h, j = pl.program_id(0), pl.program_id(1)
    v0 = pl.ds(j * block_v, block_v)
    pieces = [pl.ds(p * block_k, block_k) for p in range(s_ref.shape[1] // block_k)]  # the state's K rows
    dot = functools.partial(_op_dot, prec=prec)

    def body(c, s):  # s: the state entering chunk c, as [BK, BV] f32 pieces
        t = pl.ds(c * chunk, chunk)
        o_ref[t, h, v0] = sum(dot(qp_ref[h, t, kc], sp) for kc, sp in zip(pieces, s)) + op_ref[h, t, v0]
        v_new = u_ref[h, t, v0] - sum(dot(w_ref[h, t, kc], sp) for kc, sp in zip(pieces, s))  # [C, BV]
        return tuple(gl_ref[h, c, kc][:, None] * sp + dot(kd_ref[h, kc, t], v_new)
                     for kc, sp in zip(pieces, s))

    final = lax.fori_loop(0, w_ref.shape[1] // chunk, body, tuple(s_ref[h, kc, v0] for kc in pieces))
    for kc, sp in zip(pieces, final):
        sf_ref[h, kc, v0] = sp


def _call(kernel, grid, out_shape, *args, num_warps, num_stages, interpret, name):
    return pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                       compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages))(*args)


def _tiles(dk: int, dv: int, tuning: PrefillTuning) -> dict:
    """The tiles after clamping to the head dims."""
    return dict(block_k=min(tuning.block_k, dk), prepare_block_k=min(tuning.prepare_block_k, dk, dv),
                state_block_k=min(tuning.state_block_k, dk), block_v=min(tuning.block_v, dv))


def _intra_chunk(q, k, v, g, beta, *, tuning: PrefillTuning, prec: _Prec, interpret: bool):
    """Phases 1a and 1b on inputs padded to a multiple of the chunk: (W, Q' [H, T, K]; U [H, T, V]; O'
    [H, T, V] f32; KDᵀ [H, K, T]; γ [H, T/C, K] f32), W, Q', U, KDᵀ in the precision's operand dtype."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    chunk, tiles = tuning.chunk, _tiles(dk, dv, tuning)
    block_k, prepare_block_k = tiles["block_k"], tiles["prepare_block_k"]
    assert t % chunk == 0 and chunk >= SUB and chunk & (chunk - 1) == 0, (t, chunk)
    assert dk % block_k == 0 and dk % prepare_block_k == 0 and dv % prepare_block_k == 0, (dk, dv)
    opts = dict(num_stages=tuning.num_stages, interpret=interpret)
    f32, op, nc = jnp.float32, prec.operand, t // chunk
    tc = jax.ShapeDtypeStruct((h, t, chunk), op)
    x, a = _call(functools.partial(_blocks_kernel, chunk=chunk, block_k=block_k, prec=prec), (h, nc), (tc, tc),
                 q, k, g, beta, name="kda_prefill_blocks", num_warps=tuning.blocks_warps, **opts)
    shapes = (jax.ShapeDtypeStruct((h, t, dk), op), jax.ShapeDtypeStruct((h, t, dv), op),
              jax.ShapeDtypeStruct((h, t, dk), op), jax.ShapeDtypeStruct((h, t, dv), f32),
              jax.ShapeDtypeStruct((h, dk, t), op), jax.ShapeDtypeStruct((h, nc, dk), f32))
    return _call(functools.partial(_prepare_kernel, chunk=chunk, block_k=prepare_block_k, prec=prec), (h, nc),
                 shapes, q, k, v, g, beta, x, a, name="kda_prefill_prepare", num_warps=tuning.num_warps, **opts)


def supports(q, k, v, g, beta, state, *, tuning: PrefillTuning = PrefillTuning(), interpret=None) -> str | None:
    """None when kda_chunked_prefill takes these arguments and lowers to Triton (only .shape and .dtype are
    read), else the reason: the phases' blocks need power-of-2 sizes and their dots 16 or more per side
    (smaller dots lower and compile, but on the H200 their results can be wrong: docs/kernels/kda.md)."""
    dk, dv = k.shape[-1], v.shape[-1]
    c = tuning.chunk
    if not (is_pow2(c) and c >= SUB):
        return f"the prefill chunk {c} is not a power of 2 of at least {SUB}"
    for name, n in (("key", dk), ("value", dv)):
        if not is_pow2(n):
            return f"KDA {name} head dim {n} is not a power of 2, as a Triton block must be"
    for name, n in _tiles(dk, dv, tuning).items():  # each a side of a dot
        if n < 16:
            what = f"KDA head dim {n}" if n == min(dk, dv) else f"the prefill tile {name} = {n}"
            return f"{what} is below the 16 a Triton dot needs"
        if not is_pow2(n):
            return f"the prefill tile {name} = {n} is not a power of 2"
    return None


@functools.partial(jax.jit, static_argnames=("tuning", "interpret"))
def kda_chunked_prefill(q, k, v, g, beta, state, *, tuning: PrefillTuning = PrefillTuning(), interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chunked: q, k, g [T, H, K]; v [T, H, V]; beta
    [T, H]; state [H, K, V] -> (o [T, H, V] f32, final state [H, K, V] f32). Padding rows (g = 0, beta = 0)
    leave the state as is, so T is padded up to a multiple of the chunk here."""
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    tiles = _tiles(dk, dv, tuning)
    block_v, state_block_k = tiles["block_v"], tiles["state_block_k"]
    assert dv % block_v == 0 and dk % state_block_k == 0, (dk, dv, block_v, state_block_k)
    interpret = resolve_interpret(interpret)
    prec = _resolve(precision_for(q, k, v), interpret)
    chunk = tuning.chunk
    pad = -t_len % chunk
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    tp = t_len + pad
    w, u, qp, op, kd, gl = _intra_chunk(q, k, v, g, beta, tuning=tuning, prec=prec, interpret=interpret)
    f32 = jnp.float32
    o, final = _call(
        functools.partial(_state_kernel, chunk=chunk, block_k=state_block_k, block_v=block_v, prec=prec),
        (h, dv // block_v), (jax.ShapeDtypeStruct((tp, h, dv), f32), jax.ShapeDtypeStruct((h, dk, dv), f32)),
        w, u, qp, op, kd, gl, state.astype(f32), name="kda_prefill_state", num_warps=tuning.num_warps,
        num_stages=tuning.num_stages, interpret=interpret)
    return o[:t_len], final
