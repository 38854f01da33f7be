"""The optimizer (docs/training.md): AdamW with a compact state, linear warm-up then cosine decay to
FINAL_LR_FRACTION of the peak, decoupled weight decay on matrices only, global-norm clipping.

    tx = build(OptimConfig(lr=2e-3, warmup_steps=200, total_steps=20_000))
    opt_state = tx.init(params)                      # params: f32 masters (lingjax.train.forward)
    updates, opt_state = tx.update(grads, opt_state, params)

Why compact: the resume state (masters + optimizer state) must stay under
model_config.RESUME_BYTES_BUDGET for the embedded model, and Adam's f32 moments would triple the masters.
`scale_by_factored_adam` keeps
- the first moment m in bf16 (an EMA of the raw gradients, updated in f32 and rounded once a step);
- the second moment of each matrix (ndim >= 2: every [out, in] weight, each expert's or stacked slice of
  [N, out, in] separately) as Adafactor's rank-1 factors, f32 row means r = EMA(mean_in g²) [..., out] and
  column means c = EMA(mean_out g²) [..., in], read back as v = r ⊗ c / mean(r); vectors (norms, A_log,
  dt_bias) keep a full f32 v.
The step is Adam's: m̂ / (sqrt(v̂) + eps) with both moments bias-corrected (β1 0.9, β2 0.95), so a rank-1
gradient statistic is reproduced exactly and the state costs 2 bytes a parameter plus 4·(rows + cols) a
matrix. Weight decay (decoupled, times the learning rate) applies to matrices except the embedding and the
conv taps; norms, A_log, dt_bias and the router biases (not trained: lingjax.train.loss) get none.

Precision: the masters and gradients are f32; the loss rounds the masters to bf16 for compute
(forward.cast_params), so the gradient arrives in f32 at the masters.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

try:
    import optax
except ImportError as e:  # the `train` extra: pip install lingjax[train]
    raise ImportError("lingjax.train needs optax (pip install 'lingjax[train]')") from e

F32 = jnp.float32
FINAL_LR_FRACTION = 0.1
NO_DECAY = frozenset({"embed", "conv"})  # matrices that take no weight decay (every vector takes none)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """The optimizer's hyper-parameters; part of a run's identity (a resume with others is refused)."""

    lr: float = 2e-3  # peak learning rate
    warmup_steps: int = 200
    total_steps: int = 10_000  # the cosine reaches FINAL_LR_FRACTION · lr here
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    final_lr_fraction: float = FINAL_LR_FRACTION


def lr_schedule(cfg: OptimConfig):
    """step -> learning rate: peak·(step+1)/warmup for the first warmup_steps (no step is taken at rate 0),
    then a cosine from the peak to final_lr_fraction·peak at total_steps, flat after."""
    peak, final = cfg.lr, cfg.lr * cfg.final_lr_fraction
    warm = max(cfg.warmup_steps, 0)
    span = max(cfg.total_steps - warm, 1)

    def schedule(step):
        step = jnp.asarray(step, F32)
        rising = peak * (step + 1) / max(warm, 1)
        progress = jnp.clip((step - warm) / span, 0.0, 1.0)
        falling = final + (peak - final) * 0.5 * (1 + jnp.cos(math.pi * progress))
        return jnp.where(step < warm, rising, falling)

    return schedule


# ---- the compact Adam ------------------------------------------------------------------------------
class FactoredAdamState(NamedTuple):
    """count: int32 [] steps taken; mu: bf16, the params' structure; nu: per parameter a tuple, (row
    [..., out], col [..., in]) f32 for a matrix or (v,) f32 of the parameter's shape for a vector."""

    count: jax.Array
    mu: Any
    nu: Any


def is_factored(shape) -> bool:
    """Whether a parameter of this shape keeps a factored second moment (every matrix, ndim >= 2)."""
    return len(shape) >= 2


def _init_nu(p):
    if is_factored(p.shape):
        return (jnp.zeros(p.shape[:-1], F32), jnp.zeros(p.shape[:-2] + p.shape[-1:], F32))
    return (jnp.zeros(p.shape, F32),)


def scale_by_factored_adam(b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, mu_dtype=jnp.bfloat16,
                           eps_sq: float = 1e-30) -> optax.GradientTransformation:
    """Adam's preconditioning with a bf16 first moment and an Adafactor-factored second moment (module
    docstring). eps_sq is added to g² before averaging, so an all-zero gradient gives no 0/0."""

    def init(params):
        return FactoredAdamState(count=jnp.zeros([], jnp.int32),
                                 mu=jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype), params),
                                 nu=jax.tree.map(_init_nu, params))

    def update(grads, state, params=None):
        del params
        count = state.count + 1
        c1 = 1 - b1 ** count.astype(F32)
        c2 = 1 - b2 ** count.astype(F32)

        def one(g, m, nu):
            g = g.astype(F32)
            m = b1 * m.astype(F32) + (1 - b1) * g
            g2 = g * g + eps_sq
            if len(nu) == 2:
                row = b2 * nu[0] + (1 - b2) * jnp.mean(g2, -1)
                col = b2 * nu[1] + (1 - b2) * jnp.mean(g2, -2)
                v = row[..., :, None] * col[..., None, :] / jnp.mean(row, -1)[..., None, None]
                nu = (row, col)
            else:
                v = b2 * nu[0] + (1 - b2) * g2
                nu = (v,)
            step = (m / c1) / (jnp.sqrt(v / c2) + eps)
            return step, m.astype(mu_dtype), nu

        out = jax.tree.map(one, grads, state.mu, state.nu)
        treedef = jax.tree.structure(grads)
        steps, mus, nus = zip(*treedef.flatten_up_to(out)) if treedef.num_leaves else ((), (), ())
        return (treedef.unflatten(steps),
                FactoredAdamState(count=count, mu=treedef.unflatten(mus), nu=treedef.unflatten(nus)))

    return optax.GradientTransformation(init, update)


# ---- weight decay and the whole chain ------------------------------------------------------------------
def decays(path: tuple, shape) -> bool:
    """Whether the parameter at this pure-dict path takes weight decay: matrices but the embedding and the
    conv taps."""
    return len(shape) >= 2 and path[-1] not in NO_DECAY


def decay_mask(params: dict) -> dict:
    """bool per leaf of params (decays)."""
    return jax.tree_util.tree_map_with_path(lambda path, p: decays(tuple(k.key for k in path), p.shape), params)


def build(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip (global norm) -> factored Adam -> decoupled weight decay (mask) -> -lr(step)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        scale_by_factored_adam(cfg.b1, cfg.b2, cfg.eps),
        optax.add_decayed_weights(cfg.weight_decay, mask=decay_mask),
        optax.scale_by_learning_rate(lr_schedule(cfg)),
    )


def tree_bytes(tree) -> int:
    """Bytes of the arrays (or ShapeDtypeStructs) of a pytree."""
    return sum(int(math.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
