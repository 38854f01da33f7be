"""Routed experts at batch 1: pair-axis align, grouped up-GEMM with a SwiGLU epilogue, down-GEMM + combine.

`fused_experts` replaces `lingjax.ops.moe.experts_gathered` (same arguments, same [T, D] f32 result):
  1. moe_align (lingjax/pallas/moe_align.py) sorts the T·k (token, slot) pairs into blocks of `block_m`
     rows that share one expert (one launch on the pair axis for NP ≤ 64, sort-based above; at T = 1
     no launch: each pair is its own block, see _single_token_slots).
  2. Up kernel, grid (block, I tile): rows gathered from x by token (at T = 1 x's one row, broadcast), gate
     and up tiles read from the two [E, I, D] arrays in the same K loop, h = act(g, u) in f32 and rounded once
     to x's dtype.
  3. Down kernel, grid (block, D tile): y = h · W_downᵀ in f32, times the pair's routing weight, stored
     to the pair's own row; the k rows of a token are summed in f32 in slot order, one small XLA fusion
     (a reduce's order changed with T on the H200: a decode's row must equal its verify's).
Each block holds one expert and, for T·k ≤ 64 at block_m ≥ T, a bucket never spans two blocks, so every
touched expert's weights are read exactly once per call. Unused blocks (past the published total) exit
at once. Padding rows point at a spare row NP of the pair buffer, so no store needs a mask.

`routed_experts` replaces `lingjax.ops.moe.routed_experts` (routing included): at T = 1 the up kernel's
programs route the token themselves from the router's partial logits, so a decode has no select launch.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import dot_nt, pallas_call, pow2_tile, reads_one_row, resolve_interpret, x_rows

from lingjax.ops.moe import experts_gathered  # the reference
from lingjax.pallas.l2_prefetch import lines_per_program, prefetch_share
from lingjax.pallas.moe_align import BLOCK_M, moe_align, n_blocks_for
from lingjax.pallas.moe_router import (check_routing, partial_logits, route, token_expert, token_logits,
                                      token_routing)

F32 = jnp.float32
# Shared memory a pipelined K loop may take on an H200 (232448 B per block), less room for the rest of
# the kernel: Triton keeps num_stages - 1 tiles of each operand in flight.
SHARED_MEMORY_BUDGET = 200 * 1024
MIN_DOT_ROWS = 16  # a Triton dot's smallest tile dimension
# The decode's shared expert on twice the up programs at half width (see _expert_launches): on the H200, with
# the routed programs ranking only their own expert, the T = 1 layer 0.2-0.7 µs faster at I = 768 and 384
# (two processes; bench/results/moe_h200_2026-12-01_run6.md)
SHARED_SPLIT = 2


def _stages_within(want: int, per_stage_bytes: int) -> int:
    """At most `want` pipeline stages whose buffers fit SHARED_MEMORY_BUDGET (at least 1): the default
    tiles fit bf16 operands at 5 stages, f32 operands (parity runs) at 3."""
    return max(1, min(want, 1 + SHARED_MEMORY_BUDGET // per_stage_bytes))


def _swiglu(g, u, limit):
    act = g / (1.0 + jnp.exp(-g))  # SiLU in f32
    if limit:
        act = jnp.minimum(act, limit)
        u = jnp.clip(u, -limit, limit)
    return act * u


def _up_kernel(plan_ref, blk_ref, x_ref, wg_ref, wu_ref, *rest, nb, tokens, top_k, block_m, bn, bk, limit,
               shared_limit, routing, x_row, shared_split, prefetch_lines):
    # plan_ref [S] int32 (pair per slot, NP = padding); blk_ref [≥ NB] int32 (expert per block, −1 unused)
    # x_ref [R ≥ T, D] (rows past T unread); wg_ref, wu_ref [E, I, D]; optional shared sg_ref, su_ref [I, D];
    # h_ref [S (+ shared blocks · BM), I] in x's dtype.
    # With `routing` (T = 1): plan_ref holds the router's partial logits [KS, 1, E] and blk_ref its bias [E];
    # block b's program selects the token's b-th expert itself, and one program publishes the routing, w_ref
    # [1, k] f32 and e_ref [1, k] int32, for the down kernel.
    # shared_split (T = 1): the shared expert's rows over shared_split times the programs, bn / shared_split wide.
    # prefetch_lines (T = 1, with a shared expert): lines of the shared gate and up weights each routed program
    # pulls into L2 before it selects.
    if routing:
        *shared, h_ref, w_ref, e_ref = rest
    else:
        *shared, h_ref = rest
    b, n = pl.program_id(0), pl.program_id(1)
    npairs = tokens * top_k
    cols = pl.ds(n * bn, bn)

    def block(tok, slots, cols, wg, wu, lim):  # tok [BM] token rows; wg, wu: ks -> [cols, BK] weight tiles
        def step(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            xs = x_rows(x_ref, tok, ks, x_row)  # [BM, BK] gathered rows (T = 1: x's one row, broadcast)
            return acc[0] + dot_nt(xs, wg(ks)), acc[1] + dot_nt(xs, wu(ks))  # gate, up: same K step

        zero = jnp.zeros((block_m, cols.size), F32)
        g, u = jax.lax.fori_loop(0, x_ref.shape[1] // bk, step, (zero, zero))
        h_ref[slots, cols] = _swiglu(g, u, lim).astype(h_ref.dtype)  # the one rounding

    slots = pl.ds(b * block_m, block_m)
    if routing:
        @pl.when(b < nb)
        def _():
            logits, bias = token_logits(plan_ref, 0), blk_ref[...]
            # DRAM would idle while these programs select: once their own loads are issued, they pull the shared
            # expert's gate and up weights into L2 for the shared programs (lingjax.pallas.l2_prefetch)
            for ref in shared:
                prefetch_share(ref, b * pl.num_programs(1) + n, prefetch_lines)
            expert = token_expert(logits, bias, b, **dict(routing))
            tok = jnp.zeros((block_m,), jnp.int32)
            block(tok, slots, cols, lambda ks: wg_ref[expert, cols, ks], lambda ks: wu_ref[expert, cols, ks], limit)
    else:
        e = blk_ref[jnp.minimum(b, nb - 1)]

        @pl.when((b < nb) & (e >= 0))
        def _():
            rows = plan_ref[pl.ds(b * block_m, block_m)]  # [BM]
            tok = jnp.minimum(rows, npairs - 1) // top_k  # padding rows reuse a real token, never stored later
            block(tok, slots, cols, lambda ks: wg_ref[e, cols, ks], lambda ks: wu_ref[e, cols, ks], limit)

    if shared:
        sg_ref, su_ref = shared

        @pl.when(b >= nb)
        def _():
            if shared_split > 1:  # T = 1: program (nb + j, n) takes rows j·I/split + n·bn/split of the one block
                width = bn // shared_split
                rows = pl.ds((b - nb) * (h_ref.shape[1] // shared_split) + n * width, width)
                out, tok = pl.ds(nb * block_m, block_m), jnp.zeros((block_m,), jnp.int32)
            else:
                rows, out = cols, slots
                tok = jnp.minimum((b - nb) * block_m + jnp.arange(block_m), tokens - 1)
            block(tok, out, rows, lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], shared_limit)

    if routing:
        # the routing, for the down kernel: published by the first shared program after its tile (the shared
        # programs end ~2.5 µs before the routed ones, which select first), or, without a shared expert, by
        # block 0's first program
        @pl.when((b == (nb if shared else 0)) & (n == 0))
        def _():
            w_ref[...], e_ref[...] = token_routing(plan_ref, blk_ref, 0, **dict(routing))


def _down_kernel(ids_ref, blk_ref, w_ref, h_ref, wd_ref, *rest, nb, npairs, block_m, bn, bk, has_shared):
    # ids_ref [S] int32; blk_ref [≥ NB] int32; w_ref [≥ NP] f32 routing weight per pair
    # h_ref [S (+ shared), I]; wd_ref [E, D, I]; optional shared sd_ref [D, I]; optional aliased y_init
    # y_ref [NP + 1 (+ T), D] f32: row NP takes the padding rows, rows NP+1.. the shared expert per token
    shared, y_ref = rest[:1] if has_shared else (), rest[-1]
    b, n = pl.program_id(0), pl.program_id(1)
    e = blk_ref[jnp.minimum(b, nb - 1)]
    cols = pl.ds(n * bn, bn)
    slots = pl.ds(b * block_m, block_m)

    def block(wd):  # wd: ks -> [BN, BK] tile
        def step(kk, acc):
            ks = pl.ds(pl.multiple_of(kk * bk, bk), bk)
            return acc + dot_nt(h_ref[slots, ks], wd(ks))  # [BM, BK] · [BN, BK]ᵀ

        return jax.lax.fori_loop(0, h_ref.shape[1] // bk, step, jnp.zeros((block_m, bn), F32))

    @pl.when((b < nb) & (e >= 0))
    def _():
        rows = ids_ref[pl.ds(b * block_m, block_m)]  # [BM]
        acc = block(lambda ks: wd_ref[e, cols, ks])
        wts = w_ref[jnp.minimum(rows, npairs - 1)]  # [BM] f32
        y_ref[rows, cols] = acc * wts[:, None]  # scatter to the pairs' rows

    if shared:
        (sd_ref,) = shared

        @pl.when(b >= nb)
        def _():
            t = y_ref.shape[0] - npairs - 1
            tok = jnp.minimum((b - nb) * block_m + jnp.arange(block_m), t - 1)
            y_ref[npairs + 1 + tok, cols] = block(lambda ks: sd_ref[cols, ks])  # unweighted


def _single_token_slots(top_k: int, block_m: int):
    """The block plan at T = 1 without an align launch: a token's top-k experts are distinct, so pair j
    gets block j alone (slot j·block_m) and block j's expert is the token's j-th. A constant slot table;
    the experts are the routing's ids themselves, flat (row 0's k ids come first). On the H200 the
    pair-axis align is a ~13 µs single-program launch (bench/results/moe_h200_2026-11-29_run2.md) against
    a 30 µs byte floor for the whole layer. Repeated experts (not produced by routing) still compute
    correctly, each block reading its expert again."""
    ids = np.full((top_k * block_m,), top_k, np.int32)  # sentinel NP = top_k in the padding slots
    ids[np.arange(top_k) * block_m] = np.arange(top_k)
    return jnp.asarray(ids)


# Tiles: one set for every T (see fused_experts) but routed_experts' T = 1 path (one_token_tiles)
TILES = dict(bn_up=64, bk_up=128, bn_down=64, bk_down=128, warps_up=4, warps_down=4, stages_up=5, stages_down=3)
ONE_TOKEN_I_TILES = 12


def one_token_tiles(i_dim: int) -> dict:
    """The decode's tiles (routed_experts at T = 1) at expert width i_dim: TILES, but the up kernel steps K by 256
    at 3 stages, where it reads x's one row instead of 16 copies (X_ROW_MIN_BYTES), in I tiles of i_dim /
    ONE_TOKEN_I_TILES (at most 64 wide): Flash's top 8 + shared expert then make 108 up programs, one wave on the
    H200's 132 SMs, at TP1 (I = 768, 64-wide) and at TP2 (I = 384, 32-wide: 29.4 against 30.7 µs a layer with
    64-wide tiles, which leave half the SMs idle; bench/results/moe_h200_2026-12-01_run5.md)."""
    return dict(TILES, bk_up=256, stages_up=3, bn_up=pow2_tile(i_dim, max(16, i_dim // ONE_TOKEN_I_TILES)))


@functools.partial(
    jax.jit,
    static_argnames=("limit", "tokens", "block_m", *TILES, "shared_limit", "interpret"),
)
def fused_experts(x, w_gate, w_up, w_down, weights, experts, limit=0.0, *, tokens=None, block_m=BLOCK_M,
                  bn_up=TILES["bn_up"], bk_up=TILES["bk_up"], bn_down=TILES["bn_down"], bk_down=TILES["bk_down"],
                  warps_up=TILES["warps_up"], warps_down=TILES["warps_down"], stages_up=TILES["stages_up"],
                  stages_down=TILES["stages_down"], shared=None, shared_limit=0.0, interpret=None, y_init=None):
    """Σ_k w·E_k(x) as [T, D] f32; same arguments and result as `experts_gathered`.

    x: [R, D]; w_gate/w_up: [E, I, D]; w_down: [E, D, I] (torch [out, in]); weights: [R, k] f32;
    experts: [R, k] int32; T = `tokens` (default R): the first T rows are computed, in place, so a
    verify's zero-padded rows (lingjax/model.py, row invariance) cost no slicing launches.
    `shared=(w_gate [I, D], w_up [I, D], w_down [D, I])` also runs the shared expert
    (clamped at `shared_limit`) as extra blocks of the same two launches and adds it, unweighted, to the
    result. `y_init` ([NP + 1 (+ T), D] f32, tests only) seeds the output rows so that a row no kernel wrote
    shows up.

    Tiles: the defaults (TILES) at every T; routed_experts' decode takes one_token_tiles. On the H200 every
    tile set tried gave a token's row the same bits in a T=1 decode as in a T=6 verify (18 up and down
    variants, and the K step of 256 with x's row broadcast in every call of 2026-12-01's run5: the tensor
    cores accumulate along K in one order whatever the tile); bench/moe_bench.py checks it in every run. The
    defaults were the fastest at T = 1, 4 and 6, at I = 768 (TP1) and at I = 384 (a TP2 device's half):
    up 64 x 128 at 5 stages, down 64 x 128 at 3 (bench/results/moe_h200_2026-12-01.md: at T = 1, I = 768
    up 20.7 and down 11.0 µs against 23.8 and 13.1 for the previous 32 x 256 / 64 x 256).
    """
    interpret = resolve_interpret(interpret)
    rows = x.shape[0]
    t = rows if tokens is None else tokens
    if not 1 <= t <= rows or weights.shape[0] != rows or experts.shape[0] != rows:
        raise ValueError(f"tokens={tokens} for x {x.shape}, weights {weights.shape}, experts {experts.shape}")
    top_k = experts.shape[1]
    n_blocks = n_blocks_for(t * top_k, block_m, w_gate.shape[0])
    if t == 1 and n_blocks == top_k:
        plan, nb = (_single_token_slots(top_k, block_m), experts.reshape(-1).astype(jnp.int32)), top_k
    else:
        ids, blk, _, _ = moe_align(experts, block_m=block_m, n_blocks=n_blocks, tokens=t, interpret=interpret)
        plan, nb = (ids, blk), blk.shape[0]
    tiles = dict(bn_up=bn_up, bk_up=bk_up, bn_down=bn_down, bk_down=bk_down, warps_up=warps_up,
                 warps_down=warps_down, stages_up=stages_up, stages_down=stages_down)
    return _expert_launches(x, w_gate, w_up, w_down, plan, weights.reshape(-1).astype(F32), limit, t=t, nb=nb,
                            top_k=top_k, block_m=block_m, tiles=tiles, shared=shared, shared_limit=shared_limit,
                            routing=None, interpret=interpret, y_init=y_init)


@functools.partial(
    jax.jit,
    static_argnames=("limit", "top_k", "n_group", "topk_group", "scaling", "renormalize", "precision", "tokens",
                     "shared_limit", "select_in_up", "interpret"),
)
def routed_experts(x, router_w, bias, w_gate, w_up, w_down, limit=0.0, *, top_k, n_group, topk_group, scaling,
                   renormalize, precision="f32", tokens=None, shared=None, shared_limit=0.0, select_in_up=True,
                   interpret=None):
    """The routed experts of x's first T = `tokens` rows (default all), routing included: as
    lingjax.ops.moe.routed_experts, [T, D] f32 (`shared`, `shared_limit` as in fused_experts).

    At T = 1 routing costs no launch of its own: after the router's GEMV launch (partial logits), every
    program of the up kernel that reads a routed expert sums the partials and ranks the token's experts
    itself, taking the b-th (lingjax.pallas.moe_router.token_expert, the select kernel's own ranking, so the
    same ids), and the first shared-expert program, once its tile is done, computes the whole routing
    (token_routing) for the down kernel. On the H200 a Flash layer took 42.3 µs this way against 43.5 with the
    select launch, measured interleaved in one process (bench/results/moe_h200_2026-12-01_run3.md); the
    selection takes ~2-3 µs of every routed program, while the shared expert's programs (SHARED_SPLIT) stream
    (bench/results/moe_h200_2026-12-01_run6.md) from L2: the routed programs prefetch the shared gate and up
    weights there once they have issued their own loads (lingjax.pallas.l2_prefetch; 0.4-0.9 µs a layer at
    I = 768, bench/results/moe_h200_2026-12-01_run7.md). Its up kernel steps K by 256 at 3 stages and reads x's one
    row, in I tiles that make one wave of programs (one_token_tiles): 0.5-1.2 µs less a layer than the default
    tiles at TP1 and 1.4 at TP2's width (bench/results/moe_h200_2026-12-01_run5.md; at T = 6 the same up tiles
    took 1.2 µs more than the defaults, run4, so the verify keeps those). Above
    T = 1, or with select_in_up=False (an A/B in the step: step_bench --kernel-option): the two router
    launches (lingjax.pallas.moe_router.route), then fused_experts.
    """
    interpret = resolve_interpret(interpret)
    t = x.shape[0] if tokens is None else tokens
    routing = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scaling=float(scaling),
                   renormalize=bool(renormalize))
    if t > 1 or not select_in_up or n_blocks_for(top_k, BLOCK_M, w_gate.shape[0]) != top_k:
        weights, experts = route(x, router_w, bias, precision=precision, **routing, interpret=interpret)
        return fused_experts(x, w_gate, w_up, w_down, weights, experts, limit, tokens=t, shared=shared,
                             shared_limit=shared_limit, interpret=interpret)
    check_routing(router_w.shape[0], n_group=n_group, topk_group=topk_group, top_k=top_k)
    logits = partial_logits(x, router_w, precision=precision, tokens=1, interpret=interpret)
    return _expert_launches(x, w_gate, w_up, w_down, (logits, bias.astype(F32)), None, limit, t=1, nb=top_k,
                            top_k=top_k, block_m=BLOCK_M, tiles=one_token_tiles(w_gate.shape[1]), shared=shared,
                            shared_limit=shared_limit,
                            routing=tuple(routing.items()), interpret=interpret, y_init=None)


def _expert_launches(x, w_gate, w_up, w_down, plan, weights, limit, *, t, nb, top_k, block_m, tiles, shared,
                     shared_limit, routing, interpret, y_init):
    """The up and down launches and the k-sum. plan: (slot table, expert per block) with weights [NP] f32, or
    with `routing` (T = 1) the router's (partial logits, bias), weights None: the up kernel routes."""
    d = x.shape[1]
    n_exp, i_dim, _ = w_gate.shape
    npairs = t * top_k
    if shared is not None and shared[0].shape != (i_dim, d):
        raise ValueError(f"a fused shared expert needs width {i_dim}, got {shared[0].shape}")
    bn_up, bk_up = pow2_tile(i_dim, tiles["bn_up"]), pow2_tile(d, tiles["bk_up"])
    bn_down, bk_down = pow2_tile(d, tiles["bn_down"]), pow2_tile(i_dim, tiles["bk_down"])
    slots = nb * block_m if routing else plan[0].shape[0]
    ns = 0 if shared is None else pl.cdiv(t, block_m)  # shared-expert blocks
    # at T = 1 the shared expert's block runs on SHARED_SPLIT times the programs, each 1/SHARED_SPLIT as wide:
    # they stream while the routed programs select, and leave the bandwidth to them sooner
    split = SHARED_SPLIT if routing and ns and bn_up // SHARED_SPLIT >= MIN_DOT_ROWS else 1
    # at T = 1 the routed programs, nb x I tiles, share the shared expert's gate and up weights to prefetch
    prefetch_lines = lines_per_program(shared[:2], nb * (i_dim // bn_up)) if routing and ns else 0

    def params(warps, stages, per_stage_bytes):  # per stage: one K step's tiles of both operands
        stages = _stages_within(stages, per_stage_bytes)
        return None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages)

    x_bytes = x.dtype.itemsize
    up_stage = block_m * bk_up * x_bytes + 2 * bn_up * bk_up * w_gate.dtype.itemsize  # x rows, gate and up
    down_stage = block_m * bk_down * x_bytes + bn_down * bk_down * w_down.dtype.itemsize  # h rows (x's dtype), down

    out_shape = [jax.ShapeDtypeStruct((slots + ns * block_m, i_dim), x.dtype)]
    if routing:  # the routing the up kernel publishes
        out_shape += [jax.ShapeDtypeStruct((1, top_k), F32), jax.ShapeDtypeStruct((1, top_k), jnp.int32)]
    h, *routed = pallas_call(
        functools.partial(_up_kernel, nb=nb, tokens=t, top_k=top_k, block_m=block_m, bn=bn_up, bk=bk_up,
                          limit=float(limit), shared_limit=float(shared_limit), routing=routing,
                          x_row=reads_one_row(t, bk_up, x.dtype), shared_split=split, prefetch_lines=prefetch_lines),
        out_shape=out_shape,
        grid=(nb + ns * split, i_dim // bn_up),
        compiler_params=params(tiles["warps_up"], tiles["stages_up"], up_stage),
        interpret=interpret,
        name="moe_up_select" if routing else "moe_up_swiglu",
    )(*plan, x, w_gate, w_up, *(() if shared is None else shared[:2]))

    if routing:
        plan, weights = (_single_token_slots(top_k, block_m), routed[1].reshape(-1)), routed[0].reshape(-1)
    down_args = (*plan, weights, h, w_down) + (() if shared is None else shared[2:])
    aliases = {}
    if y_init is not None:
        down_args, aliases = down_args + (y_init,), {len(down_args): 0}
    out_rows = npairs + 1 + (t if ns else 0)
    y = pallas_call(
        functools.partial(_down_kernel, nb=nb, npairs=npairs, block_m=block_m, bn=bn_down, bk=bk_down,
                          has_shared=ns > 0),
        out_shape=jax.ShapeDtypeStruct((out_rows, d), F32),
        grid=(nb + ns, d // bn_down),
        input_output_aliases=aliases,
        compiler_params=params(tiles["warps_down"], tiles["stages_down"], down_stage),
        interpret=interpret,
        name="moe_down_combine",
    )(*down_args)
    # f32 sum over the k slots, in slot order as a chain of adds: on the H200 a reduce here summed in an order
    # that changed with T, so a token's row differed between a decode and a verify (lingjax/model.py, row
    # invariance; bench/results/moe_h200_2026-12-01_run4.md)
    per_slot = y[:npairs].reshape(t, top_k, d)
    out = per_slot[:, 0]
    for j in range(1, top_k):
        out = out + per_slot[:, j]
    return out + y[npairs + 1:] if ns else out


def _inputs(key, t, d, i, e, k, dtype):
    ks = jax.random.split(key, 6)
    x = jax.random.normal(ks[0], (t, d), F32).astype(dtype)
    wg = (jax.random.normal(ks[1], (e, i, d), F32) / d**0.5).astype(dtype)
    wu = (jax.random.normal(ks[2], (e, i, d), F32) / d**0.5).astype(dtype)
    wd = (jax.random.normal(ks[3], (e, d, i), F32) / i**0.5).astype(dtype)
    ex = jax.vmap(lambda kk: jax.random.permutation(kk, e)[:k])(jax.random.split(ks[4], t)).astype(jnp.int32)
    w = jax.random.uniform(ks[5], (t, k), F32)
    return x, wg, wu, wd, w, ex


if __name__ == "__main__":  # GPU: sweep tiles at Flash size, check each, µs and % of the byte floor
    d, i, e, k, layers = 2560, 768, 512, 8, 8
    bw = 4.3e12  # B/s; bench/moe_bench.py measures it in the same run
    for t in (1, 6):
        sets = [_inputs(jax.random.key(l), t, d, i, e, k, jnp.bfloat16) for l in range(layers)]
        want = experts_gathered(*sets[0])
        n_dist = sum(len(set(jax.device_get(s[5]).ravel().tolist())) for s in sets) / layers
        floor_us = n_dist * 3 * i * d * 2 / bw * 1e6
        for bn_up, bk_up, bn_down, stages in [(16, 256, 64, 3), (32, 256, 64, 3), (64, 128, 64, 3)]:
            kw = dict(bn_up=bn_up, bk_up=bk_up, bn_down=bn_down, stages_up=stages, stages_down=stages)
            err = float(jnp.abs(fused_experts(*sets[0], **kw) - want).max() / jnp.abs(want).max())
            run = jax.jit(lambda ss, kw=kw: jax.lax.fori_loop(0, 50, lambda _, acc: acc + sum(
                fused_experts(*s[:4], s[4] + acc[0, 0] * 0, s[5], **kw)[0, 0] for s in ss), 0.0))
            run(sets).block_until_ready()
            t0 = time.perf_counter()
            run(sets).block_until_ready()
            us = (time.perf_counter() - t0) / (50 * layers) * 1e6
            print(f"T={t} {kw}: err {err:.1e}, {us:.1f} us, {100 * floor_us / us:.0f}% of floor {floor_us:.1f} us")
