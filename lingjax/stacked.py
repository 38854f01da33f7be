"""One layer's weight inside a stack of layers' weights, read in place by the Pallas kernels.

Why: a program's host cost grows with its argument arrays (one per weight and layer: over a thousand for Flash in
fp8), and a weight sliced out of a stack before a kernel's launch is copied first. `LayerOf(stack, layer)` stands
for stack[layer] without slicing it: it has the layer's shape and dtype, passes through jit as a pytree, and
lingjax.pallas.pallas_call hands the kernel the whole stack's ref read at that layer (lingjax.pallas.LayerRef).
`layer` is a Python int (an unrolled loop over the layers) or an int32 scalar (a scan's counter); either way the
kernel reads it from an input, so one kernel serves every layer. An fp8 weight of a stack is an Fp8Array of two
LayerOfs (its values' and its scales' stacks). XLA code that needs the values takes `materialize(w)`, which slices
(and so copies where XLA cannot fuse the slice).

`Stacking` is how a model's parameters become a program's arguments: each per-layer parameter of the same name,
shape and dtype in every layer that has it is one stack (docs/engine.md, "Stacked layers"), read through LayerOf
for the Pallas kernels that read it in place (IN_PLACE names the parameters stacked).
"""

from __future__ import annotations

import dataclasses
import logging

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("lingjax")


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

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def sharding(self):
        """The stack's sharding (a layer is split as its stack is, less the layer axis)."""
        return self.stack.sharding

    def __getitem__(self, index):
        """w[...] is the weight itself, still in place (how the model reads a parameter); any other index slices."""
        return self if index is Ellipsis else materialize(self)[index]

    def reshape(self, *shape) -> LayerOf:
        """The layer's values in another shape, still in place: the stack reshaped behind the layer axis."""
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        return LayerOf(self.stack.reshape(self.stack.shape[0], *shape), self.layer)

    def astype(self, dtype):
        """In place where nothing converts (what a kernel's wrapper asks of an operand it takes as it is), else the
        converted values (a slice XLA fuses into the conversion)."""
        return self if jnp.dtype(dtype) == self.dtype else materialize(self).astype(dtype)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(materialize(self), dtype=dtype)

    def __jax_array__(self):
        return materialize(self)

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
        dtype = getattr(self.stack, "dtype", None)
        return f"LayerOf(layer {self.layer} of {'?' if dtype is None else jnp.dtype(dtype).name}" \
               f"{list(getattr(self.stack, 'shape', ()))})"


def layer_of(w, layer):
    """Layer `layer` of a stacked weight in place: a LayerOf, or for an fp8 stack (lingjax.ops.fp8.Fp8Array of [L, ...]
    values and scales) an Fp8Array of the two LayerOfs."""
    from lingjax.ops.fp8 import Fp8Array

    if isinstance(w, Fp8Array):
        return Fp8Array(LayerOf(w.q, layer), LayerOf(w.scale, layer))
    return LayerOf(w, layer)


def layer_as_value(w):
    """A LayerOf at a Python int layer -> the same at an int32 value (other arguments as they are): how a kernel's
    jitted entry takes it, so every layer's call has the same arguments' types and traces, lowers and compiles
    once (an int layer is static: one program a layer)."""
    if isinstance(w, LayerOf) and isinstance(w.layer, int):
        return LayerOf(w.stack, np.int32(w.layer))
    return w


def materialize(w):
    """A weight's values as an array: stack[layer] for a LayerOf (a slice), w itself otherwise."""
    if isinstance(w, LayerOf):
        if isinstance(w.layer, int):
            return w.stack[w.layer]
        return jax.lax.dynamic_index_in_dim(w.stack, jnp.asarray(w.layer, jnp.int32), keepdims=False)
    return w


def map_layers(f, tree):
    """f applied to each leaf of `tree`, a LayerOf taken whole (not its stack): how code that is not a kernel turns
    the stacked layers among its values into what it reads (materialize, layer_as_value)."""
    return jax.tree.map(f, tree, is_leaf=lambda a: isinstance(a, LayerOf))


def unstack_operands(operands) -> tuple[tuple, tuple[int, ...], list]:
    """A kernel launch's operands -> (the operands with each LayerOf replaced by its stack, the positions of those,
    their layers (Python ints or traced int32 scalars), in the same order)."""
    flat, positions, layers = [], [], []
    for i, op in enumerate(operands):
        if isinstance(op, LayerOf):
            flat.append(op.stack)
            positions.append(i)
            layers.append(op.layer)
        else:
            flat.append(op)
    return tuple(flat), tuple(positions), layers


