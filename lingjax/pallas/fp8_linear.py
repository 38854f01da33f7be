"""y = x·Wᵀ with an fp8 weight read as fp8: the Pallas form of lingjax.ops.linear.linear on an Fp8Array, for the
few rows of a decode or verify (at most ROWS; larger x runs the reference, XLA's GEMM on the dequantized weight).

One launch, fp8_linear, grid (N / bn, K splits): each program streams its [bn, K / splits] strip of the fp8
weight once, converts each tile to x's dtype in registers (e4m3 values are exact in bf16), multiplies it with x's
[ROWS, bk] rows on the tensor cores with f32 accumulation, and scales each block's partial sum by the block's
scale before adding it (so the product is Σ x·q·s with q·s exact in f32: the reference rounds q·s to x's dtype
first, the kernel does not). With K splits the partial sums [splits, ROWS, N] are added in split order after the
launch. Every row is computed by the same programs whatever the number of real rows, so a decode's row and a
verify's round alike (row invariance, lingjax.model).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.fp8 import Fp8Array
from lingjax.pallas import (MIN_DOT_K, dot_nt, is_pow2, pallas_call, pow2_tile, resolve_interpret, scaled_k_loop,
                            short_dot, x_rows)

F32 = jnp.float32
ROWS = 16  # the rows of x one program multiplies (a Triton dot's smallest M); fewer are padded
TARGET_PROGRAMS = 264  # two per H200 SM: enough loads in flight to stream the weight


@dataclasses.dataclass(frozen=True)
class Fp8LinearTuning:
    """The launch's static choices. bn: the N tile, the largest power of 2 up to it dividing the scale block's
    rows (wide tiles: x's rows, read again by every program, cost less beside them); bk: the K step, a power of 2
    dividing K / k_splits (steps wider than a scale block take one partial sum per block); k_splits: K splits
    (0: doubled while the programs are fewer than TARGET_PROGRAMS, each split whole scale blocks of at least
    min_split columns)."""

    bn: int = 128
    bk: int = 256
    k_splits: int = 0
    min_split: int = 256
    warps: int = 4
    stages: int = 4


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


def _kernel(x_ref, q_ref, s_ref, y_ref, *, bn, bk, sub, gn, gk, k_split, one_row):
    # x_ref [ROWS, K] (one_row: [≥ 1, K], its row 0 alone read); q_ref [N, K] fp8; s_ref [N / gn, K / gk] f32;
    # y_ref [splits, ROWS, N] f32
    n, split = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(n * bn, bn)
    row_block = n * bn // gn
    k0 = split * k_split
    rows = jnp.arange(ROWS)

    def terms(start, ks, scale):  # one partial sum per scale block a K step spans
        xs = x_rows(x_ref, rows, pl.ds(k0 + start, ks.size), one_row)
        w = q_ref[cols, pl.ds(k0 + start, ks.size)].astype(xs.dtype)
        return (dot_nt(xs, w) * scale[0],)

    (acc,) = scaled_k_loop(k_split // bk, bk, sub, (jnp.zeros((ROWS, bn), F32),), terms,
                           lambda kb: (s_ref[row_block, k0 // gk + kb],), gk)
    y_ref[split, :, cols] = acc


@functools.partial(jax.jit, static_argnames=("out_dtype", "tokens", "tuning", "interpret"))
def fp8_linear(x, w: Fp8Array, out_dtype=None, *, tokens=None, tuning: Fp8LinearTuning = Fp8LinearTuning(),
               interpret=None):
    """x [..., K] (at most ROWS rows), w an Fp8Array [N, K] -> [..., N] in out_dtype (default x's dtype), from
    f32 sums rounded once; as lingjax.ops.fp8.linear (lingjax.ops.linear.linear(x, w.dequantize(x.dtype))) but
    without rounding the dequantized weight. tokens: the rows that are real (default all); at tokens = 1 the
    kernel reads x's row 0 once per K step and broadcasts it into the dot's ROWS rows (the same dot, so row 0
    rounds as in a verify), and rows past it are unspecified. Shapes it lowers for: supports."""
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
    one_row = tokens == 1
    if rows < ROWS and not one_row:
        flat = jnp.pad(flat, ((0, ROWS - rows), (0, 0)))
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.warps, num_stages=tuning.stages)
    y = pallas_call(
        functools.partial(_kernel, bn=bn, bk=bk, sub=sub, gn=gn, gk=gk, k_split=k // splits, one_row=one_row),
        out_shape=jax.ShapeDtypeStruct((splits, ROWS, n), F32),
        grid=(n // bn, splits),
        compiler_params=params,
        interpret=interpret,
        name="fp8_linear",
    )(flat, w.q, w.scale)
    out = y[0]
    for j in range(1, splits):  # the splits' partial sums in split order, a chain of adds (row invariance)
        out = out + y[j]
    return out[:rows].astype(out_dtype or x.dtype).reshape(*lead, n)
