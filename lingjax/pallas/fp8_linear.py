"""y = x·Wᵀ with an fp8 weight read as fp8: the Pallas form of lingjax.ops.linear.linear on an Fp8Array, for the
few rows of a decode or verify (at most ROWS; larger x runs the reference, XLA's GEMM on the dequantized weight).

One launch, fp8_linear, grid (N / bn, K splits): each program streams its [bn, K / splits] strip of the fp8
weight once, converts each tile to x's dtype in registers (e4m3 values are exact in bf16), multiplies it with x's
[ROWS, bk] rows on the tensor cores with f32 accumulation, and scales each block's partial sum by the block's
scale before adding it (so the product is Σ x·q·s with q·s exact in f32: the reference rounds q·s to x's dtype
first, the kernel does not). With K splits the partial sums [splits, ROWS, N] are added in split order after the
launch, the real rows' alone. Every row is computed by the same programs whatever the number of real rows, so a
decode's row and a verify's round alike (row invariance, lingjax.model).

At T = 1 (tokens=1) every row the dot takes is x's row 0, read as lingjax.pallas.x_row_mode says: once per K step
and split in registers into the step's scale blocks, once per block, or as 16 gathered copies where a row load
would be too narrow for Triton to pipeline (the same values in every case, so row 0 rounds as in a verify).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.fp8 import Fp8Array
from lingjax.pallas import (MIN_DOT_K, ROW_PER_SUM, X_ROW_MIN_BYTES, dot_nt, is_pow2, pallas_call, pow2_tile,
                            resolve_interpret, row_reader, scaled_k_loop, short_dot, x_row_mode, x_rows)

F32 = jnp.float32
ROWS = 16  # the rows of x one program multiplies (a Triton dot's smallest M); fewer are padded
TARGET_PROGRAMS = 264  # two per H200 SM: enough loads in flight to stream the weight


@dataclasses.dataclass(frozen=True)
class Fp8LinearTuning:
    """The launch's static choices. bn: the N tile, the largest power of 2 up to it dividing the scale block's
    rows (wide tiles: x's rows, read again by every program, cost less beside them); bk: the K step, a power of 2
    dividing K / k_splits (steps wider than a scale block take one partial sum per block); k_splits: K splits
    (0: doubled while the programs are fewer than TARGET_PROGRAMS, each split whole scale blocks of at least
    min_split columns). x_row_min_bytes, x_row_split: how a decode (T = 1) reads x's one row
    (lingjax.pallas.x_row_mode: from a load of this many bytes per 4 warps; once per K step, split in registers,
    with x_row_split)."""

    bn: int = 128
    bk: int = 256
    k_splits: int = 0
    min_split: int = 256
    warps: int = 4
    stages: int = 4
    x_row_min_bytes: int = X_ROW_MIN_BYTES
    x_row_split: bool = False


def _tiles(n: int, k: int, block: tuple[int, int], tuning: Fp8LinearTuning) -> tuple[int, int, int, int]:
    """(bn, splits, bk, sub): sub is the columns of one partial sum (a K step's part inside one scale block)."""
    gn, gk = block
    bn = pow2_tile(gn, tuning.bn)
    splits = tuning.k_splits
    if splits == 0:
        splits = 1
        while (n // bn * splits < TARGET_PROGRAMS and k % (splits * 2 * gk) == 0
               and k // (splits * 2) >= tuning.min_split):
            splits *= 2
    bk = pow2_tile(k // splits, tuning.bk)
    return bn, splits, bk, min(bk, gk)


def plan(x_dtype, n: int, k: int, block: tuple[int, int], tokens=None,
         tuning: Fp8LinearTuning = Fp8LinearTuning()) -> dict:
    """The launch fp8_linear makes for x of `x_dtype` and an [n, k] weight in scale blocks `block`: its N tile,
    K splits, K step, partial-sum width and (tokens=1) how x's row is read (lingjax.pallas.x_row_mode)."""
    bn, splits, bk, sub = _tiles(n, k, block, tuning)
    mode = x_row_mode(1 if tokens == 1 else ROWS, bk, sub, x_dtype, tuning.x_row_min_bytes, tuning.warps,
                      tuning.x_row_split)
    return dict(bn=bn, splits=splits, bk=bk, sub=sub, x_row=mode or "gather")


def supports(x, w: Fp8Array, out_dtype=None, *, tokens=None, tuning: Fp8LinearTuning = Fp8LinearTuning(),
             interpret=None) -> str | None:
    """None when `fp8_linear` with these arguments (arrays or ShapeDtypeStructs) lowers to Triton and computes
    right on the GPU, else why not: at most ROWS rows; K split evenly into whole scale blocks; power-of-2 tiles of
    at least MIN_DOT_K along K and 16 along N (the scale blocks' sizes bound them)."""
    del out_dtype, tokens, interpret
    rows = 1
    for d in x.shape[:-1]:
        rows *= d
    n, k = w.shape
    gn, gk = w.block
    if rows > ROWS:
        return f"{rows} rows of x, over the {ROWS} one program multiplies"
    if tuning.k_splits and k % (tuning.k_splits * gk):
        return f"{tuning.k_splits} K splits of K = {k} in scale blocks of {gk} columns"
    bn, splits, bk, sub = _tiles(n, k, (gn, gk), tuning)
    if not is_pow2(gn) or not is_pow2(gk):
        return f"scale blocks of {gn} x {gk}, not powers of 2"
    if bn < 16:
        return f"an N tile of {bn} (scale blocks of {gn} rows), under the 16 of a Triton dot"
    if short_dot(sub, x.dtype):
        return f"a K step of {sub} (scale blocks of {gk} columns) on {jnp.dtype(x.dtype).name} operands, under {MIN_DOT_K}"
    if (k // splits) % bk:
        return f"a K step of {bk} that does not divide the split's {k // splits} columns"
    return None


def _kernel(x_ref, q_ref, s_ref, y_ref, *, bn, bk, sub, gn, gk, k_split, one_token, x_row):
    # x_ref [ROWS, K] (one_token: [≥ 1, K], its row 0 alone read); q_ref [N, K] fp8; s_ref [N / gn, K / gk] f32;
    # y_ref [splits, ROWS, N] f32. x_row: lingjax.pallas.x_row_mode at T = 1.
    n, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * bn, bn)
    row_block = n * bn // gn
    k0 = split * k_split
    # at T = 1 every row is row 0 (x may hold that row alone: the drafter's), gathered or broadcast
    rows = jnp.zeros((ROWS,), jnp.int32) if one_token else jnp.arange(ROWS)

    def terms(start, ks, scale, part):  # one partial sum per scale block a K step spans
        if part is None:
            xs = x_rows(x_ref, rows, pl.ds(k0 + start, ks.size), x_row == ROW_PER_SUM)
        else:  # x's row of the whole K step, read once, this block's part
            xs = jnp.broadcast_to(part, (ROWS, ks.size))
        w = q_ref[cols, pl.ds(k0 + start, ks.size)].astype(xs.dtype)
        return (dot_nt(xs, w) * scale[0],)

    (acc,) = scaled_k_loop(k_split // bk, bk, sub, (jnp.zeros((ROWS, bn), F32),), terms,
                           lambda kb: (s_ref[row_block, k0 // gk + kb],), gk, row_reader(x_ref, x_row, k0))
    y_ref[split, :, cols] = acc


@functools.partial(jax.jit, static_argnames=("out_dtype", "tokens", "tuning", "interpret"))
def fp8_linear(x, w: Fp8Array, out_dtype=None, *, tokens=None, tuning: Fp8LinearTuning = Fp8LinearTuning(),
               interpret=None):
    """x [..., K] (at most ROWS rows), w an Fp8Array [N, K] -> [..., N] in out_dtype (default x's dtype), from
    f32 sums rounded once; as lingjax.ops.fp8.linear (lingjax.ops.linear.linear(x, w.dequantize(x.dtype))) but
    without rounding the dequantized weight. tokens: the rows that are real (default all): only their partial
    sums are read after the launch, and the rows past them come out zero; at tokens = 1 the kernel reads x's row 0
    alone (the module docstring says how) into the dot's ROWS rows (the same dot, so row 0 rounds as in a
    verify). Shapes it lowers for: supports."""
    interpret = resolve_interpret(interpret)
    lead, k = x.shape[:-1], x.shape[-1]
    n = w.shape[0]
    if w.ndim != 2 or w.shape[1] != k:
        raise ValueError(f"fp8_linear takes x [..., {k}] and an fp8 weight [N, {k}], got weight {list(w.shape)}")
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if rows > ROWS:
        raise ValueError(f"fp8_linear multiplies at most {ROWS} rows, got {rows}")
    gn, gk = w.block
    bn, splits, bk, sub = _tiles(n, k, (gn, gk), tuning)
    one_token = tokens == 1
    if rows < ROWS and not one_token:
        flat = jnp.pad(flat, ((0, ROWS - rows), (0, 0)))
    x_row = x_row_mode(1 if one_token else ROWS, bk, sub, x.dtype, tuning.x_row_min_bytes, tuning.warps,
                       tuning.x_row_split)
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages)
    y = pallas_call(
        functools.partial(_kernel, bn=bn, bk=bk, sub=sub, gn=gn, gk=gk, k_split=k // splits, one_token=one_token,
                          x_row=x_row),
        out_shape=jax.ShapeDtypeStruct((splits, ROWS, n), F32),
        grid=(n // bn, splits),
        compiler_params=params,
        interpret=interpret,
        name="fp8_linear",
    )(flat, w.q, w.scale)
    real = rows if tokens is None else min(tokens, rows)  # the rows whose sums are read (a decode's one)
    out = y[0, :real]
    for j in range(1, splits):  # the splits' partial sums in split order, a chain of adds (row invariance)
        out = out + y[j, :real]
    out = out.astype(out_dtype or x.dtype)
    if real < rows:  # in the same fusion as the sums
        out = jnp.pad(out, ((0, rows - real), (0, 0)))
    return out.reshape(*lead, n)
