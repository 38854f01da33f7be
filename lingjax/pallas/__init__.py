"""Pallas GPU kernels, each replacing a plain-JAX reference in lingjax/ops/ (lingjax/kernels.py maps the model's
ops onto them; docs/kernels/ explains how each is shaped and why).

Every kernel is launched through `pallas_call` below, which starts it with griddepcontrol.wait
(lingjax.pallas.grid_dependency: the step programs run with programmatic dependent launch).
"""

import contextlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lingjax import target
from lingjax.pallas.grid_dependency import after_producers

_NT = (((1,), (1,)), ((), ()))  # contract a's and b's last dims: a [M, K] · b [N, K]ᵀ

# At T = 1 a kernel whose dot takes 16 copies of x's one row (moe_experts' up kernel, moe_router's GEMV) reads
# the row once per K step and broadcasts it when the step's row spans at least this many bytes; below, the
# broadcast is slower on the H200 (docs/kernels/moe.md). The default of the kernels' tuning field x_row_min_bytes.
X_ROW_MIN_BYTES = 512


def reads_one_row(tokens: int, bk: int, dtype, min_bytes: int = X_ROW_MIN_BYTES) -> bool:
    """Whether a kernel gathering 16 x rows per K step of bk reads x's one row instead: T = 1 and a step's row
    spans at least min_bytes."""
    return tokens == 1 and bk * jnp.dtype(dtype).itemsize >= min_bytes


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


# The smallest K step of a Triton dot on 16-bit operands: below it the H200 returns wrong sums without an error
# (Triton's own front end refuses such a dot, Pallas's lowering takes it); f32 operands, IEEE FMAs, take any K.
MIN_DOT_K = 16


def short_dot(k: int, dtype) -> bool:
    """Whether a dot on `dtype` operands stepping K by k is under MIN_DOT_K on the tensor cores."""
    return jnp.dtype(dtype).itemsize < 4 and k < MIN_DOT_K


def is_pow2(n: int) -> bool:
    """Whether n is a power of 2 (Triton's block shapes must be: supports() functions check tiles with it)."""
    return n >= 1 and n & (n - 1) == 0


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


class Instrument:
    """Measurement hooks inside the kernels (bench/kernel_stamps.py); this default changes nothing. launch() makes
    every kernel's launch; selected() sees the expert the decode's up kernel selects (lingjax.pallas.moe_experts)."""

    def launch(self, kernel, **kwargs):
        """The launch of `kernel` (its raw body) with pl.pallas_call's keywords -> the callable on the operands."""
        return pl.pallas_call(after_producers(kernel), **kwargs)

    def selected(self, expert):
        return expert


_instrument = Instrument()


@contextlib.contextmanager
def instrumented(instrument: Instrument):
    """Kernels traced inside the block launch through `instrument` (an Instrument subclass). Jitted entry points
    keep the programs they traced before: instrument their unjitted forms (`fn.__wrapped__`)."""
    global _instrument
    saved, _instrument = _instrument, instrument
    try:
        yield instrument
    finally:
        _instrument = saved


def pallas_call(kernel, **kwargs):
    """pl.pallas_call, its kernel first waiting for the kernels it depends on (lingjax.pallas.grid_dependency:
    safe under XLA's programmatic dependent launch). Every kernel of the package goes through here."""
    return _instrument.launch(kernel, **kwargs)


def selected(expert):
    """The expert a decode's up program selected, as the instrument sees it (Instrument.selected)."""
    return _instrument.selected(expert)


def scaled_k_loop(n_steps: int, bk: int, sub: int, zero: tuple, terms, scales=None, block_k: int = 0) -> tuple:
    """Σ over K of a kernel's partial sums -> accumulators shaped like the tuple `zero` (f32): n_steps K steps of
    bk, each in bk / sub partial sums `terms(start, ks, scale)` of `sub` columns (start, pl.ds(start, sub)).

    fp8 weights (lingjax.ops.fp8): each partial sum lies in one scale block of block_k columns, `scales(kb)` loads
    the scales of K block kb (a tuple, one per weight the terms read) and `scale` is that tuple. The loop carries
    the next step's scales, loaded before the current step's dots, so a scale's load latency hides behind them
    (Triton pipelines the weight tiles a dot reads, not a scalar load). Plain weights: scales None, scale None."""
    count = bk // sub

    def add(acc, start, scale):
        return tuple(a + t for a, t in zip(acc, terms(start, pl.ds(start, sub), scale)))

    def starts(kk):
        return [pl.multiple_of(kk * bk + j * sub, sub) for j in range(count)]

    if scales is None:
        def step(kk, acc):
            for start in starts(kk):
                acc = add(acc, start, None)
            return acc

        return jax.lax.fori_loop(0, n_steps, step, zero)

    def load(kk):
        kk = jnp.minimum(kk, n_steps - 1)
        return tuple(scales(start // block_k) for start in starts(kk))

    def scaled_step(kk, carry):
        acc, current = carry
        following = load(kk + 1)
        for start, scale in zip(starts(kk), current):
            acc = add(acc, start, scale)
        return acc, following

    acc, _ = jax.lax.fori_loop(0, n_steps, scaled_step, (zero, load(0)))
    return acc
