"""Hopper's bulk L2 prefetch inside a Pallas kernel: `cp.async.bulk.prefetch.L2.global`.

At batch 1 a MoE layer's kernels are bandwidth-bound except where they wait on latency: the router's GEMV
reads 2.6 MB in ~3.4 µs and the up kernel's routed programs spend ~2 µs selecting experts before their
first load (bench/results/moe_h200_2026-12-01_run3.md). HBM idles through those windows. A prefetch
instruction hands the memory system a whole contiguous range and returns at once, so a few programs can
fill such a window with bytes a later kernel (or a later part of this one) reads from L2 instead.

`prefetch_rows(ref, index)`: `index` picks elements of `ref` like a load would (an integer array or a
pl.ds on one axis); each picked element starts a prefetch of `nbytes` bytes (one row, say) in the
program. The addresses must be 16-byte aligned and `nbytes` a multiple of 16. It only hints: the result
of the kernel never depends on it, and in interpret mode it does nothing. With `evict_last` the lines
are marked to stay in L2 past ordinary traffic (`createpolicy ... L2::evict_last`).

Weights are never written during a step, so a prefetch of weights may run before the kernel's
griddepcontrol.wait (lingjax.pallas.grid_dependency).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax._src import core as jax_core
from jax._src import tree_util
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
from jax._src.pallas.triton import lowering as triton_lowering
from jax._src.pallas.triton import primitives as triton_primitives
from jax._src.state import discharge as state_discharge
from jax._src.state import indexing
from jax._src.state import primitives as state_primitives

prefetch_p = jax_core.Primitive("l2_prefetch")
prefetch_p.multiple_results = True


@prefetch_p.def_effectful_abstract_eval
def _abstract_eval(*avals_flat, args_tree, nbytes, evict_last):
    del avals_flat, args_tree, nbytes, evict_last
    # the barrier's effect keeps it through the kernel's dead-code pass, as grid_dependency's wait
    return [], {triton_primitives.barrier_effect}


@state_discharge.register_discharge_rule(prefetch_p)
def _discharge(ctx, *args_flat, args_tree, nbytes, evict_last):
    del args_tree, nbytes, evict_last
    return (None,) * len(ctx.in_avals), []  # interpret mode: nothing to prefetch, nothing changed


def _asm(nbytes: int, evict_last: bool) -> str:
    if evict_last:
        body = ("{\n\t.reg .b64 pol;\n\tcreatepolicy.fractional.L2::evict_last.b64 pol, 1.0;\n\t"
                f"cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], {nbytes}, pol;\n\t}}")
    else:
        body = f"cp.async.bulk.prefetch.L2.global [$1], {nbytes};"
    return body + "\n\tmov.u32 $0, 0;"  # Triton's inline asm needs a result: a register never read


@triton_lowering.register_lowering(prefetch_p)
def _triton_lowering(ctx, *args_flat, args_tree, nbytes, evict_last):
    block_info, *_ = ctx.block_infos
    ptr, transforms = args_tree.unflatten(args_flat)
    (idx,) = transforms
    ptrs = triton_lowering._compute_pointers_from_indices(ptr, block_info, idx)
    shape = idx.get_indexer_shape_static()
    i32 = ir.IntegerType.get_signless(32)
    out = ir.RankedTensorType.get(shape, i32) if shape else i32
    tt_dialect.elementwise_inline_asm([out], _asm(nbytes, evict_last), constraints="=r,l", pure=False,
                                      packed_element=1, args=[ptrs])
    return []


def prefetch_rows(ref, index, *, nbytes: int, evict_last: bool = False) -> None:
    """Prefetch `nbytes` from each element `index` picks in `ref` into L2 (see the module docstring)."""
    if nbytes <= 0 or nbytes % 16:
        raise ValueError(f"a bulk prefetch takes a positive multiple of 16 bytes, got {nbytes}")
    ref, transforms = state_primitives.get_ref_and_transforms(ref, index, "prefetch_rows")
    if len(transforms) != 1 or not isinstance(transforms[0], indexing.NDIndexer):
        raise NotImplementedError("prefetch_rows takes one index on the ref itself")
    args_flat, args_tree = tree_util.tree_flatten((ref, transforms))
    prefetch_p.bind(*args_flat, args_tree=args_tree, nbytes=int(nbytes), evict_last=bool(evict_last))


def prefetch_share(flat_ref, start, total: int, part, parts: int, *, lanes: int, evict_last: bool = False) -> None:
    """Program `part` of `parts` prefetches its share of the `total` contiguous elements of the 1-D `flat_ref`
    from element `start` on: `lanes` chunks (one per thread: lanes = 32 · warps), each of 16-byte multiples.
    The last chunks are clamped into the range (they may repeat a neighbour's bytes, never read past it)."""
    item = flat_ref.dtype.itemsize
    align = max(1, 16 // item)  # elements per 16 bytes
    chunk = -(-total // (parts * lanes))
    chunk = -(-chunk // align) * align
    if chunk > total:
        return  # a range smaller than one chunk (tiny test dims): nothing worth prefetching
    last = (total - chunk) // align * align
    lane = part * lanes + jax.lax.broadcasted_iota(jnp.int32, (lanes,), 0)
    prefetch_rows(flat_ref, (start + jnp.minimum(lane * chunk, last),), nbytes=chunk * item, evict_last=evict_last)
