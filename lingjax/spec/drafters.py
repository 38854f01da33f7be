"""Drafters: what proposes the S tokens a speculative round verifies.

A drafter is a frozen (hashable) object whose methods are pure functions called inside the jitted
round with the merged LingModel; its state is a pytree it owns, carried in SpecState.draft.
- init(module, capacity) -> state
- prefill(module, state, tokens [T], hidden [T, D], start, n_valid, next_token, ex) -> state:
  consume a prompt chunk (target hidden rows included); next_token is the token after the chunk.
- propose(module, state, bonus, s, ex) -> (drafts [S] int32, state)
- extend(module, state, tokens [S+1], hidden [S+1, D], s, n, ex) -> state: after the verdict,
  with the round's tokens (first n+1 valid: d_1..d_n, b') and the verify hidden rows.
`ex` is the lingjax.execution.Exec of the program (kernel set, TP axis: lm_head logits are vocabulary
shards under TP, so drafters take argmaxes through ex.argmax_vocab).
A block drafter (DSpark) implements the same four and reuses verify/accept/commit unchanged.
ReplayDrafter proposes a known continuation: for checking losslessness and timing at set acceptance.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lingjax.cache import MLACache, init_mla_cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NextnState:
    cache: MLACache  # the MTP layer's latent cache
    d1: jax.Array  # int32: the first draft of the next round
    g: jax.Array  # [D]: the hidden seeding the chain (the MTP's z at the last committed row)


@dataclasses.dataclass(frozen=True)
class NextnDrafter:
    """NEXTN chain (topk = 1) with the checkpoint's MTP layer: S drafts from S-1 MTP forwards
    (d_1 comes from the previous round's draft-extend)."""

    steps: int = 5

    def init(self, module, capacity: int) -> NextnState:
        cfg = module.cfg
        return NextnState(cache=init_mla_cache(cfg, capacity, module.dtype), d1=jnp.zeros((), jnp.int32),
                          g=jnp.zeros((cfg.hidden_size,), module.dtype))

    def _seed(self, module, z, cache, ex) -> NextnState:
        d1 = ex.argmax_vocab(module.lm_logits(z, pad_small=False))
        return NextnState(cache=cache, d1=d1, g=z)

    def prefill(self, module, state, tokens, hidden, start, n_valid, next_token, ex):
        # MTP row p takes (x_{p+1}, h_p): the chunk shifted left, the token after it at row n_valid-1.
        shifted = jnp.concatenate([tokens[1:], tokens[:1]]).at[n_valid - 1].set(next_token)
        z, cache = module.mtp_forward(shifted, hidden, state.cache, start, n_valid, ex)
        return self._seed(module, jax.lax.dynamic_index_in_dim(z, n_valid - 1, keepdims=False), cache, ex)

    def propose(self, module, state, bonus, s, ex):
        drafts, g, cache = [state.d1], state.g, state.cache
        for i in range(1, self.steps):  # MTP row at s+i-1 with (d_i, g) predicts d_{i+1}
            z, cache = module.mtp_forward(drafts[-1][None], g[None], cache, s + i - 1, 1, ex)
            g = z[0]
            drafts.append(ex.argmax_vocab(module.lm_logits(g, pad_small=False)))
        return jnp.stack(drafts), NextnState(cache=cache, d1=state.d1, g=g)

    def extend(self, module, state, tokens, hidden, s, n, ex):
        # MTP rows at s..s+S with (y_r, h_{s+r}); row n seeds the next round, rows past n are junk.
        z, cache = module.mtp_forward(tokens, hidden, state.cache, s, tokens.shape[0], ex)
        return self._seed(module, jax.lax.dynamic_index_in_dim(z, n, keepdims=False), cache, ex)


@dataclasses.dataclass(frozen=True)
class ReplayDrafter:
    """Proposes a known continuation of the sequence (the target's own greedy output), with the draft
    at absolute position p made wrong when (p² + p // 2) % corrupt_every == 0 (an irregular pattern,
    so accept lengths vary; corrupt_every=0: every draft right, 1: every draft wrong). Its state is
    the sequence. For checking that speculation is lossless, and for timing rounds at full or
    controlled acceptance, with random weights, whose MTP drafts are almost never right."""

    sequence: tuple
    steps: int
    vocab: int
    corrupt_every: int = 0

    @classmethod
    def replaying(cls, model, prompt, greedy, steps: int, corrupt_every: int = 0) -> ReplayDrafter:
        """Drafts `greedy` (the target's greedy tokens after `prompt`) for `model` (a lingjax.Model)."""
        return cls(tuple(int(t) for t in prompt) + tuple(int(t) for t in greedy), steps, model.cfg.vocab_size,
                   corrupt_every)

    def init(self, module, capacity: int) -> jax.Array:
        seq = np.zeros(max(capacity, len(self.sequence)) + 2 * self.steps + 2, np.int32)
        seq[: len(self.sequence)] = self.sequence
        return jnp.asarray(seq)

    def prefill(self, module, state, tokens, hidden, start, n_valid, next_token, ex):
        return state

    def propose(self, module, state, bonus, s, ex):
        positions = s + 1 + jnp.arange(self.steps)
        drafts = jax.lax.dynamic_slice_in_dim(state, s + 1, self.steps)
        if self.corrupt_every:
            wrong = (positions * positions + positions // 2) % self.corrupt_every == 0
            drafts = jnp.where(wrong, (drafts + 1) % self.vocab, drafts)
        return drafts, state

    def extend(self, module, state, tokens, hidden, s, n, ex):
        return state
