"""Fused KDA chain-verify (and decode, T=1) in Pallas, plus the on-device commit.

One program per (head, group of `tiles_per_program` V tiles of BV columns). Each program reads its
committed state tiles [K, BV] once, recomputes the short conv + SiLU, the l2norms, the safe gate and
beta for its head (cheap, V-independent, so duplicated per program), runs the gated delta rule over
the T <= 16 new rows and writes the state after every row to `staged` and the output row to `o`.
Every K-reduction is over the whole K axis of one tile, so BV does not change the sum mathematically; on
the H200 the bits differ in the last place between BV16 and BV32 (the reduction tree follows the
register layout, which BV sets), so the speculative step and plain decode must use one BV.

The inputs are the layer's in_proj output and its input x on all the forward's rows (lingjax.model: a
decode/verify forward runs the projections on 16 zero-padded rows, the first T = `tokens` real), and
the b_proj weight. The kernel reads q|k|v and f of the T real rows in place, at their column offsets,
computes beta's logit b_t = x_t·b_proj[h] itself (a 2560-long dot per row and program, beside the
state's reads: XLA's own launch for b, a reduction fusion, cost ~2.5 µs and a gap per KDA layer), and
writes zeros to the output rows past T: slicing the inputs and padding `o` in XLA cost four small
kernels around every KDA layer's call. Row j's results (o[j], staged[j]) depend on input rows 0..j,
the window and the state alone, never on T or the row count (row invariance, see lingjax.model).

The conv window comes from the layer's conv ring (lingjax.cache: position p's pre-conv input in slot
p mod N, N >= T + W - 1) at the slots of the W-1 positions before `start`, and the kernel writes each
row's pre-conv input into its position's slot, in place: those slots are never the window's, so no
program reads what another writes. A decode step thus moves no window (XLA's gather of the new window and
its copy into the carried cache were 2 launches per KDA layer), and a verify leaves nothing to commit
but the accepted state.

Each program is a serial chain (T rows, a few cross-warp reductions each) and, at H = 32 and
BV <= 32, all programs are resident at once, so the time is one program's latency. Options of
kda_chain_verify that shorten that chain (hoist_loads and parallel_read are on by default: on an H200,
bench/results/kda_h200_2026-11-29.md, they took T = 1/6/16 from 9.3/17.1/47.5 µs to 7.5/13.2/45.8):
- hoist_loads: issue every global read (state tiles, the T rows of q|k|v, f and b, window, conv weights)
  before the first reduction, and derive the per-row gate, beta and q.k before the row chain.
  Otherwise each row's f/b loads sit behind the previous row's reductions (an sm_90 compile of the
  first version has LDGs between each row's bar.syncs), so every row paid a DRAM round trip:
  the measured 1.6-2.6 us per extra row.
- parallel_read: with S' = diag(exp g_t) S_{t-1}, take u = S'^T k and w = S'^T q as two independent
  reductions of S', then delta = beta (v - u), o_t = w + (q.k) delta, S_t = S' + k delta^T. The
  read no longer waits for the write: one reduction per row leaves the serial chain (rounding
  differs from the reference's order in the last bits).
- tiles_per_program: V tiles per program, their independent chains interleaved row by row; the
  head's prologue (conv, norms, gate) is computed once per program instead of once per tile, and
  tiles_per_program = V / BV gives one program per head (more registers: spills at large T).
- row_loop: the rows in a fori_loop (_chain_loop_kernel) instead of unrolled: one compiled row body,
  the conv window carried, each row's prologue inside the loop and the next row's reads issued ahead
  of it. The unrolled kernel's rows past the eighth cost ~3.9 µs each; issuing the reads and prologue
  in blocks of rows did not change that, the loop's one row body did (~1.5 µs a row), so the cause is
  the unrolled code itself, probably its size. The loop is the default at every T: since beta's dot moved
  into the kernel, the unrolled kernel, which holds every row's x (T x 2560 values) from its hoisted
  reads, took T = 4 / 6 in 12.6 / 19.5 µs against the loop's 11.9 / 15.7 (one process on an H200,
  bench/results/kda_h200x2_2026-11-30_run4.md; before, the unrolled kernel was the faster at T = 2..8).
  The two compute bit-identical rows on the H200 (BV16: T = 1, 4, 6, 10, 16; BV32: T = 1, 4, 6, again
  with beta's dot and the ring), so a verify of any width matches plain decode. (In interpret mode on the
  CPU they differ in the last bits.)
- deferred_norms: the predict, the read and q.k are summed against the raw (conv + SiLU) q and k and
  divided by the norms after, so the norms' reductions run beside the state's instead of ahead of them:
  one reduction less on each row's critical path (the whole chain at T = 1, every row in the loop).
  Equal to the reference up to rounding order. On by default: in one process on an H200 it was as fast or
  faster in 10 of 11 variant x T pairs, by 0.1-0.8 µs (the default kernels: T = 4 / 6 / 16 in 9.89 / 12.49 /
  27.91 µs against 10.08 / 12.50 / 28.68; at T = 1 6.26 against 5.82, but the same loop kernel timed as its
  own variant gave 6.34 against 6.35: the spread there is ±0.5 µs), and the row loop and the unrolled
  kernel stay bit-identical with it
  (bench/results/kda_h200x2_2026-11-30_run3.md).

Defaults (bench/results/kda_h200x2_2026-11-30_run2.md: every variant in one process, interleaved rounds,
bench/kda_chain_ab.py): BV32 (128 programs at H = 32, one per SM) with 4 warps, T = 1 / 4 / 6 / 16 in
6.1 / 9.9 / 12.4 / 28.3 µs against BV16's best kernel's 6.8 / 10.4 / 12.6 / 28.9; 2 or 8 warps are slower.
Taking a row's independent sums in one reduction (Triton's join; 5 reductions a row to 2) measured no
faster and was removed. Where the time goes at T = 1 (ncu's warp-state samples, bench/ncu_kernels.py;
bench/results/kda_h200_2026-12-01.md): each program runs ~900 instructions a warp in ~3 µs, most of the
stall samples waiting on global loads (the state's, issued after the prologue, and the window's, behind
`start`'s); the kernel's 4.7 µs also hold ~2 µs of launch and drain that fla's kernel shows as well.

Reference: lingjax.ops.kda.kda_chain (math in ling3_architecture.md §3).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.config import VERIFY_ROWS
from lingjax.pallas import pallas_call, pow2_tile, resolve_interpret

F32 = jnp.float32


def _state_tiles(s_ref, h, col0, block_v):
    """The program's committed state tiles [K, BV], as volatile loads: on the H200 the T = 1 kernel took
    4.70-4.74 µs with them against 4.96-5.02 with plain loads (ncu, 29 launches each, three calls), and
    ~0.2 µs less in a timed loop too; T = 4, 6, 16 unchanged, results bit-identical (bench/results/kda_h200_2026-12-01.md).
    Why is not settled: the sm_90 code issues the state's loads at the same place, after the prologue, as
    strong loads."""
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


def _l2norm(x):  # eps inside the sqrt, as lingjax.ops.norms.l2norm
    return x / _norm(x)


def _norm(x):
    return jnp.sqrt(jnp.sum(x * x) + 1e-6)


def _q_k(q_conv, k_conv, dim, deferred_norms):
    """Row t's q (scaled by dim^-1/2) and k as the chain takes them: l2-normalised, norms None; or, with
    deferred_norms, raw, with the divisors (|q|·dim^1/2, |k|) that _chain_row applies after its sums."""
    if not deferred_norms:
        return _l2norm(q_conv) * dim**-0.5, _l2norm(k_conv), None
    return q_conv, k_conv, (_norm(q_conv) * dim**0.5, _norm(k_conv))


def _qk(q, k, norms):
    """q·k of the normalised row (parallel_read's o = w + (q·k) delta)."""
    return jnp.sum(q * k) if norms is None else jnp.sum(q * k) / norms[0] / norms[1]


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


def _chain_row(s, vs, decay, k, q, beta, qk, *, st_ref, o_ref, t, h, col0, block_v, norms=None):
    """One row of the gated delta rule on every V tile: s tiles x [K, BV] -> the new tiles, stored to
    st_ref[t] with the output row o_ref[t]; vs tiles x [BV]. qk None: read the written state.
    norms (deferred_norms): q and k are raw and the sums against them are divided by (q's, k's) norms
    after, so the norms' reductions run beside the state's instead of before them; qk is then already
    normalised."""
    # [:, None] here, not in the prologue: T rows x 3 vectors broadcast into the tile's layout ahead of
    # the unrolled chain spill registers at T = 16; the compact 1-D vectors do not
    def unit(x, i):  # x against raw q (i = 0) or k (i = 1) divided by that norm; as is without norms
        return x if norms is None else x / norms[i]

    kc, decay = k[:, None], decay[:, None]
    k_unit = unit(kc, 1)  # the normalised k of the write
    new = []
    for si, v, c in zip(s, vs, col0):
        sd = si * decay  # decay rows
        u = unit(jnp.sum(sd * kc, axis=0), 1)  # [BV] predict
        if qk is not None:
            w = unit(jnp.sum(sd * q[:, None], axis=0), 0)  # [BV] read of the decayed state, beside the predict
        delta = beta * (v - u)
        si = sd + k_unit * delta[None, :]  # delta write
        st_ref[t, h, :, pl.ds(c, block_v)] = si
        o = w + qk * delta if qk is not None else unit(jnp.sum(si * q[:, None], axis=0), 0)
        o_ref[t, h, pl.ds(c, block_v)] = o
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
                  *, tokens, num_heads, dim, block_v, tiles, hoist_loads, safe_gate, lower_bound, parallel_read,
                  deferred_norms):
    # proj_ref [rows, >=4P] (q|k|v columns [0, 3P), f [3P, 4P)); x_ref [rows, D]; wb_ref [H, D] (b_proj);
    # ring_ref [N, 3P] (aliased by ring_out); start_ref [1] int32; convw_ref [3P, W] f32; alog_ref [H];
    # dtb_ref [P]; s_ref [1, H, K, V] f32
    # -> o_ref [rows, H, V] f32; st_ref [T, H, K, V] f32, T = tokens. Input rows >= T are never read.
    h, col0 = _head_and_tiles(tiles, block_v)
    p, width = num_heads * dim, convw_ref.shape[1]
    start, slots, lead = start_ref[0], ring_ref.shape[0], pl.program_id(1) == 0
    chans = _channels(h, col0, num_heads, dim, block_v)

    def early(fn):  # fn's result: computed here when hoisting, else once, where it is first used
        if hoist_loads:
            x = fn()
            return lambda: x
        return functools.cache(fn)

    # ---- reads (issued here, in this order, when hoisting)
    s_tiles = early(lambda: _state_tiles(s_ref, h, col0, block_v))  # tiles x [K, BV]

    def channels(c0, n):  # conv weights W x [n] f32 and the W-1+T pre-conv input rows [n] of channels [c0, c0+n)
        return (early(lambda: [convw_ref[pl.ds(c0, n), i] for i in range(width)]),
                [early(lambda r=r: ring_ref[r, pl.ds(c0, n)]) for r in _window_slots(start, width, slots)]
                + [early(lambda t=t: proj_ref[t, pl.ds(c0, n)]) for t in range(tokens)])

    q_in, k_in, *v_in = [channels(c0, n) for c0, n in chans]
    f_in = [early(lambda t=t: proj_ref[t, pl.ds(3 * p + h * dim, dim)]) for t in range(tokens)]  # T x [K]
    x_cols = _chunks(x_ref.shape[1])
    wb_in = early(lambda: [wb_ref[h, c] for c in x_cols])
    b_in = [early(lambda t=t: _beta_logit([x_ref[t, c] for c in x_cols], wb_in(), x_ref.dtype))
            for t in range(tokens)]
    alog_in, dtb_in = early(lambda: alog_ref[h]), early(lambda: dtb_ref[pl.ds(h * dim, dim)])

    # ---- prologue: everything that does not depend on the state
    def conv_silu(chan):  # rows t of SiLU(conv): T x [n]
        w_in, src_in = chan
        w, src = w_in(), [x().astype(F32) for x in src_in]
        return [_conv_silu(w, src[t:t + width]) for t in range(tokens)]

    # In this order (every row's q, then every row's k, v, then gate, beta and q.k per row) T = 6 measured
    # 0.7 µs faster on the H200 than with each row's norms and gate together (the row loop's order).
    if deferred_norms:
        qks = [_q_k(q, k, dim, True) for q, k in zip(conv_silu(q_in), conv_silu(k_in))]
        qs, ks, norms = [x[0] for x in qks], [x[1] for x in qks], [x[2] for x in qks]
    else:
        qs = [_l2norm(x) * dim**-0.5 for x in conv_silu(q_in)]  # T x [K]
        ks = [_l2norm(x) for x in conv_silu(k_in)]  # T x [K]
        norms = [None] * tokens
    vs = [conv_silu(c) for c in v_in]  # tiles x T x [BV]
    rate = early(lambda: jnp.exp(alog_in().astype(F32)))
    dtb = early(lambda: dtb_in().astype(F32))
    rows = [early(lambda t=t: (*_gate_beta(f_in[t](), b_in[t](), dtb(), rate(), safe_gate=safe_gate,
                                           lower_bound=lower_bound),
                               _qk(qs[t], ks[t], norms[t]) if parallel_read else None)) for t in range(tokens)]

    # ---- the chain: T rows, the tiles' independent chains interleaved
    s = s_tiles()
    for t in range(tokens):
        decay, beta, qk = rows[t]()
        s = _chain_row(s, [v[t] for v in vs], decay, ks[t], qs[t], beta, qk, st_ref=st_ref, o_ref=o_ref, t=t,
                       h=h, col0=col0, block_v=block_v, norms=norms[t])
    for t in range(tokens):
        _ring_store(ring_out, start, t, chans, [src[width - 1 + t]() for _, src in [q_in, k_in, *v_in]], lead)
    _zero_rows(o_ref, tokens, h, col0, block_v)


