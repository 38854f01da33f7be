"""DSpark block drafting (docs/dspark.md): a drafter that proposes a block of γ tokens from one parallel forward of
its own small network (lingjax.spec.dspark_model), conditioned on the target's residual streams.

Per round, inside the jitted round of lingjax.spec.step:
- propose: the block [b, MASK × (γ-1)] at positions s..s+γ-1 attends to the context cache (rows < s) and to
  itself; U_k = lm_head(h_{k-1}); the Markov head adds W1[x_{k-1}]·W2 left to right (x_0 = b), each x_k the argmax
  (greedy) or a sample at the request's temperature; the confidence head gives c_k and the survival a_k = Π c_i.
  The first `steps` drafts are verified; of those, the leading ones with a_k >= min_survival count (`limit`).
- extend: the verify's rows' target features become context rows at s..s+S (each layer's k/v projections):
  rows past the accepted ones are stale and hidden by position (the next block attends to rows < s' only),
  then rewritten by a later round. Prefill writes the prompt's rows the same way.
The KDA state of the target is staged and committed by the round as for NEXTN: no replay.

`DSpark` holds a loaded drafter (config, the network, its weights); `Model.draft` carries one beside a target,
and `lingjax.generate(..., spec="dspark")` uses it. Its checkpoint files: lingjax.spec.dspark_io; the verify widths
the host chooses each round: lingjax.spec.width_schedule.
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lingjax.dtypes import dtype_of
from lingjax.sampling import SamplingParams, processed_logits
from lingjax.spec.draft_vocab import full_draft_logits
from lingjax.spec.drafters import Proposal, TargetRows
from lingjax.spec.dspark_model import DSparkConfig, DSparkDraft, abstract_draft


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DSparkState:
    k: jax.Array  # [L, capacity, G, d]: each draft layer's context keys (normed, roped) by position
    v: jax.Array  # [L, capacity, G, d]: its context values


@functools.lru_cache(maxsize=16)
def _graphdef(cfg: DSparkConfig, dtype: str):
    return nnx.split(abstract_draft(cfg, dtype_of(dtype)))[0]


@dataclasses.dataclass(frozen=True)
class DSparkDrafter:
    """The DSpark drafter of lingjax.spec.drafters' interface. steps: drafts verified a round (1..block_size);
    min_survival: of those, the leading ones whose survival probability is at least this count (the limit is a
    stopping time of the draft's own confidences, so sampled rounds stay lossless: docs/dspark.md). Its params
    are (the network's weights, Model.draft_vocab): with a draft vocabulary the base logits U_k cover its tokens
    alone (-inf elsewhere), so drafts come from it and a sampled draft's distribution is zero outside it."""

    cfg: DSparkConfig
    dtype: str
    steps: int
    min_survival: float = 1e-6

    def __post_init__(self):
        dtype_of(self.dtype)
        if not 1 <= self.steps <= self.cfg.block_size:
            raise ValueError(f"a DSpark round verifies 1..{self.cfg.block_size} drafts (its block size), got "
                             f"{self.steps}")

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.cfg.target_layer_ids

    def params_of(self, model):
        draft = getattr(model, "draft", None)
        if draft is None:
            raise ValueError(f"{model.source or 'this model'} has no DSpark drafter: lingjax.load(..., draft=DIR)")
        if draft.cfg != self.cfg or draft.dtype != self.dtype:
            raise ValueError("this DSparkDrafter was made for another drafter than the model's")
        return draft.params, getattr(model, "draft_vocab", None)

    def _net(self, params) -> DSparkDraft:
        return nnx.merge(_graphdef(self.cfg, self.dtype), params)

    def init(self, module, capacity: int) -> DSparkState:
        c = self.cfg
        shape = (c.num_layers, capacity, c.num_kv_heads, c.head_dim)
        return DSparkState(k=jnp.zeros(shape, dtype_of(self.dtype)), v=jnp.zeros(shape, dtype_of(self.dtype)))

    def _write_context(self, params, state: DSparkState, rows: TargetRows) -> DSparkState:
        positions = rows.start + jnp.arange(rows.features.shape[0], dtype=jnp.int32)
        k, v = self._net(params[0]).context_kv(rows.features, positions)

        def put(cache, new):
            return jax.lax.dynamic_update_slice_in_dim(cache, new.astype(cache.dtype), rows.start, 1)

        return DSparkState(k=put(state.k, k), v=put(state.v, v))

    def prefill(self, module, params, state, rows: TargetRows, next_token, ex):
        return self._write_context(params, state, rows)

    def extend(self, module, params, state, rows: TargetRows, n, ex):
        return self._write_context(params, state, rows)

    def propose(self, module, params, state: DSparkState, bonus, s, key, sampling: SamplingParams, ex):
        (weights, vocab), c = params, self.cfg
        net = self._net(weights)
        tokens = jnp.full((c.block_size,), c.mask_token_id, jnp.int32).at[0].set(bonus)
        positions = s + jnp.arange(c.block_size, dtype=jnp.int32)
        visible = jnp.arange(state.k.shape[1]) < s
        h = net.blocks(module.embed_tokens(tokens)[None], positions[None], state.k, state.v, visible[None])[0]
        base = full_draft_logits(module, vocab, h, ex)  # [γ, V] f32: U_1..U_γ
        drafts, probs, conf = markov_chain(net, base, h, bonus, key, sampling, c.markov_topk)
        survival = jnp.cumprod(jax.nn.sigmoid(conf))  # [γ]: a_k
        s_ = self.steps
        limit = jnp.sum(survival[:s_] >= self.min_survival).astype(jnp.int32)  # a_k does not increase with k
        return Proposal(drafts=drafts[:s_], probs=None if probs is None else probs[:s_], limit=limit,
                        report=survival), state


def markov_chain(net: DSparkDraft, base, h, first, key, sampling: SamplingParams, topk: int = 0):
    """The Markov head and the confidence head, left to right over a block: base [γ, V] f32 (U_k), h [γ, D]
    (the block's final hidden rows), first: x_0 (the anchor); topk > 0: each draft from the topk best base logits
    alone (DSparkConfig.markov_topk). -> (drafts [γ] int32, the distributions they were drawn from [γ, V] f32 or
    None when greedy, confidence logits [γ] f32). Only the drafts are sequential: the confidences, which need
    x_{k-1} alone, are one batched product after them."""
    if sampling.greedy and 0 < topk <= TABLE_CANDIDATES:
        drafts, probs = greedy_topk_chain(net, base, first, topk), None
    else:
        drafts, probs = _sequential_chain(net, base, first, key, sampling, topk)
    prev = jnp.concatenate([jnp.reshape(first, (1,)).astype(jnp.int32), drafts[:-1]])
    return drafts, probs, net.confidence_logit(h, net.markov_code(prev))


# greedy with at most this many candidates a row: the chain's choices tabulated in parallel (γ·K² scores)
TABLE_CANDIDATES = 64


def greedy_topk_chain(net: DSparkDraft, base, first, topk: int):
    """Greedy drafts over each row's topk best base logits, the sequential argmax chain replaced by a table:
    best[k, i] = the candidate of row k that follows candidate i of row k-1 (one batched product of every pair's
    Markov term), then γ - 1 lookups. The same drafts as the sequential chain (up to the rounding of ties), in a
    few kernels instead of several per row. base [γ, V] f32, first: x_0 -> drafts [γ] int32."""
    gamma = base.shape[0]
    candidates = jax.lax.top_k(base, topk)[1]  # [γ, K]
    cand_base = jnp.take_along_axis(base, candidates, 1)  # [γ, K]
    first_scores = cand_base[0] + net.markov_bias(net.markov_code(first), candidates[0])
    # [γ-1, K, K]: candidate i of row k-1 (its code) against candidate j of row k
    pair = net.markov_bias(net.markov_code(candidates[:-1]), candidates[1:, None, :])
    best = jnp.argmax(cand_base[1:, None, :] + pair, -1).astype(jnp.int32)  # [γ-1, K]
    picks = [jnp.argmax(first_scores).astype(jnp.int32)]
    for k in range(gamma - 1):
        picks.append(best[k, picks[-1]])
    return candidates[jnp.arange(gamma), jnp.stack(picks)].astype(jnp.int32)


def _sequential_chain(net: DSparkDraft, base, first, key, sampling: SamplingParams, topk: int):
    """markov_chain's drafts one row after another -> (drafts [γ] int32, distributions [γ, V] or None)."""
    prev, drafts, probs = first, [], []
    keys = jax.random.split(key, base.shape[0])
    if topk:
        candidates = jax.lax.top_k(base, topk)[1]  # [γ, K]
    for k in range(base.shape[0]):
        code = net.markov_code(prev)
        if topk:  # the candidates' logits [K]; the full vocabulary only for a sample's distribution
            chosen = base[k][candidates[k]] + net.markov_bias(code, candidates[k])
            if sampling.greedy:
                prev = candidates[k][jnp.argmax(chosen)].astype(jnp.int32)
                drafts.append(prev)
                continue
            logits = jnp.full_like(base[k], -jnp.inf).at[candidates[k]].set(chosen)
        else:
            logits = base[k] + net.markov_bias(code)
        if sampling.greedy:
            prev = jnp.argmax(logits).astype(jnp.int32)
        else:
            processed = processed_logits(logits, sampling)
            prev = jax.random.categorical(keys[k], processed).astype(jnp.int32)
            probs.append(jax.nn.softmax(processed))
        drafts.append(prev)
    return jnp.stack(drafts).astype(jnp.int32), (jnp.stack(probs) if probs else None)


# ---- a loaded drafter -------------------------------------------------------------------------------
class DSpark:
    """A DSpark drafter on the device: its config, network and weights (nnx.State, replicated under TP)."""

    def __init__(self, net: DSparkDraft, source: str = ""):
        self.cfg: DSparkConfig = net.cfg
        self.dtype = jnp.dtype(net.dtype).name
        self.source = source
        self.params = nnx.split(net)[1]

    @property
    def net(self) -> DSparkDraft:
        return nnx.merge(_graphdef(self.cfg, self.dtype), self.params)

    def with_markov_topk(self, topk: int) -> DSpark:
        """The same drafter (its weights shared) drafting from each row's `topk` best base logits (0: all)."""
        other = copy.copy(self)
        other.cfg = dataclasses.replace(self.cfg, markov_topk=topk)
        return other

    def drafter(self, steps: int, min_survival: float = 1e-6) -> DSparkDrafter:
        return DSparkDrafter(self.cfg, self.dtype, steps, min_survival)

    def num_params(self) -> int:
        return sum(int(x.size) for x in jax.tree.leaves(self.params))


def random_dspark(cfg: DSparkConfig, dtype: str = "bfloat16", seed: int = 0) -> DSpark:
    return DSpark(DSparkDraft(cfg, dtype=dtype_of(dtype), rngs=nnx.Rngs(seed)), source=f"random (seed {seed})")


def default_config(target_cfg, block_size: int = 8, num_layers: int = 2, markov_rank: int = 64,
                   mask_token_id: int | None = None) -> DSparkConfig:
    """A drafter shaped for a target (lingjax.config.LingConfig): its hidden size, heads of 64, an MLP of 8/3 D
    (rounded to 64), target layers spread over the stack as DFlash spreads them (the first, the last, and
    evenly between), the mask token the last id unless given."""
    n = target_cfg.num_hidden_layers
    layers = sorted({round(1 + i * (n - 2) / 2) for i in range(3)}) if n > 2 else list(range(n))
    d = target_cfg.hidden_size
    heads = max(1, d // 64)
    return DSparkConfig(block_size=block_size, target_layer_ids=tuple(layers),
                        mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
                        markov_rank=markov_rank, num_layers=num_layers, hidden_size=d, num_heads=heads,
                        num_kv_heads=heads, head_dim=d // heads, intermediate_size=max(64, (8 * d // 3) // 64 * 64),
                        vocab_size=target_cfg.vocab_size, rms_norm_eps=target_cfg.rms_norm_eps)
