"""`griddepcontrol.wait` for the Pallas kernels: every kernel starts with it (`after_producers`, applied by
lingjax.pallas.pallas_call), because the step programs run with programmatic dependent launch and a kernel may be
launched before the kernels it depends on finish (docs/kernels/launch.md). Without PDL the wait returns at once;
in interpret mode it does nothing.

The primitive emits the asm with side effects (Pallas's elementwise_inline_asm is pure: loads could move above it,
and it is dropped when unused), which keeps every load and store of the kernel after it.
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
