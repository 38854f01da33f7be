"""Chunked KDA prefill in Pallas: the chunked form of the gated delta rule (ling3_architecture.md §3),
split like fla's chunk_kda into parallel intra-chunk phases and one serial pass over the chunks.

Per head and chunk of C tokens with incoming state S, G_t = Σ_{i<=t} g_i (from the chunk start, [K]):
  M[t,s] = β_t Σ_k k_t k_s e^{G_t-G_s} (s < t),  A[t,s] = Σ_k q_t k_s e^{G_t-G_s} (s <= t)
  X = (I + M)^-1,  R = β k e^G,  B = β v,  W = X R,  U = X B
  V_new = U - W S,  O = (q e^G) S + A V_new = (q e^G - A W) S + A U
  S <- e^{G_C} S + (k e^{G_C-G})ᵀ V_new
Phase 1a (`_blocks_kernel`, grid (head, chunk)): the [C, C] matrices X and A.
Phase 1b (`_prepare_kernel`, grid (head, chunk)): W, U, Q' = q e^G - A W, O' = A U, KDᵀ = (k e^{G_C-G})ᵀ
  (stored transposed: the K-major operand tf32 wgmma wants in phase 2) and γ = e^{G_C}, with full-chunk
  dots: everything that does not depend on S.
Phase 2 (`_state_kernel`, grid (head, V tile)) walks the chunks in order with only S-dependent work:
  O = Q' S + O',  S <- γ S + KDᵀ (U - W S).
With fuse_output=False phase 2 stores each chunk's incoming S instead of O, and phase 3 (`_output_kernel`,
grid (head, chunk, V tile)) forms O = Q' S + O' in parallel (fla's chunk_fwd_h / chunk_fwd_o split).

Phase 1a, like fla's fused inter + solve kernel, is one program per (head, chunk) that makes ONE pass over
K in pieces of BK columns, loading each sub-chunk of D = 16 rows once per piece and accumulating all
nb(nb+1)/2 lower D x D blocks of M and A at once (nb = C/D; Triton has no value slicing, so each block is
its own array and the stores assemble the [C, C] rows). Then X: diagonal blocks by the doubling product
(I+M)^-1 = (I-M)(I+M²)(I+M⁴)... (M is nilpotent), the rest by block forward substitution
X_ij = -X_ii Σ_m M_im X_mj. The pairwise decay e^{G_t-G_s} is factored as e^{G_t-r}·e^{r-G_s} with r = G at
the middle row of t's sub-chunk. For s in an earlier sub-chunk the s factor is <= 1 (G only falls); the t
factor, and both factors in the diagonal block, are at most e^{8·max|g|}. Both must stay clear of f32's
subnormals (e^-87, flushed to zero): a term q_t·k_s whose scaled factor underflows is lost, so the gate
must satisfy g > -8.6 for such losses to stay below 1e-8 of the output scale. The safe gate
(g > lower_bound = -5) keeps the factors within e^±40. (D = 32 would reach e^±80 at g = -5 and lose ~1e-4
there: measured.) G is recomputed per piece from g (a cumsum of D rows plus the carried last row) instead
of a separate cumsum pass: that pass would write G ([T, H, K] f32) and both phase-1 kernels read it back.

Precision (`precision`, default by input dtype; interpret mode runs the f32 dots in f32 (HIGHEST) but
applies the bf16 rounding, so CPU tests see the bf16 path's real error):
  "tf32x3" (default for f32 inputs, ~f32 accuracy: each dot's error reaches the output at O(1) weight, so
    plain tf32's 2^-11 rounding shows as ~5e-4 relative error) and "ieee" (FMA, slow): every dot in f32.
  "tf32": every dot one tf32 pass (~5e-4).
  "bf16" (default when q, k, v are bf16; ~3e-3): as fla's chunk_kda. M, A and the inverse X are formed in
    tf32 (their inputs carry e^{±40} scale factors, and X's error feeds every later product); X, A, W, U,
    Q' and KD are stored as bf16 (as fla stores them: half the traffic between the phases), and S and
    V_new are rounded to bf16 where they enter a dot, so every other dot is a bf16 tensor-core dot with
    f32 accumulation. The state S itself, the accumulators, O' (added to the output without a dot) and γ
    stay f32.

Reference: lingjax.ops.kda.kda_chunked (and kda_recurrent).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import pallas_call, resolve_interpret

SUB = 16  # phase 1a's sub-chunk rows (D)


@dataclasses.dataclass(frozen=True)
class _Prec:
    """How a precision name maps onto the dots: `solve` for M, A and X (always f32 operands), `dot` and
    `operand` (the dtype the other dots' operands, and their stored forms, are rounded to) for the rest."""
    solve: object
    dot: object
    operand: object = jnp.float32


PRECISIONS = {
    "tf32x3": _Prec(lax.DotAlgorithmPreset.TF32_TF32_F32_X3, lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
    "tf32": _Prec(lax.Precision.DEFAULT, lax.Precision.DEFAULT),
    "ieee": _Prec(lax.Precision.HIGHEST, lax.Precision.HIGHEST),
    "bf16": _Prec(lax.Precision.DEFAULT, lax.Precision.DEFAULT, jnp.bfloat16),
}


def default_precision(q, k, v) -> str:
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
                  out_ref, sf_ref,  # outputs
                  *, chunk, block_k, block_v, fuse_output, prec):
    # w_ref, qp_ref [H, T, K]; kd_ref [H, K, T]; u_ref, op_ref [H, T, V]; gl_ref [H, T/C, K]; s_ref [H, K, V]
    # -> out_ref: o [T, H, V] (fuse_output) or the state entering each chunk [H, T/C, K, V]; sf_ref [H, K, V]
    h, j = pl.program_id(0), pl.program_id(1)
    v0 = pl.ds(j * block_v, block_v)
    pieces = [pl.ds(p * block_k, block_k) for p in range(s_ref.shape[1] // block_k)]  # the state's K rows
    dot = functools.partial(_op_dot, prec=prec)

    def body(c, s):  # s: the state entering chunk c, as [BK, BV] f32 pieces
        t = pl.ds(c * chunk, chunk)
        if fuse_output:
            out_ref[t, h, v0] = sum(dot(qp_ref[h, t, kc], sp) for kc, sp in zip(pieces, s)) + op_ref[h, t, v0]
        else:
            for kc, sp in zip(pieces, s):
                out_ref[h, c, kc, v0] = sp
        v_new = u_ref[h, t, v0] - sum(dot(w_ref[h, t, kc], sp) for kc, sp in zip(pieces, s))  # [C, BV]
        return tuple(gl_ref[h, c, kc][:, None] * sp + dot(kd_ref[h, kc, t], v_new)
                     for kc, sp in zip(pieces, s))

    final = lax.fori_loop(0, w_ref.shape[1] // chunk, body, tuple(s_ref[h, kc, v0] for kc in pieces))
    for kc, sp in zip(pieces, final):
        sf_ref[h, kc, v0] = sp


def _output_kernel(qp_ref, op_ref, hs_ref, o_ref, *, chunk, block_v, prec):
    # qp_ref [H, T, K]; op_ref [H, T, V]; hs_ref [H, T/C, K, V] -> o_ref [T, H, V]
    h, c, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    t, v0 = pl.ds(c * chunk, chunk), pl.ds(j * block_v, block_v)
    o_ref[t, h, v0] = _op_dot(qp_ref[h, t, :], hs_ref[h, c, :, v0], prec=prec) + op_ref[h, t, v0]


def _call(kernel, grid, out_shape, *args, num_warps, num_stages, interpret, name):
    return pallas_call(kernel, grid=grid, out_shape=out_shape, interpret=interpret, name=name,
                       compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages))(*args)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "prepare_block_k", "blocks_warps", "num_warps",
                                             "num_stages", "precision", "interpret"))
def intra_chunk(q, k, v, g, beta, *, chunk: int = 64, block_k: int = 16, prepare_block_k: int = 64,
                blocks_warps: int = 1, num_warps: int = 4, num_stages: int = 2, precision: str | None = None,
                interpret=None):
    """Phases 1a and 1b on inputs padded to a multiple of `chunk`: (W, Q' [H, T, K]; U [H, T, V]; O'
    [H, T, V] f32; KDᵀ [H, K, T]; γ [H, T/C, K] f32), W, Q', U, KDᵀ in the precision's operand dtype.
    Split out so the bench can time phase 1 alone."""
    t, h, dk = k.shape
    dv = v.shape[-1]
    block_k, prepare_block_k = min(block_k, dk), min(prepare_block_k, dk, dv)
    assert t % chunk == 0 and chunk >= SUB and chunk & (chunk - 1) == 0, (t, chunk)
    assert dk % block_k == 0 and dk % prepare_block_k == 0 and dv % prepare_block_k == 0, (dk, dv)
    interpret = resolve_interpret(interpret)
    prec = _resolve(precision or default_precision(q, k, v), interpret)
    opts = dict(num_stages=num_stages, interpret=interpret)
    f32, op, nc = jnp.float32, prec.operand, t // chunk
    tc = jax.ShapeDtypeStruct((h, t, chunk), op)
    x, a = _call(functools.partial(_blocks_kernel, chunk=chunk, block_k=block_k, prec=prec), (h, nc), (tc, tc),
                 q, k, g, beta, name="kda_prefill_blocks", num_warps=blocks_warps, **opts)
    shapes = (jax.ShapeDtypeStruct((h, t, dk), op), jax.ShapeDtypeStruct((h, t, dv), op),
              jax.ShapeDtypeStruct((h, t, dk), op), jax.ShapeDtypeStruct((h, t, dv), f32),
              jax.ShapeDtypeStruct((h, dk, t), op), jax.ShapeDtypeStruct((h, nc, dk), f32))
    return _call(functools.partial(_prepare_kernel, chunk=chunk, block_k=prepare_block_k, prec=prec), (h, nc),
                 shapes, q, k, v, g, beta, x, a, name="kda_prefill_prepare", num_warps=num_warps, **opts)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "prepare_block_k", "state_block_k", "block_v",
                                             "fuse_output", "blocks_warps", "num_warps", "num_stages", "precision",
                                             "interpret"))
