"""Drafters: what proposes the drafts a speculative round verifies.

A drafter is a frozen (hashable) object whose methods are pure functions called inside the jitted
round with the merged LingModel; its state is a pytree it owns, carried in SpecState.draft, and its own
weights (a block drafter's network; () for the others) are `params`, an argument of the programs.
- feature_layers: the target layers whose residual streams it reads (TargetRows.features); () for none
- params_of(model) -> its weights for a lingjax.Model (a pytree of arrays, replicated under TP, except a
  lingjax.spec.draft_vocab.DraftVocab among them: the model's draft vocabulary, split like the lm_head)
- init(module, capacity) -> state
- prefill(module, params, state, rows: TargetRows, next_token, ex) -> state: consume a prompt chunk
  (the target's rows included); next_token is the token after the chunk.
- propose(module, params, state, bonus, s, key, sampling, ex) -> (Proposal, state)
- extend(module, params, state, rows: TargetRows, n, ex) -> state: after the verdict, with the round's
  verify rows (tokens: the first n+1 are d_1..d_n, b').
`ex` is the lingjax.execution.Exec of the program (kernel set, TP axis: lm_head logits are vocabulary
shards under TP, so drafters take argmaxes through ex.argmax_vocab).
`steps` is S, the drafts a round verifies (verify width S + 1).
ReplayDrafter proposes a known continuation: for checking losslessness and timing at set acceptance.
The DSpark block drafter is lingjax.spec.dspark.DSparkDrafter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lingjax.cache import MLACache, init_mla_cache
from lingjax.spec.draft_vocab import draft_argmax


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TargetRows:
    """What the target computed for a run of rows at positions start..start+T-1 (a prompt chunk or a verify)."""

    tokens: jax.Array  # [T] int32: the rows' input tokens
    hidden: jax.Array  # [T, D]: after the final norm
    features: jax.Array  # [T, F]: the residual streams after the drafter's feature_layers (F = 0 for none)
    start: jax.Array  # int32
    n_valid: jax.Array  # int32: the first n_valid rows are real


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Proposal:
    """A round's drafts and what acceptance needs to know of them."""

    drafts: jax.Array  # [S] int32
    # [S, V] f32: the distribution each draft was sampled from (rejection sampling); None: the drafts are
    # deterministic (argmax), and sampled rounds take the target-only rule
    probs: jax.Array | None = None
    limit: jax.Array | None = None  # int32: drafts that count (the rest are never accepted); None: all S
    report: jax.Array | None = None  # [R] f32 for the host, read one round late (DSpark: survival probabilities)


class _NoParams:
    """For drafters without weights of their own."""

    feature_layers: tuple[int, ...] = ()

    def params_of(self, model) -> tuple:
        return ()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class NextnState:
    cache: MLACache  # the MTP layer's latent cache
    d1: jax.Array  # int32: the first draft of the next round
    g: jax.Array  # [D]: the hidden seeding the chain (the MTP's z at the last committed row)


@dataclasses.dataclass(frozen=True)
class NextnDrafter(_NoParams):
    """NEXTN chain (topk = 1) with the checkpoint's MTP layer: S drafts from S-1 MTP forwards
    (d_1 comes from the previous round's draft-extend). Every draft is an argmax (sampled rounds take the
    target-only rule), over the model's draft vocabulary when it has one: its params are Model.draft_vocab."""

    steps: int

    def params_of(self, model):
        vocab = getattr(model, "draft_vocab", None)
        return () if vocab is None else vocab

    def init(self, module, capacity: int) -> NextnState:
        cfg = module.cfg
        return NextnState(cache=init_mla_cache(cfg, capacity, module.dtype), d1=jnp.zeros((), jnp.int32),
                          g=jnp.zeros((cfg.hidden_size,), module.dtype))

    def _seed(self, module, vocab, z, cache, ex) -> NextnState:
        return NextnState(cache=cache, d1=draft_argmax(module, vocab, z, ex), g=z)

    def prefill(self, module, params, state, rows: TargetRows, next_token, ex):
        # MTP row p takes (x_{p+1}, h_p): the chunk shifted left, the token after it at row n_valid-1.
        tokens, n_valid = rows.tokens, rows.n_valid
        shifted = jnp.concatenate([tokens[1:], tokens[:1]]).at[n_valid - 1].set(next_token)
        z, cache = module.mtp_forward(shifted, rows.hidden, state.cache, rows.start, n_valid, ex)
        return self._seed(module, params, jax.lax.dynamic_index_in_dim(z, n_valid - 1, keepdims=False), cache, ex)

    def propose(self, module, params, state, bonus, s, key, sampling, ex):
        drafts, g, cache = [state.d1], state.g, state.cache
        for i in range(1, self.steps):  # MTP row at s+i-1 with (d_i, g) predicts d_{i+1}
            z, cache = module.mtp_forward(drafts[-1][None], g[None], cache, s + i - 1, 1, ex)
            g = z[0]
            drafts.append(draft_argmax(module, params, g, ex))
        return Proposal(jnp.stack(drafts)), NextnState(cache=cache, d1=state.d1, g=g)

    def extend(self, module, params, state, rows: TargetRows, n, ex):
        # MTP rows at s..s+S with (y_r, h_{s+r}); row n seeds the next round, rows past n are junk.
        z, cache = module.mtp_forward(rows.tokens, rows.hidden, state.cache, rows.start, rows.tokens.shape[0], ex)
        return self._seed(module, params, jax.lax.dynamic_index_in_dim(z, n, keepdims=False), cache, ex)


@dataclasses.dataclass(frozen=True)
class ReplayDrafter(_NoParams):
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

    def prefill(self, module, params, state, rows: TargetRows, next_token, ex):
        return state

    def propose(self, module, params, state, bonus, s, key, sampling, ex):
        positions = s + 1 + jnp.arange(self.steps)
        drafts = jax.lax.dynamic_slice_in_dim(state, s + 1, self.steps)
        if self.corrupt_every:
            wrong = (positions * positions + positions // 2) % self.corrupt_every == 0
            drafts = jnp.where(wrong, (drafts + 1) % self.vocab, drafts)
        return Proposal(drafts), state

    def extend(self, module, params, state, rows: TargetRows, n, ex):
        return state
