"""Acceptance rules for a chain of S drafts verified in one target forward of width S+1.

Row r of the verify logits predicts the token after verify input r (inputs: [b, d_1, ..., d_S]).
Both rules return (n, tokens): n accepted drafts (0..S, a device int) and tokens [S+1] whose first
n+1 entries are the round's emitted tokens d_1..d_n, b' (b' = the target's own token at row n);
entries past n repeat the drafts and are junk. Every count stays on the device.
"""

import jax
import jax.numpy as jnp

from lingjax.execution import Exec
from lingjax.sampling import SamplingParams, processed_logits


def _emit(drafts, n, bonus):
    return jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)]).at[n].set(bonus)


def greedy_accept(drafts: jax.Array, logits: jax.Array, ex: Exec = Exec()):
    """Longest prefix of drafts equal to the target's argmax, plus the target's bonus token."""
    target = ex.argmax_vocab(logits)  # [S+1]
    n = jnp.sum(jnp.cumprod(drafts == target[:-1])).astype(jnp.int32)
    return n, _emit(drafts, n, target[n])


def target_only_accept(drafts: jax.Array, logits: jax.Array, key: jax.Array, params: SamplingParams):
    """Lossless rule for a deterministic draft: accept d_i iff u_i <= p_{i-1}(d_i); at the first
    rejection sample b' from p_n with d_{n+1} removed; all accepted: b' ~ p_S.
    P(out = x) = p(d)[x = d] + (1 - p(d)) r(x) = p(x) with r ∝ p·[x != d]."""
    s = drafts.shape[0]
    processed = processed_logits(logits, params)  # [S+1, V], -inf outside top-k/top-p
    probs = jax.nn.softmax(processed, axis=-1)
    k_accept, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_accept, (s,))
    p_draft = jnp.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
    n = jnp.sum(jnp.cumprod(u <= p_draft)).astype(jnp.int32)
    row = processed[n]
    rejected = drafts[jnp.minimum(n, s - 1)]
    row = jnp.where((n < s) & (jnp.arange(row.shape[0]) == rejected), -jnp.inf, row)
    bonus = jax.random.categorical(k_bonus, row).astype(jnp.int32)
    return n, _emit(drafts, n, bonus)


def accept(drafts, logits, key, params: SamplingParams, ex: Exec = Exec()):
    """logits may be vocabulary shards under TP: greedy reduces across them, sampling gathers them
    (the same key on every shard keeps the shards' decisions identical)."""
    if params.greedy:
        return greedy_accept(drafts, logits, ex)
    return target_only_accept(drafts, ex.gather_vocab(logits), key, params)
