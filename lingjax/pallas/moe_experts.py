"""Routed experts at batch 1: grouped up-GEMM with a SwiGLU epilogue, then down-GEMM and combine.

`fused_experts` replaces lingjax.ops.moe.experts_gathered (same arguments, same [T, D] f32 result); launches
(docs/kernels/moe.md):
  1. moe_align_pairs (lingjax/pallas/moe_align.py): the T·k (token, slot) pairs in blocks of block_m rows that
     share one expert. At T = 1 no launch: pair j is block j (_single_token_slots).
  2. moe_up_swiglu, grid (block (+ shared-expert blocks), I tile): x's rows of the block's pairs (at T = 1 x's
     one row, broadcast) against the gate and up tiles in one K loop, h = act(g)·u in f32, rounded once to x's
     dtype.
  3. moe_down_combine, grid (block (+ shared), D tile): h · W_downᵀ in f32 times the pair's weight, stored to
     the pair's own row; then the k rows of a token summed in f32 in slot order (a decode's row equals its
     verify's).
Every touched expert's weights are read once per call (a block holds one expert; for T·k ≤ 64 at block_m ≥ T
no expert spans two blocks). Blocks past the plan's total exit at once; padding rows write a spare row.

`routed_experts` replaces lingjax.ops.moe.routed_experts (routing included): at T = 1, after the router's
GEMV, each up program ranks the token's experts itself and takes its own, so a decode has no select or align
launch; above T = 1 it is route + fused_experts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.fp8 import Fp8Array
from lingjax.pallas import (
    MIN_DOT_K,
    ROW_PER_SUM,
    X_ROW_MIN_BYTES,
    dot_nt,
    f16_operand,
    fp8_dots_reason,
    fp8_dots_rows,
    is_pow2,
    moe_router,
    pallas_call,
    pow2_tile,
    resolve_interpret,
    row_reader,
    scaled_k_loop,
    selected,
    short_dot,
    x_row_mode,
    x_rows,
)
from lingjax.pallas.expert_weights import fp8_blocks, streamed
from lingjax.pallas.l2_prefetch import lines_per_program, prefetch_share
from lingjax.pallas.moe_align import BLOCK_M, moe_align, n_blocks_for
from lingjax.pallas.moe_router import check_routing, partial_logits, route, token_expert, token_logits, token_routing

F32 = jnp.float32
# Shared memory a pipelined K loop may take on an H200 (232448 B per block), less room for the rest of
# the kernel: Triton keeps num_stages - 1 tiles of each operand in flight.
SHARED_MEMORY_BUDGET = 200 * 1024
MIN_DOT_ROWS = 16  # a Triton dot's smallest tile dimension
ONE_TOKEN_I_TILES = 12  # the decode's up kernel: I tiles per expert (one_token_tiles)
PREFILL_BLOCK_M = 32  # a prefill chunk's expert blocks, where it averages BLOCK_M pairs an expert (many_token_tiles)


@dataclasses.dataclass(frozen=True)
class ExpertTuning:
    """The expert launches' static choices. Each tile is the largest power of 2 up to the value given that
    divides its dimension; the stages are at most those given, fewer where the pipeline would not fit
    SHARED_MEMORY_BUDGET. The defaults serve every T but the decode's, which takes one_token_tiles."""

    block_m: int = BLOCK_M  # (token, slot) rows per block, all of one expert
    bn_up: int = 64  # up kernel: I tile
    bk_up: int = 128  # up kernel: K (D) step
    bn_down: int = 64  # down kernel: D tile
    bk_down: int = 128  # down kernel: K (I) step
    warps_up: int = 4
    warps_down: int = 4
    stages_up: int = 5
    stages_down: int = 3
    # routed_experts at T = 1: the shared expert's rows over shared_split times the up programs, bn_up / split
    # wide each (where that is at least MIN_DOT_ROWS)
    shared_split: int = 2
    # T = 1: the up kernel reads x's one row and broadcasts it where a load of it spans this many bytes per 4 warps,
    # else it gathers 16 copies (lingjax.pallas.x_row_mode)
    x_row_min_bytes: int = X_ROW_MIN_BYTES
    # T = 1 with fp8 weights, whose partial sums are a scale block wide: the row read once per K step and split in
    # registers into the step's blocks (True), or read per block (False)
    x_row_split: bool = False
    # how fp8 weights meet bf16 rows (lingjax.pallas.FP8_DOTS; "f16": x passed in f16, h rounded to x's dtype
    # then stored in f16)
    fp8_dots: str = "f16"


