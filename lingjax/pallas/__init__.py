"""Pallas GPU kernels, each beside the plain-JAX reference in lingjax/ops/ it is tested against.

kda_chain (fused chain-verify/decode + commit), kda_prefill (chunked prefill), mla_decode (absorbed MLA
attention at decode/verify widths, split-L from the bf16 cache), moe_router, moe_align (pair-axis align),
moe_experts (grouped GEMMs with the SwiGLU epilogue; routed_experts: at T = 1 the up kernel also routes the
token); and skinny_linear (projections at 16 rows), measured but not in the kernel set (its docstring says
why). lingjax/kernels.py maps each onto the reference op it replaces; `lingjax.load(..., kernels="pallas")`
selects them.
Every kernel is launched through `pallas_call` below, which starts it with griddepcontrol.wait
(grid_dependency: the step programs run with programmatic dependent launch). l2_prefetch: an L2 prefetch
primitive for kernels (the decode's up kernel pulls the shared expert's weights ahead of its reads).
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lingjax import target
from lingjax.pallas.grid_dependency import after_producers

_NT = (((1,), (1,)), ((), ()))  # contract a's and b's last dims: a [M, K] · b [N, K]ᵀ

# At T = 1 a kernel whose dot takes 16 gathered x rows (all the token's) reads the row once per K step and
# broadcasts it, when a step's row spans at least this many bytes (moe_experts' up kernel, moe_router's GEMV).
# On the H200 with bf16 x: at a K step of 256 (512 B) the up kernel took 0.9-1.7 µs less (T = 1 layer,
# interleaved in one process, seven processes) and the GEMV 0.13; at 128 (256 B) the up kernel took 9.5 µs
# more, as if the pipeliner no longer prefetched the row (bench/results/moe_h200_2026-12-01_run5.md).
X_ROW_MIN_BYTES = 512


def reads_one_row(tokens: int, bk: int, dtype) -> bool:
    """Whether a kernel gathering 16 x rows per K step of bk reads x's one row instead (T = 1, X_ROW_MIN_BYTES)."""
    return tokens == 1 and bk * jnp.dtype(dtype).itemsize >= X_ROW_MIN_BYTES


def x_rows(x_ref, rows, ks, one_row: bool):
    """x_ref[rows, ks] inside a kernel, [len(rows), ks.size]; with one_row (every row is row 0) row 0 read
    once and broadcast in registers."""
    if one_row:
        return jnp.broadcast_to(x_ref[pl.ds(0, 1), ks], (rows.shape[0], ks.size))
    return x_ref[rows, ks]


def resolve_interpret(interpret: bool | None) -> bool:
    """interpret=None means: interpret mode unless the backend is a GPU (chosen by backend, never by
    import failure; the CPU backend only runs Pallas in interpret mode)."""
    return target.platform() != "gpu" if interpret is None else interpret


def pow2_tile(n: int, want: int) -> int:
    """Largest power of 2 ≤ want dividing n (tiny test dims may get a tile under the GPU minimum)."""
    t = 1
    while t * 2 <= want and n % (t * 2) == 0:
        t *= 2
    return t


def dot_nt(a, b):
    """a [M, K] · b [N, K]ᵀ -> [M, N] f32 inside a kernel: f32 operands at IEEE precision (no TF32),
    narrower ones on the tensor cores with f32 accumulation."""
    prec = jax.lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return jax.lax.dot_general(a, b, _NT, precision=prec, preferred_element_type=jnp.float32)


def pallas_call(kernel, **kwargs):
    """pl.pallas_call, its kernel first waiting for the kernels it depends on (lingjax.pallas.grid_dependency:
    safe under XLA's programmatic dependent launch). Every kernel of the package goes through here."""
    return pl.pallas_call(after_producers(kernel), **kwargs)
