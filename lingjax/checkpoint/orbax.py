"""lingjax's own checkpoint format, the one `lingjax convert` writes: config.json, lingjax.json (MTP presence,
dtype, parameter layout version) and the parameter tree under params/ (orbax).

`save_orbax` writes a dense model; `load_orbax` restores it cast to a dtype, each parameter straight into its
sharding when given one, and refuses a parameter layout version other than this lingjax's with one CheckpointError.
The format exists as the fast load path: the tree is stored as lingjax holds it, so nothing is renamed or stacked
and each device reads only its own shard.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.checkpoint.fp8 import refuse_device_fp8
from lingjax.checkpoint.names import CheckpointError
from lingjax.checkpoint.params import merge, pure_params, refuse_nonfinite
from lingjax.config import LingConfig
from lingjax.model import LingModel, abstract_model

ORBAX_DIR = "params"
META_FILE = "lingjax.json"
PARAM_LAYOUT = 2  # orbax parameter tree version; 2: KDA q/k/v/f/g stacked into in_proj, q/k/v conv into conv


def save_orbax(model: LingModel, out_dir: str | Path, config_json: dict) -> None:
    """Write config.json, lingjax.json and the parameters (orbax) under out_dir."""
    import orbax.checkpoint as ocp  # on use: loading safetensors or a preset never needs orbax, and it slows start-up

    refuse_device_fp8(model, "save_orbax")
    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_json, indent=2))
    (out / META_FILE).write_text(json.dumps({"has_mtp": model.has_mtp, "dtype": str(model.dtype),
                                             "layout": PARAM_LAYOUT}))
    params = pure_params(model)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(out / ORBAX_DIR, params, force=True)


def is_orbax(directory: str | Path) -> bool:
    return (Path(directory) / META_FILE).exists() and (Path(directory) / ORBAX_DIR).is_dir()


def load_orbax(directory: str | Path, cfg: LingConfig, dtype=jnp.bfloat16,
               sharding_for: Callable[[tuple], jax.sharding.Sharding] | None = None) -> LingModel:
    """Restore a checkpoint written by save_orbax, cast to `dtype` (f32-by-design parameters stay f32).
    `sharding_for(path)` restores each parameter straight into that sharding (each device reads its
    own shard); without it everything lands on the default device."""
    import orbax.checkpoint as ocp  # on use, as in save_orbax

    directory = Path(directory).absolute()
    meta = json.loads((directory / META_FILE).read_text())
    if meta.get("layout", 1) != PARAM_LAYOUT:
        raise CheckpointError(f"{directory}: written by a lingjax with parameter layout {meta.get('layout', 1)}, "
                              f"this one reads layout {PARAM_LAYOUT}; convert the official checkpoint again "
                              f"(lingjax convert)")
    _, saved = nnx.split(abstract_model(cfg, jnp.dtype(meta["dtype"]), with_mtp=meta["has_mtp"]))
    target = nnx.to_pure_dict(saved)
    if sharding_for is not None:
        target = jax.tree_util.tree_map_with_path(
            lambda path, leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype,
                                                    sharding=sharding_for(tuple(k.key for k in path))), target)
    with ocp.StandardCheckpointer() as ckptr:
        try:
            params = ckptr.restore(directory / ORBAX_DIR, target)
        except Exception as e:
            raise CheckpointError(f"{directory / ORBAX_DIR}: cannot restore ({e})") from None
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, with_mtp=meta["has_mtp"]))
    params = jax.tree.map(lambda a, t: a.astype(t.dtype), params, nnx.to_pure_dict(abstract))
    refuse_nonfinite(str(directory), params, lambda path, index: "parameter " + ".".join(map(str, path)))
    return merge(graphdef, abstract, params)