def kda_chunked_prefill(q, k, v, g, beta, state, chunk: int = 64, *, block_k: int = 16, prepare_block_k: int = 64,
                        state_block_k: int = 64, block_v: int = 32, fuse_output: bool = True, blocks_warps: int = 1,
                        num_warps: int = 4, num_stages: int = 2, precision: str | None = None, interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chunked: (o [T, H, V] f32, final state [H, K, V]).

    `chunk` (C, a power of two >= 16): the chunk of every phase (the gate must satisfy g > -8.6, see the
    module docstring). `precision`: a PRECISIONS name; None picks by the inputs' dtype (default_precision).
    Tiles: `block_k` / `prepare_block_k`: the column pieces of phases 1a / 1b; `state_block_k` x `block_v`:
    phase 2's state pieces (one program per head and V tile). Warps: `blocks_warps` for phase 1a (its D x D
    dots are replicated across warps by Triton's mma layout, so more warps only split the loads and exps),
    `num_warps` for the rest; `num_stages` for all. block_k = 16 with one warp in phase 1a took 8192 tokens
    in 1392 and 1337 µs where block_k = 32 with two took 1805 and 1734, each pair in one process on the
    H200 (bench/results/kda_h200x2_2026-11-30_run2.md). Padding rows (g = 0, beta = 0) leave the state as is,
    so T is padded up to a multiple of C here. Phase 2 at the defaults takes 144 KiB of shared memory with
    f32 operands (sm_90, Triton 3.9; num_stages=3 would exceed the H200's).
    """
    t_len, h, dk = k.shape
    dv = v.shape[-1]
    block_v, state_block_k = min(block_v, dv), min(state_block_k, dk)
    assert dv % block_v == 0 and dk % state_block_k == 0, (dk, dv, block_v, state_block_k)
    precision = precision or default_precision(q, k, v)
    pad = -t_len % chunk
    if pad:
        q, k, v, g, beta = (jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, k, v, g, beta))
    tp, nc = t_len + pad, (t_len + pad) // chunk
    w, u, qp, op, kd, gl = intra_chunk(q, k, v, g, beta, chunk=chunk, block_k=block_k,
                                       prepare_block_k=prepare_block_k, blocks_warps=blocks_warps,
                                       num_warps=num_warps, num_stages=num_stages, precision=precision,
                                       interpret=interpret)
    interpret = resolve_interpret(interpret)
    prec = _resolve(precision, interpret)
    opts = dict(num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    f32 = jnp.float32
    o_shape = jax.ShapeDtypeStruct((tp, h, dv), f32)
    states_shape = jax.ShapeDtypeStruct((h, nc, dk, dv), f32)  # the state entering each chunk
    out, final = _call(
        functools.partial(_state_kernel, chunk=chunk, block_k=state_block_k, block_v=block_v,
                          fuse_output=fuse_output, prec=prec), (h, dv // block_v),
        (o_shape if fuse_output else states_shape, jax.ShapeDtypeStruct((h, dk, dv), f32)),
        w, u, qp, op, kd, gl, state.astype(f32), name="kda_prefill_state", **opts)
    if not fuse_output:
        out = _call(functools.partial(_output_kernel, chunk=chunk, block_v=block_v, prec=prec),
                    (h, nc, dv // block_v), o_shape, qp, op, out, name="kda_prefill_output", **opts)
    return out[:t_len], final
