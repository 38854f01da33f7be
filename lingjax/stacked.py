"""One layer's weight inside a stack of layers' weights, read in place by the Pallas kernels.

Why: a program's host cost grows with its argument arrays (one per weight and layer: over a thousand for Flash in
fp8), and a weight sliced out of a stack before a kernel's launch is copied first. `LayerOf(stack, layer)` stands
for stack[layer] without slicing it: it has the layer's shape and dtype, passes through jit as a pytree, and
lingjax.pallas.pallas_call hands the kernel the whole stack's ref read at that layer (lingjax.pallas.LayerRef).
`layer` is a Python int (an unrolled loop over the layers) or an int32 scalar (a scan's counter: one layer compiled
once, whatever the depth). An fp8 weight of a stack is an Fp8Array of two LayerOfs (its values' and its scales'
stacks). XLA code that needs the values takes `materialize(w)`, which slices (and so copies where XLA cannot fuse
the slice).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


@jax.tree_util.register_pytree_node_class
class LayerOf:
    """stack[layer] of a stack [L, ...], unsliced: what a Pallas kernel reads in place."""

    def __init__(self, stack, layer):
        if isinstance(layer, int) and not 0 <= layer < stack.shape[0]:
            raise IndexError(f"layer {layer} of a stack of {stack.shape[0]}")
        self.stack, self.layer = stack, layer

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.stack.shape[1:])

    @property
    def ndim(self) -> int:
        return len(self.stack.shape) - 1

    @property
    def dtype(self):
        return self.stack.dtype

    def tree_flatten(self):
        if isinstance(self.layer, int):
            return (self.stack,), self.layer
        return (self.stack, self.layer), None

    @classmethod
    def tree_unflatten(cls, layer, children):
        obj = object.__new__(cls)  # no check: the children may be abstract or placeholders
        obj.stack, obj.layer = (children[0], layer) if layer is not None else children
        return obj

    def __repr__(self) -> str:
        return f"LayerOf({self.layer} of {getattr(self.stack, 'shape', '?')})"


def layer_of(w, layer):
    """Layer `layer` of a stacked weight in place: a LayerOf, or for an fp8 stack (lingjax.ops.fp8.Fp8Array of [L, ...]
    values and scales) an Fp8Array of the two LayerOfs."""
    from lingjax.ops.fp8 import Fp8Array

    if isinstance(w, Fp8Array):
        return Fp8Array(LayerOf(w.q, layer), LayerOf(w.scale, layer))
    return LayerOf(w, layer)


def materialize(w):
    """A weight's values as an array: stack[layer] for a LayerOf (a slice), w itself otherwise."""
    if isinstance(w, LayerOf):
        if isinstance(w.layer, int):
            return w.stack[w.layer]
        return jax.lax.dynamic_index_in_dim(w.stack, jnp.asarray(w.layer, jnp.int32), keepdims=False)
    return w


def unstack_operands(operands) -> tuple[tuple, dict[int, int], list[tuple[int, jax.Array]]]:
    """A kernel launch's operands -> (the operands with each LayerOf replaced by its stack, {position: static layer},
    [(position, traced layer)])."""
    flat, static, traced = [], {}, []
    for i, op in enumerate(operands):
        if isinstance(op, LayerOf):
            flat.append(op.stack)
            if isinstance(op.layer, int):
                static[i] = op.layer
            else:
                traced.append((i, op.layer))
        else:
            flat.append(op)
    return tuple(flat), static, traced
