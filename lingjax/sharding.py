"""Tensor parallelism: a 1-D mesh over N devices and the partition of every weight and cache.

Each step program's body runs inside shard_map, where the model sees this device's shards and
Exec.tp_axis names the mesh axis:
- column-parallel (split on the output dim): KDA q/k/v/f/g (stacked in_proj) and b projections, conv
  weights, A_log and dt_bias (all by head); MLA q_proj, kv_b_proj and g_proj (by head); dense and
  shared-expert gate/up;
- row-parallel (split on the input dim, then one all-reduce): KDA and MLA output projections, dense
  down projections; routed experts split on their intermediate dim (gate/up rows, down columns), so
  every device reads 1/N of each touched expert, and the MoE block all-reduces routed + shared once;
- replicated: embeddings, norms, the router and its bias, MLA kv_a_proj (so the latent cache is
  replicated), the MTP layer's eh_proj;
- vocab-parallel lm_head, with Exec.argmax_vocab for the distributed greedy argmax.
Caches: KDA state and conv ring split by head, MLA latent caches replicated.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from lingjax import target
from lingjax.cache import KDACache
from lingjax.config import KDA, LingConfig

AXIS = "tp"

_COLUMN = P(AXIS, None)
_ROW = P(None, AXIS)
_BY_NAME = {
    # KDA attention (in_proj: q|k|v|f|g stacked [5, P, D], each split by channel)
    "in_proj": P(None, AXIS, None), "b_proj": _COLUMN,
    "conv": P(None, AXIS, None), "a_log": P(AXIS), "dt_bias": P(AXIS),
    "o_norm": P(),
    # MLA attention (g_proj [H, D] by head)
    "q_proj": _COLUMN, "kv_a_proj": P(), "kv_a_norm": P(), "kv_b_proj": _COLUMN, "g_proj": _COLUMN,
    # both attentions
    "o_proj": _ROW,
    # dense MLP and shared expert
    "gate_proj": _COLUMN, "up_proj": _COLUMN, "down_proj": _ROW,
    # routed experts
    "router": P(), "router_bias": P(), "w_gate": P(None, AXIS, None), "w_up": P(None, AXIS, None),
    "w_down": P(None, None, AXIS),
    # model level
    "embed": P(), "lm_head": _COLUMN, "eh_proj": P(),
}


def make_mesh(tp: int) -> Mesh:
    """The 1-D mesh of the first tp devices."""
    devices = target.devices()
    if tp < 1 or tp > len(devices):
        raise ValueError(f"tp={tp} needs that many devices; {len(devices)} available")
    return Mesh(np.asarray(devices[:tp]), (AXIS,))


def mesh_for(cfg: LingConfig, tp: int) -> Mesh | None:
    """The mesh every weight and cache of cfg is split over at tp devices (None at tp = 1), after check_tp."""
    check_tp(cfg, tp)
    return make_mesh(tp) if tp > 1 else None


def param_spec(path: tuple) -> P:
    """Partition of the parameter at `path` (its keys in the model's state, e.g. ('layers', 3, 'attn',
    'q_proj')). Norm weights (input/post/final/enorm/hnorm) are replicated. An fp8 matrix's `q` and `scale`
    (lingjax.model.Fp8Weight) split as the matrix does: its scale blocks are cut so that each shard holds whole
    blocks (lingjax.ops.fp8.device_block)."""
    name = path[-2] if path[-1] in ("q", "scale") and len(path) > 1 else path[-1]
    return _BY_NAME.get(name, P())


def path_keys(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "name", k)) for k in path if getattr(k, "name", None) != "value")


def param_specs(params):
    """A PartitionSpec for every leaf of the model's parameter state."""
    return jax.tree_util.tree_map_with_path(lambda path, _: param_spec(path_keys(path)), params)


def check_tp(cfg: LingConfig, tp: int) -> None:
    """Enough devices, and every split dim divides evenly; say what does not."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp (tensor-parallel devices) must be an integer >= 1, got {tp!r}")
    if tp > len(target.devices()):
        raise ValueError(f"tp={tp} needs that many devices; {len(target.devices())} available")
    dims = {
        "num_attention_heads (MLA)": cfg.num_heads if any(t != KDA for t in cfg.layer_types) else tp,
        "KDA heads": cfg.kda_num_heads,
        "vocab_size": cfg.vocab_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "shared expert intermediate size": cfg.shared_intermediate_size or tp,
        "intermediate_size": cfg.intermediate_size,
    }
    bad = [f"{name} = {value}" for name, value in dims.items() if value % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide: {', '.join(bad)}")


def cache_spec(cache):
    """KDA states [H, K, V] and conv rings [N, 3, P] split by head; everything else replicated."""

    def spec(entry):
        if isinstance(entry, KDACache):
            return KDACache(state=P(AXIS), conv=P(None, None, AXIS))
        return jax.tree.map(lambda _: P(), entry)

    return jax.tree.map(spec, cache, is_leaf=lambda x: isinstance(x, KDACache))


def place(tree, specs, mesh: Mesh):
    """device_put every leaf with its NamedSharding: each device receives only its shard. Abstract leaves
    (ShapeDtypeStructs: a deviceless compile's weights, bench/aot_census.py) stay as they are."""
    def put(x, s):
        return x if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, NamedSharding(mesh, s))

    return jax.tree.map(put, tree, specs)
