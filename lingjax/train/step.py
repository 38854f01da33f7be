"""One training run's hyper-parameters, its state, and the two jitted programs that use them: the train step
(loss, gradient, optimizer, bias update; the state donated) and the held-out evaluation (docs/training.md).

    rc = RunConfig(config="small", batch=8, seq_len=64, optim=OptimConfig(total_steps=100))
    state = init_state(rc)                             # {"params", "biases", "opt", "rng"}
    state, metrics = train_step_fn(rc)(state, batch)   # batch: int32 [B, T + 2] (PackedBatches.batch)
    nll, count = eval_fn(rc)(state["params"], state["biases"], windows, mask)

Both programs are cached per RunConfig, so one process (a resumed run, the tests) compiles each once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from lingjax.config import LingConfig
from lingjax.dtypes import dtype_of
from lingjax.train import forward, loss, model_config, optim


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that decides a run's trajectory: the model config's name, the batch shape, the seed (the
    initialisation and the data order), the optimizer and the objective's weights. A resume must match it
    exactly (lingjax.train.checkpointing)."""

    config: str = "embedded"
    batch: int = 32
    seq_len: int = 1024
    seed: int = 0
    optim: optim.OptimConfig = optim.OptimConfig()
    mtp_weight: float = loss.MTP_WEIGHT
    balance_weight: float = loss.BALANCE_WEIGHT
    bias_rate: float = loss.BIAS_RATE
    compute_dtype: str = "bfloat16"
    remat: bool = False

    def __post_init__(self):
        model_config.config_dict(self.config)  # a known name
        dtype_of(self.compute_dtype, "compute_dtype")  # a known name
        if self.batch < 1 or self.seq_len < 1:
            raise ValueError(f"batch and seq_len must be >= 1, got {self.batch} and {self.seq_len}")

    @property
    def cfg(self) -> LingConfig:
        return LingConfig.from_hf(model_config.config_dict(self.config))

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict) -> RunConfig:
        raw = dict(raw)
        raw["optim"] = optim.OptimConfig(**raw["optim"])
        return cls(**raw)


def init_state(rc: RunConfig) -> dict:
    """A fresh run's state: f32 masters from forward.init_params(seed), zero biases, the optimizer's
    state and the run's rng key (uint32 key data, so it saves as a plain array). Committed to the default
    device, as a restored state is: a jitted step keys its cache on that, so both share one compiled step."""
    params, biases = forward.init_params(rc.cfg, rc.seed, tied=model_config.TIE_EMBEDDINGS)
    return jax.device_put(_state_fn(rc)(params, biases), jax.devices()[0])


@functools.lru_cache(maxsize=8)
def _state_fn(rc: RunConfig):
    """jitted (params, biases) -> the whole state: one program builds every optimizer moment (eagerly, each
    distinct shape would compile its own)."""

    def state(params, biases):
        key = jax.random.fold_in(jax.random.key(rc.seed), 1)
        return {"params": params, "biases": biases, "opt": optim.build(rc.optim).init(params),
                "rng": jax.random.key_data(key)}

    return jax.jit(state)


def abstract_state(rc: RunConfig) -> dict:
    """init_state's ShapeDtypeStructs, nothing allocated: the restore target and the budget test's input."""
    params, biases = forward.abstract_params(rc.cfg, tied=model_config.TIE_EMBEDDINGS)
    return jax.eval_shape(_state_fn(rc), params, biases)


@functools.lru_cache(maxsize=8)
def train_step_fn(rc: RunConfig):
    """jitted (state, batch int32 [B, T + 2]) -> (state, metrics): loss and gradient (f32 masters, compute
    in rc.compute_dtype), clip + factored AdamW, then the selection-bias update from the step's loads.
    The state is donated. metrics: loss.loss_and_metrics' scalars plus "grad_norm" (before clipping)."""
    cfg, tx = rc.cfg, optim.build(rc.optim)
    objective = functools.partial(loss.loss_and_metrics, cfg=cfg, compute_dtype=dtype_of(rc.compute_dtype),
                                  remat=rc.remat, mtp_weight=rc.mtp_weight, balance_weight=rc.balance_weight)

    def step(state, batch):
        params = state["params"]
        (_, aux), grads = jax.value_and_grad(objective, has_aux=True)(params, state["biases"], batch)
        updates, opt = tx.update(grads, state["opt"], params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        biases = loss.update_biases(state["biases"], aux.pop("loads"), rc.bias_rate)
        aux["grad_norm"] = optim.optax.tree.norm(grads)
        return {"params": params, "biases": biases, "opt": opt, "rng": state["rng"]}, aux

    return jax.jit(step, donate_argnums=0)


@functools.lru_cache(maxsize=8)
def eval_fn(rc: RunConfig):
    """jitted (params, biases, windows int32 [n, T + 1], mask bool [n, T]) -> (summed next-token NLL over the
    masked targets, nats f32; their count int32): the main model only, at the training compute dtype."""
    cfg, dtype = rc.cfg, dtype_of(rc.compute_dtype)

    def evaluate(params, biases, windows, mask):
        p = forward.cast_params(params, cfg, dtype)
        hidden, _ = forward.forward(p, biases, windows[:, :-1], cfg)
        nll = loss.token_nll(forward.logits(p, hidden), windows[:, 1:])
        return jnp.sum(jnp.where(mask, nll, 0.0)), jnp.sum(mask, dtype=jnp.int32)

    return jax.jit(evaluate)
