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


# The token id a program returns in place of a token chosen from logits that hold a NaN or an infinity: the host
# reads it with the tokens (no other transfer) and stops the generation with an error (lingjax.engine).
NONFINITE = -1


def flag_nonfinite(tokens: jax.Array, top: jax.Array) -> jax.Array:
    """tokens, or NONFINITE where `top` (the max of the logits a token came from; NaN if any is NaN) is not
    finite; with `top` over several rows ([R]), every token of tokens is flagged when any row is."""
    ok = jnp.all(jnp.isfinite(top))
    return jnp.where(ok, tokens, NONFINITE)


def sample(logits: jax.Array, key: jax.Array, params: SamplingParams, ex: Exec = Exec()) -> jax.Array:
    """logits: [..., V] (a vocabulary shard under TP) -> token ids [...] int32 (NONFINITE where the logits are
    not finite). Greedy reduces across shards; sampling gathers the full vocabulary and draws with the same key on
    every shard."""
    if params.greedy:
        top, token = ex.max_argmax_vocab(logits)
    else:
        logits = ex.gather_vocab(logits)
        top = jnp.max(logits, axis=-1)
        token = jax.random.categorical(key, processed_logits(logits, params), axis=-1).astype(jnp.int32)
    return jnp.where(jnp.isfinite(top), token, NONFINITE)