def one_token_tiles(i_dim: int, fp8: bool = False) -> ExpertTuning:
    """The decode's tiles (routed_experts at T = 1) at expert width i_dim: the up kernel steps K by 256 at 3
    stages, where it reads x's one row, in I tiles of i_dim / ONE_TOKEN_I_TILES (at most 64 wide), so that
    Flash's top 8 and shared expert fill the H200's SMs in one wave at TP 1 and 2. With fp8 weights the up kernel
    runs 8 warps: its programs convert every weight element (to f16: fp8_dots) before the dot, which 4 warps a
    program do not keep up with at one program an SM (docs/kernels/moe.md)."""
    return dataclasses.replace(ExpertTuning(), bk_up=256, stages_up=3, warps_up=8 if fp8 else 4,
                               bn_up=pow2_tile(i_dim, max(16, i_dim // ONE_TOKEN_I_TILES)))


def many_token_tiles(t: int, top_k: int, n_experts: int) -> ExpertTuning:
    """A prefill chunk's tiles: blocks of PREFILL_BLOCK_M rows where the chunk's T·k pairs average at least BLOCK_M
    an expert (Flash: T >= 1024), else the defaults. Every block reads its expert's whole weights and converts
    them tile by tile, so an expert spanning several 16-row blocks is read and converted several times; 32-row
    blocks halve that, and each row's sums are the same (docs/kernels/moe.md)."""
    if t * top_k >= BLOCK_M * n_experts:
        return dataclasses.replace(ExpertTuning(), block_m=PREFILL_BLOCK_M)
    return ExpertTuning()


def _stages_within(want: int, per_stage_bytes: int) -> int:
    """At most `want` pipeline stages whose buffers fit SHARED_MEMORY_BUDGET (at least 1)."""
    return max(1, min(want, 1 + SHARED_MEMORY_BUDGET // per_stage_bytes))


def _shared_split(tuning: ExpertTuning, bn_up: int, routing: bool, has_shared: bool) -> int:
    """Programs per shared-expert up tile: tuning.shared_split at T = 1 (routing) when the split tile is at
    least MIN_DOT_ROWS wide, else 1."""
    split = tuning.shared_split
    return split if routing and has_shared and bn_up // split >= MIN_DOT_ROWS else 1


def _experts_supports(x, w_gate, w_down, shared, tuning: ExpertTuning, routing: bool) -> str | None:
    """The expert launches' rules (see supports_fused_experts)."""
    d, i_dim = x.shape[1], w_gate.shape[1]
    if shared is not None and tuple(shared[0].shape) != (i_dim, d):
        return (f"a fused shared expert of shape {tuple(shared[0].shape)} beside experts of width {i_dim} "
                "(fused only at the same width)")
    if not is_pow2(tuning.block_m):
        return f"expert blocks of {tuning.block_m} rows, not a power of 2"
    if reason := fp8_dots_reason(tuning.fp8_dots):
        return reason
    fp8 = isinstance(w_gate, Fp8Array)
    if any(isinstance(w, Fp8Array) != fp8 for w in (w_down, *(shared or ()))):
        return "expert weights partly in fp8 (the kernels take all routed and shared ones in fp8 or none)"
    bn_up = pow2_tile(i_dim, min(tuning.bn_up, w_gate.block[0]) if fp8 else tuning.bn_up)
    split = _shared_split(tuning, bn_up, routing, shared is not None)
    if not is_pow2(split):
        return f"a shared-expert split of {split}, not a power of 2"
    up_k, down_k = pow2_tile(d, tuning.bk_up), pow2_tile(i_dim, tuning.bk_down)
    if fp8:  # a K step's partial sums lie inside one scale block; an N tile inside one block's rows
        up_k, down_k = min(up_k, w_gate.block[1]), min(down_k, w_down.block[1])
        if bn_up < MIN_DOT_ROWS:
            return f"an up N tile of {bn_up} (fp8 scale blocks of {w_gate.block[0]} rows), under {MIN_DOT_ROWS}"
        if pow2_tile(d, min(tuning.bn_down, w_down.block[0])) < MIN_DOT_ROWS:
            return f"a down N tile under {MIN_DOT_ROWS} (fp8 scale blocks of {w_down.block[0]} rows)"
    for kernel, k, dim in (("up", up_k, f"hidden size {d}"), ("down", down_k, f"expert width {i_dim}")):
        if short_dot(k, x.dtype):  # both kernels' dots take x's dtype (h is stored in it)
            return (f"the {kernel} kernel's K step of {k} ({dim}) on {x.dtype.name} operands, under the {MIN_DOT_K} "
                    "a 16-bit Triton dot needs")
    return None


def supports_fused_experts(x, w_gate, w_up, w_down, weights, experts, limit=0.0, *, tokens=None, shared=None,
                           shared_limit=0.0, tuning: ExpertTuning | None = None, interpret=None) -> str | None:
    """None when `fused_experts` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes
    right on the GPU, else why not. Its tiles are powers of 2 dividing their dimensions by construction
    (pow2_tile) and the align's blocks powers of 2 (moe_align): refused are a K step under MIN_DOT_K on 16-bit
    operands (a hidden size or expert width with a small power-of-2 factor), a tuning's block_m that is no power
    of 2, and a shared expert of another width than the experts'."""
    del w_up, weights, limit, shared_limit, interpret
    t = x.shape[0] if tokens is None else tokens
    if tuning is None:
        tuning = many_token_tiles(t, experts.shape[1], w_gate.shape[0])
    return _experts_supports(x, w_gate, w_down, shared, tuning, routing=False)


def supports_routed_experts(x, router_w, bias, w_gate, w_up, w_down, limit=0.0, *, top_k, n_group, topk_group,
                            scaling, renormalize, precision="f32", tokens=None, shared=None, shared_limit=0.0,
                            tuning: ExpertTuning | None = None, interpret=None) -> str | None:
    """None when `routed_experts` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes
    right on the GPU, else why not: the router's rules (lingjax.pallas.moe_router.supports; at T = 1 the up kernel
    runs the same selection) and the experts' (supports_fused_experts)."""
    del w_up, limit, shared_limit, interpret
    t = x.shape[0] if tokens is None else tokens
    tuning = _resolve(tuning, t, w_gate, top_k)
    return (moe_router.supports(x, router_w, bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                                scaling=scaling, renormalize=renormalize, precision=precision)
            or _experts_supports(x, w_gate, w_down, shared, tuning, routing=t == 1))


def _swiglu(g, u, limit):
    act = g / (1.0 + jnp.exp(-g))  # SiLU in f32
    if limit:
        act = jnp.minimum(act, limit)
        u = jnp.clip(u, -limit, limit)
    return act * u


def _up_kernel(plan_ref, blk_ref, x_ref, wg_ref, wu_ref, *rest, nb, tokens, top_k, block_m, bn, bk, limit,
               shared_limit, routing, x_row_modes, shared_split, prefetch_lines, has_shared, blocks, h_round):
    # plan_ref [S] int32 (pair per slot, NP = padding); blk_ref [≥ NB] int32 (expert per block, −1 unused)
    # x_ref [R ≥ T, D] (rows past T unread); wg_ref, wu_ref [E, I, D]; optional shared sg_ref, su_ref [I, D];
    # with fp8 weights (blocks = ((gn, gk) of the experts, of the shared expert)) their scales after them, the
    # experts' [E, I/gn, D/gk] and the shared expert's [I/gn, D/gk];
    # h_ref [S (+ shared blocks · BM), I] in x's dtype, each value rounded to h_round (bf16 in f16: fp8_dots).
    # With `routing` (T = 1): plan_ref holds the router's partial logits [KS, 1, E] and blk_ref its bias [E];
    # block b's program selects the token's b-th expert itself, and one program publishes the routing, w_ref
    # [1, k] f32 and e_ref [1, k] int32, for the down kernel.
    # shared_split (T = 1): the shared expert's rows over shared_split times the programs, bn / shared_split wide.
    # prefetch_lines (T = 1, with a shared expert): lines of the shared gate and up weights each routed program
    # pulls into L2 before it selects.
    # x_row_modes: (partial-sum width, how x is read at T = 1 with sums that wide: lingjax.pallas.x_row_mode) pairs.
    shared = rest[:2] if has_shared else ()
    rest = rest[len(shared):]
    scales = rest[:2 + 2 * has_shared] if blocks else ()
    rest = rest[len(scales):]
    if routing:
        h_ref, w_ref, e_ref = rest
    else:
        (h_ref,) = rest
    b, n = pl.program_id(0), pl.program_id(1)
    npairs = tokens * top_k
    cols = pl.ds(n * bn, bn)

    def block(tok, slots, rows, wg, wu, lim, scale=None, block_k=bk):
        # tok [BM] token rows; wg, wu: ks -> [rows, sub] weight tiles; scale: (K block) -> (gate, up) scales
        x_row = dict(x_row_modes)[block_k]

        def terms(start, ks, scales, part):
            if part is None:  # [BM] gathered rows (T = 1: x's one row, broadcast or gathered)
                xs = x_rows(x_ref, tok, ks, x_row == ROW_PER_SUM)
            else:  # T = 1: x's row of the whole K step, read once, this partial sum's part
                xs = jnp.broadcast_to(part, (block_m, ks.size))
            g, u = dot_nt(xs, wg(ks).astype(xs.dtype)), dot_nt(xs, wu(ks).astype(xs.dtype))  # gate, up: same K step
            return (g, u) if scales is None else (g * scales[0], u * scales[1])

        zero = jnp.zeros((block_m, rows.size), F32)
        g, u = scaled_k_loop(x_ref.shape[1] // bk, bk, min(bk, block_k), (zero, zero), terms, scale, block_k,
                             row_reader(x_ref, x_row))
        h = _swiglu(g, u, lim).astype(h_round)  # the one rounding
        h_ref[slots, rows] = h if h_ref.dtype == h_round else f16_operand(h)

    def expert_scale(e):
        if not blocks:
            return None
        gs, us = scales[:2]
        row = n * bn // blocks[0][0]
        return lambda kb: (gs[e, row, kb], us[e, row, kb])

    expert_k = blocks[0][1] if blocks else bk
    slots = pl.ds(b * block_m, block_m)
    if routing:
        @pl.when(b < nb)
        def _():
            logits, bias = token_logits(plan_ref, 0), blk_ref[...]
            # DRAM would idle while these programs select: once their own loads are issued, they pull the shared
            # expert's gate and up weights into L2 for the shared programs (lingjax.pallas.l2_prefetch)
            for ref in shared:
                prefetch_share(ref, b * pl.num_programs(1) + n, prefetch_lines)
            expert = selected(token_expert(logits, bias, b, **dict(routing)))
            tok = jnp.zeros((block_m,), jnp.int32)
            block(tok, slots, cols, lambda ks: wg_ref[expert, cols, ks], lambda ks: wu_ref[expert, cols, ks], limit,
                  expert_scale(expert), expert_k)
    else:
        e = blk_ref[jnp.minimum(b, nb - 1)]

        @pl.when((b < nb) & (e >= 0))
        def _():
            rows = plan_ref[pl.ds(b * block_m, block_m)]  # [BM]
            tok = jnp.minimum(rows, npairs - 1) // top_k  # padding rows reuse a real token, never stored later
            block(tok, slots, cols, lambda ks: wg_ref[e, cols, ks], lambda ks: wu_ref[e, cols, ks], limit,
                  expert_scale(e), expert_k)

    if shared:
        sg_ref, su_ref = shared

        @pl.when(b >= nb)
        def _():
            if shared_split > 1:  # T = 1: program (nb + j, n) takes rows j·I/split + n·bn/split of the one block
                width = bn // shared_split
                first = (b - nb) * (h_ref.shape[1] // shared_split) + n * width
                rows = pl.ds(first, width)
                out, tok = pl.ds(nb * block_m, block_m), jnp.zeros((block_m,), jnp.int32)
            else:
                first, rows, out = n * bn, cols, slots
                tok = jnp.minimum((b - nb) * block_m + jnp.arange(block_m), tokens - 1)
            scale, shared_k = None, bk
            if blocks:
                gs, us = scales[2:]
                row = first // blocks[1][0]
                scale, shared_k = (lambda kb: (gs[row, kb], us[row, kb])), blocks[1][1]
            block(tok, out, rows, lambda ks: sg_ref[rows, ks], lambda ks: su_ref[rows, ks], shared_limit, scale,
                  shared_k)

    if routing:
        # the routing, for the down kernel: published by the first shared program after its tile (the shared
        # programs end before the routed ones, which select first), or, without a shared expert, by block 0's
        # first program
        @pl.when((b == (nb if shared else 0)) & (n == 0))
        def _():
            w_ref[...], e_ref[...] = token_routing(plan_ref, blk_ref, 0, **dict(routing))


def _down_kernel(ids_ref, blk_ref, w_ref, h_ref, wd_ref, *rest, nb, npairs, block_m, bn, bk, has_shared, blocks):
    # ids_ref [S] int32; blk_ref [≥ NB] int32; w_ref [≥ NP] f32 routing weight per pair
    # h_ref [S (+ shared), I]; wd_ref [E, D, I]; optional shared sd_ref [D, I]; with fp8 weights their scales
    # after them ([E, D/gn, I/gk], [D/gn, I/gk])
    # y_ref [NP + 1 (+ T), D] f32: row NP takes the padding rows, rows NP+1.. the shared expert per token
    shared = rest[:1] if has_shared else ()
    rest = rest[len(shared):]
    scales = rest[:1 + has_shared] if blocks else ()
    (y_ref,) = rest[len(scales):]
    b, n = pl.program_id(0), pl.program_id(1)
    e = blk_ref[jnp.minimum(b, nb - 1)]
    cols = pl.ds(n * bn, bn)
    slots = pl.ds(b * block_m, block_m)

    def block(wd, scale=None, block_k=bk):  # wd: ks -> [BN, sub] tile; scale: (K block) -> (the tile's scale,)
        def terms(start, ks, scales, xs):
            del xs  # h's rows are read here (scaled_k_loop reads no row for this kernel)
            hs = h_ref[slots, ks]
            d = dot_nt(hs, wd(ks).astype(hs.dtype))  # [BM, sub] · [BN, sub]ᵀ
            return (d if scales is None else d * scales[0],)

        (acc,) = scaled_k_loop(h_ref.shape[1] // bk, bk, min(bk, block_k), (jnp.zeros((block_m, bn), F32),), terms,
                               scale, block_k)
        return acc

    @pl.when((b < nb) & (e >= 0))
    def _():
        rows = ids_ref[pl.ds(b * block_m, block_m)]  # [BM]
        scale, block_k = None, bk
        if blocks:
            row = n * bn // blocks[0][0]
            scale, block_k = (lambda kb: (scales[0][e, row, kb],)), blocks[0][1]
        acc = block(lambda ks: wd_ref[e, cols, ks], scale, block_k)
        wts = w_ref[jnp.minimum(rows, npairs - 1)]  # [BM] f32
        y_ref[rows, cols] = acc * wts[:, None]  # scatter to the pairs' rows

    if shared:
        (sd_ref,) = shared

        @pl.when(b >= nb)
        def _():
            t = y_ref.shape[0] - npairs - 1
            tok = jnp.minimum((b - nb) * block_m + jnp.arange(block_m), t - 1)
            scale, block_k = None, bk
            if blocks:
                row = n * bn // blocks[1][0]
                scale, block_k = (lambda kb: (scales[1][row, kb],)), blocks[1][1]
            y_ref[npairs + 1 + tok, cols] = block(lambda ks: sd_ref[cols, ks], scale, block_k)  # unweighted


def _single_token_slots(top_k: int, block_m: int):
    """The block plan at T = 1 without an align launch: a token's top-k experts are distinct, so pair j gets
    block j alone (slot j·block_m) and block j's expert is the token's j-th: a constant slot table [k·BM] int32
    (sentinel NP = k in the padding slots). Repeated experts (which routing does not produce) still compute
    correctly, each block reading its expert again."""
    ids = np.full((top_k * block_m,), top_k, np.int32)
    ids[np.arange(top_k) * block_m] = np.arange(top_k)
    return jnp.asarray(ids)


@functools.partial(jax.jit, static_argnames=("limit", "tokens", "shared_limit", "tuning", "interpret"))
def fused_experts(x, w_gate, w_up, w_down, weights, experts, limit=0.0, *, tokens=None, shared=None,
                  shared_limit=0.0, tuning: ExpertTuning | None = None, interpret=None):
    """Σ_k w·E_k(x) as [T, D] f32; same arguments and result as `experts_gathered`.

    x: [R, D]; w_gate/w_up: [E, I, D]; w_down: [E, D, I] (torch [out, in]); weights: [R, k] f32;
    experts: [R, k] int32; T = `tokens` (default R): the first T rows are computed, in place, so a
    verify's zero-padded rows (lingjax/model.py, row invariance) cost no slicing launches.
    `shared=(w_gate [I, D], w_up [I, D], w_down [D, I])` also runs the shared expert (clamped at
    `shared_limit`) as extra blocks of the same two launches and adds it, unweighted, to the result.
    `tuning`: the launches' tiles (None: many_token_tiles, so a prefill chunk takes its larger blocks).
    Shapes it lowers for: supports_fused_experts.
    """
    interpret = resolve_interpret(interpret)
    rows = x.shape[0]
    t = rows if tokens is None else tokens
    if not 1 <= t <= rows or weights.shape[0] != rows or experts.shape[0] != rows:
        raise ValueError(f"tokens={tokens} for x {x.shape}, weights {weights.shape}, experts {experts.shape}")
    top_k = experts.shape[1]
    if tuning is None:
        tuning = many_token_tiles(t, top_k, w_gate.shape[0])
    block_m = tuning.block_m
    n_blocks = n_blocks_for(t * top_k, block_m, w_gate.shape[0])
    if t == 1 and n_blocks == top_k:
        plan, nb = (_single_token_slots(top_k, block_m), experts.reshape(-1).astype(jnp.int32)), top_k
    else:
        ids, blk, _, _ = moe_align(experts, block_m=block_m, n_blocks=n_blocks, tokens=t, interpret=interpret)
        plan, nb = (ids, blk), blk.shape[0]
    return _expert_launches(x, w_gate, w_up, w_down, plan, weights.reshape(-1).astype(F32), limit, t=t, nb=nb,
                            top_k=top_k, tuning=tuning, shared=shared, shared_limit=shared_limit, routing=None,
                            interpret=interpret)


def _resolve(tuning: ExpertTuning | None, t: int, w_gate, top_k: int) -> ExpertTuning:
    """routed_experts' tiles: those given, else one_token_tiles at T = 1 and many_token_tiles above."""
    if tuning is not None:
        return tuning
    if t == 1:
        return one_token_tiles(w_gate.shape[1], isinstance(w_gate, Fp8Array))
    return many_token_tiles(t, top_k, w_gate.shape[0])


@functools.partial(
    jax.jit,
    static_argnames=("limit", "top_k", "n_group", "topk_group", "scaling", "renormalize", "precision", "tokens",
                     "shared_limit", "tuning", "interpret"),
)
def routed_experts(x, router_w, bias, w_gate, w_up, w_down, limit=0.0, *, top_k, n_group, topk_group, scaling,
                   renormalize, precision="f32", tokens=None, shared=None, shared_limit=0.0,
                   tuning: ExpertTuning | None = None, interpret=None):
    """The routed experts of x's first T = `tokens` rows (default all), routing included: as
    lingjax.ops.moe.routed_experts, [T, D] f32 (`shared`, `shared_limit` as in fused_experts).

    At T = 1: the router's GEMV (moe_router.partial_logits), then the up kernel, whose routed programs each
    rank the token's experts and take their own (moe_router.token_expert) and whose first shared-expert program
    publishes the whole routing (token_routing) for the down kernel; the same ids as the select kernel's.
    Above T = 1: moe_router.route, then fused_experts. The router takes RouterTuning's defaults; `tuning` is
    the expert launches' (None: one_token_tiles at T = 1, many_token_tiles above). Shapes it lowers for:
    supports_routed_experts.
    """
    interpret = resolve_interpret(interpret)
    t = x.shape[0] if tokens is None else tokens
    tuning = _resolve(tuning, t, w_gate, top_k)
    routing = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, scaling=float(scaling),
                   renormalize=bool(renormalize))
    if t > 1 or n_blocks_for(top_k, tuning.block_m, w_gate.shape[0]) != top_k:
        weights, experts = route(x, router_w, bias, precision=precision, **routing, interpret=interpret)
        return fused_experts(x, w_gate, w_up, w_down, weights, experts, limit, tokens=t, shared=shared,
                             shared_limit=shared_limit, tuning=tuning, interpret=interpret)
    check_routing(router_w.shape[0], n_group=n_group, topk_group=topk_group, top_k=top_k)
    logits = partial_logits(x, router_w, precision=precision, tokens=1, interpret=interpret)
    return _expert_launches(x, w_gate, w_up, w_down, (logits, bias.astype(F32)), None, limit, t=1, nb=top_k,
                            top_k=top_k, tuning=tuning, shared=shared, shared_limit=shared_limit,
                            routing=tuple(routing.items()), interpret=interpret)


def _expert_launches(x, w_gate, w_up, w_down, plan, weights, limit, *, t, nb, top_k, tuning, shared, shared_limit,
                     routing, interpret):
    """The up and down launches and the k-sum. plan: (slot table, expert per block) with weights [NP] f32, or
    with `routing` (T = 1) the router's (partial logits, bias), weights None: the up kernel routes."""
    d = x.shape[1]
    n_exp, i_dim, _ = w_gate.shape
    npairs = t * top_k
    block_m = tuning.block_m
    if shared is not None and shared[0].shape != (i_dim, d):
        raise ValueError(f"a fused shared expert needs width {i_dim}, got {shared[0].shape}")
    up_blocks, down_blocks = fp8_blocks(w_gate, w_up, w_down, shared)
    # an fp8 weight's N tile lies inside one scale block (one scale per tile and K block)
    bn_up = pow2_tile(i_dim, min([tuning.bn_up] + [b[0] for b in up_blocks or ()]))
    bn_down = pow2_tile(d, min([tuning.bn_down] + [b[0] for b in down_blocks or ()]))
    bk_up, bk_down = pow2_tile(d, tuning.bk_up), pow2_tile(i_dim, tuning.bk_down)
    scales_up = () if not up_blocks else (w_gate.scale, w_up.scale) + (() if shared is None else
                                                                     (shared[0].scale, shared[1].scale))
    scales_down = () if not down_blocks else (w_down.scale,) + (() if shared is None else (shared[2].scale,))
    h_round = x.dtype
    if up_blocks:
        x = fp8_dots_rows(x, tuning.fp8_dots)
    w_gate, w_up, w_down = (streamed(w) for w in (w_gate, w_up, w_down))
    shared = None if shared is None else tuple(streamed(w) for w in shared)
    slots = nb * block_m if routing else plan[0].shape[0]
    ns = 0 if shared is None else pl.cdiv(t, block_m)  # shared-expert blocks
    # at T = 1 the shared expert's block runs on more programs, each narrower: they stream while the routed
    # programs select, and leave the bandwidth to them sooner
    split = _shared_split(tuning, bn_up, bool(routing), ns > 0)
    # at T = 1 the routed programs, nb x I tiles, share the shared expert's gate and up weights to prefetch
    prefetch_lines = lines_per_program(shared[:2], nb * (i_dim // bn_up)) if routing and ns else 0

    # how the up kernel reads x at T = 1 with partial sums of each width its weights take (a scale block's or bk_up)
    x_row_modes = tuple((block_k, x_row_mode(t, bk_up, min(bk_up, block_k), x.dtype, tuning.x_row_min_bytes,
                                             tuning.warps_up, tuning.x_row_split))
                        for block_k in sorted({bk_up, *(b[1] for b in up_blocks or ())}))

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
                          x_row_modes=x_row_modes, shared_split=split,
                          prefetch_lines=prefetch_lines, has_shared=ns > 0, blocks=up_blocks, h_round=h_round),
        out_shape=out_shape,
        grid=(nb + ns * split, i_dim // bn_up),
        compiler_params=params(tuning.warps_up, tuning.stages_up, up_stage),
        interpret=interpret,
        name="moe_up_select" if routing else "moe_up_swiglu",
    )(*plan, x, w_gate, w_up, *(() if shared is None else shared[:2]), *scales_up)

    if routing:
        plan, weights = (_single_token_slots(top_k, block_m), routed[1].reshape(-1)), routed[0].reshape(-1)
    out_rows = npairs + 1 + (t if ns else 0)
    y = pallas_call(
        functools.partial(_down_kernel, nb=nb, npairs=npairs, block_m=block_m, bn=bn_down, bk=bk_down,
                          has_shared=ns > 0, blocks=down_blocks),
        out_shape=jax.ShapeDtypeStruct((out_rows, d), F32),
        grid=(nb + ns, d // bn_down),
        compiler_params=params(tuning.warps_down, tuning.stages_down, down_stage),
        interpret=interpret,
        name="moe_down_combine",
    )(*plan, weights, h, w_down, *(() if shared is None else shared[2:]), *scales_down)
    # f32 sum over the k slots, in slot order as a chain of adds (not a reduce, whose order on the GPU may
    # change with T): a token's row is the same in a decode and a verify (lingjax/model.py, row invariance)
    per_slot = y[:npairs].reshape(t, top_k, d)
    out = per_slot[:, 0]
    for j in range(1, top_k):
        out = out + per_slot[:, j]
    return out + y[npairs + 1:] if ns else out
