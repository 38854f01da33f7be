"""Pulling weights into L2 from inside a Pallas kernel, ahead of their reads: `prefetch.global.L2`.

The decode's up kernel (lingjax/pallas/moe_experts.py) uses it: its routed programs, before they spend time
selecting their expert, ask for the shared expert's gate and up weights, which the shared programs then
read from L2 (docs/kernels/moe.md). A prefetch holds no register: the program issues it and goes on.

Pallas has no prefetch, and its `elementwise_inline_asm` takes no pointers: the primitive here takes a ref
and element offsets and lowers to the instruction at each offset's address. In interpret mode it does
nothing (a kernel computes the same with or without it). No tuning: which lines each program asks for
follows from the arrays and the program count (lines_per_program).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax.experimental import pallas as pl

LINE_BYTES = 128  # an L2 line (the prefetch's granule)
PREFETCH_ASM = "prefetch.global.L2 [$1];"

prefetch_p = jax_core.Primitive("l2_prefetch")
prefetch_p.multiple_results = True


@prefetch_p.def_effectful_abstract_eval
def _abstract_eval(ref, offsets):
    del ref, offsets
    return (), {triton_primitives.barrier_effect}  # kept through the kernel's dead-code pass


@state_discharge.register_discharge_rule(prefetch_p)
def _discharge(ctx, ref, offsets):  # interpret mode: the ref is unchanged, nothing is returned
    del ctx, ref, offsets
    return (None, None), []


@triton_lowering.register_lowering(prefetch_p)
def _triton_lowering(ctx, ptr, offsets):
    del ctx
    shape = ir.RankedTensorType(offsets.type).shape
    pointers = ir.RankedTensorType.get(shape, ptr.type)
    addresses = tt_dialect.addptr(pointers, tt_dialect.splat(pointers, ptr), offsets)
    # Triton's inline asm needs a result: a register written and never read
    i32 = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(32))
    tt_dialect.elementwise_inline_asm([i32], PREFETCH_ASM + "\n\tmov.u32 $0, 0;", constraints="=r,l",
                                      pure=False, packed_element=1, args=[addresses])
    return []


def _line_count(shape, dtype) -> int:
    """128-byte lines an array of `shape` and `dtype` spans, the last one partial."""
    return -(-math.prod(shape) * jnp.dtype(dtype).itemsize // LINE_BYTES)


def share_lines(part, lines: int, total: int):
    """The line indices of share `part` (traced or not) when runs of `lines` cover `total` lines: the last run's
    tail repeats the final line. Runs past the end are not issued (prefetch_share)."""
    return jnp.minimum(part * lines + jnp.arange(lines, dtype=jnp.int32), total - 1)


def prefetch_share(ref, part, lines: int):
    """Inside a kernel: prefetch the `part`-th (traced) run of `lines` (a power of 2: a Triton tensor) 128-byte
    lines of ref, a contiguous array ref or one layer of a stack's (lingjax.pallas.LayerRef: the offsets start at
    its layer); runs past its end issue nothing."""
    per_line = LINE_BYTES // ref.dtype.itemsize
    total = _line_count(ref.shape, ref.dtype)
    base, first = (ref.ref, ref.layer * math.prod(ref.shape)) if hasattr(ref, "layer") else (ref, 0)

    @pl.when(part * lines < total)
    def _():
        prefetch_p.bind(base, first + share_lines(part, lines, total) * per_line)


def lines_per_program(arrays, parts: int) -> int:
    """The power-of-2 line count a program prefetches so that `parts` programs cover each of the arrays."""
    most = max(_line_count(a.shape, a.dtype) for a in arrays)
    return 1 << (-(-most // parts) - 1).bit_length()
