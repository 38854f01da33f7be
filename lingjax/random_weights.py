"""Random weights for a config: every leaf drawn with the distribution its constructor records
(lingjax.param_init.ParamInit), on the host or on the device(s), optionally quantized to fp8 as it is drawn. What a
preset name loads (lingjax.load("tiny")), and what the benches time rounds with."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from lingjax import sharding
from lingjax.config import LingConfig
from lingjax.model import LingModel, abstract_model
from lingjax.ops import fp8 as fp8_ops
from lingjax.param_init import draw
from lingjax.quantization import Fp8Layout

# Random weights up to HOST_DRAW_BYTES are drawn on the host (numpy: no program to compile, the fastest start
# for the small presets); up to ONE_PROGRAM_DRAW_BYTES in one device program; beyond, by one small program per
# distinct leaf kind, reused across leaves (one program for all of Flash would hold its temporaries at once).
HOST_DRAW_BYTES = 64 << 20
ONE_PROGRAM_DRAW_BYTES = 2 << 30


def random_model(cfg: LingConfig, dtype, seed: int, mesh=None, fp8: Fp8Layout | None = None) -> LingModel:
    """LingModel with random weights, each leaf with the distribution its constructor records
    (lingjax.param_init.ParamInit) and its own stream (the seed and the leaf's index). Small models are drawn on the
    host and placed; larger ones on the device(s), in one program or leaf by leaf, and with a mesh every
    device draws only its own shards (partitionable threefry), so a model larger than one device, such as
    Flash at TP2, never exists whole anywhere. The weights are a function of (config, dtype, seed): the same
    for any mesh. fp8: the matrices kept in fp8 (lingjax.model.fp8_layout), each drawn in `dtype` and quantized
    in the same program (Flash in fp8 on one H200: no bf16 copy of the model ever exists)."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype, fp8=fp8))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))
    keys = [sharding.path_keys(path) for path, _ in leaves]
    where = {k: i for i, k in enumerate(keys)}
    outs = [None if mesh is None else NamedSharding(mesh, sharding.param_spec(k)) for k in keys]
    # one draw per weight: (leaf indices it fills, shape, draw dtype, distribution, fp8 blocks or None)
    draws = []
    for i, (key, (_, var)) in enumerate(zip(keys, leaves)):
        if var.random == ("fp8_scale",):
            continue
        if jnp.dtype(var.dtype) == jnp.dtype(fp8_ops.FP8):
            scale = leaves[where[key[:-1] + ("scale",)]][1]
            (n, k), (sn, sk) = var.shape[-2:], scale.shape[-2:]
            draws.append(((i, where[key[:-1] + ("scale",)]), var.shape, jnp.dtype(dtype), var.random,
                          (var.fp8_block, (n // sn, k // sk))))
        else:
            draws.append(((i,), var.shape, jnp.dtype(var.dtype), var.random, None))
    arrays = [None] * len(leaves)
    total = sum(int(np.prod(shape)) * dt.itemsize for _, shape, dt, _, _ in draws)
    if total <= HOST_DRAW_BYTES:
        for fills, shape, dt, how, blocks in draws:
            w = host_draw(np.random.default_rng([seed, fills[0]]), shape, dt, how)
            if blocks is None:
                arrays[fills[0]] = w
            else:
                q, scale = fp8_ops.quantize(w, blocks[0])
                arrays[fills[0]], arrays[fills[1]] = q, fp8_ops.refine_scales(scale, shape, *blocks)
        arrays = jax.device_put(arrays, outs if mesh is not None else None)
    else:
        base = jax.random.key(seed)
        programs = [_drawer(shape, dt, how, blocks, tuple(outs[f] for f in fills))
                    for fills, shape, dt, how, blocks in draws]
        if total <= ONE_PROGRAM_DRAW_BYTES:
            def draw_all(key):
                return [p.__wrapped__(jax.random.fold_in(key, d[0][0])) for p, d in zip(programs, draws)]

            shardings = [tuple(outs[f] for f in d[0]) for d in draws] if mesh is not None else None
            drawn = jax.jit(draw_all, out_shardings=shardings)(base)
        else:
            drawn = [p(jax.random.fold_in(base, d[0][0])) for p, d in zip(programs, draws)]
        for (fills, *_), values in zip(draws, drawn):
            for f, v in zip(fills, values):
                arrays[f] = v
    return nnx.merge(graphdef, treedef.unflatten([var.replace(a) for (_, var), a in zip(leaves, arrays)]))


def host_draw(rng: np.random.Generator, shape, dtype, how: tuple) -> np.ndarray:
    """lingjax.param_init.draw's distributions with numpy: normal(mean, std) or log(uniform(low, high)), f32,
    then rounded to dtype."""
    if how[0] == "normal":
        w = how[1] + how[2] * rng.standard_normal(shape, dtype=np.float32)
    else:
        w = np.log(rng.uniform(how[1], how[2], shape)).astype(np.float32)
    return np.asarray(w, np.float32).astype(dtype)


@functools.lru_cache(maxsize=256)
def _drawer(shape, dtype, how, blocks, out_shardings):
    """The jitted draw of one weight -> a tuple of its leaves: (array,), or for fp8 blocks (quantizer block,
    device block) (q, scale), quantized in the same program (lingjax.model.quantize_matrices' rounding)."""
    def one(key):
        w = draw(key, shape, dtype, how)
        if blocks is None:
            return (w,)
        fp8 = fp8_ops.quantize_on_device(w, blocks[0])
        return fp8.q, fp8_ops.refine_scales_on_device(fp8.scale, shape, *blocks)

    return jax.jit(one, out_shardings=None if out_shardings[0] is None else out_shardings)
