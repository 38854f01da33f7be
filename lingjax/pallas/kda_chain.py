"""Fused KDA chain-verify (decode at T = 1) in Pallas: the contract of lingjax.ops.kda.kda_chain.

One program per (head, group of `tiles_per_program` V tiles of BV columns), the T <= VERIFY_ROWS new
rows in a loop. Each program reads its committed state tiles [K, BV] once, recomputes the head's short
conv + SiLU, l2 norms, safe gate and beta (beta's logit x_t·b_proj[h] included), runs the gated delta
rule over the rows and writes the state after every row to `staged` and each output row to `o`.

Inputs are the layer's in_proj output and its input x on all the forward's rows (the first T real, the
rest padding the kernel never reads; it writes zeros to o there), the conv ring (lingjax.cache), whose
slots of the T new positions the kernel writes in place, and the committed state. Row j's results
depend on input rows 0..j, the window and the state alone, never on T or the row count (row invariance,
lingjax.model). BV sets the rounding of the K-reductions on the GPU, so a verify and a plain decode
match bit for bit only at one BV. Design and measurements: docs/kernels/kda.md.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.config import VERIFY_ROWS
from lingjax.pallas import is_pow2, pallas_call, pow2_tile, resolve_interpret

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class ChainTuning:
    """kda_chain_verify's launch shape (performance only; BV also fixes the GPU's rounding).
    block_v: V columns per tile (clamped to V); num_warps: per program; tiles_per_program: V tiles one
    program runs, their rows interleaved (clamped to V / block_v; V / block_v gives one program per head)."""
    block_v: int = 32
    num_warps: int = 4
    tiles_per_program: int = 1


def _state_tiles(s_ref, h, col0, block_v):
    """The program's committed state tiles [K, BV], as volatile loads (measured faster at T = 1:
    docs/kernels/kda.md)."""
    zero = jnp.int32(0)  # an array index: interpret mode does not take a Python int in a volatile load
    return [pltriton.load(s_ref.at[zero, h, :, pl.ds(c, block_v)], volatile=True) for c in col0]


def _head_and_tiles(tiles, block_v):
    """This program's head and the first V column of each of its tiles."""
    h, j = pl.program_id(0), pl.program_id(1)
    return h, [(j * tiles + i) * block_v for i in range(tiles)]


def _conv_silu(w, src):
    """SiLU of one row's short conv: w W x [n] conv weights, src the W pre-conv rows [n] f32, oldest first."""
    acc = w[0] * src[0]
    for wi, x in zip(w[1:], src[1:]):
        acc = acc + wi * x
    return acc * jax.nn.sigmoid(acc)


def _norm(x):  # eps inside the sqrt, as lingjax.ops.norms.l2norm
    return jnp.sqrt(jnp.sum(x * x) + 1e-6)


def _gate_beta(f, b, dtb, rate, *, safe_gate, lower_bound):
    """Row t's decay exp(g_t) [K] from f [K], and beta_t = sigmoid(b), the only sigmoid on beta."""
    x = f.astype(F32) + dtb
    g = lower_bound * jax.nn.sigmoid(rate * x) if safe_gate else -rate * jax.nn.softplus(x)
    return jnp.exp(g), jax.nn.sigmoid(b.astype(F32))


def _beta_logit(x_chunks, w_chunks, dtype):
    """Row t's b = x_t·b_proj[h] from the two rows' chunks: f32 products and sum, rounded once to x's
    dtype, as lingjax.ops.linear.dot_rows (the summation order differs, the rounding point does not)."""
    acc = x_chunks[0].astype(F32) * w_chunks[0].astype(F32)
    for a, w in zip(x_chunks[1:], w_chunks[1:]):
        acc = acc + a.astype(F32) * w.astype(F32)
    return jnp.sum(acc).astype(dtype)


def _chunks(n):
    """pl.ds slices covering [0, n) in power-of-2 pieces (Triton's blocks): D = 2560 in 5 of 512."""
    step = pow2_tile(n, 512)
    return [pl.ds(c, step) for c in range(0, n, step)]


def _chain_row(s, vs, decay, k, q, beta, qk, norms, *, st_ref, o_ref, t, h, col0, block_v):
    """One row of the gated delta rule on every V tile: s tiles x [K, BV] -> the new tiles, stored to
    st_ref[t] with the output row o_ref[t]; vs tiles x [BV]. q and k are the raw (conv + SiLU) rows and
    norms their divisors (|q|·K^1/2, |k|), applied after the sums against them; qk is the normalised q·k.
    With S' the decayed state, u = S'ᵀk and w = S'ᵀq are independent reductions, delta = beta (v - u),
    o = w + (q·k) delta and S = S' + k deltaᵀ."""
    kc, decay = k[:, None], decay[:, None]
    k_unit = kc / norms[1]  # the normalised k of the write
    new = []
    for si, v, c in zip(s, vs, col0):
        sd = si * decay  # decay rows
        u = jnp.sum(sd * kc, axis=0) / norms[1]  # [BV] predict
        w = jnp.sum(sd * q[:, None], axis=0) / norms[0]  # [BV] read of the decayed state, beside the predict
        delta = beta * (v - u)
        si = sd + k_unit * delta[None, :]  # delta write
        st_ref[t, h, :, pl.ds(c, block_v)] = si
        o_ref[t, h, pl.ds(c, block_v)] = w + qk * delta
        new.append(si)
    return new