# The per-layer parameters that travel stacked, by their name in the layer (the path after layers/<i>/; an fp8
# weight's q and scale alike): those a Pallas kernel reads, handed to it as a LayerOf (the ops' XLA references get
# them sliced, lingjax.kernels.on_values). The rest travel one array a layer: a weight only XLA reads would be
# sliced out of its stack, and inside a loop (several rounds a call) XLA hoists each such slice out of the loop
# body as a copy of its own, one launch each (the norms, MLA's head gate), or copies it before its GEMM
# (MLA's kv_b_proj).
IN_PLACE = frozenset({
    "attn/in_proj", "attn/b_proj", "attn/conv", "attn/a_log", "attn/dt_bias", "attn/o_proj",
    "attn/q_proj", "attn/kv_a_proj",
    "mlp/gate_proj", "mlp/up_proj", "mlp/down_proj",
    "mlp/router", "mlp/router_bias", "mlp/w_gate", "mlp/w_up", "mlp/w_down",
    "mlp/shared/gate_proj", "mlp/shared/up_proj", "mlp/shared/down_proj",
})
FP8_PARTS = ("q", "scale")
# The most elements a stack may hold: the kernels index their operands with 32-bit offsets. Full Flash's routed
# experts (40 layers of 512 x 768 x 2560) would not fit them, and stay per layer.
MAX_STACK_ELEMENTS = 2**31 - 1


def _name(path: tuple) -> str | None:
    """A per-layer parameter's name (layers/<i>/attn/o_proj/q -> attn/o_proj), None for any other parameter."""
    if len(path) < 3 or path[0] != "layers" or not isinstance(path[1], int):
        return None
    tail = path[2:-1] if path[-1] in FP8_PARTS else path[2:]
    return "/".join(map(str, tail))


def _device_bytes(leaf) -> int:
    """The bytes one device holds of a leaf (its first shard; an abstract leaf's whole size)."""
    if isinstance(leaf, jax.Array):
        return int(leaf.addressable_shards[0].data.nbytes)
    return int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Stacking:
    """Which of a model's parameter leaves (jax.tree.flatten order) travel stacked. A program's weight arguments
    are the stacks (in `groups` order), then the leaves that travel alone (in leaf order); `views` turns them back
    into one value per leaf inside the program."""

    groups: tuple[tuple[int, ...], ...] = ()  # each: the leaves of one stack, in layer order
    n_leaves: int = 0

    @classmethod
    def plan(cls, paths: list[tuple], leaves: list, specs: list, free: int | None = None) -> Stacking:
        """Stack each IN_PLACE name's leaves that agree in shape, dtype and partition spec across two or more layers,
        but for a stack of more than MAX_STACK_ELEMENTS. free: a device's free bytes (None: no limit); a stack is
        made beside the leaves it copies, so a group larger than what is still free stays per layer (said once, in
        the log)."""
        by_key: dict[tuple, list[int]] = {}
        for i, (path, leaf, spec) in enumerate(zip(paths, leaves, specs)):
            name = _name(path)
            if name in IN_PLACE:
                key = (name, path[-1], tuple(leaf.shape), jnp.dtype(leaf.dtype).name, str(spec))
                by_key.setdefault(key, []).append(i)
        groups, skipped = [], []
        for key, members in by_key.items():
            if len(members) < 2 or len(members) * int(np.prod(key[2])) > MAX_STACK_ELEMENTS:
                continue
            size = sum(_device_bytes(leaves[i]) for i in members)
            if free is not None and size > free:
                skipped.append(f"{key[0]} ({size / 1e9:.1f} GB)")
                continue
            free = None if free is None else free - size
            groups.append(tuple(members))
        if skipped:
            log.info("lingjax: kept per layer for want of device memory to stack them: %s", ", ".join(skipped))
        return cls(tuple(groups), len(leaves))

    @property
    def alone(self) -> tuple[int, ...]:
        """The leaves that travel as themselves, in leaf order."""
        grouped = {i for g in self.groups for i in g}
        return tuple(i for i in range(self.n_leaves) if i not in grouped)

    def arguments(self, leaves: list, shardings=None) -> tuple:
        """The program arguments of the leaves: a stack per group, then the lone leaves. The stacks are made in one
        program (one compile), placed with `shardings` (one per group; None: as the compiler chooses); abstract
        leaves (ShapeDtypeStructs) give abstract stacks."""
        members = [[leaves[i] for i in g] for g in self.groups]
        alone = tuple(leaves[i] for i in self.alone)
        if any(isinstance(m, jax.ShapeDtypeStruct) for g in members for m in g):
            return tuple(jax.ShapeDtypeStruct((len(g), *g[0].shape), g[0].dtype) for g in members) + alone
        stack = jax.jit(lambda groups: tuple(jnp.stack(g) for g in groups),
                        out_shardings=None if shardings is None else tuple(shardings))
        return tuple(stack(members)) + alone

    def specs(self, leaf_specs: list) -> tuple:
        """The arguments' partition specs from the leaves': a stack's is its members' behind the layer axis."""
        from jax.sharding import PartitionSpec as P

        return (tuple(P(None, *leaf_specs[g[0]]) for g in self.groups)
                + tuple(leaf_specs[i] for i in self.alone))

    def views(self, arguments) -> list:
        """One value per leaf from the arguments: LayerOf(stack, j) for a stacked leaf (nothing sliced), the argument
        itself for a lone one."""
        out = [None] * self.n_leaves
        n = len(self.groups)
        for g, members in enumerate(self.groups):
            for j, i in enumerate(members):
                out[i] = LayerOf(arguments[g], j)
        for i, arg in zip(self.alone, arguments[n:]):
            out[i] = arg
        return out
