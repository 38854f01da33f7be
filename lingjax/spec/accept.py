"""Acceptance rules for a chain of S drafts verified in one target forward of width S+1.

Row r of the verify logits predicts the token after verify input r (inputs: [b, d_1, ..., d_S]).
Every rule returns (n, tokens): n accepted drafts (0..S, a device int) and tokens [S+1] whose first
n+1 entries are the round's emitted tokens d_1..d_n, b' (b' = the target's own token at row n);
entries past n repeat the drafts and are junk. Every count stays on the device.

`limit` (a device int, default S) is how many drafts count: drafts past it are never accepted, and with
all `limit` accepted b' comes from row `limit` as if the round had drafted no more. It must not depend on
the verify's logits or the acceptance uniforms (lossless sampling needs the drafts that count to be chosen
before the target is consulted); a drafter's own confidence qualifies.
"""

import jax
import jax.numpy as jnp

from lingjax.execution import Exec
from lingjax.sampling import SamplingParams, flag_nonfinite, processed_logits


def _emit(drafts, n, bonus):
    return jnp.concatenate([drafts, jnp.zeros((1,), drafts.dtype)]).at[n].set(bonus)


def _limit(drafts, limit):
    return drafts.shape[0] if limit is None else limit


def _leading(accepted, limit) -> jax.Array:
    """The number of leading True in accepted [S] among the first `limit`."""
    counted = accepted & (jnp.arange(accepted.shape[0]) < limit)
    return jnp.sum(jnp.cumprod(counted)).astype(jnp.int32)


def greedy_accept(drafts: jax.Array, logits: jax.Array, ex: Exec = Exec(), limit=None):
    """Longest prefix of drafts equal to the target's argmax (at most `limit`), plus the target's bonus token."""
    top, target = ex.max_argmax_vocab(logits)  # [S+1]
    n = _leading(drafts == target[:-1], _limit(drafts, limit))
    return n, flag_nonfinite(_emit(drafts, n, target[n]), top)


def target_only_accept(drafts: jax.Array, logits: jax.Array, key: jax.Array, params: SamplingParams, limit=None):
    """Lossless rule for a deterministic draft: accept d_i iff u_i <= p_{i-1}(d_i); at the first
    rejection sample b' from p_n with d_{n+1} removed; all accepted: b' ~ p_n.
    P(out = x) = p(d)[x = d] + (1 - p(d)) r(x) = p(x) with r ∝ p·[x != d]."""
    s = drafts.shape[0]
    limit = _limit(drafts, limit)
    processed = processed_logits(logits, params)  # [S+1, V], -inf outside top-k/top-p
    probs = jax.nn.softmax(processed, axis=-1)
    k_accept, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_accept, (s,))
    p_draft = jnp.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
    n = _leading(u <= p_draft, limit)
    row = processed[n]
    rejected = drafts[jnp.minimum(n, s - 1)]
    row = jnp.where((n < limit) & (jnp.arange(row.shape[0]) == rejected), -jnp.inf, row)
    bonus = jax.random.categorical(k_bonus, row).astype(jnp.int32)
    return n, flag_nonfinite(_emit(drafts, n, bonus), jnp.max(logits, axis=-1))


def rejection_accept(drafts: jax.Array, draft_probs: jax.Array, logits: jax.Array, key: jax.Array,
                     params: SamplingParams, limit=None):
    """Speculative sampling for drafts sampled from known distributions q_i (draft_probs [S, V]): accept d_i iff
    u_i <= p_{i-1}(d_i) / q_i(d_i); at the first rejection sample b' from max(p_n - q_{n+1}, 0), normalised;
    all accepted: b' ~ p_n. P(out = x) = q(x)·min(1, p(x)/q(x)) + (1 - Σ min(p, q))·r(x) = p(x)."""
    s = drafts.shape[0]
    limit = _limit(drafts, limit)
    processed = processed_logits(logits, params)
    probs = jax.nn.softmax(processed, axis=-1)  # [S+1, V]
    k_accept, k_bonus = jax.random.split(key)
    u = jax.random.uniform(k_accept, (s,))
    p_draft = jnp.take_along_axis(probs[:-1], drafts[:, None], axis=-1)[:, 0]
    q_draft = jnp.take_along_axis(draft_probs, drafts[:, None], axis=-1)[:, 0]
    n = _leading(u * q_draft <= p_draft, limit)  # u <= p/q without dividing by a zero q
    residual = jnp.maximum(probs[n] - draft_probs[jnp.minimum(n, s - 1)], 0.0)
    # all accepted, or a residual of no mass (p = q, only rounding left): b' from p_n itself
    use_residual = (n < limit) & (jnp.sum(residual) > 0)
    row = jnp.where(use_residual, jnp.log(residual), processed[n])
    bonus = jax.random.categorical(k_bonus, row).astype(jnp.int32)
    return n, flag_nonfinite(_emit(drafts, n, bonus), jnp.max(logits, axis=-1))


def accept(proposal, logits, key, params: SamplingParams, ex: Exec = Exec()):
    """The rule for a lingjax.spec.drafters.Proposal: greedy reduces across vocabulary shards under TP,
    sampling gathers them (the same key on every shard keeps the shards' decisions identical) and takes
    rejection sampling when the proposal carries its distributions, the target-only rule otherwise."""
    if params.greedy:
        return greedy_accept(proposal.drafts, logits, ex, proposal.limit)
    logits = ex.gather_vocab(logits)
    if proposal.probs is not None:
        return rejection_accept(proposal.drafts, proposal.probs, logits, key, params, proposal.limit)
    return target_only_accept(proposal.drafts, logits, key, params, proposal.limit)