def _chain_loop_kernel(proj_ref, x_ref, wb_ref, ring_ref, start_ref, convw_ref, alog_ref, dtb_ref, s_ref,  # inputs
                       o_ref, st_ref, ring_out,  # outputs
                       *, tokens, num_heads, dim, block_v, tiles, safe_gate, lower_bound, parallel_read,
                       deferred_norms):
    # The same contract as _chain_kernel, the rows in a fori_loop: one compiled row body whatever T, the
    # conv window carried, and the next row's global reads issued before this row's reductions.
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
        q_conv, k_conv, *vs = [_conv_silu(w, x) for w, x in zip(conv_w, src)]
        q, k, norms = _q_k(q_conv, k_conv, dim, deferred_norms)
        decay, beta = _gate_beta(f_t, b_t, dtb, rate, safe_gate=safe_gate, lower_bound=lower_bound)
        s = _chain_row(s, vs, decay, k, q, beta, _qk(q, k, norms) if parallel_read else None, st_ref=st_ref,
                       o_ref=o_ref, t=t, h=h, col0=col0, block_v=block_v, norms=norms)
        _ring_store(ring_out, start, t, chans, x_t, lead)
        return s, [x[1:] for x in src], nxt

    jax.lax.fori_loop(0, tokens, row, (s0, win0, first))
    _zero_rows(o_ref, tokens, h, col0, block_v)


