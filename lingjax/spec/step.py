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

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from lingjax import cache as cache_lib
from lingjax.runtime import Model, steps_in_one_call
from lingjax.sampling import SamplingParams, sample
from lingjax.spec import draft_vocab
from lingjax.spec.accept import accept
from lingjax.spec.drafters import TargetRows


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SpecState:
    cache: cache_lib.ModelCache  # target caches (KDA committed state, MLA latent caches)
    draft: object  # the drafter's own state pytree
    s: jax.Array  # int32: committed length (tokens the target has consumed)
    bonus: jax.Array  # int32: x_s, emitted but not yet consumed by the target
    round: jax.Array  # int32: rounds run so far (keys are fold_in(base_key, round))
    key: jax.Array  # base PRNG key


def spec_program(model: Model, drafter, sampling: SamplingParams, rounds_per_call: int = 1) -> SpecProgram:
    """The jitted speculative prefill and rounds of `model` for this drafter, sampling and rounds per call (a
    checked request's: lingjax.requests.check_generation), built once per model and options, then reused
    (Model.programs)."""
    key = ("spec", drafter, sampling, rounds_per_call)
    if key not in model.programs:
        model.programs[key] = SpecProgram(model, drafter, sampling, rounds_per_call)
    return model.programs[key]


class SpecProgram:
    """Jitted prefill and rounds for one (model, drafter, sampling, rounds_per_call) combination;
    under TP each body runs inside shard_map (the drafter's state and weights are replicated, but for a draft
    vocabulary, split like the lm_head: lingjax.spec.draft_vocab).
    Every program takes `weights` = (the target's weights, the drafter's params): `self.weights`.
    round(weights, state) -> (state after rounds_per_call rounds, int32 [rounds_per_call, 2 + S + R]: each
    round's `output_row`)."""

    def __init__(self, model, drafter, sampling: SamplingParams, rounds_per_call: int = 1):
        self.model, self.drafter, self.sampling = model, drafter, sampling
        self.rounds_per_call = rounds_per_call
        self.draft_params = drafter.params_of(model)
        rep = P()
        weight_specs = (model.weight_specs, draft_vocab.specs(self.draft_params))
        draft_specs = jax.tree.map(lambda _: rep, jax.eval_shape(lambda: drafter.init(model.module, 1)))
        state_specs = SpecState(cache=model.cache_specs, draft=draft_specs, s=rep, bonus=rep, round=rep, key=rep)
        chunk_specs = ((weight_specs, model.cache_specs, draft_specs) + (rep,) * 6, (rep, model.cache_specs,
                                                                                  draft_specs))
        # one program for the chunks of a padded size, the last one's too (its flag is an argument)
        what = f"{drafter!r} {sampling!r} {rounds_per_call}"
        self.prefill_program = model.step_jit(model.sharded(self._prefill_chunk, *chunk_specs),
                                              f"speculative prefill {what}", donate_argnums=(1, 2))
        # the jitted round; `round` calls it (what lingjax.precompile compiles, whatever wraps `round`)
        self.round_program = model.step_jit(model.sharded(self._rounds, (weight_specs, state_specs),
                                                          (state_specs, rep)), f"speculative round {what}",
                                            donate_argnums=(1,))
        self.round = self.round_program

    @property
    def weights(self) -> tuple:
        """What every program of this one takes first: (the model's weights, the drafter's params)."""
        return self.model.weights, self.draft_params

    def _module(self, weights):
        return self.model._module(weights[0]), weights[1]

    def _prefill_chunk(self, weights, cache, draft, tokens, start, n_valid, next_token, last, key):
        """One prompt chunk through the target, then through the drafter -> (the token after the chunk, cache,
        draft). next_token: the prompt's token after the chunk; on the last chunk (`last`, a bool) it is the
        target's own first token b instead, sampled here. Every chunk samples, so that one program serves every chunk
        of a padded size, the last one's too (a middle chunk's sample, one lm_head row, is dropped)."""
        module, params = self._module(weights)
        ex = self.model.ex
        hidden, cache, features = module.forward_features(tokens, cache, start, n_valid, ex,
                                                          self.drafter.feature_layers)
        logits = module.lm_logits(jax.lax.dynamic_index_in_dim(hidden, n_valid - 1, keepdims=False), ex=ex)
        next_token = jnp.where(last, sample(logits, jax.random.fold_in(key, 0), self.sampling, ex), next_token)
        rows = TargetRows(tokens=tokens, hidden=hidden, features=features, start=start, n_valid=n_valid)
        draft = self.drafter.prefill(module, params, draft, rows, next_token, ex)
        return next_token, cache, draft

    def _rounds(self, weights, state: SpecState):
        """-> (state after rounds_per_call rounds, int32 [rounds_per_call, 2 + S + R]: each round's output)."""
        return steps_in_one_call(lambda st: self._round(weights, st), state, self.rounds_per_call)

    def _round(self, weights, state: SpecState):
        """-> (next state, int32 [2 + S + R]: output_row)."""
        module, params = self._module(weights)
        ex = self.model.ex
        key = jax.random.fold_in(state.key, state.round + 1)
        k_draft, k_accept = jax.random.split(key)
        with jax.named_scope("draft"):
            proposal, draft = self.drafter.propose(module, params, state.draft, state.bonus, state.s, k_draft,
                                                   self.sampling, ex)
        with jax.named_scope("verify"):
            inputs = jnp.concatenate([state.bonus[None], proposal.drafts])  # [S+1]: b, d_1..d_S
            hidden, cache, staging, features = module.verify(inputs, state.cache, state.s, ex,
                                                             self.drafter.feature_layers)
            logits = module.lm_logits(hidden, ex=ex)  # [S+1, V], lm_head read once for all rows
        with jax.named_scope("accept"):
            n, tokens = accept(proposal, logits, k_accept, self.sampling, ex)
        with jax.named_scope("commit"):
            cache = cache_lib.commit(cache, staging, n)
        with jax.named_scope("draft_extend"):
            rows = TargetRows(tokens=tokens, hidden=hidden, features=features, start=state.s,
                              n_valid=jnp.int32(tokens.shape[0]))
            draft = self.drafter.extend(module, params, draft, rows, n, ex)
        new_state = SpecState(cache=cache, draft=draft, s=state.s + n + 1, bonus=tokens[n],
                              round=state.round + 1, key=state.key)
        return new_state, output_row(n, tokens, proposal.report)


def output_row(n, tokens, report=None) -> jax.Array:
    """A round's one small array for the host's one read: int32 [2 + S + R] = [count, t_0..t_S, report...]: the
    first count = n+1 tokens (the accept length) are the round's new tokens; then the proposal's report (R f32
    values, bit for bit in int32: read_output_row)."""
    parts = [(n + 1)[None], tokens]
    if report is not None:
        parts.append(jax.lax.bitcast_convert_type(report.astype(jnp.float32), jnp.int32))
    return jnp.concatenate(parts)


def read_output_row(row: np.ndarray, steps: int) -> tuple[list[int], np.ndarray]:
    """A host copy of output_row of a round with `steps` drafts -> (its new tokens, its report as float32)."""
    return row[1 : 1 + row[0]].tolist(), row[2 + steps :].view(np.float32)
