"""The parameter tree a loader fills (the pure dict of nnx.to_pure_dict): get and set by path, the refusal of NaN
or infinite values, and the merge into a model.

Both loaders end the same way: every parameter checked for NaN and infinity on the device in one program, the
first bad ones named in one CheckpointError, then the tree merged into the abstract model. Kept in one place so
the safetensors and orbax paths cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lingjax.checkpoint.names import CheckpointError
from lingjax.model import LingModel
from lingjax.stacked import map_layers, materialize


def pure_params(model: LingModel) -> dict:
    """The module's parameters as the pure dict of arrays a writer saves: a stacked layer's weight (a
    lingjax.stacked.LayerOf, as lingjax.Model.module holds it) sliced out of its stack."""
    return map_layers(materialize, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def set_at(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_at(tree, path: tuple):
    for key in path:
        tree = tree[key]
    return tree


def nonfinite(params: dict, stacked=frozenset()) -> list[tuple[tuple, int | None]]:
    """(parameter path, index or None) of each parameter in the pure dict `params` that holds a NaN or an infinity,
    checked on the device in one program; a path in `stacked` is checked per entry of its leading axis (experts
    stacked from separate tensors), so the tensor can be named."""
    leaves = jax.tree_util.tree_leaves_with_path(params)
    paths = [tuple(k.key for k in path) for path, _ in leaves]
    per_entry = [path[:-1] in stacked or path in stacked for path in paths]

    def flags(arrays):
        return [jnp.all(jnp.isfinite(a), axis=tuple(range(1, a.ndim))) if entry else jnp.all(jnp.isfinite(a))
                for a, entry in zip(arrays, per_entry)]

    found = jax.jit(flags)([a for _, a in leaves])
    bad = []
    for path, entry, ok in zip(paths, per_entry, found):
        ok = np.asarray(ok)
        bad += [(path, int(i)) for i in np.flatnonzero(~ok)] if entry else [] if ok else [(path, None)]
    return bad


def refuse_nonfinite(where: str, params: dict, names: Callable[[tuple, int | None], str],
                     stacked=frozenset()) -> None:
    """A CheckpointError naming the first tensors that hold NaN or infinite values."""
    bad = nonfinite(params, stacked)
    if bad:
        listed = ", ".join(names(path, index) for path, index in bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise CheckpointError(f"{where}: NaN or infinite values in {listed}")


def merge(graphdef, abstract, params: dict) -> LingModel:
    nnx.replace_by_pure_dict(abstract, params)
    return nnx.merge(graphdef, abstract)