@functools.partial(jax.jit, static_argnames=("tokens", "num_heads", "safe_gate", "lower_bound", "block_v",
                                             "num_warps", "hoist_loads", "parallel_read", "tiles_per_program",
                                             "row_loop", "deferred_norms", "in_place", "interpret"))
def kda_chain_verify(proj, x, b_proj, ring, start, conv_w, a_log, dt_bias, state, *, tokens, num_heads, safe_gate,
                     lower_bound,
                     block_v: int = 32, num_warps: int = 4, hoist_loads: bool = True,
                     parallel_read: bool = True, tiles_per_program: int = 1, row_loop: bool = True,
                     deferred_norms: bool = True, in_place: bool = True, interpret=None):
    """Same arguments and results as lingjax.ops.kda.kda_chain: (o [rows, H, V] f32, zero past row
    `tokens`; staged [tokens, H, K, V] f32; the ring [N, 3P] with the rows' conv inputs written, in place:
    the output aliases `ring`, so where the ring is not donated XLA copies it first). block_v: V columns
    per tile; tiles_per_program (clamped to
    V / block_v), hoist_loads (unrolled kernel only), parallel_read, row_loop (False: the unrolled kernel):
    see the module docstring. in_place (T = 1 only): staged aliases the state, which
    the kernel overwrites (each program reads its [K, BV] tile whole, for the row's reductions, before its
    one write), so under a loop carrying the state (the model's decode) the new state needs no copy; where
    the state is not donated XLA copies it first (the benches' loop-invariant inputs: they pass False)."""
    rows = proj.shape[0]
    h, dk, dv = state.shape
    assert 1 <= tokens <= min(rows, VERIFY_ROWS), f"chain-verify takes 1..{VERIFY_ROWS} tokens of {rows} rows, got {tokens}"
    assert x.shape[0] == rows and b_proj.shape == (h, x.shape[1]), (x.shape, b_proj.shape, proj.shape)
    assert h == num_heads and dk == dv and proj.shape[1] >= 4 * h * dk, (proj.shape, state.shape)
    width = conv_w.shape[1]
    assert ring.ndim == 2 and ring.shape[1] == 3 * h * dk and ring.shape[0] >= tokens + width - 1, (ring.shape, tokens)
    block_v = min(block_v, dv)
    tiles = min(tiles_per_program, dv // block_v)
    assert dv % (block_v * tiles) == 0, (dv, block_v, tiles)
    cfg = dict(tokens=tokens, num_heads=h, dim=dk, block_v=block_v, tiles=tiles, safe_gate=safe_gate,
               lower_bound=lower_bound, parallel_read=parallel_read, deferred_norms=deferred_norms)
    if row_loop:
        kernel = functools.partial(_chain_loop_kernel, **cfg)
    else:
        kernel = functools.partial(_chain_kernel, hoist_loads=hoist_loads, **cfg)
    return pallas_call(
        kernel,
        grid=(h, dv // (block_v * tiles)),
        out_shape=(jax.ShapeDtypeStruct((rows, h, dv), jnp.float32),
                   jax.ShapeDtypeStruct((tokens, h, dk, dv), jnp.float32),
                   jax.ShapeDtypeStruct(ring.shape, ring.dtype)),
        # the ring always (its slots past the rows keep their contents); the state at T = 1 if in_place
        input_output_aliases={3: 2, **({8: 1} if in_place and tokens == 1 else {})},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="kda_chain_verify",
    )(proj, x, b_proj, ring, jnp.asarray(start, jnp.int32).reshape(1), conv_w.astype(jnp.float32), a_log, dt_bias,
      state.astype(jnp.float32)[None])


def _commit_kernel(n_ref, st_ref, s_out, *, block_k):
    # n_ref [1] int32; st_ref [T, H, K, V] f32 -> s_out [H, K, V]
    h, i = pl.program_id(0), pl.program_id(1)
    rows = pl.ds(i * block_k, block_k)
    s_out[h, rows, :] = st_ref[n_ref[0], h, rows, :]


@functools.partial(jax.jit, static_argnames=("block_k", "interpret"))
def kda_commit(staged, n, *, block_k: int = 32, interpret=None):
    """Commit the accepted row's state: staged [T, H, K, V], n int32 device scalar = accepted count - 1
    -> staged[n] [H, K, V], one launch. n = 0 is the zero-accept commit (state after the first row),
    n = T-1 all-accept. The conv ring needs no commit (lingjax.cache)."""
    _, h, dk, dv = staged.shape
    block_k = min(block_k, dk)
    assert dk % block_k == 0
    return pallas_call(
        functools.partial(_commit_kernel, block_k=block_k),
        grid=(h, dk // block_k),
        out_shape=jax.ShapeDtypeStruct(staged.shape[1:], staged.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1),
        interpret=resolve_interpret(interpret),
        name="kda_commit",
    )(jnp.asarray(n, jnp.int32).reshape(1), staged)


def kda_commit_reference(staged, n):
    """The same commit as XLA's dynamic slice."""
    return jax.lax.dynamic_index_in_dim(staged, n, keepdims=False)
