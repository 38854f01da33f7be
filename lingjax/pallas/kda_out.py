"""KDA's output sub-layer in one launch: the gated RMSNorm of the chain's output and the o_proj GEMM.

y = rms_norm(o_h)·w·sigmoid(g_h) per head h, rounded to the activations' dtype, then y·o_projᵀ in f32:
the row-parallel partial sums that the layer's all-reduce takes. XLA runs this as three kernels at
verify/decode widths (the gated-norm fusion, a split-K GEMM and its reduce: 18 launches per KDA + MoE
verify layer, bench/results/aot_census_2026-11-30.md). Here one program per `block_n` output columns
streams its [block_n, H·V] weight rows one head at a time; the head's K block is exactly the span of
its norm, so each step norms and gates one [rows, V] block of o in registers before the dot. Every
program recomputes the norms (rows·H·V elements, a few KB from L2), and reads only the first `tokens`
rows of o and g: the padded rows are masked to zero, which is what the reference computes for them
(o is zero there), so a decode reads one row, not sixteen.

Row invariance (lingjax.model): row j's result depends on row j alone, the K order is fixed (head by
head), and the GEMM always has the forward's padded row count, so a verify's row rounds as a decode's.

Reference: lingjax.ops.kda.kda_output.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from lingjax.ops.kda import kda_output
from lingjax.pallas import dot_nt, pow2_tile, resolve_interpret

F32 = jnp.float32
MAX_ROWS = 64  # decode/verify widths (a multiple of 16, the GPU dot's minimum M); wider forwards take the reference


def _kernel(o_ref, g_ref, nw_ref, w_ref, y_ref, *, tokens, dim, gate_col, block_n, heads_per_step, mask_rows, eps):
    # o_ref [rows, H, V] f32; g_ref [rows, >= gate_col + H·V] (g in columns [gate_col, gate_col + H·V));
    # nw_ref [V]; w_ref [N, H·V] -> y_ref [rows, N] f32
    rows, heads = o_ref.shape[0], o_ref.shape[1]
    cols = pl.ds(pl.multiple_of(pl.program_id(0) * block_n, block_n), block_n)
    live = (jnp.arange(rows) < tokens)[:, None]  # rows past T are not read: zeros, as the reference's o there
    nw = nw_ref[...].astype(F32)

    def read(ref):
        return pltriton.load(ref, mask=live, other=0.0) if mask_rows else ref[...]

    def head(h, acc):
        o = read(o_ref.at[:, h, :]).astype(F32)  # [rows, V]
        g = read(g_ref.at[:, pl.ds(gate_col + h * dim, dim)]).astype(F32)
        y = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps)
        y = (y * nw * jax.nn.sigmoid(g)).astype(g_ref.dtype)  # the reference's rounding before the GEMM
        return acc + dot_nt(y, w_ref[cols, pl.ds(pl.multiple_of(h * dim, dim), dim)])

    def step(i, acc):  # heads_per_step heads, unrolled
        for j in range(heads_per_step):
            acc = head(i * heads_per_step + j, acc)
        return acc

    y_ref[:, cols] = jax.lax.fori_loop(0, heads // heads_per_step, step, jnp.zeros((rows, block_n), F32))


@functools.partial(jax.jit, static_argnames=("tokens", "eps", "block_n", "warps", "stages", "heads_per_step",
                                             "mask_rows", "interpret"))
def kda_output_fused(o, proj, norm_w, o_proj, *, tokens, eps, block_n: int = 16, warps: int = 2, stages: int = 4,
                     heads_per_step: int = 1, mask_rows: bool = True, interpret=None):
    """Same arguments and result as lingjax.ops.kda.kda_output, one launch. Rows a multiple of 16 up to
    MAX_ROWS (decode and verify); other row counts (prefill) take the reference. block_n, warps, stages:
    skinny_linear's best o_proj tile on the H200 (bench/results/linear_h200x2_2026-11-30.md)."""
    rows, h, dv = o.shape
    n, p = o_proj.shape
    if p != h * dv or norm_w.shape != (dv,) or proj.shape[0] != rows or proj.shape[1] < p:
        raise ValueError(f"kda_output: o {o.shape}, proj {proj.shape}, norm_w {norm_w.shape} and o_proj "
                         f"{o_proj.shape} disagree")
    if rows % 16 or rows > MAX_ROWS:
        return kda_output(o, proj, norm_w, o_proj, tokens=tokens, eps=eps)
    block_n = pow2_tile(n, block_n)
    heads_per_step = pow2_tile(h, heads_per_step)
    interpret = resolve_interpret(interpret)
    kernel = functools.partial(_kernel, tokens=min(tokens, rows), dim=dv, gate_col=proj.shape[1] - p,
                               block_n=block_n, heads_per_step=heads_per_step, mask_rows=mask_rows, eps=eps)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, n), F32),
        grid=(n // block_n,),
        compiler_params=None if interpret else pltriton.CompilerParams(num_warps=warps, num_stages=stages),
        interpret=interpret,
        name="kda_output",
    )(o, proj, norm_w, o_proj)