def _zero_rows(o_ref, tokens, h, col0, block_v):
    """The output rows past T: zeros, so the caller needs no pad (one row per store, as the chain's)."""
    for t in range(tokens, o_ref.shape[0]):
        for c in col0:
            o_ref[t, h, pl.ds(c, block_v)] = jnp.zeros((block_v,), F32)


def _channels(h, col0, num_heads, dim, block_v):
    """(first column, width) of the conv channel blocks a program reads: its head's q and k, its v tiles."""
    p = num_heads * dim
    return [(h * dim, dim), (p + h * dim, dim)] + [(2 * p + h * dim + c, block_v) for c in col0]


def _ring_slot(start, offset, size):
    """The conv ring's slot of position start + offset, for start >= 0 and offset > -size."""
    return jax.lax.rem(start + (offset + size), size)


def _window_slots(start, width, size):
    """The ring slots of the W-1 positions before start, oldest first: the conv window's rows."""
    return [_ring_slot(start, r - (width - 1), size) for r in range(width - 1)]


def _ring_store(ring_out, start, t, chans, rows, lead):
    """Row t's pre-conv inputs (rows: one per channel block of `chans`, q and k first) into the slot of
    position start + t: every program its v tiles, the head's first program (lead) its q and k."""
    slot = _ring_slot(start, t, ring_out.shape[0])
    for (c0, n), x in list(zip(chans, rows))[2:]:
        ring_out[slot, pl.ds(c0, n)] = x.astype(ring_out.dtype)

    @pl.when(lead)
    def _():
        for (c0, n), x in list(zip(chans, rows))[:2]:
            ring_out[slot, pl.ds(c0, n)] = x.astype(ring_out.dtype)


def _chain_kernel(proj_ref, x_ref, wb_ref, ring_ref, start_ref, convw_ref, alog_ref, dtb_ref, s_ref,  # inputs
                  o_ref, st_ref, ring_out,  # outputs
                  *, tokens, num_heads, dim, block_v, tiles, safe_gate, lower_bound):
    # proj_ref [rows, >=4P] (q|k|v columns [0, 3P), f [3P, 4P)); x_ref [rows, D]; wb_ref [H, D] (b_proj);
    # ring_ref [N, 3P] (aliased by ring_out); start_ref [1] int32; convw_ref [3P, W] f32; alog_ref [H];
    # dtb_ref [P]; s_ref [1, H, K, V] f32
    # -> o_ref [rows, H, V] f32; st_ref [T, H, K, V] f32, T = tokens. Input rows >= T are never read.
    # The rows run in a fori_loop: one row body whatever T, the conv window carried, and the next row's
    # global reads issued before this row's reductions.
    h, col0 = _head_and_tiles(tiles, block_v)
    s0 = _state_tiles(s_ref, h, col0, block_v)  # tiles x [K, BV]
    p, width = num_heads * dim, convw_ref.shape[1]
    start, slots, lead = start_ref[0], ring_ref.shape[0], pl.program_id(1) == 0
    chans = _channels(h, col0, num_heads, dim, block_v)  # q, k, v tiles

    x_cols = _chunks(x_ref.shape[1])

    def reads(t):  # row t's global reads: pre-conv q, k, v tiles, f, and x (for b)
        return ([proj_ref[t, pl.ds(c0, n)] for c0, n in chans], proj_ref[t, pl.ds(3 * p + h * dim, dim)],
                [x_ref[t, c] for c in x_cols])

    win0 = [[ring_ref[r, pl.ds(c0, n)].astype(F32) for r in _window_slots(start, width, slots)] for c0, n in chans]
    first = reads(0)
    wb = [wb_ref[h, c] for c in x_cols]
    conv_w = [[convw_ref[pl.ds(c0, n), i] for i in range(width)] for c0, n in chans]
    rate = jnp.exp(alog_ref[h].astype(F32))
    dtb = dtb_ref[pl.ds(h * dim, dim)].astype(F32)

    def row(t, carry):
        s, win, (x_t, f_t, xb_t) = carry
        nxt = reads(jnp.minimum(t + 1, tokens - 1))  # the last row re-reads itself, unused
        b_t = _beta_logit(xb_t, wb, x_ref.dtype)
        src = [rows + [x.astype(F32)] for rows, x in zip(win, x_t)]
        q, k, *vs = [_conv_silu(w, x) for w, x in zip(conv_w, src)]
        norms = (_norm(q) * dim**0.5, _norm(k))  # q's carries the dim^-1/2 scale
        decay, beta = _gate_beta(f_t, b_t, dtb, rate, safe_gate=safe_gate, lower_bound=lower_bound)
        qk = jnp.sum(q * k) / norms[0] / norms[1]
        s = _chain_row(s, vs, decay, k, q, beta, qk, norms, st_ref=st_ref, o_ref=o_ref, t=t, h=h, col0=col0,
                       block_v=block_v)
        _ring_store(ring_out, start, t, chans, x_t, lead)
        return s, [x[1:] for x in src], nxt

    jax.lax.fori_loop(0, tokens, row, (s0, win0, first))
    _zero_rows(o_ref, tokens, h, col0, block_v)


