"""The speculative round as one jitted program over one donated state pytree.

round: draft -> verify -> accept -> commit -> extend. Nothing in it needs a host value: the
committed length s, the bonus token, the accept count n and every index derived from them are
device values under fixed shapes, so the host can enqueue round k+1 before round k finishes.
One call may run several rounds back to back on the device (rounds_per_call, a lax.scan): each
execution of a program has fixed host costs (at TP2 an execution's setup, its collectives'
cliques, re-recorded CUDA graphs), which the rounds of one call share.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from lingjax import cache as cache_lib
from lingjax.runtime import check_rounds_per_call, steps_in_one_call
from lingjax.sampling import SamplingParams, sample
from lingjax.spec.accept import accept


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: cache_lib.ModelCache  # target caches (KDA committed state, MLA latent caches)
    draft: object  # the drafter's own state pytree
    s: jax.Array  # int32: committed length (tokens the target has consumed)
    bonus: jax.Array  # int32: x_s, emitted but not yet consumed by the target
    round: jax.Array  # int32: rounds run so far (keys are fold_in(base_key, round))
    key: jax.Array  # base PRNG key


class SpecProgram:
    """Jitted prefill and rounds for one (model, drafter, sampling, rounds_per_call) combination;
    under TP each body runs inside shard_map (the drafter's state is replicated).
    round(weights, state) -> (state after rounds_per_call rounds, int32 [rounds_per_call, S+2])."""

    def __init__(self, model, drafter, sampling: SamplingParams, rounds_per_call: int = 1):
        self.model, self.drafter, self.sampling = model, drafter, sampling
        self.rounds_per_call = check_rounds_per_call(rounds_per_call)
        rep = P()
        draft_specs = jax.tree.map(lambda _: rep, jax.eval_shape(lambda: drafter.init(model.module, 1)))
        state_specs = SpecState(cache=model.cache_specs, draft=draft_specs, s=rep, bonus=rep, round=rep, key=rep)
        chunk_specs = ((model.weight_specs, model.cache_specs, draft_specs) + (rep,) * 5, (rep, model.cache_specs,
                                                                                        draft_specs))
        self._prefill = {
            last: model.step_jit(model.sharded(functools.partial(self._prefill_chunk, last=last), *chunk_specs),
                                 donate_argnums=(1, 2))
            for last in (False, True)
        }
        self.round = model.step_jit(model.sharded(self._rounds, (model.weight_specs, state_specs), (state_specs, rep)),
                                    donate_argnums=(1,))

    def prefill_chunk(self, weights, cache, draft, tokens, start, n_valid, next_token, key, *, last: bool):
        return self._prefill[last](weights, cache, draft, tokens, start, n_valid, next_token, key)

    def _module(self, weights):
        return self.model._module(weights)

    def _prefill_chunk(self, weights, cache, draft, tokens, start, n_valid, next_token, key, last: bool):
        """One prompt chunk through the target, then through the drafter. On the last chunk the
        token after the prompt is the target's own first token b, sampled here."""
        module = self._module(weights)
        ex = self.model.ex
        hidden, cache = module.forward(tokens, cache, start, n_valid, ex)
        if last:
            logits = module.lm_logits(jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False))
            next_token = sample(logits, jax.random.fold_in(key, 0), self.sampling, ex)
        draft = self.drafter.prefill(module, draft, tokens, hidden, start, n_valid, next_token, ex)
        return next_token, cache, draft

    def _rounds(self, weights, state: SpecState):
        """-> (state after rounds_per_call rounds, int32 [rounds_per_call, S+2]: each round's output)."""
        return steps_in_one_call(lambda st: self._round(weights, st), state, self.rounds_per_call)

    def _round(self, weights, state: SpecState):
        """-> (next state, int32 [S+2] output)."""
        module = self._module(weights)
        ex = self.model.ex
        key = jax.random.fold_in(state.key, state.round + 1)
        with jax.named_scope("draft"):
            drafts, draft = self.drafter.propose(module, state.draft, state.bonus, state.s, ex)
        with jax.named_scope("verify"):
            inputs = jnp.concatenate([state.bonus[None], drafts])  # [S+1]: b, d_1..d_S
            hidden, cache, staging = module.verify(inputs, state.cache, state.s, ex)
            logits = module.lm_logits(hidden)  # [S+1, V], lm_head read once for all rows
        with jax.named_scope("accept"):
            n, tokens = accept(drafts, logits, key, self.sampling, ex)
        with jax.named_scope("commit"):
            cache = cache_lib.commit(cache, staging, n)
        with jax.named_scope("draft_extend"):
            draft = self.drafter.extend(module, draft, tokens, hidden, state.s, n, ex)
        new_state = SpecState(cache=cache, draft=draft, s=state.s + n + 1, bonus=tokens[n],
                              round=state.round + 1, key=state.key)
        # One small array for the host's one read: [t_0..t_S, count]; the first count = n+1 tokens
        # (the accept length) are this round's new tokens.
        return new_state, jnp.concatenate([tokens, (n + 1)[None]])
