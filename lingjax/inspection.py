"""What the model does inside, for notebooks (notebooks/explore.ipynb): a token-by-token walk and speculation
round by round.

`walk(model, ids)` runs the ids through the target one token at a time (the decode path, T = 1, on the XLA
references: the model's math in plain JAX, whatever kernel set the model was loaded with) and keeps, per token:
the residual stream after every layer, each MoE layer's chosen experts (and so their groups), each KDA layer's
recurrent-state norm per head, and each MLA layer's attention weights over the context. The values come from
the model's own forward, through Exec.tap (lingjax/execution.py), not from a copy of its math.

`speculate(model, ids, "nextn" | "dspark", rounds)` runs the engine's speculative program (lingjax.spec.step)
round by round, greedy, and returns each round's drafts, how many the target accepted, its bonus token and
(DSpark) the drafter's survival probabilities, the product of its confidences.

    walk = inspection.walk(model, model.tokenizer.encode("def add(a, b):"))
    walk.expert_load()                   # [MoE layers, E] tokens routed to each expert
    rounds = inspection.speculate(model, ids, "dspark", rounds=6)

Batch 1, one device (tp = 1).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lingjax.config import KDA, MLA, MOE


@dataclasses.dataclass
class Walk:
    """Per token of a walk (T tokens, L layers, D hidden, H heads of that layer kind, k experts a token)."""

    tokens: np.ndarray  # [T] int32: the ids walked
    predicted: np.ndarray  # [T] int32: the target's greedy next token after each
    hidden: np.ndarray  # [T, L, D] f32: the residual stream after each layer
    experts: dict[int, np.ndarray]  # MoE layer index -> [T, k] int32: the experts each token was routed to
    groups: dict[int, np.ndarray]  # MoE layer index -> [T, k] int32: the group of each chosen expert
    kda_state_norm: dict[int, np.ndarray]  # KDA layer index -> [T, H] f32: ‖state‖_F per head after each token
    mla_attention: dict[int, np.ndarray]  # MLA layer index -> [T, H, T] f32: each token's weights over tokens 0..t
    num_experts: int

    def expert_load(self) -> np.ndarray:
        """[MoE layers (in order), E] int: how many of the walk's tokens each layer routed to each expert."""
        load = np.zeros((len(self.experts), self.num_experts), np.int64)
        for row, chosen in enumerate(self.experts.values()):
            np.add.at(load[row], chosen.reshape(-1), 1)
        return load


def _check(model) -> None:
    if model.tp != 1:
        raise ValueError(f"lingjax.inspection runs on one device; this model has tp={model.tp}")