def _tiles(dv: int, tuning: ChainTuning) -> tuple[int, int]:
    """(BV, tiles per program) after clamping to V."""
    block_v = min(tuning.block_v, dv)
    return block_v, min(tuning.tiles_per_program, dv // block_v)


def supports(proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state, *, tokens, num_heads, safe_gate,
             lower_bound, tuning: ChainTuning = ChainTuning(), in_place: bool = True, interpret=None) -> str | None:
    """None when kda_chain_verify takes these arguments and lowers to Triton (only .shape and .dtype are
    read), else the reason: the kernel's blocks (a head's K and its V tiles) need power-of-2 sizes."""
    h, dk, dv = state.shape
    if not 1 <= tokens <= min(proj.shape[0], VERIFY_ROWS):
        return f"chain-verify takes 1..{VERIFY_ROWS} tokens of the {proj.shape[0]} rows, not {tokens}"
    if dk != dv:
        return f"chain-verify needs equal key and value head dims, not {dk} and {dv}"
    if not is_pow2(dk):
        return f"KDA head dim {dk} is not a power of 2, as a Triton block must be"
    block_v, tiles = _tiles(dv, tuning)
    if not is_pow2(block_v) or dv % (block_v * tiles):
        return f"V tiles of {block_v} columns, {tiles} per program, do not split the head dim {dv}"
    return None


@functools.partial(jax.jit, static_argnames=("tokens", "num_heads", "safe_gate", "lower_bound", "tuning", "in_place",
                                             "interpret"))
def kda_chain_verify(proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state, *, tokens, num_heads, safe_gate,
                     lower_bound, tuning: ChainTuning = ChainTuning(), in_place: bool = True, interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chain: (o [rows, H, V] f32, zero past row
    `tokens`; staged [tokens, H, K, V] f32; the ring [N, 3P] with the rows' conv inputs written, in place:
    the output aliases `ring`, so where the ring is not donated XLA copies it first).
    in_place (T = 1 only): staged aliases the state, which the kernel overwrites (each program reads its
    [K, BV] tiles whole before its one write), so a loop carrying the state (the model's decode) needs no
    copy; where the state is not donated XLA copies it first (pass False for a loop-invariant state)."""
    rows = proj.shape[0]
    h, dk, dv = state.shape
    assert 1 <= tokens <= min(rows, VERIFY_ROWS), f"chain-verify takes 1..{VERIFY_ROWS} of {rows} rows, not {tokens}"
    assert x.shape[0] == rows and b_proj.shape == (h, x.shape[1]), (x.shape, b_proj.shape, proj.shape)
    assert h == num_heads and dk == dv and proj.shape[1] >= 4 * h * dk, (proj.shape, state.shape)
    width = conv_w.shape[1]
    assert ring.ndim == 2 and ring.shape[1] == 3 * h * dk and ring.shape[0] >= tokens + width - 1, (ring.shape, tokens)
    block_v, tiles = _tiles(dv, tuning)
    assert dv % (block_v * tiles) == 0, (dv, block_v, tiles)
    kernel = functools.partial(_chain_kernel, tokens=tokens, num_heads=h, dim=dk, block_v=block_v, tiles=tiles,
                               safe_gate=safe_gate, lower_bound=lower_bound)
    return pallas_call(
        kernel,
        grid=(h, dv // (block_v * tiles)),
        out_shape=(jax.ShapeDtypeStruct((rows, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, h, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct(ring.shape, ring.dtype)),
        # the ring always (its slots past the rows keep their contents); the state at T = 1 if in_place
        input_output_aliases={3: 2, **({8: 1} if in_place and tokens == 1 else {})},
        compiler_params=pltriton.CompilerParams(num_warps=tuning.num_warps, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="kda_chain_verify",
    )(proj, x, b_proj, ring, jnp.asarray(start, jnp.int32).reshape(1), conv_w.astype(jnp.float32), a_log, dt_bias,
      state.astype(jnp.float32)[None])
