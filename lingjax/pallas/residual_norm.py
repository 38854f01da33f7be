"""The residual add and the next RMSNorm of a decode or verify in one launch: the Pallas form of
lingjax.ops.norms.residual_rms_norm.

Why: at a decode's few rows the add and the norm are a few µs of launch each and almost no bytes. XLA emits them
as two kernels (a loop fusion that writes the residual stream, a norm fusion that reads it again), and the split-K
partial sums of the projection before them (lingjax.pallas.linear, split_sums) as part of the first. Here one
program per row adds the partial sums in their order, rounds once to the stream's dtype, adds the residual, and
normalizes the row it holds in registers: every element of both outputs is written by that row's program.

The row's D columns are read in `chunk`-wide pieces (the largest power of 2 dividing D, at most MAX_CHUNK: Triton
blocks are powers of 2), unrolled; the mean of squares adds the pieces' squares column by column, then reduces the
chunk once, divided by D. That order is not XLA's: a rounding change against the reference in the mean's last
places (docs/kernels/README.md).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.pallas import pallas_call, resolve_interpret

F32 = jnp.float32
MAX_CHUNK = 1024  # columns of one load
MAX_CHUNKS = 16  # pieces of a row held in registers at once


@dataclasses.dataclass(frozen=True)
class ResidualNormTuning:
    """The launch's static choices: warps per program (one program a row); chunk: the columns of one load, a power of
    2 dividing D (0: the largest up to MAX_CHUNK)."""

    warps: int = 4
    chunk: int = 0


def _chunk(d: int, tuning: ResidualNormTuning = ResidualNormTuning()) -> int:
    if tuning.chunk:
        return tuning.chunk
    chunk = 1
    while d % (chunk * 2) == 0 and chunk * 2 <= MAX_CHUNK:
        chunk *= 2
    return chunk


def supports(x, parts, weight, eps=None, *, tuning: ResidualNormTuning = ResidualNormTuning(),
             interpret=None) -> str | None:
    """None when residual_norm lowers for these shapes: x [R, D], parts [S, T ≤ R, D], weight [D], D a multiple of a
    power of 2 of at least 16 in at most MAX_CHUNKS pieces."""
    del eps, interpret
    if len(x.shape) != 2 or len(parts.shape) != 3 or parts.shape[2] != x.shape[1] or parts.shape[1] > x.shape[0]:
        return f"x {list(x.shape)} and parts {list(parts.shape)}, not [R, D] and [S, T <= R, D]"
    d = x.shape[1]
    chunk = _chunk(d, tuning)
    if d % chunk or chunk & (chunk - 1):
        return f"a chunk of {chunk} columns for a row of {d}"
    if chunk < 16 or d // chunk > MAX_CHUNKS:
        return f"a row of {d} columns: {d // chunk} pieces of {chunk}"
    return None


def _kernel(x_ref, p_ref, w_ref, h_ref, n_ref, *, splits, part_rows, d, chunk, eps):
    r = pl.program_id(0)
    pr = jnp.minimum(r, part_rows - 1)  # the parts' row (rows past part_rows add zero)
    has_part = r < part_rows
    rows_f32 = []
    squares = jnp.zeros((chunk,), F32)  # the pieces' squares added lane by lane, reduced once
    for c in range(d // chunk):
        cols = pl.ds(c * chunk, chunk)
        a = p_ref[0, pr, cols]
        for j in range(1, splits):  # the partial sums in their order, in their dtype, as the reference adds them
            a = a + p_ref[j, pr, cols]
        a = jnp.where(has_part, a.astype(x_ref.dtype), jnp.zeros_like(a, x_ref.dtype))
        h = (x_ref[r, cols].astype(F32) + a.astype(F32)).astype(h_ref.dtype)
        h_ref[r, cols] = h
        hf = h.astype(F32)
        rows_f32.append(hf)
        squares = squares + hf * hf
    inv = jax.lax.rsqrt(jnp.sum(squares) / d + eps)
    for c, hf in enumerate(rows_f32):
        cols = pl.ds(c * chunk, chunk)
        y = (hf * inv).astype(x_ref.dtype).astype(F32)
        n_ref[r, cols] = (w_ref[cols].astype(F32) * y).astype(n_ref.dtype)


@functools.partial(jax.jit, static_argnames=("eps", "tuning", "interpret"))
def residual_norm(x, parts, weight, eps: float, *, tuning: ResidualNormTuning = ResidualNormTuning(), interpret=None):
    """x [R, D], parts [S, T ≤ R, D] (a projection's partial sums, f32, or one part of any float dtype), weight [D]
    -> (h = x + Σ parts rounded once to x's dtype [R, D], rms_norm(h, weight, eps) [R, D]); rows past T add zero.
    lingjax.ops.norms.residual_rms_norm, one launch (the module docstring says how). Shapes: supports."""
    interpret = resolve_interpret(interpret)
    reason = supports(x, parts, weight, tuning=tuning)
    if reason and not interpret:
        raise ValueError(f"residual_norm does not lower for {reason}")
    if len(x.shape) != 2 or len(parts.shape) != 3 or parts.shape[2] != x.shape[1] or parts.shape[1] > x.shape[0]:
        raise ValueError(f"residual_norm takes x [R, D] and parts [S, T <= R, D], got {list(x.shape)} and "
                         f"{list(parts.shape)}")
    rows, d = x.shape
    out_dtype = jnp.result_type(weight.dtype, x.dtype)
    chunk = _chunk(d, tuning)
    params = None if interpret else pltriton.CompilerParams(num_warps=tuning.warps, num_stages=1)
    return pallas_call(
        functools.partial(_kernel, splits=parts.shape[0], part_rows=parts.shape[1], d=d, chunk=chunk, eps=eps),
        out_shape=(jax.ShapeDtypeStruct((rows, d), x.dtype), jax.ShapeDtypeStruct((rows, d), out_dtype)),
        grid=(rows,),
        compiler_params=params,
        interpret=interpret,
        name="residual_norm",
    )(x, parts, weight)