def walk(model, token_ids) -> Walk:
    """Run token_ids (int [T], T >= 1) through `model` one at a time from an empty cache -> Walk."""
    _check(model)
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    if ids.size == 0:
        raise ValueError("walk needs at least one token")
    cfg = model.cfg
    layers = tuple(range(len(cfg.layer_types)))
    ex = dataclasses.replace(model.ex, kernels="xla")

    def one(weights, cache, token, pos):
        taps = []
        tapped = dataclasses.replace(ex, tap=lambda event, value: taps.append((event, value)))
        module = model._module(weights)
        hidden, cache, features = module.forward_features(token[None], cache, pos, 1, tapped, capture=layers)
        predicted = jnp.argmax(module.lm_logits(hidden, ex=tapped)[0]).astype(jnp.int32)
        routes = [v[0] for e, v in taps if e == "moe_route"]
        attention = [v[0] for e, v in taps if e == "mla_attention"]
        norms = [jnp.sqrt(jnp.sum(jnp.square(c.state), axis=(1, 2))) for c, kind in zip(cache.layers, cfg.layer_types)
                 if kind == KDA]
        return cache, predicted, features.reshape(len(layers), -1).astype(jnp.float32), routes, attention, norms

    step = jax.jit(one, donate_argnums=(1,))
    cache = model.new_cache(ids.size)
    rows = []
    for t, token in enumerate(ids):
        cache, *out = step(model.weights, cache, jnp.int32(token), jnp.int32(t))
        rows.append(jax.device_get(out))
    moe = [i for i, kind in enumerate(cfg.mlp_types) if kind == MOE]
    kda = [i for i, kind in enumerate(cfg.layer_types) if kind == KDA]
    mla = [i for i, kind in enumerate(cfg.layer_types) if kind == MLA]
    experts = {layer: np.stack([r[2][j] for r in rows]).astype(np.int32) for j, layer in enumerate(moe)}
    per_group = cfg.num_experts // max(cfg.n_group, 1)
    n = ids.size
    attention = {}
    for j, layer in enumerate(mla):
        weights = np.stack([r[3][j] for r in rows])  # [T, H, capacity]
        attention[layer] = weights[:, :, :n]
    return Walk(tokens=ids, predicted=np.array([r[0] for r in rows], np.int32),
                hidden=np.stack([r[1] for r in rows]), experts=experts,
                groups={layer: e // per_group for layer, e in experts.items()},
                kda_state_norm={layer: np.stack([r[4][j] for r in rows]) for j, layer in enumerate(kda)},
                mla_attention=attention, num_experts=cfg.num_experts)


@dataclasses.dataclass
class Round:
    """One speculative round: the target took the first len(accepted) of `drafts`, then its own `bonus` token."""

    drafts: list[int]  # the drafter's S proposals, in order
    accepted: list[int]  # the drafts the target accepted, in order (the accept length is len + 1)
    bonus: int  # the target's token after them (its correction, or the next token when all were accepted)
    survival: np.ndarray | None  # DSpark: [S] f32, the drafter's probability that drafts 1..k all survive

    @property
    def drafted(self) -> int:
        return len(self.drafts)

    @property
    def rejected(self) -> list[int]:
        """The drafts after the accepted ones (the first of them is the one the target refused)."""
        return self.drafts[len(self.accepted):]

    @property
    def tokens(self) -> list[int]:
        return [*self.accepted, self.bonus]


@dataclasses.dataclass(frozen=True)
class _ReportingDrafts:
    """A drafter that is `inner` in every way but one: its proposal's report (the f32 values a round hands the
    host, lingjax.spec.step.output_row) carries its drafts after its own report, token ids being exact in f32.
    Acceptance never reads the report, so the round's tokens are unchanged."""

    inner: object

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def propose(self, *args):
        proposal, state = self.inner.propose(*args)
        drafts = proposal.drafts.astype(jnp.float32)
        report = drafts if proposal.report is None else jnp.concatenate([proposal.report.astype(jnp.float32), drafts])
        return dataclasses.replace(proposal, report=report), state


def speculate(model, token_ids, spec: str = "nextn", rounds: int = 8, steps: int | None = None):
    """Greedy speculative generation after the prompt token_ids, `rounds` rounds of the engine's own program ->
    (the first token, from the prefill; [Round, ...]). spec: "nextn" (the MTP chain, `steps` drafts, default
    lingjax.config.DEFAULT_STEPS) or "dspark" (model.draft, its block size unless `steps`)."""
    from lingjax import engine
    from lingjax.sampling import SamplingParams
    from lingjax.spec import step as spec_step

    _check(model)
    if spec not in ("nextn", "dspark"):
        raise ValueError(f"spec must be 'nextn' or 'dspark', got {spec!r}")
    if spec == "dspark" and model.draft is None:
        raise ValueError("spec='dspark' needs a model loaded with a DSpark drafter (lingjax.load(..., draft=...))")
    if spec == "nextn" and not model.has_mtp:
        raise ValueError("spec='nextn' needs a model with an MTP layer")
    prompt = np.asarray(token_ids, np.int32).reshape(-1)
    drafter = _ReportingDrafts(engine.make_drafter(model, spec, steps))
    s = drafter.steps
    program = spec_step.spec_program(model, drafter, SamplingParams())
    first, state = engine.spec_prefill(model, program, drafter, prompt, (s + 1) * (rounds + 1), jax.random.key(0))
    out = []
    for _ in range(rounds):
        state, rows = program.round(program.weights, state)
        tokens, report = spec_step.read_output_row(np.asarray(jax.device_get(rows))[0], s)
        survival, drafts = report[:-s], report[-s:]
        out.append(Round(drafts=drafts.astype(np.int64).tolist(), accepted=tokens[:-1], bonus=tokens[-1],
                         survival=survival.copy() if survival.size else None))
    return int(jax.device_get(first)), out
