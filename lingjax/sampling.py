"""Token choice from logits, on the device: greedy, or temperature with optional top-k / top-p."""

import dataclasses

import jax
import jax.numpy as jnp

from lingjax.execution import Exec
from lingjax.requests import check_sampling


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax, ties to the lowest id)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def processed_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Temperature, then top-k, then top-p masking (-inf outside). logits: [..., V] f32."""
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if params.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # keep a token if the mass before it is below top_p (the first token is always kept)
        keep_sorted = jnp.cumsum(probs, axis=-1) - probs < params.top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams, ex: Exec = Exec()) -> jax.Array:
    """logits: [..., V] (a vocabulary shard under TP) -> token ids [...] int32. Greedy reduces across
    shards; sampling gathers the full vocabulary and draws with the same key on every shard."""
    if params.greedy:
        return ex.argmax_vocab(logits)
    logits = ex.gather_vocab(logits)
    return jax.random.categorical(key, processed_logits(logits, params), axis=-1).astype(jnp.int32)
