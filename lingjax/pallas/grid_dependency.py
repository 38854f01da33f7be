"""Hopper's programmatic dependent launch (PDL) inside the Pallas kernels: `griddepcontrol.wait`.

The step programs run with XLA's `xla_gpu_enable_pdl` (lingjax.runtime.step_compiler_options): a kernel
may then be launched while the one before it on the stream still runs, and must execute
`griddepcontrol.wait` before it touches memory that kernel writes or reads (buffers are reused). XLA
puts the wait into the kernels it generates, not into a Pallas kernel's Triton IR, yet it launches the
Pallas kernels with PDL too: on the H200 a wait at their top changed their timing with PDL on and not
without it (bench/results/pdl_h200_2026-12-01.md). So every kernel of lingjax.pallas starts with the
wait (`after_producers`, applied by lingjax.pallas.pallas_call). Without PDL the wait returns at once.

Pallas's `elementwise_inline_asm` marks its asm pure: the compiler could move loads above it, and drops
it when its result is unused. The primitive here emits the asm with side effects, as Triton's own
gdc_wait does, which keeps every load and store of the kernel after it. In interpret mode it does
nothing.
"""

from __future__ import annotations

import functools

from jax._src import core as jax_core
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives

WAIT_ASM = "griddepcontrol.wait;"

wait_p = jax_core.Primitive("griddepcontrol_wait")
wait_p.multiple_results = True


@wait_p.def_effectful_abstract_eval
def _abstract_eval():
    # the effect Pallas's debug_barrier has: it keeps the primitive through the kernel's dead-code pass
    return (), {triton_primitives.barrier_effect}


wait_p.def_impl(lambda: [])
mlir.register_lowering(wait_p, lambda ctx: [])  # interpret mode: no grids to wait for


@triton_lowering.register_lowering(wait_p)
def _triton_lowering(ctx):
    del ctx
    # Triton's inline asm needs a result: a register written and never read
    i32 = ir.IntegerType.get_signless(32)
    tt_dialect.elementwise_inline_asm([i32], WAIT_ASM + "\n\tmov.u32 $0, 0;", constraints="=r", pure=False,
                                      packed_element=1, args=[])
    return []


def after_producers(kernel):
    """kernel, starting with griddepcontrol.wait."""

    @functools.wraps(kernel)
    def body(*refs, **kwargs):
        wait_p.bind()
        return kernel(*refs, **kwargs)

    return body
