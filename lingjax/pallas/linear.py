"""y = x·Wᵀ for the few rows of a decode or verify (at most ROWS): the Pallas form of lingjax.ops.linear.linear, for a
plain weight and for an fp8 one (lingjax.ops.fp8.Fp8Array, read as fp8). Larger x runs the reference, XLA's GEMM.

Why a kernel for plain weights too: XLA picks a GEMM's algorithm either by autotuning, which times candidates per
fusion and per process (so a decode and a verify, or two processes, may round one shape two ways), or, with
autotuning off, by a default that is far slower at these shapes. Here the launch follows from the shape alone
(`plan`): every program, process and machine runs the same tiles, so a decode's row rounds as a verify's does, and
the speed does not depend on what a cache holds (docs/engine.md).

One launch, grid (N / bn, K splits): each program streams its [bn, K / splits] strip of the weight once, multiplies it
with x's [ROWS, bk] rows on the tensor cores with f32 accumulation (an fp8 tile is converted to x's dtype in registers,
bf16 rows being passed in f16 first under fp8_dots "f16", the default, e4m3 values exact in either; each scale block's
partial sum is scaled before it is added, so the product is Σ x·q·s with q·s exact in f32: the reference rounds q·s to
x's dtype first, the kernel does not). Rows past `tokens` are written as zeros. With one split the kernel writes the
output in its dtype; with K splits it writes f32 partial sums [splits, ROWS, N], added in split order after the launch.
Every row is computed by the same programs whatever the number of real rows, so a decode's row and a verify's round
alike (row invariance, lingjax.model).

At T = 1 (tokens=1) every row the dot takes is x's row 0, read as lingjax.pallas.x_row_mode says: once per K step
and split in registers into the step's scale blocks, once per partial sum, or as 16 gathered copies where a row load
would be too narrow for Triton to pipeline (the same values in every case, so row 0 rounds as in a verify).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import (
    MIN_DOT_K,
    ROW_PER_SUM,
    X_ROW_MIN_BYTES,
    dot_nt,
    fp8_dots_reason,
    fp8_dots_rows,
    is_pow2,
    pallas_call,
    pow2_tile,
    resolve_interpret,
    row_reader,
    scaled_k_loop,
    short_dot,
    weight_layout,
    x_row_mode,
    x_rows,
)

F32 = jnp.float32
ROWS = 16  # the rows of x one program multiplies (a Triton dot's smallest M); fewer are padded
TARGET_PROGRAMS = 264  # two per H200 SM: enough loads in flight to stream the weight
STEP_BYTES = 256  # the default K step: this many bytes of each weight row (256 fp8 columns, 128 bf16 ones)


@dataclasses.dataclass(frozen=True)
class LinearTuning:
    """The launch's static choices. bn: the N tile, the largest power of 2 up to it dividing N (an fp8 weight: its
    scale block's rows); bk: the K step, a power of 2 dividing K / k_splits (0: STEP_BYTES of a weight row; an fp8
    step wider than a scale block takes one partial sum per block); k_splits: K splits (0: doubled while the programs
    are fewer than TARGET_PROGRAMS, each split whole K units (scale blocks, or K steps of a plain weight) of at least
    min_split columns). x_row_min_bytes, x_row_split: how a decode (T = 1) reads x's one row
    (lingjax.pallas.x_row_mode: from a load of this many bytes per 4 warps; once per K step, split in registers,
    with x_row_split). fp8_dots: how an fp8 weight meets bf16 rows (lingjax.pallas.FP8_DOTS; "f16": x passed in
    f16)."""

    bn: int = 64
    bk: int = 0
    k_splits: int = 0
    min_split: int = 256
    warps: int = 4
    stages: int = 4
    x_row_min_bytes: int = X_ROW_MIN_BYTES
    x_row_split: bool = False
    fp8_dots: str = "f16"


def _tiles(n: int, k: int, itemsize: int, block: tuple[int, int] | None,
           tuning: LinearTuning) -> tuple[int, int, int, int]:
    """(bn, splits, bk, sub): sub is the columns of one partial sum (a K step's part inside one scale block; a plain
    weight's whole step)."""
    want_bk = tuning.bk or max(STEP_BYTES // itemsize, 1)
    gn, gk = block if block is not None else (n, pow2_tile(k, want_bk))
    bn = pow2_tile(gn, tuning.bn)
    splits = tuning.k_splits
    if splits == 0:
        splits = 1
        while (n // bn * splits < TARGET_PROGRAMS and k % (splits * 2 * gk) == 0
               and k // (splits * 2) >= tuning.min_split):
            splits *= 2
    bk = pow2_tile(k // splits, want_bk)
    return bn, splits, bk, min(bk, gk)


def plan(x_dtype, w, tokens=None, tuning: LinearTuning = LinearTuning()) -> dict:
    """The launch `linear` makes for x of `x_dtype` and the weight w (array, Fp8Array or their ShapeDtypeStructs):
    its N tile, K splits, K step, partial-sum width and (tokens=1) how x's row is read (lingjax.pallas.x_row_mode)."""
    n, k, itemsize, block = weight_layout(w)
    bn, splits, bk, sub = _tiles(n, k, itemsize, block, tuning)
    mode = x_row_mode(1 if tokens == 1 else ROWS, bk, sub, x_dtype, tuning.x_row_min_bytes, tuning.warps,
                      tuning.x_row_split)
    return dict(bn=bn, splits=splits, bk=bk, sub=sub, x_row=mode or "gather")


def supports(x, w, out_dtype=None, *, tokens=None, tuning: LinearTuning = LinearTuning(), interpret=None) -> str | None:
    """None when `linear` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes right on
    the GPU, else why not: at most ROWS rows; a 2-D weight; K split evenly (an fp8 weight: into whole scale blocks);
    power-of-2 tiles of at least MIN_DOT_K along K and 16 along N (an fp8 weight's scale blocks bound them)."""
    del out_dtype, tokens, interpret
    if reason := fp8_dots_reason(tuning.fp8_dots):
        return reason
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    if rows > ROWS:
        return f"{rows} rows of x, over the {ROWS} one program multiplies"
    if len(w.shape) != 2:
        return f"a weight of {len(w.shape)} dimensions, not a matrix"
    n, k, itemsize, block = weight_layout(w)
    if block is not None:
        gn, gk = block
        if not is_pow2(gn) or not is_pow2(gk):
            return f"scale blocks of {gn} x {gk}, not powers of 2"
        if tuning.k_splits and k % (tuning.k_splits * gk):
            return f"{tuning.k_splits} K splits of K = {k} in scale blocks of {gk} columns"
    bn, splits, bk, sub = _tiles(n, k, itemsize, block, tuning)
    where = f" (scale blocks of {block[0]} x {block[1]})" if block is not None else ""
    if bn < 16:
        return f"an N tile of {bn} for N = {n}{where}, under the 16 of a Triton dot"
    if short_dot(sub, x.dtype):
        return f"a K step of {sub} for K = {k}{where} on {jnp.dtype(x.dtype).name} operands, under {MIN_DOT_K}"
    if k % splits or (k // splits) % bk:
        return f"a K step of {bk} that does not divide the split's {k / splits:g} columns"
    return None


def _kernel(x_ref, w_ref, *refs, bn, bk, sub, gn, gk, k_split, one_token, x_row, tokens, scaled, partial):
    # x_ref [ROWS, K] (one_token: [≥ 1, K], its row 0 alone read); w_ref [N, K], plain or fp8; scaled: s_ref
    # [N / gn, K / gk] f32 first; y_ref [splits, ROWS, N] f32 (partial) or [ROWS, N] in the output's dtype.
    # x_row: lingjax.pallas.x_row_mode at T = 1.
    s_ref, y_ref = refs if scaled else (None, refs[0])
    n, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * bn, bn)
    k0 = split * k_split
    # at T = 1 every row is row 0 (x may hold that row alone: the drafter's), gathered or broadcast
    rows = jnp.zeros((ROWS,), jnp.int32) if one_token else jnp.arange(ROWS)

    def terms(start, ks, scale, part):  # one partial sum per scale block a K step spans (a plain weight: one)
        if part is None:
            xs = x_rows(x_ref, rows, pl.ds(k0 + start, ks.size), x_row == ROW_PER_SUM)
        else:  # x's row of the whole K step, read once, this block's part
            xs = jnp.broadcast_to(part, (ROWS, ks.size))
        w = w_ref[cols, pl.ds(k0 + start, ks.size)].astype(xs.dtype)
        product = dot_nt(xs, w)
        return (product * scale[0] if scaled else product,)

    scales = None
    if scaled:
        scales = lambda kb: (s_ref[n * bn // gn, k0 // gk + kb],)  # noqa: E731
    (acc,) = scaled_k_loop(k_split // bk, bk, sub, (jnp.zeros((ROWS, bn), F32),), terms, scales, gk,
                           row_reader(x_ref, x_row, k0))
    if tokens < ROWS:  # the rows past the real ones come out zero
        acc = jnp.where(jnp.arange(ROWS)[:, None] < tokens, acc, 0.0)
    if partial:
        y_ref[split, :, cols] = acc
    else:
        y_ref[:, cols] = acc.astype(y_ref.dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "tokens", "tuning", "interpret"))
def linear(x, w, out_dtype=None, *, tokens=None, tuning: LinearTuning = LinearTuning(), interpret=None):
    """x [..., K] (at most ROWS rows), w [N, K] (an array, or an Fp8Array read as fp8) -> [..., N] in out_dtype
    (default x's dtype), from f32 sums rounded once: lingjax.ops.linear.linear (for an fp8 weight without rounding
    the dequantized weight). tokens: the rows that are real (default all): the rows past them come out zero; at
    tokens = 1 the kernel reads x's row 0 alone (the module docstring says how) into the dot's ROWS rows (the same
    dot, so row 0 rounds as in a verify). w may be one layer of a stack (lingjax.stacked.LayerOf, or an Fp8Array
    of two), read in place. Shapes it lowers for: supports."""
    interpret = resolve_interpret(interpret)
    lead, k = x.shape[:-1], x.shape[-1]
    if len(w.shape) != 2 or w.shape[1] != k:
        raise ValueError(f"linear takes x [..., {k}] and a weight [N, {k}], got weight {list(w.shape)}")
    n, _, itemsize, block = weight_layout(w)
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows > ROWS:
        raise ValueError(f"the Pallas linear multiplies at most {ROWS} rows, got {rows}")
    bn, splits, bk, sub = _tiles(n, k, itemsize, block, tuning)
    one_token = tokens == 1
    if rows < ROWS and not one_token:
        flat = jnp.pad(flat, ((0, ROWS - rows), (0, 0)))
    real = rows if tokens is None else min(tokens, rows)
    x_row = x_row_mode(1 if one_token else ROWS, bk, sub, x.dtype, tuning.x_row_min_bytes, tuning.warps,
                       tuning.x_row_split)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    partial = splits > 1
    out_shape = (splits, ROWS, n) if partial else (ROWS, n)
    operands = (fp8_dots_rows(flat, tuning.fp8_dots), w.q, w.scale) if block is not None else (flat, w)
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages)
    y = pallas_call(
        functools.partial(_kernel, bn=bn, bk=bk, sub=sub, gn=block[0] if block else bn, gk=block[1] if block else bk,
                          k_split=k // splits,
                          one_token=one_token, x_row=x_row, tokens=real, scaled=block is not None, partial=partial),
        out_shape=jax.ShapeDtypeStruct(out_shape, F32 if partial else out_dtype),
        grid=(n // bn, splits),
        compiler_params=params,
        interpret=interpret,
        name="linear",
    )(*operands)
    if partial:
        out = y[0]
        for j in range(1, splits):  # the splits' partial sums in split order, a chain of adds (row invariance)
            out = out + y[j]
        y = out.astype(out_dtype)
    return y[:rows].reshape(*lead, n)
