"""Projections at decode/verify widths: y = x·Wᵀ for x of 16 (up to 64) rows, one launch, no split-K.

At 16 rows a projection is a weight read: XLA's GEMM fusion for the Flash o_proj ([16, 2048] x
[2560, 2048] on one TP2 device, 10.5 MB) chose split-K, a GEMM of 6.0 µs plus a reduce kernel of 1.6 µs,
2.6x the byte floor, 42 times a verify (bench/results/step_flash_h200x2_2026-11-30_run3.md).
Here one program per `block_n` output columns streams its [block_n, K] weight rows once over the whole
K axis (block_k at a time, `stages` loads in flight) against all rows of x, and writes its columns in
the output dtype: one launch, and the K order of every output element is fixed by block_k alone, so a
row rounds the same whatever the other rows hold (row invariance, lingjax/model.py).

Not in the model's kernel set. Alone it beats XLA's GEMM at every Flash projection shape at 16 rows
(bench/linear_bench.py; the wide KDA in_proj only with 32-column tiles, 17.7 against 18.8 µs), and in a
Flash TP2 step's profile the o_proj took 6.0 µs against XLA's 7.6. But with every 16-row projection on
it the whole step was between 2.8% faster and 2.8% slower (decode and round, one and four per call, an
A/B in one process), and the host's dispatch time per round grew by up to 1.5 ms, 183 more custom calls
a round (bench/results/linear_h200x2_2026-11-30.md). Fusing the KDA gated norm into an o_proj of this
shape (one launch for three) ran 21.8 µs against XLA's 11.6: every program recomputed every head's norm
and gate between its weight loads (bench/results/step_flash_h200x2_2026-11-30_run5.md).

Reference: lingjax.ops.linear.linear.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.linear import linear
from lingjax.pallas import dot_nt, pallas_call, pow2_tile, resolve_interpret

F32 = jnp.float32
MAX_ROWS = 64  # the whole x is every program's M block


def _kernel(x_ref, w_ref, y_ref, *, block_n, block_k):
    # x_ref [M, K]; w_ref [N, K]; y_ref [M, N]
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)

    def step(kk, acc):
        ks = pl.ds(pl.multiple_of(kk * block_k, block_k), block_k)
        return acc + dot_nt(x_ref[:, ks], w_ref[cols, ks])

    acc = jax.lax.fori_loop(0, x_ref.shape[1] // block_k, step, jnp.zeros((x_ref.shape[0], block_n), F32))
    y_ref[:, cols] = acc.astype(y_ref.dtype)  # the one rounding


@functools.partial(jax.jit, static_argnames=("out_dtype", "block_n", "block_k", "warps", "stages", "interpret"))
def skinny_linear(x, w, out_dtype=None, *, block_n: int | None = None, block_k: int = 256, warps: int = 2,
                  stages: int | None = None, interpret=None):
    """Same arguments and result as lingjax.ops.linear.linear: x [M, K], w [N, K] -> [M, N] in out_dtype
    (default x's dtype), f32 accumulation. M a multiple of 16 up to MAX_ROWS (the GPU dot's minimum M);
    other shapes (prefill, the drafter's unpadded rows) take the reference, XLA's GEMM.

    Tiles by the H200 sweep (bench/results/linear_h200x2_2026-11-30.md, Flash TP2 shares at 16 rows):
    block_n 16 and 4 stages for N < 8192 (o_proj 6.6 µs, XLA 11.7 in the same harness), block_n 32 and 3
    stages for the wide KDA in_proj (N = 10240: 17.7 µs, XLA 18.8, 16-column tiles 21.3)."""
    wide = w.shape[0] >= 8192
    block_n = block_n or (32 if wide else 16)
    stages = stages or (3 if wide else 4)
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"x {x.shape} and w {w.shape} disagree on the input dim")
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if m % 16 or m > MAX_ROWS:
        return linear(x, w, out_dtype)
    block_n, block_k = pow2_tile(n, block_n), pow2_tile(k, block_k)
    interpret = resolve_interpret(interpret)
    return pallas_call(
        functools.partial(_kernel, block_n=block_n, block_k=block_k),
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(n // block_n,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="skinny_linear",
    )(x, w)
